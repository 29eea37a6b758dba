"""Benchmark: exact vs naive on the default model (fundus-demo), over a whole image, as
the app runs it by default (the model's own patch, 12; stride 4), side by side in one run.

    python -m bench.default_model [--repeats 2] [--stride 4] [--patch P]

Runs alternate naive and exact on the same image and explainer (views materialised
once, as the app does before Run), so load on this shared machine hits both alike; the
ratio of the medians is printed with the theoretical FLOP ratio. Target (issue: a
default model that deserves trust): exact at least 2x faster than naive.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--patch", type=int, help="default the model's own (registry)")
    args = parser.parse_args(argv)

    from PIL import Image

    import krypton
    from krypton.fundus import FundusGenerator

    loaded = krypton.load_model("fundus-demo")
    sample = FundusGenerator(seed=31).sample(kinds=["EXUDATE"], rendering="colour")
    image = loaded.preprocess(Image.fromarray(sample.image))
    explainer = krypton.OcclusionExplainer(loaded.module)
    patch = loaded.patch if args.patch is None else args.patch
    common = dict(patch=patch, stride=args.stride, fill=loaded.gray_fill())
    with torch.inference_mode():
        explainer.views_for(image)
    seconds: dict[str, list[float]] = {"naive": [], "exact": []}
    results = {}
    for _ in range(args.repeats):
        for mode in ("naive", "exact"):
            started = time.perf_counter()
            results[mode] = explainer.explain(image, mode=mode, **common)
            seconds[mode].append(time.perf_counter() - started)
    exact, naive = results["exact"], results["naive"]
    difference = float(np.nanmax(np.abs(exact.values - naive.values)))
    positions = exact.values.size
    naive_s, exact_s = statistics.median(seconds["naive"]), statistics.median(seconds["exact"])
    height, width = loaded.input_size
    print(
        f"fundus-demo ({width}x{height}), whole image, patch {patch}, stride "
        f"{args.stride}: {positions} positions, {torch.get_num_threads()} threads"
    )
    print(f"{'mode':<8}{'seconds':>10}{'ms/position':>14}")
    for mode, value in (("naive", naive_s), ("exact", exact_s)):
        print(f"{mode:<8}{value:>10.2f}{value / positions * 1000:>14.2f}")
    print(
        f"exact vs naive: {naive_s / exact_s:.2f}x faster (medians of {args.repeats} "
        f"alternating runs); FLOPs {exact.flops_ratio:.2f}x fewer; plan: "
        f"{exact.extra['plan']}; largest difference {difference:.1e}"
    )


if __name__ == "__main__":
    main()
