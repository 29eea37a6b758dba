"""make serve's front (Debian's nginx before waitress, webapp/front.py) against one address
that tries to fill the server: 1,010 slow sockets once took waitress's 1,000 connections and
an authenticated user waited over 70 s. The attacker speaks from 127.0.0.2, the user from
127.0.0.1 (both loopback). Skipped where nginx is not installed (.ci/run installs it)."""

from __future__ import annotations

import json
import resource
import socket
import time

import pytest
import requests

from bench.costs import closed_by_peer, slow_sockets, trickle
from bench.dash_client import Server, Tab

from .costs import needs_nginx
from .test_hostile_costs import FUNDUS, shipped_models  # noqa: F401 - a fixture

pytestmark = pytest.mark.security

ATTACK_SOCKETS = 2000
ANSWER_LIMIT_S = 2.0
AUTH = ("reader", "s3cret-words")


@needs_nginx
def test_two_thousand_slow_sockets_from_one_address_leave_another_answered(
    tmp_path,
    shipped_models,  # noqa: F811
):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    env = {"KRYPTON_USERNAME": AUTH[0], "KRYPTON_PASSWORD": AUTH[1]}
    server = Server(tmp_path, env=env, models_dir=shipped_models, production=True)
    attack: list[socket.socket] = []
    try:
        attack = slow_sockets(server.port, ATTACK_SOCKETS)
        slowest = 0.0
        for _ in range(4):  # the attack keeps trickling, a byte a second
            started = time.perf_counter()
            answer = requests.get(server.url + "/", auth=AUTH, timeout=10)
            slowest = max(slowest, time.perf_counter() - started)
            assert answer.status_code == 200
            time.sleep(1.0)
            alive = trickle(attack)
        print(f"FRONT {len(attack)} sockets opened, {alive} still open; slowest answer "
              f"{slowest:.2f} s")  # fmt: skip
        assert slowest < ANSWER_LIMIT_S
        assert alive <= 64, f"{alive} sockets from one address still held"
        assert requests.get(server.url + "/", timeout=10).status_code == 401  # still guarded
    finally:
        for connection in attack:
            connection.close()
        server.stop()


@needs_nginx
def test_headers_that_never_finish_are_dropped_by_the_front(tmp_path, shipped_models):  # noqa: F811
    env = {"KRYPTON_HEADER_TIMEOUT_SECONDS": "2"}
    server = Server(tmp_path, env=env, models_dir=shipped_models, production=True)
    try:
        connections = slow_sockets(server.port, 8)
        time.sleep(1.0)
        assert trickle(connections) == 8  # within the header time: still open
        time.sleep(3.0)
        for connection in connections:  # then closed by the front, never left to wait
            assert closed_by_peer(connection)
    finally:
        server.stop()


@needs_nginx
def test_a_client_cannot_pose_as_another_address_through_the_front(tmp_path, shipped_models):  # noqa: F811
    """Behind the front the per-client limits hold: X-Forwarded-For from a client is
    overwritten with its real address, so made-up addresses do not make it many clients."""
    env = {"KRYPTON_MAX_RUNNING_JOBS": "1"}
    server = Server(tmp_path, models_dir=shipped_models, env=env, production=True)
    try:
        attacker = Tab(server.url)
        image = attacker.upload_image(FUNDUS)
        attacker.predict(image)
        answers = []
        for index in range(12):
            attacker.session = f"made-up-{index}"
            attacker.http.headers["X-Forwarded-For"] = f"10.9.{index}.1"
            answers.append(attacker.run(image, mode="naive", patch=4, stride=2, poll=False))
            time.sleep(0.05)
        time.sleep(2.0)
        refused = sum(
            "limit per user is 4" in json.dumps(attacker.poll_once("run-outcome.data", h) or {})
            for h in answers
        )
        assert refused == 8
    finally:
        server.stop()
