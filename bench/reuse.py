"""How much of exact mode's work is identical across positions: the ceiling of reuse.

    python -m bench.reuse [--models tv:resnet18,tv:vgg16] [--positions 16]   (make bench)

The per-query limit (eqs 9-12) counts every position's update patches on their own. Work
that one position could take from another is bounded by the cells of those patches whose
values do not depend on the position alone. Per convolution, for a batch of positions at
patch 16 / stride 4 in a central region (random weights, 224x224), each cell of each
position's output update patch is put in one class, by running the occluded images in full
and comparing values bit for bit (all channels of the cell):

- *occluder only*: equal when the image behind the patch is replaced by another random
  image (same occluder, same place) — its receptive field lies inside the occluder, so the
  value is the same for every position with the same offset to the grid: compute once.
- *unchanged*: equal to the unoccluded image's value — the patch's projective field
  rectangle holds it, but the occlusion did not change it (e.g. a ReLU clamps both to 0).
- *as the neighbour's*: equal to the value of the next position of the batch (stride px
  along the row) at the same place, and not in the classes above.

Weighted by each cell's MACs, the three give the MACs any cross-position reuse could skip;
``limit with reuse`` is the FLOP limit if all of it were skipped for free. Bit-equal values
can only undercount: a cell that should be shared but rounds differently is not counted.

The classes are counted twice: inside eq 14's windows, which the paper's per-query limit
counts (there 7% of ResNet18's and 16% of VGG16's MACs are *unchanged* cells in a border
row and column after each stride-2 layer), and inside the engine's windows, sized for the
positions of the call (``geometry.tight_output_length``), which leave them out.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from bench.zoo import build

MODELS = ["tv:resnet18", "tv:vgg16"]
PATCH, STRIDE, SIDE = 16, 4, 52


class _Collector(fx.Interpreter):
    """Runs the graph and hands each watched node's output to ``on_output``."""

    def __init__(self, module: fx.GraphModule, watched: set[str], on_output):
        super().__init__(module)
        self.watched = watched
        self.on_output = on_output

    def run_node(self, node: fx.Node) -> Any:
        result = super().run_node(node)
        if node.name in self.watched:
            self.on_output(node.name, result)
        return result


def _outputs(module: fx.GraphModule, images: torch.Tensor, watched: set[str]) -> dict:
    found: dict[str, torch.Tensor] = {}
    _Collector(module, watched, lambda name, value: found.__setitem__(name, value)).run(images)
    return found


def _occlude(image: torch.Tensor, ys: np.ndarray, xs: np.ndarray) -> torch.Tensor:
    batch = image.unsqueeze(0).repeat(len(ys), 1, 1, 1)
    for item, (y, x) in enumerate(zip(ys, xs)):  # building inputs, not a hot path
        batch[item, :, y : y + PATCH, x : x + PATCH] = 0.0
    return batch


def _outside_changed_box(changed: torch.Tensor) -> int:
    """Cells of a window outside the bounding box of its changed cells."""
    rows = torch.nonzero(changed.any(dim=1)).flatten()
    cols = torch.nonzero(changed.any(dim=0)).flatten()
    if len(rows) == 0:
        return changed.numel()
    box = (int(rows[-1]) - int(rows[0]) + 1) * (int(cols[-1]) - int(cols[0]) + 1)
    return changed.numel() - box


def reuse_ceiling(name: str, positions: int) -> list[dict]:
    """Per-position MACs (eq 11) and the share of them each reuse class could skip, in
    eq 14's windows (the paper's per-query count) and in the engine's own."""
    import krypton
    from krypton.engine import NodeKind
    from krypton.explainer import grid_positions

    model = build(name)
    size = 224
    generator = torch.Generator().manual_seed(0)
    image = torch.randn(3, size, size, generator=generator)
    other = torch.randn(3, size, size, generator=generator)
    start = (size - SIDE) // 2
    region = (start, start, start + SIDE, start + SIDE)
    explainer = krypton.OcclusionExplainer(model)
    graph, _ = explainer.views_for(image)
    grid = grid_positions((size, size), PATCH, STRIDE, region)
    ys = np.repeat(grid[0], len(grid[1]))[: positions + 1]
    xs = np.tile(grid[1], len(grid[0]))[: positions + 1]
    convs = [s for s in graph.steps if s.kind == NodeKind.LOCAL and s.local.kind == "conv"]
    watched = {s.node.name for s in convs}
    with torch.inference_mode():
        occluded = _outputs(graph.module, _occlude(image, ys, xs), watched)
        swapped = _outputs(graph.module, _occlude(other, ys, xs), watched)
        clean = _outputs(graph.module, image.unsqueeze(0), watched)
    same = {
        node: (
            (occluded[node] == swapped[node]).all(dim=1),
            (occluded[node] == clean[node]).all(dim=1),
            (occluded[node][:-1] == occluded[node][1:]).all(dim=1),
        )
        for node in watched
    }
    rows = []
    for windows, tight in (("eq 14's", False), ("the engine's", True)):
        geometry = graph.geometry((ys, xs), (PATCH, PATCH), tight=tight)
        incremental, full = graph.macs_per_position(geometry)
        saved, outside_box = _classify(graph, convs, geometry, same, positions)
        rows.append(
            {
                "model": name,
                "windows": windows,
                "positions": positions,
                "macs_full": full,
                "macs_incremental": incremental,
                "saved": saved,
                "outside_changed_box": outside_box,
                "limit": full / incremental,
                "limit_with_reuse": full / (incremental - sum(saved.values())),
            }
        )
    return rows


def _classify(graph, convs, geometry, same: dict, positions: int) -> tuple[dict, float]:
    """MACs per position of each reuse class inside ``geometry``'s windows, and of the
    cells outside the bounding box of the changed ones."""
    saved = {"occluder only": 0.0, "unchanged": 0.0, "as the neighbour's": 0.0}
    outside_box = 0.0
    for step in convs:
        rows, cols = geometry.windows[step.node]
        cell_macs = step.local.conv_macs_per_output * graph.shapes[step.node][1]
        same_swapped, same_clean, same_next = same[step.node.name]
        for item in range(positions):  # counting cells, not a hot path
            window = (
                slice(int(rows.start[item]), int(rows.stop[item])),
                slice(int(cols.start[item]), int(cols.stop[item])),
            )
            only = same_swapped[item][window]
            unchanged = same_clean[item][window] & ~only
            neighbour = same_next[item][window] & ~only & ~unchanged
            saved["occluder only"] += int(only.sum()) * cell_macs / positions
            saved["unchanged"] += int(unchanged.sum()) * cell_macs / positions
            saved["as the neighbour's"] += int(neighbour.sum()) * cell_macs / positions
            outside_box += _outside_changed_box(~same_clean[item][window]) * cell_macs / positions
    return saved, outside_box


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--positions", type=int, default=16)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    print(
        f"Cross-position reuse ceiling: patch {PATCH}, stride {STRIDE}, "
        f"{args.positions} central positions, random weights, 224x224"
    )
    print(
        "| model | windows | MACs per position (eq 11) | occluder only | unchanged "
        "| as the neighbour's | of these, outside the changed cells' box | FLOP limit "
        "| limit with all reuse |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for row in reuse_ceiling(name, args.positions):
            shares = " | ".join(
                f"{value / row['macs_incremental']:.2%}" for value in row["saved"].values()
            )
            box = row["outside_changed_box"] / row["macs_incremental"]
            print(
                f"| {name} | {row['windows']} | {row['macs_incremental'] / 1e6:.0f} M | {shares} "
                f"| {box:.2%} | {row['limit']:.2f}x | {row['limit_with_reuse']:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
