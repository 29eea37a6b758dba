"""Per-layer profile: where exact mode's time goes, layer by layer, against full inference.

    python -m bench.profile [--models tv:vgg13,tv:resnet34] [--top 8]      (make bench)

Per architecture (random weights, 224x224, patch 16, stride 4, one batch of 16 positions
in a central region): every node's seconds in the incremental run
(``IncrementalGraph.run_batch(..., timings=)``) beside the same node's seconds in a full
forward pass of 16 images (a ``torch.fx.Interpreter`` that times each node, as
``torch/fx/passes/shape_prop.py`` annotates each node), best of three each. For a
convolution, its MAC ratio (eq 9 over eq 11) is the most the incremental step can gain;
"excess" is the incremental time beyond the full time scaled by that ratio, the overhead
a faster kernel or fewer copies could remove. Rows: the layers with the most excess.
The totals say how much of the incremental time is convolutions and how much the steps
that only move data (copies into read-in contexts, scatters, merges, remaps). CPU only:
on a GPU the timings would need a synchronize per node.
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from bench.zoo import build

MODELS = ["tv:vgg11", "tv:vgg13", "tv:vgg16", "tv:resnet34", "tv:mnasnet1_0", "timm:regnety_002"]
PATCH, STRIDE, BATCH, SIDE = 16, 4, 16, 52


class TimedInterpreter(fx.Interpreter):
    """Runs a GraphModule and adds each node's seconds to ``timings`` by node name."""

    def __init__(self, module: fx.GraphModule, timings: dict[str, float]):
        super().__init__(module)
        self.timings = timings

    def run_node(self, node: fx.Node) -> Any:
        began = time.perf_counter()
        result = super().run_node(node)
        self.timings[node.name] = self.timings.get(node.name, 0.0) + time.perf_counter() - began
        return result


def best_of(runs: int, measure) -> dict[str, float]:
    """Per node, the least seconds over ``runs`` calls of ``measure(timings)``."""
    best: dict[str, float] = {}
    for _ in range(runs):
        timings: dict[str, float] = {}
        measure(timings)
        for name, seconds in timings.items():
            best[name] = min(seconds, best.get(name, float("inf")))
    return best


def profile(name: str) -> dict:
    """Per-node timings and MACs of one architecture, full against incremental."""
    import krypton
    from krypton.engine import NodeKind
    from krypton.explainer import grid_positions

    model = build(name)
    size = 224
    image = torch.randn(3, size, size)
    start = (size - SIDE) // 2
    region = (start, start, start + SIDE, start + SIDE)
    explainer = krypton.OcclusionExplainer(model)
    graph, views = explainer.views_for(image)
    grid = grid_positions((size, size), PATCH, STRIDE, region)
    ys = np.repeat(grid[0], len(grid[1]))[:BATCH]
    xs = np.tile(grid[1], len(grid[0]))[:BATCH]
    geometry = graph.geometry((ys, xs), (PATCH, PATCH))
    occluder = torch.zeros(3, PATCH, PATCH)
    images = image.unsqueeze(0).repeat(BATCH, 1, 1, 1)
    with torch.inference_mode():
        incremental = best_of(
            3, lambda t: graph.run_batch(views, geometry, slice(0, BATCH), occluder, t)
        )
        full = best_of(3, lambda t: TimedInterpreter(graph.module, t).run(images))
    rows = []
    for step in graph.steps:
        node = step.node.name
        kind = step.kind.name.lower()
        macs_full = step.macs_full * BATCH
        macs_incremental = None
        if step.kind == NodeKind.LOCAL and step.local.kind == "conv":
            kind = "conv"
            macs_incremental = geometry.step_macs(step, graph.shapes) * BATCH  # eq 11
        elif step.kind == NodeKind.LOCAL:
            kind = step.local.kind
        seconds_full = full.get(node, 0.0)
        seconds_incremental = incremental.get(node, 0.0)
        ideal = (
            seconds_full * macs_incremental / macs_full
            if macs_incremental is not None and macs_full
            else None
        )
        rows.append(
            {
                "node": node,
                "kind": kind,
                "full_ms": seconds_full * 1e3,
                "incremental_ms": seconds_incremental * 1e3,
                "mac_ratio": macs_full / macs_incremental if macs_incremental else None,
                "excess_ms": (seconds_incremental - ideal) * 1e3 if ideal is not None else None,
            }
        )
    return {"model": name, "rows": rows}


def totals(rows: list[dict]) -> dict[str, float]:
    """Milliseconds per kind of step: full and incremental in all, the convolutions (and
    their excess over their MAC ratio), and the steps that only move data or run whole."""
    return {
        "full": sum(r["full_ms"] for r in rows),
        "incremental": sum(r["incremental_ms"] for r in rows),
        "conv": sum(r["incremental_ms"] for r in rows if r["kind"] == "conv"),
        "conv_full": sum(r["full_ms"] for r in rows if r["kind"] == "conv"),
        "moving": sum(
            r["incremental_ms"] for r in rows if r["kind"] in ("pointwise", "remap", "global")
        ),
        "moving_full": sum(
            r["full_ms"] for r in rows if r["kind"] in ("pointwise", "remap", "global")
        ),
        "excess": sum(r["excess_ms"] for r in rows if r["excess_ms"] is not None),
    }


def overhead(result: dict) -> str:
    """The measured overhead that keeps a network from its FLOP limit, in one line: the
    share of the incremental time spent outside the convolutions' ideal (their excess
    over the MAC ratio, and the steps that gain nothing or lose), and the worst layer."""
    rows, t = result["rows"], totals(result["rows"])
    worst = max(  # a convolution by its excess, any other step by its whole time
        rows, key=lambda r: r["excess_ms"] if r["excess_ms"] is not None else r["incremental_ms"]
    )
    return (
        f"non-convolution steps {t['moving']:.1f} of {t['incremental']:.1f} ms incremental "
        f"({t['moving'] / t['incremental']:.0%}; {t['moving_full']:.1f} ms in full), "
        f"convolutions' excess over their MAC ratio {t['excess']:.1f} ms; most: "
        f"{worst['node']} ({worst['kind']}, {worst['incremental_ms']:.1f} ms)"
    )


def print_profile(result: dict, top: int) -> None:
    rows, t = result["rows"], totals(result["rows"])
    full, incremental, conv = t["full"], t["incremental"], t["conv"]
    print(f"\n### {result['model']}: {BATCH} positions, patch {PATCH}")
    print(
        f"full {full:.1f} ms, incremental {incremental:.1f} ms ({full / incremental:.2f}x); "
        f"convolutions {conv:.1f} ms of the incremental time ({conv / incremental:.0%}; "
        f"{t['conv_full']:.1f} ms in full), pointwise/merge/copy/global steps "
        f"{t['moving']:.1f} ms ({t['moving'] / incremental:.0%}); convolutions' excess over "
        f"their MAC ratio {t['excess']:.1f} ms"
    )
    print("| layer | kind | full (ms) | incremental (ms) | MAC ratio | time ratio | excess (ms) |")
    print("|---|---|---|---|---|---|---|")
    ranked = sorted(
        rows,
        key=lambda r: r["excess_ms"] if r["excess_ms"] is not None else r["incremental_ms"],
        reverse=True,
    )
    for r in ranked[:top]:
        mac = "-" if r["mac_ratio"] is None else f"{r['mac_ratio']:.1f}x"
        ratio = r["full_ms"] / r["incremental_ms"] if r["incremental_ms"] else float("nan")
        excess = "-" if r["excess_ms"] is None else f"{r['excess_ms']:.2f}"
        print(
            f"| {r['node']} | {r['kind']} | {r['full_ms']:.2f} | {r['incremental_ms']:.2f} "
            f"| {mac} | {ratio:.1f}x | {excess} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--top", type=int, default=8, help="layers shown per model")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_grad_enabled(False)
    for name in args.models.split(","):
        print_profile(profile(name), args.top)


if __name__ == "__main__":
    main()
