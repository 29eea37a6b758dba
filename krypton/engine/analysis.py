"""Static analysis: how much incremental inference can save, before running any occlusion.

Theoretical speedup Q / Q_inc over convolution layers (eqs 9-12) for one patch at the
centre of the input, the worst case, with eq 14's windows: the paper's per-query limit
(exact mode's own windows, sized for the positions it runs, can be smaller). Shapes come
from one inference on a blank image; no occluded image is ever run.
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
    output_patch: tuple[int, int]  # (height, width) of the output update patch
    macs_full: int  # eq 9 (0 for pooling)
    macs_incremental: int  # eq 11 (0 for pooling)


@dataclass(frozen=True)
class SpeedupReport:
    """Per-layer costs and the totals of eqs 10 and 12."""

    model: str
    input_shape: tuple[int, int, int]
    patch: int
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
            patch = f"{layer.output_patch[0]}x{layer.output_patch[1]}"
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


def _normalise_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    shape = tuple(int(d) for d in input_shape)
    if len(shape) == 4 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"input_shape must be (C, H, W), got {tuple(input_shape)}")
    return shape


def analyze(
    model: nn.Module, input_shape: Sequence[int], patch: int, tau: float = 1.0
) -> SpeedupReport:
    """Per-layer output patch sizes and conv FLOPs, full vs incremental (eqs 9-16, 21-27)."""
    channels, height, width = _normalise_shape(input_shape)
    if isinstance(patch, bool) or not isinstance(patch, int) or patch < 1:
        raise ValueError(f"patch must be a positive integer, got {patch!r}")
    if patch > min(height, width):
        raise ValueError(f"patch {patch} is larger than the {width}x{height} input")
    if not 0 < tau <= 1:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    if model.training:
        raise ValueError("model is in training mode; call model.eval() first")
    parameter = next(iter(model.parameters()), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    dtype = parameter.dtype if parameter is not None else torch.float32
    with torch.inference_mode():
        graph = IncrementalGraph(
            model, torch.zeros((channels, height, width), dtype=dtype, device=device)
        )
    centre_y, centre_x = (height - patch) // 2, (width - patch) // 2
    # the paper's per-query count: eq 14 for any offset, as the paper's tables use it
    geometry = graph.geometry(
        np.array([centre_y]), np.array([centre_x]), patch, patch, tau, tight=False
    )
    layers = []
    for step in graph.steps:
        node = step.node
        shape = graph.shapes.get(node)
        if step.kind == NodeKind.LOCAL:
            rows, cols = geometry.windows[node]
            is_conv = step.local.kind == "conv"
            incremental = (
                (step.local.conv_macs_per_output * shape[1] * rows.length * cols.length)
                if is_conv
                else 0
            )
            layers.append(
                LayerCost(
                    node.name,
                    step.local.kind,
                    shape,
                    (rows.length, cols.length),
                    step.macs_full if is_conv else 0,
                    incremental,
                )
            )
        elif (
            step.kind == NodeKind.GLOBAL
            and node.op == "call_module"
            and isinstance(graph.module.get_submodule(str(node.target)), nn.Conv2d)
            and len(shape) == 4
        ):
            layers.append(
                LayerCost(
                    node.name,
                    "conv (global)",
                    shape,
                    (shape[2], shape[3]),
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
        (channels, height, width),
        patch,
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
    model: nn.Module, input_shape: Sequence[int], patch: int, tau: float = 1.0
) -> float:
    """Q / Q_inc for a patch at the centre of the input (eqs 9-12; tau per eqs 21-27)."""
    return analyze(model, input_shape, patch, tau).speedup
