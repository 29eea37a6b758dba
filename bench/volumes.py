"""Exact over naive on volumes, side by side, against the conv-FLOP limit.

    python -m bench.volumes [--rounds 2] [--json out/bench-volumes.json]   (make bench)

For each 3-D network (random weights, seeded) and input of issue 31: the paper's
per-query conv-FLOP limit for a centred patch (eqs 9-14 per axis, ``krypton.analyze``),
and one explain() call's time in naive mode and in exact mode (forced incremental, so the
row measures the engine, not the planner) on the same grid of positions, alternated and
repeated; each mode's best call counts. The row meets issue 31's target when exact/naive
reaches 0.7 of the limit wherever the limit is at least 1.5x.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torchvision

import krypton

TARGET_SHARE, LIMIT_FLOOR = 0.7, 1.5


def _monai_resnet10() -> torch.nn.Module:
    from monai.networks.nets import resnet10

    return resnet10(spatial_dims=3, n_input_channels=1, num_classes=2)


# name -> (model, volume (C, D, H, W), patch (d, h, w), stride (d, h, w))
ROWS = {
    "torchvision r3d_18": (
        torchvision.models.video.r3d_18,
        (3, 8, 56, 56),
        (4, 16, 16),
        (4, 8, 8),
    ),
    "torchvision mc3_18": (
        torchvision.models.video.mc3_18,
        (3, 8, 56, 56),
        (4, 16, 16),
        (4, 8, 8),
    ),
    "MONAI resnet10": (_monai_resnet10, (1, 48, 48, 48), (12, 12, 12), (6, 6, 6)),
}


def _central_region(shape: tuple[int, ...], patch: tuple[int, ...], stride: tuple[int, ...]):
    """A region holding two grid steps per axis around the centre (8 positions), so a
    row takes seconds, not minutes."""
    low, high = [], []
    for size, p, s in zip(shape[1:], patch, stride):
        start = max(0, (size - p - s) // 2)
        low.append(start)
        high.append(min(size, start + p + s))
    return (*low, *high)


def measure(name: str, rounds: int) -> dict:
    """One row: the FLOP limit and the best naive and exact calls on the same positions."""
    build, shape, patch, stride = ROWS[name]
    torch.manual_seed(0)
    model = build().eval()
    volume = torch.rand(shape)
    limit = krypton.theoretical_speedup(model, shape, patch)
    region = _central_region(shape, patch, stride)
    explainer = krypton.OcclusionExplainer(model)
    kwargs = dict(patch=patch, stride=stride, region=region, batch_size=8)
    explainer.explain(volume, mode="exact", strategy="incremental", **kwargs)  # capture
    seconds: dict[str, list[float]] = {"naive": [], "exact": []}
    values = {}
    for index in range(rounds):
        order = ("naive", "exact") if index % 2 == 0 else ("exact", "naive")
        for mode in order:
            extra = {"strategy": "incremental"} if mode == "exact" else {}
            began = time.perf_counter()
            heatmap = explainer.explain(volume, mode=mode, **kwargs, **extra)
            seconds[mode].append(time.perf_counter() - began)
            values[mode] = heatmap.values
    difference = float(np.nanmax(np.abs(values["exact"] - values["naive"])))
    naive, exact = min(seconds["naive"]), min(seconds["exact"])
    ratio = naive / exact
    return {
        "model": name,
        "volume": list(shape),
        "patch": list(patch),
        "positions": int(values["exact"].size),
        "naive_s": naive,
        "exact_s": exact,
        "exact_over_naive": ratio,
        "flop_limit": limit,
        "share_of_limit": ratio / limit,
        "meets_target": limit < LIMIT_FLOOR or ratio >= TARGET_SHARE * limit,
        "max_difference": difference,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two modes")
    parser.add_argument("--json", default="out/bench-volumes.json")
    args = parser.parse_args(argv)
    print(
        f"{'model':<20} {'volume':>12} {'patch':>9} {'pos':>4} {'naive s':>8} {'exact s':>8} "
        f"{'exact/naive':>11} {'limit':>6} {'share':>6} {'max |diff|':>10}"
    )
    rows = []
    for name in ROWS:
        row = measure(name, args.rounds)
        rows.append(row)
        verdict = "" if row["meets_target"] else "  below 0.7 of the limit"
        print(
            f"{name:<20} {'x'.join(map(str, row['volume'])):>12} "
            f"{'x'.join(map(str, row['patch'])):>9} {row['positions']:>4} "
            f"{row['naive_s']:>8.2f} {row['exact_s']:>8.2f} {row['exact_over_naive']:>10.2f}x "
            f"{row['flop_limit']:>5.2f}x {row['share_of_limit']:>6.0%} "
            f"{row['max_difference']:>10.1e}{verdict}",
            flush=True,
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
