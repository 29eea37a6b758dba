"""Shared pytest configuration: headless Debian Chromium for the browser tests, and the
split `make test` runs in two pytest-xdist workers."""

import os
import shutil
import subprocess
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share two cores: one thread of torch each (and in every process they
    # start), or four threads would contend for two cores and spin at every barrier.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

import pytest

# Tests that start servers, browsers, Redis and Celery workers pick free ports, so they
# spread over both xdist workers like the rest, except the team tests: they share one
# Redis-and-Celery cluster (tests/test_team.py), so they join one xdist group and the
# cluster starts once per `make test`, not once per worker.
TEAM_GROUP = "team"


@pytest.hookimpl(optionalhook=True)  # dash[testing]'s hook: absent where it is not installed
def pytest_setup_options():
    """Chrome options for dash[testing]'s dash_duo (Debian's chromium, headless, as root)."""
    from selenium.webdriver.chrome.options import Options

    options = Options()
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary:
        options.binary_location = binary
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1500,1000",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-quic",
    ):
        options.add_argument(argument)
    return options


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Browser tests need chromium and chromedriver; .ci/run installs both. Elsewhere say
    clearly why they are skipped rather than failing on a missing binary. Under xdist
    (`--dist loadgroup`), the team tests join one group: this hook runs first, because
    xdist's own (registered before this file) turns the marks into "@team" node ids."""
    for item in items:
        if "team" in item.keywords:
            item.add_marker(pytest.mark.xdist_group(TEAM_GROUP))
    # the group is one unit of 15-20 minutes on one worker: handed out first, the other
    # worker takes the rest meanwhile; collected where its file falls (test_team.py, near
    # the end), it ran on one worker while the other had little or nothing left
    items.sort(key=lambda item: "team" not in item.keywords)  # stable: else as collected
    if shutil.which("chromedriver") and (
        shutil.which("chromium") or shutil.which("chromium-browser")
    ):
        return
    skip = pytest.mark.skip(
        reason="chromium/chromedriver not installed (apt-get install chromium chromium-driver)"
    )
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(skip)


# `make test` (and `make test-load`) sets this: the tests marked "underload" then run
# beside this many CPU-burning processes (one per core on the 2-core machines this project
# runs on), as a user's page runs beside a browser, a video call or a test suite. They
# assert what the page shows, never how fast this host is, so they pass idle and busy
# alike.
BURNERS_VARIABLE = "KRYPTON_TEST_BURNERS"
BURN_SECONDS = 1200  # bounded: a burner left behind by a killed run ends by itself
_BURN = "import time\nend = time.time() + {}\nwhile time.time() < end:\n    pass\n"


@pytest.fixture
def busy_host() -> int:
    """Start KRYPTON_TEST_BURNERS CPU burners (0 by default) for the test; their count."""
    try:
        count = max(0, int(os.environ.get(BURNERS_VARIABLE, "0") or 0))
    except ValueError:
        raise pytest.UsageError(f"{BURNERS_VARIABLE} must be a whole number") from None
    burners = [
        subprocess.Popen([sys.executable, "-c", _BURN.format(BURN_SECONDS)]) for _ in range(count)
    ]
    try:
        yield count
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """Each test ends with the torch threads it began with: a test that sets a count as a
    caller would (torch.set_num_threads) must not carry it into the next test's timings
    or logged runs. Krypton itself changes only a run's own thread, for the run."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def krypton_home(tmp_path_factory, monkeypatch):
    """Every test gets its own data folder: nothing is written under ~/.krypton. It is a
    fresh host, and the app's runs in it a fresh process's: the first run of a model in
    a mode is its first (webapp.runs.timing marks it cold), whichever tests ran before
    it in this xdist worker (which decided it before, and two estimate tests failed or
    passed by the order the workers took the tests in)."""
    home = tmp_path_factory.mktemp("krypton-home")
    monkeypatch.setenv("KRYPTON_HOME", str(home))
    timing = sys.modules.get("webapp.runs.timing")
    if timing is not None:
        with timing._RAN_LOCK:
            timing._RAN.clear()
    return home


@pytest.fixture
def quick_integrated_gradients(monkeypatch):
    """Integrated Gradients from 4 steps, at most 8 (krypton.methods: 32 doubled up to 128
    until the completeness gap is within 1%), for tests of where the gradient maps go
    (the app, the CLI, the exports), which compare them with the library's own maps
    computed under the same setting. The step policy itself is tests/test_methods.py's;
    at its defaults one compared fundus image took 60-80 s of a 2-core suite."""
    from krypton import methods

    monkeypatch.setattr(methods, "IG_STEPS", 4)
    monkeypatch.setattr(methods, "IG_MAX_STEPS", 8)


# -- the web app (browser tests) ---------------------------------------------------------


def _fundus_sample():
    from krypton.synthetic.fundus import FundusGenerator

    return FundusGenerator(seed=11).sample(label=2, lesions=1)  # one planted exudate


FUNDUS_SAMPLE = _fundus_sample()


@pytest.fixture
def krypton_app(tmp_path):
    """The app, built the way `make run` builds it, with its own cache folder."""
    from app import create_app

    return create_app(tmp_path / "cache")


@pytest.fixture
def fundus_png(tmp_path):
    """A generated fundus image with one planted exudate, as a PNG file."""
    from PIL import Image

    path = tmp_path / "fundus.png"
    Image.fromarray(FUNDUS_SAMPLE.image).save(path)
    return path


@pytest.fixture
def cli_here(capsys):
    """``python -m krypton ARGS`` in this process (krypton.cli.main, what the module
    runs): its exit code and output, without a new interpreter importing torch again.
    For checks of arguments and messages; tests of the installed command start it."""
    from krypton.cli import main

    def run(*args: str) -> subprocess.CompletedProcess:
        message = ""
        try:
            code = main(list(args))
        except SystemExit as stopped:  # as the interpreter ends: a text goes to stderr, 1
            code = stopped.code
            if code is None:
                code = 0
            elif not isinstance(code, int):
                message, code = f"{code}\n", 1
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), code, captured.out, captured.err + message)

    return run


@pytest.fixture
def two_cores(monkeypatch) -> list[float]:
    """A caller who set no threads on a two-core host whose load the test sets (the one
    item of the list returned: the other processes' busy cores, as the engine samples
    them at a run's start and while it runs)."""
    import torch

    from krypton import host

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("KRYPTON_TORCH_THREADS", raising=False)
    monkeypatch.setattr(host, "_MAX_THREADS", [2])
    monkeypatch.setattr(host.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(host, "_TORCH_DEFAULT", torch.get_num_threads())
    monkeypatch.setattr(host.torch_threads, "callers_count", lambda: None)  # set by no one
    monkeypatch.setattr(host, "_BAND", [])
    load = [0.0]
    monkeypatch.setattr(host, "_recent_load", lambda: load[0])
    monkeypatch.setattr(host.OthersLoad, "read", lambda self: load[0])
    return load
