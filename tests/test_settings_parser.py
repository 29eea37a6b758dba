"""One parser for every numeric setting (krypton._environment): nan, inf, 0, -1, abc and
1e30 are each refused at start with one line naming the variable, no traceback. Before:
KRYPTON_MEMORY_BUDGET_MB=nan gave "cannot convert float NaN to integer", inf an
OverflowError traceback, 0.0001 a run that never ended."""

import subprocess
import sys
from pathlib import Path

import pytest

from krypton._environment import LIBRARY_SETTINGS, SettingError, library_setting
from webapp.settings import ServerSettings, SettingsError

ROOT = Path(__file__).resolve().parents[1]
BAD = ("nan", "inf", "-inf", "0", "-1", "abc", "1e30", "0.0001")
SERVER = (
    "KRYPTON_MAX_IMAGE_MB", "KRYPTON_MAX_REQUEST_KB", "KRYPTON_MAX_RUNNING_JOBS",
    "KRYPTON_ABANDON_SECONDS", "KRYPTON_IMAGE_STORE_COUNT", "KRYPTON_CELL_CACHE_MB",
    "KRYPTON_READ_TIMEOUT_SECONDS", "KRYPTON_FRONT_CONNECTIONS_PER_ADDRESS",
    "KRYPTON_SERVER_THREADS", "KRYPTON_FRONT_REQUESTS_PER_ADDRESS",
)  # fmt: skip


def _allowed(name: str, text: str) -> bool:
    """Whether ``text`` is inside the variable's range (0 threads means every core)."""
    return name == "KRYPTON_TORCH_THREADS" and text == "0"


@pytest.mark.parametrize("name", sorted(LIBRARY_SETTINGS))
@pytest.mark.parametrize("text", BAD)
def test_every_library_setting_refuses_what_it_cannot_use(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    if _allowed(name, text):
        assert library_setting(name) == 0
        return
    with pytest.raises(SettingError) as refused:
        library_setting(name)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(name) and repr(text) in message


@pytest.mark.parametrize("name", SERVER)
@pytest.mark.parametrize("text", ("nan", "inf", "0", "-1", "abc", "1e30"))
def test_every_server_setting_refuses_what_it_cannot_use(monkeypatch, name, text):
    monkeypatch.setenv(name, text)
    try:
        ServerSettings.from_environment()
    except SettingsError as refused:
        assert str(refused).startswith(name) and "\n" not in str(refused)
    else:  # 0 is a valid count of queued jobs only; none of these is
        raise AssertionError(f"{name}={text} was taken")


def test_the_cli_and_the_server_stop_with_one_line(tmp_path):
    environment = {"KRYPTON_MEMORY_BUDGET_MB": "nan", "KRYPTON_HOME": str(tmp_path),
                   "PATH": "/usr/bin:/bin"}  # fmt: skip
    for command in (
        [sys.executable, "-m", "krypton", "models"],
        [sys.executable, "app.py", "--port", "0"],
    ):
        done = subprocess.run(
            command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, (command, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert lines == [lines[-1]] and lines[-1].startswith("error: KRYPTON_MEMORY_BUDGET_MB")
        assert "Traceback" not in done.stderr


def test_one_address_may_hold_at_most_half_the_server_threads(monkeypatch, tmp_path):
    """The front let one address have 32 requests in flight while waitress answered with
    16 threads: one address could hold every thread. The cap and the threads are now set
    together, the cap at most half the threads, and the front is configured with both."""
    from webapp.front import Front

    settings = ServerSettings.from_environment()
    assert settings.front_requests_per_address * 2 <= settings.server_threads
    config = Front("127.0.0.1", 8050, settings, 2**20, tmp_path).config("")
    assert f"limit_conn requests_per_address {settings.front_requests_per_address};" in config
    assert f"limit_conn per_address {settings.front_connections_per_address};" in config
    monkeypatch.setenv("KRYPTON_SERVER_THREADS", "16")
    monkeypatch.setenv("KRYPTON_FRONT_REQUESTS_PER_ADDRESS", "9")
    with pytest.raises(SettingsError, match="at most half the server's threads' worth"):
        ServerSettings.from_environment()
    monkeypatch.setenv("KRYPTON_SERVER_THREADS", "32")
    assert ServerSettings.from_environment().front_requests_per_address == 9
