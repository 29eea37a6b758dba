"""`make test` keeps the team tests on one xdist worker: they share one Redis-and-Celery
cluster, which then starts once per run instead of once per worker."""

import os

import pytest


def test_team_tests_join_one_xdist_group(request: pytest.FixtureRequest) -> None:
    """xdist's loadgroup scheduler reads the group from the node id's "@team" suffix; a
    pytest whose node ids drop that suffix (9.2, pytest-xdist#1386), or a mark added after
    xdist's hook has run, spreads the group over every worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("the group only forms under pytest-xdist with --dist loadgroup (make test)")
    grouped = [item for item in request.session.items if item.get_closest_marker("xdist_group")]
    if not grouped:
        pytest.skip("no team test was collected in this run")
    strays = [item.nodeid for item in grouped if not item.nodeid.endswith("@team")]
    assert not strays, f"{len(strays)} team tests outside the group, e.g. {strays[:3]}"
