"""Exact mode against the best naive run, alone and beside CPU burners, as a user calls
the library (no thread setting: the engine takes its share of the host and picks the
schedule, krypton.schedule), side by side in one process.

    python -m bench.busy_host [--burners 0 2 6] [--rounds 1] [--cases resnet18 vgg16 ...]

For each load and case: exact (``krypton.OcclusionExplainer(model).explain`` on a fresh
image each call, the graph captured once before), and the best naive: Krypton's naive
mode and plain batched torch (16 occluded images a batch under ``inference_mode``), each
at one and at two torch threads, the fastest of the four, timed on the first 32 positions
and scaled to all of them (a naive position costs the same anywhere). The ratio is the best naive's
seconds over exact's. ``intra s`` is exact held to the intra-op schedule (as before the
engine could split a batch across threads, alternated with the chosen run) and ``gain``
its seconds over the chosen schedule's: what the inter-position schedule adds where it
runs (1.00x where only intra-op ran). The drop-in rows time Captum's ``Occlusion`` and MONAI's
``OcclusionSensitivity`` against Krypton's drop-ins (bench.dropin), at the libraries'
defaults and at a large batch, and the CLI row ``krypton explain`` on the fundus sample
at its defaults, exact against ``--mode naive`` (each its own process).
Burners are ``python -c 'while True: pass'`` processes.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torchvision

import krypton
import krypton.schedule
from bench.dropin import captum_row, monai_row
from krypton.torch_threads import threads_for_this_thread

# naive runs are timed on this many of a case's positions (two batches) and scaled: a
# naive position costs the same wherever the patch is, and VGG16's 169 naive positions
# beside six burners would take minutes per thread count
SAMPLE = 32

# name -> (model builder, input shape, explain settings)
CASES: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, ...], dict]] = {
    "resnet18": (
        lambda: torchvision.models.resnet18(num_classes=10),
        (3, 224, 224),
        dict(patch=16, stride=4, region=(80, 80, 144, 144)),  # 169 positions
    ),
    "vgg16": (
        lambda: torchvision.models.vgg16(num_classes=10),
        (3, 224, 224),
        dict(patch=16, stride=4, region=(80, 80, 144, 144)),  # 169 positions
    ),
    "inception3": (
        lambda: torchvision.models.inception_v3(
            num_classes=10, aux_logits=False, init_weights=False
        ),
        (3, 299, 299),
        dict(patch=16, stride=4, region=(118, 118, 182, 182)),  # 169 positions
    ),
    "r3d_18": (
        lambda: torchvision.models.video.r3d_18(num_classes=10),
        (3, 8, 56, 56),
        dict(patch=(4, 16, 16), stride=(4, 8, 8)),  # 72 positions
    ),
}


def _plain_torch(model: torch.nn.Module, image: torch.Tensor, corners: np.ndarray, patch) -> float:
    """Seconds of plain batched torch over the positions: 16 occluded copies a batch."""
    extent = tuple(patch) if isinstance(patch, tuple) else (patch,) * (image.dim() - 1)
    began = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(corners), 16):
            batch = image.unsqueeze(0).repeat(
                len(corners[first : first + 16]), 1, 1, 1, *([1] * (image.dim() - 3))
            )
            for row, corner in enumerate(corners[first : first + 16]):
                window = tuple(slice(int(c), int(c) + e) for c, e in zip(corner, extent))
                batch[(row, slice(None), *window)] = 0.5
            model(batch)
    return time.perf_counter() - began


def _corners(heatmap: krypton.Heatmap) -> np.ndarray:
    """Each position's first cell per axis, from a heatmap's axes."""
    axes = [heatmap.zs] if heatmap.zs is not None else []
    axes += [heatmap.ys, heatmap.xs]
    grids = np.meshgrid(*axes, indexing="ij")
    return np.stack([g.ravel() for g in grids], axis=1)


def _values_at(heatmap: krypton.Heatmap, corners: np.ndarray) -> np.ndarray:
    """The heatmap's values at these positions (first cell per axis, tensor order)."""
    axes = ([heatmap.zs] if heatmap.zs is not None else []) + [heatmap.ys, heatmap.xs]
    cells = tuple(np.searchsorted(axis, column) for axis, column in zip(axes, corners.T))
    return heatmap.values[cells]


@contextlib.contextmanager
def intra_op_only() -> Iterator[None]:
    """Runs inside offer the intra-op schedule alone (what the engine did before it could
    split a batch across threads): the yardstick for what inter-position adds."""
    offered = krypton.schedule.schedule_options

    def intra(*args, **kwargs) -> list[krypton.schedule.Schedule]:
        return [s for s in offered(*args, **kwargs) if s.kind == krypton.schedule.INTRA]

    krypton.schedule.schedule_options = intra
    try:
        yield
    finally:
        krypton.schedule.schedule_options = offered


def model_row(name: str, rounds: int) -> dict:
    """Exact as the library runs it against the best of four naive runs, alternated."""
    build, shape, settings = CASES[name]
    torch.manual_seed(0)
    model = build().eval()
    explainer = krypton.OcclusionExplainer(model)
    explainer.explain(torch.rand(shape), **settings)  # the capture, once, as a user's first call
    exact, intra, naive = [], [], {}
    difference = 0.0
    with intra_op_only():  # its pace is learnt on a first call, as the chosen one's was
        explainer.explain(torch.rand(shape), **settings)
    for _ in range(rounds):
        image = torch.rand(shape)
        with intra_op_only():
            began = time.perf_counter()
            explainer.explain(image, **settings)
            intra.append(time.perf_counter() - began)
        began = time.perf_counter()
        heatmap = explainer.explain(image, **settings)
        exact.append(time.perf_counter() - began)
        schedules = heatmap.extra["host"]["schedules"]
        corners = _corners(heatmap)
        sample = corners[:SAMPLE]  # naive's seconds per position are the same for all
        scale = len(corners) / len(sample)
        at = [tuple(int(c) for c in corner) for corner in sample]
        if len(shape) == 3:  # an image's positions are (x, y)
            at = [(x, y) for y, x in at]
        sampled = {k: v for k, v in settings.items() if k != "region"}
        for threads in (1, 2):
            began = time.perf_counter()
            reference = explainer.explain(
                image, mode="naive", threads=threads, positions=at, **sampled
            )
            naive.setdefault(f"krypton naive, {threads} thread(s)", []).append(
                (time.perf_counter() - began) * scale
            )
            gap = np.abs(_values_at(reference, sample) - _values_at(heatmap, sample))
            difference = max(difference, float(gap.max()))
            # this thread's count only: torch.set_num_threads would make every later
            # run's count the caller's (krypton.torch_threads), not the load's
            with threads_for_this_thread(threads):
                seconds = _plain_torch(model, image, sample, settings["patch"]) * scale
            naive.setdefault(f"plain torch, {threads} thread(s)", []).append(seconds)
    best_name, best = min(((k, min(v)) for k, v in naive.items()), key=lambda item: item[1])
    return {
        "case": f"{name} {'x'.join(map(str, shape[1:]))}, {len(corners)} positions",
        "exact": min(exact),
        "naive": best,
        "naive_by": best_name,
        "ratio": best / min(exact),
        "intra": min(intra),
        "schedules": schedules,
        "diff": difference,
    }


SAMPLE_IMAGE = "assets/samples/fundus-exudates.png"


def _cli_seconds(mode: str, out: str) -> float:
    """The run's seconds as `krypton explain` prints them (its ``time`` line: the run,
    not the interpreter's start or the model's load), in a process of its own."""
    printed = subprocess.run(
        [sys.executable, "-m", "krypton", "explain", SAMPLE_IMAGE, "--mode", mode, "--out", out],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    line = next(line for line in printed.splitlines() if line.startswith("time "))
    return float(line.split()[1])


def cli_row(repeats: int) -> dict:
    """The CLI on the fundus sample at its defaults, exact against naive, alternated,
    each the best of ``repeats`` processes."""
    import tempfile

    seconds: dict[str, list[float]] = {"exact": [], "naive": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(repeats):
            for mode in seconds:
                seconds[mode].append(_cli_seconds(mode, f"{folder}/{mode}.png"))
    return {"case": "krypton explain, fundus sample", **{k: min(v) for k, v in seconds.items()}}


def dropin_rows() -> list[dict]:
    """The drop-ins against their libraries at the defaults and at a large batch, each
    the best of three alternated calls (a fresh instance each: the first pays the capture,
    the second the schedule's first look at the other schedule, as a loop's first calls)."""
    small = torchvision.models.resnet18(weights=None, num_classes=3).eval()
    image = torch.randn(1, 3, 64, 64)
    return [
        captum_row("resnet18", 112, 8, 1, repeats=3),
        captum_row("resnet18", 112, 8, 64, repeats=3),
        monai_row("MONAI, ResNet18 2-D 64², defaults", small, image, {}, repeats=3),
        monai_row(
            "MONAI, ResNet18 2-D 64², n_batch=128", small, image, {"n_batch": 128}, repeats=3
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burners", type=int, nargs="+", default=[0, 2, 6])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--no-dropins", action="store_true")
    parser.add_argument("--no-cli", action="store_true")
    args = parser.parse_args()
    for count in args.burners:
        burners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)
        ]
        try:
            time.sleep(0.5)
            print(f"\n## beside {count} CPU burners" if count else "\n## alone", flush=True)
            print(
                f"{'case':<44} {'exact s':>8} {'naive s':>8} {'ratio':>6} {'intra s':>8} "
                f"{'gain':>6}  best naive; schedules"
            )
            for name in args.cases:
                row = model_row(name, args.rounds)
                gain = row["intra"] / row["exact"]
                print(
                    f"{row['case']:<44} {row['exact']:8.2f} {row['naive']:8.2f} "
                    f"{row['ratio']:5.2f}x {row['intra']:8.2f} {gain:5.2f}x  "
                    f"{row['naive_by']}; {row['schedules']} (max diff {row['diff']:.1e})",
                    flush=True,
                )
            if not args.no_cli:
                cli = cli_row(2)
                print(
                    f"{cli['case']:<44} {cli['exact']:8.2f} {cli['naive']:8.2f} "
                    f"{cli['naive'] / cli['exact']:5.2f}x  its own naive run (the CLI's time "
                    "line)",
                    flush=True,
                )
            if not args.no_dropins:
                for row in dropin_rows():
                    ratio = row["library"] / row["krypton"]
                    print(
                        f"{row['case'][:44]:<44} {row['krypton']:8.2f} {row['library']:8.2f} "
                        f"{ratio:5.2f}x  the library itself; {row['engine']} "
                        f"(max diff {row['diff']:.1e})",
                        flush=True,
                    )
        finally:
            for burner in burners:
                burner.kill()
                burner.wait()


if __name__ == "__main__":
    main()
