"""The server's budgets without a server: the job queue's per-client limit, the request
guard's duplicate-key check, the byte-bounded result and cell stores, pending uploads."""

from __future__ import annotations

import io
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from webapp.guard import DuplicateKeyError, RequestGuard, strict_json
from webapp.helpers import InputError, ResultStore
from webapp.jobs import JobQueue, QueueFull
from webapp.runs import CellCache, RunRequest, cell_key
from webapp.settings import ServerSettings
from webapp.uploads import UploadStore


def test_one_client_holds_at_most_its_share_of_the_queue():
    queue = JobQueue(running=1, waiting=10, per_session=1, per_client=2)
    held, release = threading.Event(), threading.Event()

    def occupy(session: str):
        with queue.slot(session, lambda ahead: None, "address:10.0.0.1"):
            held.set()
            release.wait(10)

    threads = [threading.Thread(target=occupy, args=(f"made-up-{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    held.wait(5)
    with pytest.raises(QueueFull, match="the limit per user is 2"):
        with queue.slot("made-up-3", lambda ahead: None, "address:10.0.0.1"):
            pass
    waited = []

    def other_client():
        with queue.slot("mine", lambda ahead: waited.append(ahead), "address:10.0.0.2"):
            pass

    other = threading.Thread(target=other_client)
    other.start()
    release.set()
    for thread in [*threads, other]:
        thread.join(10)
    assert waited and not other.is_alive()  # queued, then ran: never refused


def test_duplicate_keys_are_refused_anywhere_in_a_body():
    assert strict_json(b'{"a": {"b": 1}, "c": [{"d": 2}]}') == {"a": {"b": 1}, "c": [{"d": 2}]}
    with pytest.raises(DuplicateKeyError, match="'output' twice"):
        strict_json(b'{"output": "x", "inputs": [], "output": "y"}')
    with pytest.raises(DuplicateKeyError):
        strict_json(b'{"inputs": [{"id": "a", "id": "b"}]}')


def _guarded(body: bytes, path: str = "/_dash-update-component", length: int | None = None):
    seen, statuses = {}, []

    def app(environ, start_response):
        seen["body"] = environ["wsgi.input"].read()
        start_response("200 OK", [])
        return [b"ok"]

    guard = RequestGuard(app, ServerSettings())
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": path,
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body) if length is None else length),
        "HTTP_HOST": "127.0.0.1:8050",
        "REMOTE_ADDR": "127.0.0.9",
        "HTTP_X_KRYPTON_CLIENT": "forged",
        "wsgi.input": io.BytesIO(body),
    }
    answer = b"".join(guard(environ, lambda status, headers: statuses.append(status)))
    return statuses[0], answer, seen.get("body"), environ


def test_the_guard_passes_unique_bodies_on_whole_and_names_the_client():
    status, _, body, environ = _guarded(b'{"output": "x", "inputs": []}')
    assert status == "200 OK" and body == b'{"output": "x", "inputs": []}'
    assert environ["HTTP_X_KRYPTON_CLIENT"] == "address:127.0.0.9"  # the client's is overwritten
    status, answer, body, _ = _guarded(b'{"output": "a", "output": "b"}')
    assert status.startswith("400") and b"twice" in answer and body is None
    status, _, _, _ = _guarded(b"{}", length=2 * 2**20)  # announced over 1 MB: not read
    assert status.startswith("413")
    status, _, _, _ = _guarded(b"x", path="/_krypton/upload/image", length=20 * 2**20)
    assert status == "200 OK"  # an image upload may be 25 MB
    status, _, _, _ = _guarded(b"x", path="/_krypton/upload/image", length=26 * 2**20)
    assert status.startswith("413")


def _result(positions: int, classes: int) -> dict:
    return {
        "id": "r",
        "values": np.zeros(positions, np.float32),
        "class_values": np.zeros((positions, classes), np.float32),
        "base_probs": [0.0] * classes,
        "xs": [0] * positions,
    }


def test_results_are_kept_within_a_byte_budget_and_say_what_was_dropped():
    store = ResultStore(max_sessions=100, max_bytes=10 * 2**20)
    for index in range(4):
        store.put(f"tab{index}", _result(100, 10_000))  # 4 MB each
    assert store.get("tab0") is None and store.dropped("tab0")
    assert store.get("tab3") is not None and not store.dropped("tab3")
    assert store.usage()[1] <= 10 * 2**20
    store.put("big", _result(200, 10_000))  # 8 MB of per-class values: over half
    kept = store.get("big")
    assert kept["class_values"] is None and "were not kept" in kept["classes_dropped"]
    store.put("tab0", _result(10, 10))
    assert not store.dropped("tab0")


def test_cells_are_kept_within_a_byte_budget():
    cache = CellCache(max_keys=100, max_bytes=2 * 2**20)
    for index in range(4):
        request = RunRequest(
            key=f"{index:024x}", name="x", model="m", patch=4, stride=4,
            mode="exact", fill_rgb=(0.5, 0.5, 0.5),
        )  # fmt: skip
        known = cache.get(cell_key(request, "w"))
        known.add({(x, 0): np.zeros(1000, np.float32) for x in range(300)})  # 1.2 MB
    assert cache.usage()[1] <= 2 * 2**20 + 1.2 * 2**20
    assert cache.usage()[0] < 4


def test_a_pending_upload_works_once_and_only_for_its_tab(tmp_path):
    store = UploadStore(tmp_path / "uploads", max_bytes=2**20)
    token = store.save(io.BytesIO(b"abc"), 3, "image", "tab-a", "x.png", limit=100)
    with pytest.raises(InputError, match="no longer on the server"):
        with store.take(token, "image", "tab-b"):
            pass
    with pytest.raises(RuntimeError):  # the use failed: the file stays for another try
        with store.take(token, "image", "tab-a"):
            raise RuntimeError
    with store.take(token, "image", "tab-a") as (path, name):
        assert path.read_bytes() == b"abc" and name == "x.png"
    with pytest.raises(InputError):
        with store.take(token, "image", "tab-a"):
            pass
    with pytest.raises(InputError, match="the limit is"):
        store.save(io.BytesIO(b"x" * 200), 200, "image", "tab-a", "big.png", limit=100)
    with pytest.raises(InputError, match="broke off"):
        store.save(io.BytesIO(b"x" * 10), 50, "image", "tab-a", "short.png", limit=100)
    first = store.save(io.BytesIO(b"1"), 1, "model", "tab-a", "a.pt", limit=100)
    store.save(io.BytesIO(b"2"), 1, "model", "tab-a", "b.pt", limit=100)  # replaces it
    with pytest.raises(InputError):
        with store.take(first, "model", "tab-a"):
            pass
    assert store.usage() == (1, 1)


def test_one_clients_pending_uploads_never_push_out_another_clients():
    """Pending uploads were evicted oldest first whoever sent them: one client's volume
    uploads under made-up tabs pushed out another user's upload before its callback ran."""
    store = UploadStore(Path(tempfile.mkdtemp()) / "uploads", max_bytes=4000)
    mine = store.save(io.BytesIO(b"a" * 900), 900, "volume", "tab-a", "a.nii", 2000, "address:1")
    for index in range(8):  # another client, under a new tab each time
        store.save(
            io.BytesIO(b"b" * 900), 900, "volume", f"tab-b{index}", "b.nii", 2000, "address:2"
        )
    assert store.usage() == (2, 1800)  # b keeps its newest (its share: 1,000 bytes)
    with store.take(mine, "volume", "tab-a") as (path, _):
        assert path.read_bytes() == b"a" * 900
    tokens = [  # five clients together overflow the store: anyone's oldest go
        store.save(
            io.BytesIO(b"c" * 900), 900, "volume", f"t{i}", "c.nii", 2000, f"address:{i + 3}"
        )
        for i in range(5)
    ]
    with pytest.raises(InputError, match="no longer on the server"):
        with store.take(tokens[0], "volume", "t0"):
            pass
    with store.take(tokens[-1], "volume", "t4") as (path, _):
        assert path.stat().st_size == 900


def test_a_trusted_proxys_user_authenticates_and_is_the_client():
    def app(environ, start_response):
        start_response("200 OK", [])
        return [environ["HTTP_X_KRYPTON_CLIENT"].encode()]

    guard = RequestGuard(app, ServerSettings(auth_header="X-Forwarded-User"))

    def get(**headers):
        statuses = []
        environ = {"REQUEST_METHOD": "GET", "HTTP_HOST": "localhost", "REMOTE_ADDR": "10.0.0.5"}
        environ.update(headers)
        body = b"".join(guard(environ, lambda status, _: statuses.append(status)))
        return statuses[0], body

    assert get(HTTP_X_FORWARDED_USER="ana") == ("200 OK", b"user:ana")
    assert get()[0].startswith("401")  # no proxy user: not authenticated


def test_a_second_read_from_one_client_is_refused_at_once_not_parked_in_a_thread(tmp_path):
    """A client's loads waited inside server threads (up to 30 s each): 32 in flight from
    one address held waitress's 16 threads, and another user's page took 26-29 s. A read
    that cannot start now is refused at once; another client reads meanwhile."""
    import threading
    import time

    from flask import Flask

    from webapp.client import CLIENT_HEADER
    from webapp.helpers import InputError
    from webapp.services import Services

    services = Services(tmp_path / "cache")
    flask = Flask("intake-test")
    holding, release = threading.Event(), threading.Event()

    def first_read():
        with flask.test_request_context(headers={CLIENT_HEADER: "attacker"}):
            with services.intake():
                holding.set()
                release.wait(30)

    reader = threading.Thread(target=first_read)
    reader.start()
    try:
        assert holding.wait(10)
        began = time.perf_counter()
        with flask.test_request_context(headers={CLIENT_HEADER: "attacker"}):
            with pytest.raises(InputError, match="your other file is still being read"):
                with services.intake():
                    pass
        assert time.perf_counter() - began < 10  # refused, not waited out (before: 30 s)
        with flask.test_request_context(headers={CLIENT_HEADER: "someone else"}):
            with services.intake() as client:  # another client is not held up
                assert client == "someone else"
    finally:
        release.set()
        reader.join()


def test_ipv6_addresses_of_one_64_are_one_client_and_ipv4_stays_per_address():
    """On IPv6 one host holds 2^64 addresses: counted per address, a client could mint
    as many shares of the run places and the stores as it liked."""
    from webapp.guard import client_network

    guard = RequestGuard(lambda *a: [], ServerSettings())
    one = guard.client_of({"REMOTE_ADDR": "2001:db8:1:2::1"})
    assert one == guard.client_of({"REMOTE_ADDR": "2001:db8:1:2:ffff:0:0:abcd"})
    assert one != guard.client_of({"REMOTE_ADDR": "2001:db8:1:3::1"})
    assert guard.client_of({"REMOTE_ADDR": "192.0.2.7"}) == "address:192.0.2.7"
    assert guard.client_of({"REMOTE_ADDR": "192.0.2.8"}) == "address:192.0.2.8"
    assert client_network("::ffff:192.0.2.7") == "192.0.2.7"
    assert client_network("fe80::1%eth0") == "fe80::/64"
    assert client_network("not an address") == "not an address"


def test_a_client_with_nothing_running_gets_the_next_place_and_joins_a_full_line():
    """Nine addresses with four runs each took all 34 run places and a tenth user was
    told the server was busy. A newcomer joins a full line, and the next running place
    goes to the waiting client with the fewest runs going, before a client with several."""
    queue = JobQueue(running=1, waiting=2, per_session=1, per_client=3)
    order: list[str] = []
    release = threading.Event()
    started = threading.Semaphore(0)

    def run(session: str, client: str) -> None:
        with queue.slot(session, lambda ahead: None, client):
            order.append(client)
            started.release()
            release.wait(10)

    first = threading.Thread(target=run, args=("a-0", "address:10.0.0.1"))
    first.start()
    assert started.acquire(timeout=10)  # the attacker holds the running place ...
    line = [threading.Thread(target=run, args=(f"a-{n}", "address:10.0.0.1")) for n in (1, 2)]
    for thread in line:
        thread.start()
    deadline = time.time() + 10
    while queue.status()["waiting"] < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert queue.status() == {"running": 1, "waiting": 2}  # ... and fills the line
    victim = threading.Thread(target=run, args=("victim", "address:10.0.0.9"))
    victim.start()  # not refused: the victim has nothing running or waiting
    deadline = time.time() + 10
    while queue.status()["waiting"] < 3 and time.time() < deadline:
        time.sleep(0.05)
    assert queue.status()["waiting"] == 3
    release.set()  # each run ends at once from here; the order they start in is the test
    for thread in [first, *line, victim]:
        thread.join(10)
    assert order[1] == "address:10.0.0.9", order  # before the attacker's older ones
