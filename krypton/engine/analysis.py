"""Static analysis: how much incremental inference can save, before running any occlusion.

Theoretical speedup Q / Q_inc over convolution layers (eqs 9-12) for one patch at the
centre of the input (an image (C, H, W) or a volume (C, D, H, W)), the worst case, with
eq 14's windows: the paper's per-query limit (exact mode's own windows, sized for the
positions it runs, can be smaller). Shapes come from one inference on a blank input; no
occluded input is ever run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import IncrementalGraph, NodeKind

__all__ = ["LayerCost", "SpeedupReport", "analyze", "theoretical_speedup"]


@dataclass(frozen=True)
class LayerCost:
    """One convolution or pooling layer of the static analysis."""

    name: str
    op: str  # "conv", "max_pool", "avg_pool", or "conv (global)" when not incremental
    output_shape: tuple[int, ...]
    output_patch: tuple[int, ...]  # the output update patch's extent per spatial axis
    macs_full: int  # eq 9 (0 for pooling)
    macs_incremental: int  # eq 11 (0 for pooling)


@dataclass(frozen=True)
class SpeedupReport:
    """Per-layer costs and the totals of eqs 10 and 12."""

    model: str
    input_shape: tuple[int, ...]  # (C, H, W) or (C, D, H, W)
    patch: int | tuple[int, ...]
    tau: float
    layers: list[LayerCost]
    first_global: str | None = None  # the first image-dependent op that is not local
    macs_before_first_global: int = 0  # conv + linear MACs of one image before it
    macs_all: int = 0  # conv + linear MACs of one image

    @property
    def share_before_first_global(self) -> float:
        """Share of the model's MACs computed before the first global op: the most that
        incremental inference can ever touch."""
        return self.macs_before_first_global / self.macs_all if self.macs_all else 0.0

    @property
    def macs_full(self) -> int:
        return sum(layer.macs_full for layer in self.layers)  # eq 10

    @property
    def macs_incremental(self) -> int:
        return sum(layer.macs_incremental for layer in self.layers)  # eq 12

    @property
    def speedup(self) -> float:
        return self.macs_full / self.macs_incremental if self.macs_incremental else float("inf")

    def table(self) -> str:
        """Human-readable per-layer table."""
        lines = [
            f"{'layer':<34} {'op':<14} {'output':>16} {'patch':>9} "
            f"{'MMACs full':>11} {'MMACs inc':>10}"
        ]
        for layer in self.layers:
            shape = "x".join(str(d) for d in layer.output_shape[1:])
            patch = "x".join(str(d) for d in layer.output_patch)
            lines.append(
                f"{layer.name[:34]:<34} {layer.op:<14} {shape:>16} {patch:>9} "
                f"{layer.macs_full / 1e6:>11.1f} {layer.macs_incremental / 1e6:>10.1f}"
            )
        lines.append(
            f"total conv MACs: full {self.macs_full / 1e9:.3f} G, incremental "
            f"{self.macs_incremental / 1e9:.3f} G -> theoretical speedup "
            f"{self.speedup:.2f}x (patch {self.patch}, tau {self.tau})"
        )
        if self.first_global is not None:
            lines.insert(
                -1,
                f"first global op: {self.first_global}; "
                f"{self.share_before_first_global:.0%} of the conv/linear MACs come before it",
            )
        return "\n".join(lines)


def _normalise_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    """(C, H, W) for an image or (C, D, H, W) for a volume, without a batch dimension
    (a 4-tuple is a volume: (1, D, H, W) is a one-channel one)."""
    shape = tuple(int(d) for d in input_shape)
    if len(shape) not in (3, 4) or min(shape) < 1:
        raise ValueError(f"input_shape must be (C, H, W) or (C, D, H, W), got {tuple(input_shape)}")
    return shape


def patch_extent(patch: int | Sequence[int], spatial: Sequence[int]) -> tuple[int, ...]:
    """A patch as one extent per spatial axis: an int is a square (cube); a sequence
    gives each axis. Checked against the spatial sizes."""
    rank = len(spatial)
    if isinstance(patch, (tuple, list)):
        extent = tuple(patch)
    else:
        extent = (patch,) * rank
    if len(extent) != rank or any(
        isinstance(p, bool) or not isinstance(p, (int, np.integer)) or p < 1 for p in extent
    ):
        raise ValueError(
            f"patch must be a positive integer or {rank} positive integers, got {patch!r}"
        )
    extent = tuple(int(p) for p in extent)
    if any(p > size for p, size in zip(extent, spatial)):
        sizes = "x".join(str(s) for s in spatial)
        raise ValueError(f"patch {patch} is larger than the {sizes} input")
    return extent


def analyze(
    model: nn.Module, input_shape: Sequence[int], patch: int | Sequence[int], tau: float = 1.0
) -> SpeedupReport:
    """Per-layer output patch sizes and conv FLOPs, full vs incremental (eqs 9-16, 21-27).

    ``input_shape``: (C, H, W) for an image, (C, D, H, W) for a volume; ``patch``: an int
    (a square or a cube) or one extent per spatial axis."""
    input_dims = _normalise_shape(input_shape)
    spatial = input_dims[1:]
    extent = patch_extent(patch, spatial)
    if not 0 < tau <= 1:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    if model.training:
        raise ValueError("model is in training mode; call model.eval() first")
    parameter = next(iter(model.parameters()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    dtype = parameter.dtype if parameter is not None else torch.float32
    with torch.inference_mode():
        graph = IncrementalGraph(model, torch.zeros(input_dims, dtype=dtype, device=device))
    centre = [np.array([(size - p) // 2]) for size, p in zip(spatial, extent)]
    # the paper's per-query count: eq 14 for any offset, as the paper's tables use it
    geometry = graph.geometry(centre, extent, tau, tight=False)
    layers = []
    for step in graph.steps:
        node = step.node
        shape = graph.shapes.get(node)
        if step.kind == NodeKind.LOCAL:
            windows = geometry.windows[node]
            is_conv = step.local.kind == "conv"
            incremental = (
                step.local.conv_macs_per_output * shape[1] * geometry.cells(node) if is_conv else 0
            )
            layers.append(
                LayerCost(
                    node.name,
                    step.local.kind,
                    shape,
                    tuple(window.length for window in windows),
                    step.macs_full if is_conv else 0,
                    incremental,
                )
            )
        elif (
            step.kind == NodeKind.GLOBAL
            and node.op == "call_module"
            and isinstance(graph.module.get_submodule(str(node.target)), (nn.Conv2d, nn.Conv3d))
            and len(shape) == graph.rank + 2
        ):
            layers.append(
                LayerCost(
                    node.name,
                    "conv (global)",
                    shape,
                    tuple(shape[2:]),
                    step.macs_full,
                    step.macs_full,
                )
            )
    step, before, total = graph.first_global_step()
    first_global = None
    if step is not None:
        why = f": {step.reason}" if step.reason else ""
        first_global = f"{step.node.name} ({_describe(step.node)}{why})"
    return SpeedupReport(
        type(model).__name__,
        input_dims,
        patch if isinstance(patch, int) else extent,
        tau,
        layers,
        first_global,
        before,
        total,
    )


def _describe(node) -> str:
    """What a graph node does, in a few words: 'call_module AdaptiveAvgPool2d'."""
    target = node.target
    if node.op == "call_module":
        return f"module {type(node.graph.owning_module.get_submodule(target)).__name__}"
    if node.op == "call_function":
        return f"function {getattr(target, '__name__', str(target))}"
    return f"{node.op} {target}"


def theoretical_speedup(
    model: nn.Module, input_shape: Sequence[int], patch: int | Sequence[int], tau: float = 1.0
) -> float:
    """Q / Q_inc for a patch at the centre of the input (eqs 9-12; tau per eqs 21-27)."""
    return analyze(model, input_shape, patch, tau).speedup
