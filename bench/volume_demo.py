"""The 3-D demo model (chestct-demo) on whole held-out volumes: naive, exact and
approximate, side by side, and whether approximate mode keeps the nodule's evidence.

    python -m bench.volume_demo [--volumes 100] [--timed 4] [--compare 30] [--json FILE]

Held-out volumes with one nodule each (krypton.synthetic.chestct, seed 40: never trained or tuned
on). Timing: on the first ``--timed`` volumes the three modes run in turn on the same
volume (the order rotating), each over the whole 48^3 volume at the model's patch 8 and
stride 5 (729 positions); the ratios are of summed times. Quality, on every volume: the
approximate heatmap (the model's tuned tau, default drill-down) "keeps the lowest cell"
when, against the exact heatmap (first ``--compare`` volumes), exact's lowest cell is among
approximate's lowest (krypton.approximate.tuning.localisation's minimum criterion); and,
on every volume, whether the occluder at either map's lowest cell hides the nodule's
centre (the card's pointing game). Issue 31's target: approximate >= 10x naive with the
lowest cell kept on >= 95% of the volumes.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import krypton
from krypton.approximate.tuning import localisation
from krypton.registry import load_model
from krypton.synthetic.chestct import ChestCTGenerator

SEED, NAME, STRIDE = 40, "chestct-demo", 5
TARGET_SPEEDUP, TARGET_KEPT = 10.0, 0.95


def _input(model, volume: np.ndarray):
    from krypton.io.volumes import Volume

    return model.prepare_volume(Volume(volume, tuple(model.volume["spacing_mm"]), "generated"))


def _hides(heatmap, nodule, patch: int) -> bool:
    """Whether the occluder at the heatmap's lowest cell covers the nodule's centre."""
    k, i, j = np.unravel_index(np.nanargmin(heatmap.values), heatmap.values.shape)
    corner = (heatmap.zs[k], heatmap.ys[i], heatmap.xs[j])
    return all(c <= n < c + patch for c, n in zip(corner, (nodule.z, nodule.y, nodule.x)))


def run(volumes: int, timed: int, compare: int, log=print) -> dict:
    """Time the modes on the first ``timed`` volumes, compare approximate with exact on
    the first ``compare`` (at least ``timed``), and score approximate on all."""
    compare = max(compare, timed)
    model = load_model(NAME)
    patch = model.patch
    generator = ChestCTGenerator(seed=SEED)
    seconds = {"naive": 0.0, "exact": 0.0, "approximate": 0.0}
    kept_nodule = kept_exact = exact_on_nodule = compared = 0
    for index in range(volumes):
        sample = generator.sample(label=1, nodules=1)
        tensor = _input(model, sample.volume).tensor
        options = dict(patch=patch, stride=STRIDE, fill=model.gray_fill(), label=1)
        modes = ["naive"] * (index < timed) + ["exact"] * (index < compare) + ["approximate"]
        modes = modes[index % len(modes) :] + modes[: index % len(modes)]  # rotate the order
        maps = {}
        for mode in modes:
            started = time.perf_counter()
            maps[mode] = krypton.explain(model, tensor, mode=mode, **options)
            if index < timed:
                seconds[mode] += time.perf_counter() - started
        nodule = sample.nodules[0]
        kept_nodule += _hides(maps["approximate"], nodule, patch)
        if "exact" in maps:
            compared += 1
            exact_on_nodule += _hides(maps["exact"], nodule, patch)
            kept_exact += localisation(
                maps["exact"].values, maps["approximate"].values
            ).minimum_kept
        if (index + 1) % 10 == 0:
            log(f"{index + 1}/{volumes} volumes: approximate on the nodule {kept_nodule}")
    approximate = maps["approximate"]
    return {
        "model": NAME,
        "volumes": volumes,
        "timed_volumes": timed,
        "positions_per_volume": int(np.prod(approximate.values.shape)),
        "patch": patch,
        "stride": STRIDE,
        "tau": approximate.extra.get("tau"),
        "r_drill_down": approximate.extra.get("r_drill_down"),
        "seconds": {mode: round(value / max(timed, 1), 2) for mode, value in seconds.items()},
        "exact_over_naive": round(seconds["naive"] / seconds["exact"], 2),
        "approximate_over_naive": round(seconds["naive"] / seconds["approximate"], 2),
        "approximate_lowest_on_nodule": round(kept_nodule / volumes, 4),
        "exact_lowest_on_nodule": round(exact_on_nodule / max(compared, 1), 4),
        "exact_minimum_kept_by_approximate": round(kept_exact / max(compared, 1), 4),
        "compared_with_exact": compared,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--volumes", type=int, default=100)
    parser.add_argument("--timed", type=int, default=4)
    parser.add_argument("--compare", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = run(args.volumes, args.timed, args.compare)
    print(
        f"{NAME}, {result['positions_per_volume']} positions per 48^3 volume (patch "
        f"{result['patch']}, stride {result['stride']}), seconds per volume: naive "
        f"{result['seconds']['naive']}, exact {result['seconds']['exact']}, approximate "
        f"{result['seconds']['approximate']} (tau {result['tau']}, r {result['r_drill_down']})"
    )
    speedup, kept = result["approximate_over_naive"], result["exact_minimum_kept_by_approximate"]
    verdict = "meets" if speedup >= TARGET_SPEEDUP and kept >= TARGET_KEPT else "MISSES"
    print(
        f"approximate {speedup}x naive (exact {result['exact_over_naive']}x); exact's lowest "
        f"cell kept by approximate on {kept:.0%} of {result['compared_with_exact']} — "
        f"{verdict} issue 31's >= {TARGET_SPEEDUP:g}x with >= {TARGET_KEPT:.0%}; lowest cell "
        f"on the nodule: approximate {result['approximate_lowest_on_nodule']:.0%} of "
        f"{result['volumes']}, exact {result['exact_lowest_on_nodule']:.0%} of "
        f"{result['compared_with_exact']}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
