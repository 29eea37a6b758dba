"""Do the speed lines hold against a stopwatch? For each case, an exact run and a naive
run of the same positions are timed whole, side by side in one process (the app's own
run path, webapp.runs.execute, or krypton.explain for a volume), and the exact run's
claimed ratio (krypton.speed_line.speed_claim: the whole run against a naive run of its
positions, fixed costs counted) is printed beside the ratio the stopwatch gives. For the
image runs also the naive figure the page showed before the run (its estimate line's
"naive: about") beside the one the speed line states after it, and the naive run's
stopwatch.

    python -m bench.speed_claims            (also part of make bench)
    python -m bench.speed_claims --burners 2   beside two CPU-burning processes
    python -m bench.speed_claims --burners 2 --exact-only 6

``--exact-only N``: a machine that never runs naive mode, so no line can take a naive
run's pace: on a fresh runtime log, N exact runs of new chest-CT volumes on the volume
panel's path and N of the fundus image at stride 16, each against a naive run of the
same positions whose own log row goes to another folder (exact_only_cases).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

import krypton
from krypton.registry import load_model
from krypton.synthetic.chestct import ChestCTGenerator
from krypton.synthetic.fundus import FundusGenerator


def page_case(
    services, key: str, stride: int, region, grey: float
) -> tuple[float, float, str, tuple[float, float, float]]:
    """(claimed ratio, stopwatch ratio, the claim, (naive seconds shown before the run,
    stated after it, the naive run's stopwatch)) for one image on the app's run path."""
    from webapp import runs

    def run(mode: str, colour: float) -> dict:  # a colour each: no cells to reuse
        request = runs.RunRequest(
            key=key, name="fundus.png", model="fundus-demo", patch=16,
            stride=stride, mode=mode, fill_rgb=(colour,) * 3, region=region,
        )  # fmt: skip
        return runs.execute(services, "bench", request, lambda *a: None)

    shown = runs.find_estimate("fundus-demo", 16, stride, "naive", region, 0.25, 2.0)
    exact = run("exact", grey)
    naive = run("naive", grey + 0.01)
    whole = (exact.get("speed") or {}).get("whole")
    claimed = whole["naive_seconds"] / whole["seconds"] if whole else float("nan")
    claim = runs.speed_text(exact.get("speed"), "exact")
    figures = (
        shown.seconds if shown else float("nan"),
        whole["naive_seconds"] if whole else float("nan"),
        naive["seconds"],
    )
    return claimed, naive["seconds"] / exact["seconds"], claim, figures


def volume_case() -> tuple[float, float, str]:
    """The same for a generated chest-CT volume through krypton.explain and the speed line
    the CLI prints (krypton.cli.volumes.print_speed: stated_speed at the load now)."""
    from krypton.io.volumes import Volume
    from krypton.speed_line import speed_claim

    model = load_model("chestct-demo")
    sample = ChestCTGenerator(seed=3).sample(label=1)
    spacing = tuple(model.volume["spacing_mm"])
    tensor = model.prepare_volume(Volume(sample.volume, spacing, "generated")).tensor
    started = time.perf_counter()
    exact = krypton.explain(model, tensor, patch=model.patch, stride=6, mode="exact")
    exact_seconds = time.perf_counter() - started
    started = time.perf_counter()
    krypton.explain(model, tensor, patch=model.patch, stride=6, mode="naive", fill=0.01)
    naive_seconds = time.perf_counter() - started
    from krypton.estimator import host_load
    from krypton.speed_line import stated_speed

    # as the CLI prints it: the probe's naive figure bounded by the model's own pace here
    speed = stated_speed(exact, model.name, host_load())
    if not speed or "whole" not in speed:
        return float("nan"), naive_seconds / exact_seconds, "no timing"
    whole = speed["whole"]
    return (
        whole["naive_seconds"] / whole["seconds"],
        naive_seconds / exact_seconds,
        (speed_claim(speed)),
    )


def chest_upload(services, seed: int) -> str:
    """A generated chest-CT volume (``seed``) put in the store as the volume panel's
    upload of a .nii.gz is: its key."""
    import gzip

    import nibabel
    import numpy as np

    sample = ChestCTGenerator(seed=seed).sample(label=1)
    affine = np.diag([5.0, 5.0, 5.0, 1.0])
    image = nibabel.Nifti1Image(np.transpose(sample.volume, (2, 1, 0)).astype(np.int16), affine)
    data = gzip.compress(image.to_bytes(), compresslevel=1)  # a .nii.gz, as uploaded
    return services.images.put_source(data, "bench")


def volume_panel_case(services, stride: int) -> tuple[float, float, str]:
    """The same for a generated chest-CT volume on the volume panel's run path
    (webapp.runs.execute at rank 3: a NIfTI upload)."""
    from webapp import runs

    key = chest_upload(services, seed=4)

    def run(mode: str) -> dict:
        request = runs.RunRequest(
            key=key, name="chest.nii.gz", model="chestct-demo", patch=8, stride=stride,
            mode=mode, rank=3,
        )  # fmt: skip
        return runs.execute(services, "bench", request, lambda *a: None)

    exact = run("exact")
    naive = run("naive")
    whole = (exact.get("speed") or {}).get("whole")
    claimed = whole["naive_seconds"] / whole["seconds"] if whole else float("nan")
    claim = runs.speed_text(exact.get("speed"), "exact")
    return claimed, naive["seconds"] / exact["seconds"], claim


def main() -> None:
    import argparse
    import subprocess
    import sys

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--burners", type=int, default=0, help="CPU burners beside the runs")
    parser.add_argument(
        "--exact-only", type=int, default=0, metavar="N",
        help="instead: N exact runs per case on a log that never learns a naive run",
    )  # fmt: skip
    args = parser.parse_args()
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)
    ]
    try:
        print(f"beside {args.burners} CPU burners" if burners else "idle host")
        if args.exact_only:
            exact_only_cases(args.exact_only)
        else:
            cases()
    finally:
        for burner in burners:
            burner.kill()


def cases() -> None:
    """Every case, each as a table row: claimed, stopwatch, their ratio."""
    from webapp.services import Services

    torch.manual_seed(0)
    services = Services(Path(tempfile.mkdtemp()) / "cache")
    image = Image.fromarray(FundusGenerator(seed=5).sample(label=1, lesions=1).image)
    key = services.images.put(image)
    runs_ = [
        ("fundus 224², stride 8, whole image", 8, None, 0.5),
        ("fundus 224², stride 4, 96² region", 4, (0, 0, 96, 96), 0.4),
        ("fundus 224², stride 16, whole image", 16, None, 0.3),
    ]
    print("| case | claimed | stopwatch | claim / stopwatch |\n|---|---|---|---|")
    naive_figures = []
    for name, stride, region, grey in runs_:
        claimed, measured, claim, figures = page_case(services, key, stride, region, grey)
        naive_figures.append((name, *figures))
        print(f"| {name} | {claimed:.2f}× | {measured:.2f}× | {claimed / measured:.2f} |")
        print(f"|   ↳ {claim} ||||", flush=True)
    print("\n| case | naive shown before | stated after | before / after | naive stopwatch |")
    print("|---|---|---|---|---|")
    for name, before, after, stopwatch in naive_figures:
        print(f"| {name} | {before:.1f} s | {after:.1f} s | {before / after:.2f} | "
              f"{stopwatch:.1f} s |")  # fmt: skip
    try:
        claimed, measured, claim = volume_case()
        print(f"| chest CT volume, stride 6 | {claimed:.2f}× | {measured:.2f}× | "
              f"{claimed / measured:.2f} |")  # fmt: skip
        print(f"|   ↳ {claim} ||||", flush=True)
    except Exception as exc:  # the volume path needs the shipped 3-D model
        print(f"| chest CT volume | (not run: {exc}) |||")
    claimed, measured, claim = volume_panel_case(services, stride=6)
    print(f"| chest CT volume, stride 6, the volume panel's path | {claimed:.2f}× | "
          f"{measured:.2f}× | {claimed / measured:.2f} |")  # fmt: skip
    print(f"|   ↳ {claim} ||||", flush=True)


def exact_only_cases(count: int) -> None:
    """``count`` exact runs per case on a fresh runtime log, each against a naive run of
    its positions logged elsewhere: the speed lines of a machine whose log has exact runs
    only (their naive probes: krypton.estimator.probed_naive_pace), with the basis each
    took."""
    from webapp import runs
    from webapp.services import Services

    kept = os.environ.get("KRYPTON_HOME")
    logged, elsewhere = tempfile.mkdtemp(), tempfile.mkdtemp()
    services = Services(Path(tempfile.mkdtemp()) / "cache")

    def pair(request) -> float:
        os.environ["KRYPTON_HOME"] = logged
        exact = runs.execute(services, "bench", request, lambda *a: None)
        os.environ["KRYPTON_HOME"] = elsewhere
        naive = runs.execute(services, "bench", dataclasses.replace(request, mode="naive"),
                             lambda *a: None)  # fmt: skip
        speed = exact["speed"]
        whole = speed["whole"]
        claimed = whole["naive_seconds"] / whole["seconds"]
        measured = naive["seconds"] / exact["seconds"]
        pace = whole.get("naive_pace_ms", whole["naive_ms"])
        print(
            f"| {whole['naive_ms']:.0f} | {pace:.0f} | {speed.get('naive_basis')} | "
            f"{claimed:.2f}× | {measured:.2f}× | {claimed / measured:.2f} |",
            flush=True,
        )
        return claimed / measured

    try:
        print("| probe ms/position | pace stated | basis | claimed | stopwatch | ratio |")
        print("|---|---|---|---|---|---|")
        print("| chest CT volumes, stride 6, the volume panel's path ||||||")
        ratios = []
        for number in range(count):
            ratios.append(pair(runs.RunRequest(
                key=chest_upload(services, seed=10 + number), name="chest.nii.gz",
                model="chestct-demo", patch=8, stride=6, mode="exact", rank=3,
            )))  # fmt: skip
        print("| fundus 224², stride 16, whole image, a fill each ||||||")
        image = Image.fromarray(FundusGenerator(seed=5).sample(label=1, lesions=1).image)
        key = services.images.put(image)
        for number in range(count):
            ratios.append(pair(runs.RunRequest(
                key=key, name="fundus.png", model="fundus-demo", patch=16, stride=16,
                mode="exact", fill_rgb=(0.2 + number / 40,) * 3,
            )))  # fmt: skip
        within = sum(abs(ratio - 1) <= 0.15 for ratio in ratios)
        print(f"claim / stopwatch within 15%: {within} of {len(ratios)}")
    finally:
        if kept is None:
            os.environ.pop("KRYPTON_HOME", None)
        else:
            os.environ["KRYPTON_HOME"] = kept


if __name__ == "__main__":
    main()
