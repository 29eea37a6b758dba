"""The package as a packager ships it: `pip wheel .` builds a wheel with the whole engine,
the shipped models and real dependencies, and a fresh virtual environment with only
that wheel explains an image with the default model from any folder.

The fresh environment gets the pinned stack (torch, torchvision, ...) from this
checkout's .venv through a .pth file, and pip installs the wheel with --no-index: it
must resolve every declared dependency against those pinned packages, and nothing is
downloaded. The checkout's own (editable) krypton is not importable there."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def run(*command, cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "KRYPTON_HOME": str(cwd / "home")},
    )
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel .` of a copy of the sources (the build leaves nothing in the checkout)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "krypton", source / "krypton", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("wheels")
    run(
        sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
        "-q", "-w", out, cwd=source,
    )  # fmt: skip
    (built,) = out.glob("krypton-*.whl")
    return built


def test_the_wheel_holds_the_engine_the_models_and_its_dependencies(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = [
            line.split(":", 1)[1].strip()
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    engine = {p.relative_to(ROOT).as_posix() for p in (ROOT / "krypton" / "engine").glob("*.py")}
    assert engine and engine <= names, engine - names
    for shipped in ("fundus-demo.json", "fundus-demo.pt", "fundus-demo.ood.npz", "resnet18.json"):
        assert f"krypton/shipped_models/{shipped}" in names
    core = {
        r.split(">")[0].split("=")[0].split(";")[0].strip() for r in requires if "extra" not in r
    }
    assert {"torch", "torchvision", "numpy", "pillow", "scikit-image", "scikit-learn"} <= core
    extras = {r.split("extra ==")[1].strip(" \"'") for r in requires if "extra ==" in r}
    assert {"app", "dicom", "team", "dropin"} <= extras


def test_an_installed_wheel_explains_with_the_default_model_from_any_folder(wheel, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    fresh = Path(
        run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path
        ).strip()
    )
    pinned = sysconfig.get_paths()["purelib"]  # this checkout's .venv: the pinned stack
    (fresh / "pinned-stack.pth").write_text(pinned + "\n")
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "-q", wheel,
        cwd=tmp_path)  # fmt: skip
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (160, 160, 3), dtype=np.uint8)).save(folder / "x.png")
    where = run(python, "-c", "import krypton; print(krypton.__file__)", cwd=folder)
    assert where.strip().startswith(str(fresh)), where  # the wheel's, not the checkout's
    printed = run(
        venv / "bin" / "krypton", "explain", "x.png", "--stride", "16",
        "--region", "0,0,64,64", "--out", "heat.png", cwd=folder,
    )  # fmt: skip
    assert "positions  16 evaluated" in printed and "mode exact" in printed, printed
    assert (folder / "heat.png").stat().st_size > 0 and np.load(folder / "heat.npy").shape == (4, 4)
    code = (
        "import numpy as np, krypton, torch\n"
        "from PIL import Image\n"
        "from krypton.registry import default_model_name, load_model\n"
        "model = load_model(default_model_name())\n"
        "image = model.preprocess(Image.open('x.png').convert('RGB'))\n"
        "heatmap = krypton.explain(model, image, patch=16, stride=16, region=(0, 0, 64, 64))\n"
        "print(default_model_name(), heatmap.values.shape, np.isfinite(heatmap.values).all())\n"
    )
    answer = run(python, "-c", code, cwd=folder)
    assert answer.split() == ["fundus-demo", "(4,", "4)", "True"], answer
