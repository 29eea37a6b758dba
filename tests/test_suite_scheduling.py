"""`make test` keeps the team tests on one xdist worker: they share one Redis-and-Celery
cluster, which then starts once per run instead of once per worker."""

import os

import pytest


def test_team_tests_join_one_xdist_group(request: pytest.FixtureRequest) -> None:
    """xdist's loadgroup scheduler reads the group from the node id's "@<group>" suffix; a
    pytest whose node ids drop that suffix (9.2, pytest-xdist#1386), or a mark added after
    xdist's hook has run, spreads the group over every worker."""
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("the group only forms under pytest-xdist with --dist loadgroup (make test)")
    groups = {
        item.nodeid: mark.args[0]
        for item in request.session.items
        if (mark := item.get_closest_marker("xdist_group"))
    }
    if not groups:
        pytest.skip("no team test was collected in this run")
    strays = [nodeid for nodeid, group in groups.items() if not nodeid.endswith(f"@{group}")]
    assert not strays, f"{len(strays)} team tests outside their group, e.g. {strays[:3]}"


def test_the_team_group_is_handed_out_first(request: pytest.FixtureRequest) -> None:
    """The team group is the suite's longest unit (one worker, 15-20 minutes): xdist hands
    units out in collection order, and where test_team.py falls (near the end) one worker
    ran the group alone at the end of `make test`. It is collected first now."""
    kinds = ["team" in item.keywords for item in request.session.items]
    if not any(kinds):
        pytest.skip("no team test was collected in this run")
    first_other = kinds.index(False) if False in kinds else len(kinds)
    assert all(kinds[:first_other]) and not any(kinds[first_other:]), (
        f"team tests after others: {sum(kinds[first_other:])}"
    )


def test_make_test_gpu_collects_on_a_host_without_dash_testing() -> None:
    """`make test-gpu` runs on a card's own Python, which has no dash[testing]: pytest
    refused this suite's conftest there ("unknown hook 'pytest_setup_options'"), so no
    cuda-marked test could run on the card. The hook is optional now; here dash's pytest
    plugin is turned off to stand in for its absence."""
    import subprocess
    import sys

    files = [
        name
        for name in sorted(os.listdir("tests"))
        if name.startswith("test_") and "mark.cuda" in open(os.path.join("tests", name)).read()
    ]
    assert files, "no cuda-marked tests found"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
         "-p", "no:dash", "-m", "cuda", "--collect-only", *(f"tests/{f}" for f in files)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "INTERNALERROR" not in done.stdout
