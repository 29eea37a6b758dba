"""A run's region as (low, high) corners per axis in tensor order, whatever its rank, and
one refusal of a region the occluder cannot be placed in, in its panel's words."""

from __future__ import annotations

from krypton.explainer import grid

from ..helpers import InputError

__all__ = ["Bounds", "whole", "check_bounds", "check_region", "check_grid", "grid_count"]

Bounds = tuple[tuple[int, ...], tuple[int, ...]]  # a region's (low, high) corners, tensor order


def whole(size: tuple[int, ...]) -> Bounds:
    """The bounds of the whole input of spatial ``size``."""
    return tuple(0 for _ in size), tuple(int(s) for s in size)


# the words of a rank's region: its unit, what occludes it, and the order its sides are said in
_WORDS = {2: ("pixel", "patch", ""), 3: ("voxel", "cube", " (z x y x x)")}


def check_bounds(bounds: Bounds, size: tuple[int, ...], patch: int, stride: int) -> None:
    """Refuse a region (tensor-order ``bounds``, any rank) the occluder cannot be placed
    in, in the words of its panel: pixels and a patch for an image (its sides said width
    by height, as the panel draws them), voxels and a cube for a volume."""
    unit, occluder, order = _WORDS[len(size)]
    low, high = bounds
    if stride < 1 or patch < 1:
        raise InputError(f"the patch and the stride must be at least 1 {unit}")
    if not all(0 <= a < b <= s for a, b, s in zip(low, high, size)):
        flat = [*low[::-1], *high[::-1]] if len(size) == 2 else [*low, *high]
        raise InputError(f"the region {flat} is outside the {'x'.join(map(str, size))} input")
    extent = [b - a for a, b in zip(low, high)]
    if min(extent) < patch:
        said = extent[::-1] if len(size) == 2 else extent
        raise InputError(
            f"the region is {'x'.join(map(str, said))} {unit}s{order}, smaller than the "
            f"{patch}-{unit} {occluder}{' on some axis' if len(size) == 3 else ''}; draw a "
            f"larger region or pick a smaller patch"
        )


def check_region(region: list[int] | None, size: tuple[int, int], patch: int, stride: int) -> None:
    """:func:`check_bounds` of the image panel's region, flat (x0, y0, x1, y1), or None
    for the whole image."""
    height, width = size
    x0, y0, x1, y1 = region or (0, 0, width, height)
    check_bounds(((y0, x0), (y1, x1)), size, patch, stride)


def check_grid(size: tuple[int, int], patch: int, stride: int, region) -> None:
    """Refuse, in the image panel's words, settings whose grid explain() would refuse
    (``region``: the panel's (x0, y0, x1, y1), or None)."""
    check_region(region, size, patch, stride)
    grid(size, patch, stride, region)


def grid_count(size: tuple[int, int], patch: int, stride: int, region) -> int:
    """Positions on the grid these image settings make, as drawn (before any snapping)."""
    ys, xs = grid(size, patch, stride, region)
    return len(ys) * len(xs)
