"""The command line: explain an image file, analyze a model, and refuse bad files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from krypton.io.images import ImageLoadError, load_image, to_rgb
from krypton.render.overlay import overlay

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "krypton", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=None if env is None else {**os.environ, **env},
    )


def test_explain_writes_overlay_and_values(tmp_path):
    out = tmp_path / "heat.png"
    result = run_cli(
        "explain",
        str(ROOT / "assets/samples/coffee.png"),
        "--model",
        "resnet18",
        "--patch",
        "32",
        "--stride",
        "16",
        "--region",
        "64,64,160,160",
        "--random-weights",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "RANDOM weights" in result.stderr and "RANDOM weights" in result.stdout
    values = np.load(tmp_path / "heat.npy")
    assert values.shape == (5, 5) and np.isfinite(values).all()
    with Image.open(out) as picture:  # the photo's own resolution (600x400), colour bar
        assert picture.size[0] > 600 and picture.size[1] > 400
    assert "probability" in result.stdout and "time" in result.stdout
    label_line = next(line for line in result.stdout.splitlines() if line.startswith("label"))
    assert "RANDOM weights" in label_line
    every = np.load(tmp_path / "heat.npz")
    assert every["probabilities"].shape == (5, 5, 1000)
    np.testing.assert_allclose(
        every["probabilities"][..., int(label_line.split()[1])], values, atol=1e-6
    )


def test_the_installed_command_works_from_any_folder(tmp_path):
    """docs/usage.md's commands as written: `.venv/bin/krypton ...` outside the repository."""
    command = ROOT / ".venv" / "bin" / "krypton"
    assert command.exists(), "make installs the package into .venv (pip install -e .)"

    def krypton(*args):
        return subprocess.run(
            [str(command), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
        )

    retina = str(ROOT / "assets/samples/retina.jpg")
    result = krypton("explain", retina, "--mode", "approximate", "--stride", "8", "--out", "h.png")
    assert result.returncode == 0, result.stderr
    assert "no tuned tau" not in result.stderr  # the registry's tuned τ is used
    assert "tau        0.80 (tuned for SSIM 0.9 and localisation)" in result.stdout
    assert "over the whole grid (thresholding and drill-down)" in result.stdout
    assert (tmp_path / "h.png").exists() and (tmp_path / "h.npy").exists()
    result = krypton(
        "explain",
        retina,
        "--mode",
        "approximate",
        "--stride",
        "8",
        "--tau",
        "0.7",
        "--drill-down",
        "1",
        "--region",
        "0,0,112,112",
        "--out",
        "g.png",
    )
    assert "tau        0.70 (given); drill-down r 1" in result.stdout, result.stderr
    result = krypton("analyze", "--model", "fundus-demo")
    assert result.returncode == 0 and "theoretical speedup" in result.stdout


def test_explain_without_weights_says_how_to_get_them(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "krypton",
            "explain",
            str(ROOT / "assets/samples/coffee.png"),
            "--model",
            "resnet18",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"TORCH_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode != 0
    assert "make models" in result.stderr and "--random-weights" in result.stderr


def test_default_model_explains_offline(tmp_path):
    out = tmp_path / "retina.png"
    result = run_cli(
        "explain", str(ROOT / "assets/samples/retina.jpg"), "--stride", "16", "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert "fundus-demo (trained weights)" in result.stdout
    assert "(patch 12, stride 16)" in result.stdout  # the model's own default patch
    assert np.load(tmp_path / "retina.npy").shape == (14, 14)
    assert "the first global op is avgpool, 100% of the FLOPs before it" in result.stdout
    incremental = np.load(tmp_path / "retina.npy")
    forced = run_cli(
        "explain",
        str(ROOT / "assets/samples/retina.jpg"),
        "--stride",
        "16",
        "--strategy",
        "naive",
        "--region",
        "0,0,224,44",  # the top three rows of the same grid: 42 full inferences, not 196
        "--out",
        str(out),
    )
    assert forced.returncode == 0, forced.stderr
    assert "plan       naive: forced (strategy='naive')" in forced.stdout
    forced_values = np.load(tmp_path / "retina.npy")
    assert forced_values.shape == (3, 14)
    np.testing.assert_allclose(forced_values, incremental[:3], atol=1e-4)


def test_models_lists_availability(cli_here):
    result = cli_here("models")
    assert result.returncode == 0
    assert "fundus-demo (default): 3 classes" in result.stdout
    assert "make models" in result.stdout or "vgg16: 1000 classes" in result.stdout


def test_explain_rejects_non_image(tmp_path, cli_here):
    bogus = tmp_path / "notes.png"
    bogus.write_text("this is not a picture")
    result = cli_here("explain", str(bogus), "--random-weights")
    assert result.returncode == 2
    assert "is not an image file" in result.stderr
    assert "Traceback" not in result.stderr


def test_explain_reports_bad_arguments_cleanly(cli_here):
    result = cli_here(
        "explain", str(ROOT / "assets/samples/coffee.png"), "--random-weights", "--stride", "0"
    )
    assert result.returncode == 2 and "stride must be positive" in result.stderr
    assert "Traceback" not in result.stderr


def test_analyze_prints_per_layer_and_total(cli_here):
    result = cli_here("analyze", "--model", "vgg16", "--patch", "16")
    assert result.returncode == 0, result.stderr
    assert "features_0" in result.stdout
    assert "theoretical speedup 6.8" in result.stdout


def test_analyze_names_why_a_timm_model_cannot_gain(cli_here):
    result = cli_here("analyze", "--model", "timm:efficientnet_b0", "--patch", "16")
    assert result.returncode == 0, result.stderr
    assert "first global op: mean (call_method mean: " in result.stdout
    assert "of the conv/linear MACs come before it" in result.stdout
    result = cli_here("analyze", "--model", "timm:no_such_net")
    assert result.returncode != 0 and "Unknown model" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "mode, maker",
    [
        ("L", lambda: Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8))),
        ("RGBA", lambda: Image.new("RGBA", (8, 8), (255, 0, 0, 0))),
        ("P", lambda: Image.new("RGB", (8, 8), (0, 128, 255)).convert("P")),
        ("I;16", lambda: Image.fromarray((np.arange(64).reshape(8, 8) * 64).astype(np.uint16))),
    ],
)
def test_image_modes_convert_to_rgb(mode, maker):
    image = maker()
    assert image.mode.startswith(mode[0])
    rgb = to_rgb(image)
    assert rgb.mode == "RGB" and rgb.size == (8, 8)
    array = np.asarray(rgb)
    if mode == "RGBA":
        assert (array == 255).all()  # fully transparent red composites to white
    if mode == "I;16":
        assert array.max() == 255 and array.min() == 0  # rescaled, not clipped to black


def test_truncated_and_empty_files(tmp_path):
    source = ROOT / "assets/samples/coffee.png"
    truncated = source.read_bytes()[:5000]
    with pytest.raises(ImageLoadError, match="truncated"):
        load_image(truncated)
    with pytest.raises(ImageLoadError, match="empty"):
        load_image(b"")
    with pytest.raises(ImageLoadError, match="no such file"):
        load_image(tmp_path / "missing.png")


def test_overlay_covers_positions():
    image = Image.new("RGB", (64, 64), (0, 0, 0))
    values = np.array([[0.1, np.nan], [0.5, 0.9]], dtype=np.float32)
    picture = np.asarray(overlay(image, values, np.array([0, 32]), np.array([0, 32]), 32, 0.5))
    assert picture[16, 16].sum() > 0  # coloured cell
    assert picture[16, 48].sum() == 0  # NaN cell left transparent


def test_tune_defaults_to_the_models_own_patch(tmp_path):
    """τ is tuned at the patch the model's heatmaps default to (its registry entry's), as
    the app, explain and the benchmarks run it — not at a fixed 16."""
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=2).eval()
    torch.save(model.state_dict(), tmp_path / "tiny.pt")
    entry = {
        "name": "tiny",
        "architecture": "resnet18",
        "weights": {"source": "file", "path": "tiny.pt"},
        "classes": ["a", "b"],
        "input_size": [64, 64],
        "patch": 8,
    }
    (tmp_path / "tiny.json").write_text(json.dumps(entry))
    result = run_cli(
        "tune", "--model", "tiny", "--count", "2", "--held-out", "1", "--stride", "8",
        env={"KRYPTON_MODELS_DIR": str(tmp_path), "KRYPTON_HOME": str(tmp_path / "home")},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "tiny.json").read_text())["tuning"]["patch"] == 8
