"""Hardening at the edges: image files, the registry, the CLI, server start-up and graph
capture under concurrency."""

import io
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

import krypton
from krypton.io.images import ImageLoadError, load_image
from krypton.registry import RegistryError, available_models, load_model, register_model

ROOT = Path(__file__).resolve().parents[1]


# -- image files ---------------------------------------------------------------------------


def test_float_tiff_with_a_nan_pixel_is_refused(tmp_path):
    array = np.random.default_rng(0).random((64, 64)).astype(np.float32)
    array[10, 20] = np.nan
    Image.fromarray(array, mode="F").save(tmp_path / "scan.tif")
    with pytest.raises(ImageLoadError, match="1 NaN or infinite pixel"):
        load_image(tmp_path / "scan.tif")
    array[10, 20] = np.inf
    Image.fromarray(array, mode="F").save(tmp_path / "scan.tif")
    with pytest.raises(ImageLoadError, match="NaN or infinite"):
        load_image(tmp_path / "scan.tif")


def test_exif_orientation_is_applied(tmp_path):
    """A portrait photo is stored sideways with orientation 6 (rotate 90° clockwise)."""
    stored = Image.new("RGB", (80, 40), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 10, 40))  # red band at the stored image's left
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(tmp_path / "portrait.jpg", exif=exif, quality=95)
    shown = load_image(tmp_path / "portrait.jpg")
    assert shown.size == (40, 80)  # portrait, as the camera meant it
    top = np.asarray(shown)[:8].reshape(-1, 3).mean(axis=0)
    assert top[0] > 200 and top[2] < 60  # the red band is now at the top


@pytest.mark.parametrize("size", [(1, 1), (15, 300)])
def test_tiny_images_are_refused_with_the_minimum(size, tmp_path):
    Image.new("RGB", size).save(tmp_path / "tiny.png")
    with pytest.raises(ImageLoadError, match="at least 16 pixels on each side"):
        load_image(tmp_path / "tiny.png")


def test_huge_images_are_reduced_to_what_models_use():
    buffer = io.BytesIO()
    Image.new("RGB", (3000, 1500), (10, 20, 30)).save(buffer, format="PNG")
    assert load_image(buffer.getvalue()).size == (1024, 512)


# -- registry -----------------------------------------------------------------------------


@pytest.fixture
def weights(tmp_path) -> Path:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=2)
    torch.save(model.state_dict(), tmp_path / "w.pt")
    return tmp_path / "w.pt"


def test_user_models_live_in_krypton_home_and_can_be_removed(weights, krypton_home):
    register_model("mine", weights, ["a", "b"], architecture="resnet18", input_size=(64, 64))
    assert (krypton_home / "models" / "mine.json").exists()
    assert not (ROOT / "krypton" / "shipped_models" / "mine.json").exists()
    info = {i.name: i for i in available_models()}
    assert info["mine"].user and not info["fundus-demo"].user
    assert load_model("mine").classes == ["a", "b"]
    krypton.registry.remove_model("mine")
    assert "mine" not in {i.name for i in available_models()}
    assert not list((krypton_home / "models").glob("mine*"))
    with pytest.raises(RegistryError, match="shipped model"):
        krypton.registry.remove_model("fundus-demo")
    assert (ROOT / "krypton" / "shipped_models" / "fundus-demo.pt").exists()


def test_names_are_unique_regardless_of_case_and_never_overwritten(weights, krypton_home):
    for taken in ("fundus-demo", "FUNDUS-DEMO"):
        with pytest.raises(RegistryError, match="already registered"):
            register_model(taken, weights, ["a", "b"], architecture="resnet18", input_size=(64, 64))
    register_model("Scan", weights, ["a", "b"], architecture="resnet18", input_size=(64, 64))
    before = (krypton_home / "models" / "Scan.pt").read_bytes()
    with pytest.raises(RegistryError, match="already registered"):
        register_model("scan", weights, ["x", "y"], architecture="resnet18", input_size=(64, 64))
    assert (krypton_home / "models" / "Scan.pt").read_bytes() == before


def test_concurrent_registrations_of_one_name_let_exactly_one_win(weights, krypton_home):
    outcomes: list = []

    def register(name):
        try:
            register_model(name, weights, ["a", "b"], architecture="resnet18", input_size=(64, 64))
            outcomes.append("ok")
        except RegistryError as exc:
            outcomes.append(str(exc))

    threads = [
        threading.Thread(target=register, args=(name,)) for name in ("race", "RACE", "Race", "race")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outcomes.count("ok") == 1
    assert len(list((krypton_home / "models").glob("*.json"))) == 1


def test_registration_limits_input_size_and_class_names(weights):
    with pytest.raises(RegistryError, match="16 to 1024 pixels"):
        register_model("big", weights, ["a", "b"], architecture="resnet18", input_size=(4000, 4000))
    with pytest.raises(RegistryError, match="the limit is 10000"):
        register_model("many", weights, [f"c{i}" for i in range(10_001)], architecture="resnet18")
    with pytest.raises(RegistryError, match="at most 200 characters"):
        register_model("long", weights, ["a" * 201, "b"], architecture="resnet18")


# -- command line and server start-up -----------------------------------------------------


def run_cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "krypton", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


@pytest.mark.parametrize(
    "out, message",
    [
        ("/proc/heatmap.png", "cannot write in '/proc'"),
        ("heatmap.jpg", "must name a .png file"),
        ("{tmp}", "is a folder"),
        ("{tmp}/file.txt/heatmap.png", "it is a file"),
    ],
)
def test_a_bad_out_is_refused_before_computing(out, message, tmp_path, cli_here):
    """In this process (krypton.cli.main, what `python -m krypton` calls): a new
    interpreter per case only repeated the import of torch."""
    (tmp_path / "file.txt").write_text("x")
    started = time.perf_counter()
    result = cli_here(
        "explain",
        str(ROOT / "assets" / "samples" / "retina.jpg"),
        "--out",
        out.format(tmp=tmp_path),
        "--mode",
        "naive",
        "--stride",
        "2",
        "--patch",
        "4",
    )
    assert result.returncode == 2 and message in result.stderr
    assert "positions" not in result.stderr  # no progress: nothing was computed
    assert time.perf_counter() - started < 30


def test_remove_command(weights):
    register_model("gone", weights, ["a", "b"], architecture="resnet18", input_size=(64, 64))
    result = run_cli("remove", "gone")
    assert result.returncode == 0 and "removed 'gone'" in result.stdout
    result = run_cli("remove", "fundus-demo")
    assert result.returncode == 2 and "shipped model" in result.stderr


def test_port_in_use_is_said_first(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "app.py", "--port", str(port)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: cannot serve on 127.0.0.1:{port}")
    assert "Krypton is running" not in result.stdout


def test_serving_beyond_localhost_without_authentication_warns(capsys):
    from app import warn_if_exposed
    from webapp.settings import ServerSettings

    warn_if_exposed("0.0.0.0", ServerSettings())
    assert "WARNING: serving on 0.0.0.0 without authentication" in capsys.readouterr().err
    warn_if_exposed("0.0.0.0", ServerSettings(username="a", password="b"))
    warn_if_exposed("127.0.0.1", ServerSettings())
    assert capsys.readouterr().err == ""


def test_make_serve_runs_the_production_server_with_authentication(tmp_path):
    """The production entry: waitress with threads, basic authentication, host check."""
    import requests

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = dict(
        __import__("os").environ,
        KRYPTON_USERNAME="ana",
        KRYPTON_PASSWORD="pw",
        KRYPTON_HOME=str(tmp_path),
        KRYPTON_CACHE_DIR=str(tmp_path / "cache"),
    )
    process = subprocess.Popen(
        ["make", "-s", "serve", "HOST=127.0.0.1", f"PORT={port}"],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.time() + 90
        while time.time() < deadline:
            try:
                answer = requests.get(url, timeout=30)
                break
            except requests.RequestException:  # not listening yet, or still booting
                time.sleep(0.5)
        assert answer.status_code == 401
        assert requests.get(url, auth=("ana", "pw"), timeout=10).status_code == 200
        assert (
            requests.get(
                url, auth=("ana", "pw"), timeout=10, headers={"Host": "evil.example"}
            ).status_code
            == 400
        )
    finally:
        import os
        import signal

        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


# -- graph capture under concurrency -------------------------------------------------------


def test_captures_and_forward_passes_in_many_threads_agree():
    """symbolic_trace patches nn.Module process-wide: without the capture lock, a model
    running in another thread during a capture failed (NameError) or was traced."""
    torch.manual_seed(0)
    models = [torchvision.models.resnet18(weights=None, num_classes=3).eval() for _ in range(4)]
    running = torchvision.models.resnet18(weights=None, num_classes=3).eval()
    image = torch.randn(3, 64, 64)
    with torch.inference_mode():
        expected = running(image.unsqueeze(0))
    errors: list = []
    stop = threading.Event()

    def forward_loop():
        try:
            while not stop.is_set():
                with torch.inference_mode():
                    heatmap = krypton.explain(running, image, mode="naive", patch=32, stride=32)
                assert heatmap.prob == pytest.approx(
                    float(torch.softmax(expected[0], 0).max()), abs=1e-5
                )
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    def capture(model):
        try:
            krypton.OcclusionExplainer(model).views_for(image)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)

    runner = threading.Thread(target=forward_loop)
    runner.start()
    captures = [threading.Thread(target=capture, args=(m,)) for m in models]
    for thread in captures:
        thread.start()
    for thread in captures:
        thread.join()
    stop.set()
    runner.join()
    assert errors == []
