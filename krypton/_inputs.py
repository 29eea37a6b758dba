"""Validation of what explain() is given (model, image, positions, fill), before any
inference: every problem is reported with what to change."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
    if not isinstance(image, torch.Tensor):
        raise TypeError(
            f"image must be a torch.Tensor of shape (C, H, W), got {type(image).__name__}"
        )
    if image.dim() != 3:
        raise ValueError(f"image must have shape (C, H, W), got {tuple(image.shape)}")
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


def _listed_positions(
    positions: Iterable, image_hw: tuple[int, int], patch: int
) -> tuple[np.ndarray, np.ndarray]:
    try:
        array = np.asarray(list(positions), dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError("positions must be a list of (x, y) integer pairs") from exc
    if array.size == 0:
        raise ValueError("positions is empty: give at least one (x, y) position")
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"positions must be a list of (x, y) pairs, got shape {array.shape}")
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


def _occluder(fill, channels: int, patch: int, dtype, device) -> torch.Tensor:
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
    column = torch.tensor(values, dtype=dtype, device=device).view(channels, 1, 1)
    return column.expand(channels, patch, patch).contiguous()


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
