"""Adaptive drill-down (paper §4.2-4.3): a coarse pass, then full resolution where it matters.

Pure numpy. Stage one evaluates the region at stride S1; the fraction r_drill_down of its
cells is refined at the original stride S2. The paper refines the cells with the largest
probability drops ("drop"); the default here ("drop+variation") spends half of the same
budget on them and half on the cells whose neighbours disagree most, so a lesion that
falls between stage-one samples — a moderate drop beside no drop — is still drilled.

Stage one's axis is the region's first position, every S1 after it, and always the region's
last position (a shorter last step when the span is not a multiple of S1): the border row
and column are sampled, never extrapolated, so a drop there is seen. Each S2 position
belongs to the stage-one block [y_k, y_k+1) that contains it; the last position is a block
of its own.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy.interpolate import RegularGridInterpolator

__all__ = [
    "drill_down_speedup",
    "stage_one_stride",
    "stage_one_axis",
    "block_of",
    "max_drill_down_speedup",
    "check_drill_down",
    "selected_blocks",
    "local_variation",
    "REFINE_RULES",
    "interpolate_to_grid",
]


# The paper's eqs 28-30 count positions on a 2-D grid, where they fall with the square of
# the stride; on a volume's grid they fall with its cube. ``rank`` (2 for an image, 3 for
# a volume) is that power; with rank 2 every formula is the paper's.


def drill_down_speedup(s1: float, s2: float, r_drill_down: float, rank: int = 2) -> float:
    """Theoretical speedup of drill-down over regular OBE at stride S2 (eq 28)."""
    return s1**rank / (s2**rank + r_drill_down * s1**rank)


def max_drill_down_speedup(width: int, s2: int, r_drill_down: float, rank: int = 2) -> float:
    """Upper bound on achievable drill-down speedup for a region of this width (eq 30)."""
    return min(width**rank / (s2**rank + r_drill_down * width**rank), 1.0 / r_drill_down)


def stage_one_stride(target: float, r_drill_down: float, s2: int, rank: int = 2) -> float:
    """S1 that gives the target speedup: eq 28 solved for S1 (eq 29)."""
    return (target / (1.0 - r_drill_down * target)) ** (1.0 / rank) * s2


def check_drill_down(target: float, r_drill_down: float, s2: int, width: int, rank: int = 2) -> int:
    """Validate the target against eq 30 and return the stage-one stride: eq 29 rounded to
    the nearest multiple of S2 (at least 2 S2)."""
    bound = max_drill_down_speedup(width, s2, r_drill_down, rank)
    if target >= bound:
        raise ValueError(
            f"target_speedup {target:g} is not achievable with r_drill_down "
            f"{r_drill_down:g} on a {width}-pixel-wide region at stride {s2}: the largest "
            f"achievable drill-down speedup is below {bound:.2f} (eq 30)"
        )
    s1 = stage_one_stride(target, r_drill_down, s2, rank)  # eq 29
    # A multiple of S2, so every stage-one position is also a stage-two grid position and
    # its value is reused rather than interpolated past.
    return s2 * max(2, int(round(s1 / s2)))


REFINE_RULES = ("drop+variation", "drop")


def local_variation(stage_one: np.ndarray) -> np.ndarray:
    """Per cell, the largest absolute difference to any of its neighbours (8 on an
    image's grid, 26 on a volume's)."""
    padded = np.pad(stage_one.astype(np.float64), 1, mode="edge")
    largest = np.zeros(stage_one.shape)
    for offset in itertools.product((-1, 0, 1), repeat=stage_one.ndim):
        window = tuple(slice(1 + d, 1 + d + n) for d, n in zip(offset, stage_one.shape))
        largest = np.maximum(largest, np.abs(padded[window] - stage_one))
    return largest


def selected_blocks(
    stage_one: np.ndarray, r_drill_down: float, rule: str = "drop+variation"
) -> np.ndarray:
    """Boolean mask of the ceil(r * cells) stage-one cells to drill into.

    "drop" (the paper): the lowest probabilities. "drop+variation": the lowest half of
    that count by probability, the rest by local variation among the cells left — the
    same number of positions, so the two rules cost the same. Ties go by position.
    """
    if rule not in REFINE_RULES:
        raise ValueError(f"refine_by must be one of {', '.join(REFINE_RULES)}; got {rule!r}")
    flat = stage_one.ravel()
    count = max(1, math.ceil(r_drill_down * flat.size))
    by_drop = count if rule == "drop" else math.ceil(count / 2)
    chosen = np.argsort(flat, kind="stable")[:by_drop]
    mask = np.zeros(flat.size, dtype=bool)
    mask[chosen] = True
    if count > by_drop:
        variation = np.where(mask, -np.inf, local_variation(stage_one).ravel())
        # largest variation first; among equals the lower probability (the dip itself
        # before the neighbours that border it)
        order = np.lexsort((flat, -variation))
        mask[order[: count - by_drop]] = True
    return mask.reshape(stage_one.shape)


def stage_one_axis(grid_axis: np.ndarray, s1: int) -> np.ndarray:
    """Stage-one positions along one axis of the stage-two grid: the first position, every
    S1 after it, and the last position (so the border is sampled, not extrapolated)."""
    grid_axis = np.asarray(grid_axis)
    axis = grid_axis[0] + np.arange(0, grid_axis[-1] - grid_axis[0] + 1, s1)
    if axis[-1] != grid_axis[-1]:
        axis = np.append(axis, grid_axis[-1])
    return axis


def block_of(coordinates: np.ndarray, stage_axis: np.ndarray) -> np.ndarray:
    """Index of the stage-one block [stage_axis[k], stage_axis[k + 1]) each stage-two
    coordinate falls in (the last stage-one position is a block of its own)."""
    return np.searchsorted(stage_axis, coordinates, side="right") - 1


def interpolate_to_grid(
    stage_axes: tuple[np.ndarray, ...],
    stage_one: np.ndarray,
    grid_axes: tuple[np.ndarray, ...],
) -> np.ndarray:
    """Multilinear interpolation (bilinear on an image's grid, trilinear on a volume's) of
    the stage-one heatmap, sampled at ``stage_axes``, onto the stage-two grid
    ``grid_axes``; values beyond the outermost stage-one positions take the nearest edge
    value."""
    axes, values = [], stage_one.astype(np.float64)
    for axis, coordinates in enumerate(stage_axes):
        coordinates = np.asarray(coordinates, dtype=np.float64)
        if len(coordinates) == 1:  # a single row/column: constant along that axis
            coordinates = np.array([coordinates[0], coordinates[0] + 1.0])
            values = np.repeat(values, 2, axis=axis)
        axes.append(coordinates)
    interpolator = RegularGridInterpolator(tuple(axes), values, method="linear")
    clipped = [
        np.clip(np.asarray(grid, dtype=np.float64), axis[0], axis[-1])
        for grid, axis in zip(grid_axes, axes)
    ]
    points = np.stack(np.meshgrid(*clipped, indexing="ij"), axis=-1)
    return interpolator(points).astype(np.float32)
