"""Approximate mode's plan for one call: the projective-field threshold τ (from the
model's tuning or the default policy) and the drill-down strides S1/S2 (eqs 28-30)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from .._inputs import _positive_int, region_bounds
from . import drilldown
from .settings import ApproximateSettings
from .tuning import choose_tau


@dataclass
class _ApproximatePlan:
    tau: float
    tau_source: str
    r_drill_down: float
    s1: int | None  # None: no drill-down
    s2: int | None
    refine_by: str = "drop+variation"


def _approximate_plan(
    mode: str,
    settings: ApproximateSettings,
    tuning,
    grid,
    patch,
    stride,
    region,
    sizes,
) -> _ApproximatePlan | None:
    """Validate the approximate-mode settings before any work; None for other modes.
    ``sizes``: the image's (H, W) or the volume's (D, H, W); ``region`` in any form
    :func:`krypton._inputs.region_bounds` takes."""
    if mode != "approximate":
        return None
    tau, target_ssim, s1 = settings.tau, settings.target_ssim, settings.s1
    r_drill_down, target_speedup = settings.r_drill_down, settings.target_speedup
    refine_by = settings.refine_by
    if refine_by not in drilldown.REFINE_RULES:
        raise ValueError(
            f"refine_by must be one of {', '.join(drilldown.REFINE_RULES)}; got {refine_by!r}"
        )
    for name, value in (("tau", tau), ("target_ssim", target_ssim)):
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, (int, float, np.floating))
            or not 0.0 < value <= 1.0
        ):
            raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    if (
        isinstance(r_drill_down, bool)
        or not isinstance(r_drill_down, (int, float))
        or not 0.0 < r_drill_down <= 1.0
    ):
        raise ValueError(f"r_drill_down must be in (0, 1], got {r_drill_down!r}")
    if (
        isinstance(target_speedup, bool)
        or not isinstance(target_speedup, (int, float))
        or target_speedup <= 1.0
    ):
        raise ValueError(f"target_speedup must be greater than 1, got {target_speedup!r}")
    choice = choose_tau(tuning, tau, target_ssim)
    if tau is None and target_ssim is None and tuning is None:
        warnings.warn(
            "no tuned tau for this model: using tau=1.0 (no projective-field "
            "thresholding); run `krypton tune` to tune it",
            stacklevel=3,
        )
    tau_value, source = choice.tau, choice.source
    if grid is None or r_drill_down >= 1.0 or all(len(axis) < 2 for axis in grid):
        return _ApproximatePlan(tau_value, source, r_drill_down, None, stride, refine_by)
    rank = len(grid)
    if isinstance(stride, tuple):  # a volume's stride per axis: drill-down needs one
        if len(set(stride)) != 1:
            raise ValueError(
                f"drill-down needs one stride on every axis, got {stride}; give one stride "
                f"or r_drill_down=1.0 (no drill-down)"
            )
        stride = stride[0]
    if s1 is not None:
        s1 = _positive_int(s1, "s1")
        if s1 <= stride:
            raise ValueError(f"s1 ({s1}) must be larger than the stride ({stride})")
    else:
        low, high = region_bounds(region, sizes)
        width = min(b - a for a, b in zip(low, high))
        s1 = drilldown.check_drill_down(
            float(target_speedup), float(r_drill_down), stride, int(width), rank
        )
    return _ApproximatePlan(tau_value, source, float(r_drill_down), s1, stride, refine_by)
