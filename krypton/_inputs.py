"""Validation of what explain() is given (model, image, positions, fill), before any
inference: every problem is reported with what to change."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

# ---------------------------------------------------------------------------------------
# Validation: every problem is reported before any inference is done
# ---------------------------------------------------------------------------------------


def _check_model(model: nn.Module) -> None:
    """A module whose every submodule is in eval mode.

    A submodule left in training mode (a Dropout or batch norm under an ``eval()`` parent)
    makes results random or batch-dependent, so exact would differ from naive: refuse it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    training = [
        name or "(the model itself)" for name, module in model.named_modules() if module.training
    ]
    if training:
        shown = ", ".join(training[:5]) + (
            f" and {len(training) - 5} more" if len(training) > 5 else ""
        )
        raise ValueError(
            f"model is in training mode ({shown}); dropout and batch norm "
            f"would make results random or batch-dependent: call model.eval() "
            f"first"
        )


def _check_image(image: torch.Tensor) -> None:
    """An image (C, H, W) or a volume (C, D, H, W): finite floats, nothing empty."""
    if not isinstance(image, torch.Tensor):
        raise TypeError(
            f"image must be a torch.Tensor of shape (C, H, W), or (C, D, H, W) for a "
            f"volume, got {type(image).__name__}"
        )
    if image.dim() not in (3, 4):
        raise ValueError(
            f"image must have shape (C, H, W), or (C, D, H, W) for a volume, got "
            f"{tuple(image.shape)}"
        )
    if min(image.shape) < 1:
        raise ValueError(f"image is empty: shape {tuple(image.shape)}")
    if not image.is_floating_point():
        raise ValueError(
            f"image must be a floating point tensor in the model's input space, got {image.dtype}"
        )
    if not torch.isfinite(image).all():
        raise ValueError("image contains NaN or infinite values")


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


Region = Sequence[int] | tuple[Sequence[int], Sequence[int]]


def _noun(rank: int) -> tuple[str, str]:
    """What an input of ``rank`` is called, and its cells."""
    return ("image", "pixels") if rank == 2 else ("volume", "voxels")


def _shown(sizes: Sequence[int]) -> str:
    """Sizes as the messages write them: an image's W x H ('32x24'), else in tensor order."""
    return "x".join(map(str, sizes[::-1] if len(sizes) == 2 else sizes))


def region_bounds(region: Region | None, sizes: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """A region as (low, high) per axis in tensor order, checked inside ``sizes``.

    ``region`` is (low, high) with one first and one past-the-end cell per spatial axis
    in tensor order ((y0, x0), (y1, x1) for an image; (z0, y0, x0), (z1, y1, x1) for a
    volume), or the flat forms the public API has always taken: (x0, y0, x1, y1) for an
    image, (z0, y0, x0, z1, y1, x1) for a volume. None is the whole input."""
    rank = len(sizes)
    if region is None:
        return (0,) * rank, tuple(int(s) for s in sizes)
    noun, _ = _noun(rank)
    flat = "(x0, y0, x1, y1)" if rank == 2 else "(z0, y0, x0, z1, y1, x1)"
    try:
        if len(region) == 2 and all(isinstance(r, (tuple, list, np.ndarray)) for r in region):
            low, high = (tuple(int(v) for v in r) for r in region)  # type: ignore[union-attr]
        elif len(region) == 2 * rank:
            values = tuple(int(v) for v in region)  # type: ignore[arg-type]
            low, high = values[:rank], values[rank:]
            if rank == 2:  # the image's public order is (x, y)
                low, high = low[::-1], high[::-1]
        else:
            raise TypeError
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"a{'n' if noun == 'image' else ''} {noun}'s region must be {flat} or (low, high) "
            f"per axis, got {region!r}"
        ) from exc
    if len(low) != rank or len(high) != rank:
        raise ValueError(f"a {rank}-D region needs {rank} values per end, got {region!r}")
    if not all(0 <= a < b <= size for a, b, size in zip(low, high, sizes)):
        shown = _shown(sizes)
        order = "W x H" if rank == 2 else "D x H x W"
        raise ValueError(
            f"region {tuple(region)} is outside the {shown} {noun} or empty ({order}; need "
            f"0 <= first < end <= size on every axis)"
        )
    return low, high


def grid(
    sizes: Sequence[int], patch, stride, region: Region | None = None
) -> tuple[np.ndarray, ...]:
    """The grid of patch positions over an input of spatial ``sizes`` (any rank), in
    tensor order: per axis, the first cells c = c0, c0 + stride, ... while
    c + patch <= c1 inside ``region`` (:func:`region_bounds`; the whole input by
    default). ``patch`` and ``stride``: one int for every axis, or one per axis."""
    rank = len(sizes)
    extent, steps = per_axis(patch, "patch", rank), per_axis(stride, "stride", rank)
    low, high = region_bounds(region, sizes)
    if any(p > b - a for p, a, b in zip(extent, low, high)):
        noun, cells = _noun(rank)
        where = noun if region is None else "region"
        shown = _shown([b - a for a, b in zip(low, high)])
        size = _compact(extent)
        raise ValueError(f"patch {size} is larger than the {where} ({shown} {cells})")
    return tuple(
        np.arange(a, b - p + 1, s, dtype=np.int64) for a, b, p, s in zip(low, high, extent, steps)
    )


def grid_positions(
    image_hw: tuple[int, int], patch: int, stride: int, region: Sequence[int] | None
) -> tuple[np.ndarray, np.ndarray]:
    """An image's grid (ys, xs), region (x0, y0, x1, y1): :func:`grid` at rank 2, kept
    for the callers that have always read it."""
    ys, xs = grid(image_hw, patch, stride, region)
    return ys, xs


def snap_start(start: int, end: int, through: int, stride: int, patch: int) -> int:
    """One axis of a region moved onto the grid through ``through``: its first position
    moves forward to the next grid line, never outside the region, so the positions
    computed are ones the earlier grid has (the same rule for images and volumes); the
    start is kept where the patch would no longer fit before ``end``."""
    snapped = start + (through - start) % stride
    return snapped if snapped + patch <= end else start


def _position_array(positions: Iterable, axes: str) -> np.ndarray:
    """Listed positions as an (N, len(axes)) integer array; ``axes`` names their order
    ("xy" for an image, "zyx" for a volume), which the messages say."""
    names, kind = ", ".join(axes), "pairs" if len(axes) == 2 else "triples"
    try:
        array = np.asarray(list(positions), dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"positions must be a list of ({names}) integer {kind}") from exc
    if array.size == 0:
        raise ValueError(f"positions is empty: give at least one ({names}) position")
    if array.ndim != 2 or array.shape[1] != len(axes):
        raise ValueError(f"positions must be a list of ({names}) {kind}, got shape {array.shape}")
    return array


def _listed_corners(positions: Iterable, size: tuple[int, ...], extent: tuple[int, ...]):
    """Listed positions as (N, rank) unique first cells in tensor order, every patch
    inside the input. An image's are given as (x, y), as its public API always took
    them; a volume's as (z, y, x), as its region."""
    rank = len(size)
    axes = "xy" if rank == 2 else "zyx"
    array = _position_array(positions, axes)
    if rank == 2:
        array = array[:, ::-1]  # (x, y) -> tensor order (y, x)
    bad = ((array < 0) | (array + np.asarray(extent) > np.asarray(size))).any(axis=1)
    if bad.any():
        given = array[np.argmax(bad)][::-1] if rank == 2 else array[np.argmax(bad)]
        named = ", ".join(f"{a}={v}" for a, v in zip(axes, given))
        noun, _ = _noun(rank)
        shape = _shown(size)
        what = f"{extent[0]}-pixel patch" if rank == 2 and len(set(extent)) == 1 else (
            f"{'x'.join(map(str, extent))} {'patch' if rank == 2 else 'cube'}")  # fmt: skip
        raise ValueError(f"position ({named}) puts the {what} outside the {shape} {noun}")
    return np.unique(array, axis=0)  # duplicates cost time and change nothing


def per_axis(value, name: str, rank: int) -> tuple[int, ...]:
    """A patch or stride for a volume: one positive int (a cube) or one per axis."""
    if isinstance(value, (tuple, list)):
        if len(value) != rank:
            raise ValueError(f"{name} must be one integer or {rank}, got {value!r}")
        return tuple(_positive_int(v, name) for v in value)
    return (_positive_int(value, name),) * rank


def _occluder(fill, channels: int, patch: int | tuple[int, ...], dtype, device) -> torch.Tensor:
    """The patch's pixels (C, *patch): one value, or one per channel. An int patch is a
    square; a tuple gives each spatial axis."""
    if isinstance(fill, torch.Tensor):
        values = fill.detach().flatten().tolist()
    elif isinstance(fill, (int, float, np.floating, np.integer)) and not isinstance(fill, bool):
        values = [float(fill)]
    elif isinstance(fill, (list, tuple, np.ndarray)):
        values = [float(v) for v in np.asarray(fill).flatten()]
    else:
        raise TypeError(f"fill must be a number or one number per channel, got {fill!r}")
    if len(values) == 1:
        values = values * channels
    if len(values) != channels:
        raise ValueError(f"fill has {len(values)} values but the image has {channels} channels")
    if not all(np.isfinite(values)):
        raise ValueError(f"fill must be finite, got {values}")
    extent = patch if isinstance(patch, tuple) else (patch, patch)
    column = torch.tensor(values, dtype=dtype, device=device).view(channels, *[1] * len(extent))
    return column.expand(channels, *extent).contiguous()


def _model_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _model_dtype(model: nn.Module) -> torch.dtype:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _check_logits(logits) -> int:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != 1:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"model output must be logits of shape (N, classes); for one image it returned {shape}"
        )
    return int(logits.shape[1])


def _check_label_type(label) -> None:
    """None (the predicted class) or an integer class index."""
    if label is not None and (isinstance(label, bool) or not isinstance(label, (int, np.integer))):
        raise TypeError(f"label must be an integer class index, got {label!r}")


@dataclass(frozen=True)
class Where:
    """The positions one explain() call evaluates.

    ``corners`` (N, rank): each patch's first cell per spatial axis, in the tensor's order
    ((y, x) for an image, (z, y, x) for a volume); ``extent``: the patch per axis;
    ``grid``: the grid's coordinates per axis, None for a position list; ``patch`` and
    ``stride`` as the heatmap reports them (an int for a square or a cube)."""

    corners: np.ndarray
    extent: tuple[int, ...]
    grid: tuple[np.ndarray, ...] | None
    patch: int | tuple[int, ...]
    stride: int | tuple[int, ...] | None


def _where(image: torch.Tensor, patch, stride, region, positions, mode: str) -> Where:
    """Validate where the patch goes: a grid over the input (or a region of it,
    :func:`region_bounds`), or a list of positions (an image's as (x, y), a volume's as
    (z, y, x)); one path for any rank, the patch and stride one int or one per axis."""
    if positions is not None and region is not None:
        raise ValueError("give either region or positions, not both")
    sizes = tuple(int(s) for s in image.shape[1:])
    rank = len(sizes)
    extent = per_axis(patch, "patch", rank)
    if positions is not None:
        corners = _listed_corners(positions, sizes, extent)
        return Where(corners, extent, None, _compact(extent), None)
    strides = per_axis(stride, "stride", rank)
    axes = grid(sizes, extent, strides, region)
    mesh = np.meshgrid(*axes, indexing="ij")
    corners = np.stack([axis.ravel() for axis in mesh], axis=1)
    return Where(corners, extent, axes, _compact(extent), _compact(strides))


def _compact(values: tuple[int, ...]) -> int | tuple[int, ...]:
    """One int when every axis has the same value (a cube), else the tuple."""
    return values[0] if len(set(values)) == 1 else values
