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


def grid_positions(
    image_hw: tuple[int, int], patch: int, stride: int, region: Sequence[int] | None
) -> tuple[np.ndarray, np.ndarray]:
    """Top-left corners x = x0, x0+stride, ... while x + patch <= x1 (same for y)."""
    height, width = image_hw
    if region is None:
        x0, y0, x1, y1 = 0, 0, width, height
    else:
        if len(region) != 4:
            raise ValueError(f"region must be (x0, y0, x1, y1), got {region!r}")
        x0, y0, x1, y1 = (int(v) for v in region)
        if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
            raise ValueError(
                f"region {tuple(region)} is outside the {width}x{height} image "
                f"or empty (need 0 <= x0 < x1 <= {width}, 0 <= y0 < y1 <= "
                f"{height})"
            )
    if patch > x1 - x0 or patch > y1 - y0:
        where = "image" if region is None else "region"
        raise ValueError(f"patch {patch} is larger than the {where} ({x1 - x0}x{y1 - y0} pixels)")
    xs = np.arange(x0, x1 - patch + 1, stride, dtype=np.int64)
    ys = np.arange(y0, y1 - patch + 1, stride, dtype=np.int64)
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


def _listed_positions(
    positions: Iterable, image_hw: tuple[int, int], patch: int
) -> tuple[np.ndarray, np.ndarray]:
    array = _position_array(positions, "xy")
    height, width = image_hw
    bad = (
        (array[:, 0] < 0)
        | (array[:, 1] < 0)
        | (array[:, 0] + patch > width)
        | (array[:, 1] + patch > height)
    )
    if bad.any():
        x, y = array[np.argmax(bad)]
        raise ValueError(
            f"position (x={x}, y={y}) puts the {patch}-pixel patch outside the "
            f"{width}x{height} image"
        )
    array = np.unique(array, axis=0)  # duplicates cost time and change nothing
    return array[:, 1], array[:, 0]


def _listed_corners(positions: Iterable, size: tuple[int, ...], extent: tuple[int, ...]):
    """A volume's listed positions: (z, y, x) first voxels of the cube, as its region is
    (z0, y0, x0, ...); (N, 3) unique corners, every cube inside the volume."""
    array = _position_array(positions, "zyx")
    bad = ((array < 0) | (array + np.asarray(extent) > np.asarray(size))).any(axis=1)
    if bad.any():
        z, y, x = array[np.argmax(bad)]
        raise ValueError(
            f"position (z={z}, y={y}, x={x}) puts the {'x'.join(map(str, extent))} cube "
            f"outside the {'x'.join(map(str, size))} volume"
        )
    return np.unique(array, axis=0)  # duplicates cost time and change nothing


def per_axis(value, name: str, rank: int) -> tuple[int, ...]:
    """A patch or stride for a volume: one positive int (a cube) or one per axis."""
    if isinstance(value, (tuple, list)):
        if len(value) != rank:
            raise ValueError(f"{name} must be one integer or {rank}, got {value!r}")
        return tuple(_positive_int(v, name) for v in value)
    return (_positive_int(value, name),) * rank


def volume_grid(
    sizes: tuple[int, int, int],
    patch: tuple[int, int, int],
    stride: tuple[int, int, int],
    region: Sequence[int] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First corners z, y, x of every patch inside ``region`` (z0, y0, x0, z1, y1, x1),
    the whole volume by default: c = c0, c0 + stride, ... while c + patch <= c1."""
    if region is None:
        low, high = (0, 0, 0), tuple(sizes)
    else:
        if len(region) != 6:
            raise ValueError(f"a volume's region must be (z0, y0, x0, z1, y1, x1), got {region!r}")
        bounds = tuple(int(v) for v in region)
        low, high = bounds[:3], bounds[3:]
        if not all(0 <= a < b <= size for a, b, size in zip(low, high, sizes)):
            raise ValueError(
                f"region {tuple(region)} is outside the {'x'.join(map(str, sizes))} volume "
                f"(D x H x W) or empty: need 0 <= c0 < c1 <= size on every axis"
            )
    if any(p > b - a for p, a, b in zip(patch, low, high)):
        where = "volume" if region is None else "region"
        extent = "x".join(str(b - a) for a, b in zip(low, high))
        raise ValueError(f"patch {patch} is larger than the {where} ({extent} voxels)")
    zs, ys, xs = (
        np.arange(a, b - p + 1, s, dtype=np.int64) for a, b, p, s in zip(low, high, patch, stride)
    )
    return zs, ys, xs


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
    """Validate where the patch goes: a grid over the image (or a region of it), or a
    list of (x, y) positions; for a volume (C, D, H, W), a grid over it or over a region
    (z0, y0, x0, z1, y1, x1) with a cube or per-axis patch and stride."""
    if positions is not None and region is not None:
        raise ValueError("give either region or positions, not both")
    if image.dim() == 4:
        extent = per_axis(patch, "patch", 3)
        if positions is not None:
            corners = _listed_corners(positions, tuple(image.shape[1:]), extent)
            return Where(corners, extent, None, _compact(extent), None)
        strides = per_axis(stride, "stride", 3)
        grid = volume_grid(tuple(image.shape[1:]), extent, strides, region)
        mesh = np.meshgrid(*grid, indexing="ij")
        corners = np.stack([axis.ravel() for axis in mesh], axis=1)
        return Where(corners, extent, grid, _compact(extent), _compact(strides))
    patch = _positive_int(patch, "patch")
    size = (int(image.shape[1]), int(image.shape[2]))
    if positions is not None:
        ys, xs = _listed_positions(positions, size, patch)
        return Where(np.stack([ys, xs], axis=1), (patch, patch), None, patch, None)
    stride = _positive_int(stride, "stride")
    ys, xs = grid_positions(size, patch, stride, region)
    corners = np.stack([np.repeat(ys, len(xs)), np.tile(xs, len(ys))], axis=1)
    return Where(corners, (patch, patch), (ys, xs), patch, stride)


def _compact(values: tuple[int, ...]) -> int | tuple[int, ...]:
    """One int when every axis has the same value (a cube), else the tuple."""
    return values[0] if len(set(values)) == 1 else values
