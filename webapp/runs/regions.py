"""A run's region as (low, high) corners per axis in tensor order, whatever its rank, and
the volume panel's refusal of one its cube cannot be placed in."""

from __future__ import annotations

from krypton.explainer import grid_positions

from ..helpers import InputError

__all__ = ["Bounds", "whole", "check_region", "check_volume_bounds", "check_grid", "grid_count"]

Bounds = tuple[tuple[int, ...], tuple[int, ...]]  # a region's (low, high) corners, tensor order


def whole(size: tuple[int, ...]) -> Bounds:
    """The bounds of the whole input of spatial ``size``."""
    return tuple(0 for _ in size), tuple(int(s) for s in size)


def check_volume_bounds(bounds: Bounds, size: tuple[int, ...], patch: int, stride: int) -> None:
    """Refuse a volume region the cube cannot be placed in, in the volume panel's words."""
    low, high = bounds
    if stride < 1 or patch < 1:
        raise InputError("the patch and the stride must be at least 1 voxel")
    extent = [b - a for a, b in zip(low, high)]
    if not all(0 <= a < b <= s for a, b, s in zip(low, high, size)):
        raise InputError(f"the region {[*low, *high]} is outside the {tuple(size)} block")
    if min(extent) < patch:
        raise InputError(
            f"the region is {'x'.join(map(str, extent))} voxels (z x y x x), smaller than "
            f"the {patch}-voxel cube on some axis; draw a larger region or pick a smaller patch"
        )


def check_region(region: list[int] | None, size: tuple[int, int], patch: int, stride: int) -> None:
    """Refuse a region the occluding patch cannot be placed in, with a clear message."""
    height, width = size
    x0, y0, x1, y1 = region or (0, 0, width, height)
    if x1 - x0 < patch or y1 - y0 < patch:
        raise InputError(
            f"the region is {x1 - x0}x{y1 - y0} pixels, smaller than the "
            f"{patch}-pixel patch; draw a larger region or pick a smaller patch"
        )
    if stride < 1:
        raise InputError("the stride must be at least 1")


def check_grid(size: tuple[int, int], patch: int, stride: int, region) -> None:
    """Refuse, in the image panel's words, settings whose grid explain() would refuse
    (``region``: the panel's (x0, y0, x1, y1), or None)."""
    check_region(region, size, patch, stride)
    grid_positions(size, patch, stride, region)


def grid_count(size: tuple[int, int], patch: int, stride: int, region) -> int:
    """Positions on the grid these image settings make, as drawn (before any snapping)."""
    ys, xs = grid_positions(size, patch, stride, region)
    return len(ys) * len(xs)
