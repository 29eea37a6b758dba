"""Benchmark: exact (planned) vs naive over the architecture matrix, side by side.

    python -m bench.architectures [--models tv:resnet18,timm:efficientnet_b0] [--side 52]

Per architecture (random weights, 224x224 — 299 for Inception3 —, patch 16, stride 4,
batch 16, a central region of 100 positions): the FLOP limit from static analysis
(full / incremental MACs for exactly these positions, eqs 9-12), the share of FLOPs
before the first global op, the capture time, the plan exact mode chose, and the measured
exact/naive ratio. Exact and naive runs alternate on the same explainer (best of two
each), after one first exact call that captures the graph and times both plans; ratios
are taken within the run because this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import numpy as np
import torch

MATRIX = [
    "tv:resnet18",
    "tv:vgg16",
    "tv:inception_v3",
    "tv:densenet121",
    "tv:mobilenet_v2",
    "tv:mobilenet_v3_large",
    "tv:efficientnet_b0",
    "tv:convnext_tiny",
    "tv:regnet_y_400mf",
    "tv:shufflenet_v2_x1_0",
    "tv:resnext50_32x4d",
    "tv:googlenet",
    "tv:squeezenet1_0",
    "timm:resnet50d",
    "timm:efficientnet_b0",
    "timm:convnext_nano",
    "timm:densenet121",
    "timm:regnetx_002",
    "timm:mobilenetv3_large_100",
    "timm:inception_v3",
    "timm:xception41",
    "timm:res2net50_14w_8s",
    "timm:ghostnet_100",
    "timm:hgnetv2_b0",
    "timm:selecsls42b",
    "timm:dla34",
    "timm:cspresnet50",
    "timm:dpn68",
    "timm:repvgg_a0",
    "timm:ese_vovnet19b_dw",
    "timm:rexnet_100",
    "timm:mobilenetv3_small_100",
]
PATCH, STRIDE, BATCH = 16, 4, 16


def build(name: str) -> torch.nn.Module:
    source, arch = name.split(":")
    torch.manual_seed(0)
    if source == "tv":
        import torchvision

        kwargs = (
            {"aux_logits": False, "init_weights": True}
            if arch in ("inception_v3", "googlenet")
            else {}
        )
        return getattr(torchvision.models, arch)(weights=None, **kwargs).eval()
    import timm

    return timm.create_model(arch, pretrained=False).eval()


def measure(name: str, side: int) -> dict:
    import krypton
    from krypton.explainer import grid_positions

    model = build(name)
    size = 299 if "inception" in name else 224
    image = torch.randn(3, size, size)
    start = (size - side) // 2
    region = (start, start, start + side, start + side)
    explainer = krypton.OcclusionExplainer(model)
    began = time.perf_counter()
    with torch.inference_mode():
        graph, _ = explainer.views_for(image)
    capture = time.perf_counter() - began
    grid = grid_positions((size, size), PATCH, STRIDE, region)
    ys, xs = np.repeat(grid[0], len(grid[1])), np.tile(grid[1], len(grid[0]))
    incremental, full = graph.macs_per_position(graph.geometry(ys, xs, PATCH, PATCH))
    first, share = graph.first_global()
    settings = dict(patch=PATCH, stride=STRIDE, region=region, batch_size=BATCH)
    began = time.perf_counter()
    first_call = explainer.explain(image, **settings)
    first_seconds = time.perf_counter() - began
    exact_times, naive_times = [], []
    for _ in range(2):
        began = time.perf_counter()
        naive = explainer.explain(image, mode="naive", **settings)
        naive_times.append(time.perf_counter() - began)
        began = time.perf_counter()
        exact = explainer.explain(image, **settings)
        exact_times.append(time.perf_counter() - began)
    assert np.allclose(exact.values, naive.values, atol=1e-4), name
    return {
        "model": name,
        "positions": int(exact.values.size),
        "flop_limit": full / incremental,
        "share_before_first_global": share,
        "first_global": first,
        "capture_s": capture,
        "first_call_s": first_seconds,
        "exact_s": min(exact_times),
        "naive_s": min(naive_times),
        "ratio": min(naive_times) / min(exact_times),
        "plan": exact.extra["plan"],
        "strategy": exact.extra["plan"].split(":")[0],
        "first_plan": first_call.extra["plan"],
    }


def verdict(row: dict) -> str:
    """Which target the row meets: >= 0.95x naive always; >= 0.8x of a limit >= 1.5x."""
    problems = []
    if row["ratio"] < 0.95:
        problems.append("below 0.95x naive")
    if row["flop_limit"] >= 1.5 and row["ratio"] < 0.8 * row["flop_limit"]:
        problems.append(f"below 0.8x of its {row['flop_limit']:.2f}x limit")
    return "; ".join(problems) or "met"


def print_table(rows: list[dict]) -> None:
    print(
        "| model | FLOP limit | FLOPs before first global op | first global op | capture (s) "
        "| naive (s) | exact (s) | exact/naive | plan | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['flop_limit']:.2f}x | {r['share_before_first_global']:.0%} | "
            f"{r['first_global']} | {r['capture_s']:.2f} | {r['naive_s']:.2f} | "
            f"{r['exact_s']:.2f} | {r['ratio']:.2f}x | {r['strategy']} | {verdict(r)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MATRIX))
    parser.add_argument("--side", type=int, default=52, help="region side (52: 100 positions)")
    parser.add_argument("--json", default="out/bench-architectures.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_grad_enabled(False)
    rows = []
    for name in args.models.split(","):
        row = measure(name, args.side)
        rows.append(row)
        print(
            f"{name}: limit {row['flop_limit']:.2f}x, exact/naive {row['ratio']:.2f}x "
            f"({row['plan']})",
            flush=True,
        )
    print()
    print_table(rows)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    missed = [r["model"] for r in rows if verdict(r) != "met"]
    print(f"\n{len(rows) - len(missed)} of {len(rows)} rows meet their targets; missed: {missed}")


if __name__ == "__main__":
    main()
