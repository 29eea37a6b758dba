"""Public API: occlusion heatmaps, naive or incremental (exact).

``krypton.explain(model, image, ...)`` is the one entry point notebooks, the CLI and the
web app call. ``OcclusionExplainer`` is the same thing as an object that keeps the captured
graph and the materialised views of the last image, so refining a region or re-running with
other positions on the same image skips capture and materialisation.
"""
from __future__ import annotations

import hashlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from .engine import IncrementalGraph, MaterializedViews, Patched, _scatter_full

__all__ = ["Heatmap", "OcclusionExplainer", "explain", "MODES"]

MODES = ("naive", "exact")
DEFAULT_BATCH = {"cpu": 16, "cuda": 128}

ProgressCallback = Callable[[int, int], None]


@dataclass
class Heatmap:
    """Result of one occlusion run.

    ``values[i, j]`` is the softmax probability of ``label`` with the patch's top-left corner
    at ``(xs[j], ys[i])``; NaN where no position was evaluated (sparse position lists).
    """

    values: np.ndarray
    xs: np.ndarray
    ys: np.ndarray
    label: int
    prob: float
    mode: str
    seconds: float
    patch: int
    stride: int | None
    positions_evaluated: int
    macs_spent: int
    macs_naive: int
    extra: dict = field(default_factory=dict)

    @property
    def flops_spent(self) -> int:
        """Multiply-accumulates spent on occluded images (conv + linear, eq 9/11)."""
        return self.macs_spent

    @property
    def flops_naive(self) -> int:
        """What full re-inference would spend on the same positions."""
        return self.macs_naive

    @property
    def flops_ratio(self) -> float:
        """Naive FLOPs over FLOPs spent: the speedup the arithmetic alone allows."""
        return self.macs_naive / self.macs_spent if self.macs_spent else float("inf")

    @property
    def shape(self) -> tuple[int, int]:
        return self.values.shape

    def position_values(self) -> list[tuple[int, int, float]]:
        """(x, y, probability) for every evaluated position."""
        rows, cols = np.nonzero(~np.isnan(self.values))
        return [(int(self.xs[c]), int(self.ys[r]), float(self.values[r, c]))
                for r, c in zip(rows, cols)]


# ---------------------------------------------------------------------------------------
# Validation: every problem is reported before any inference is done
# ---------------------------------------------------------------------------------------


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if model.training:
        raise ValueError("model is in training mode (batch norm and dropout would change "
                         "results); call model.eval() first")


def _check_image(image: torch.Tensor) -> None:
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"image must be a torch.Tensor of shape (C, H, W), got "
                        f"{type(image).__name__}")
    if image.dim() != 3:
        raise ValueError(f"image must have shape (C, H, W), got {tuple(image.shape)}")
    if min(image.shape) < 1:
        raise ValueError(f"image is empty: shape {tuple(image.shape)}")
    if not image.is_floating_point():
        raise ValueError(f"image must be a floating point tensor in the model's input space, "
                         f"got {image.dtype}")
    if not torch.isfinite(image).all():
        raise ValueError("image contains NaN or infinite values")


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def grid_positions(image_hw: tuple[int, int], patch: int, stride: int,
                   region: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray]:
    """Top-left corners x = x0, x0+stride, ... while x + patch <= x1 (same for y)."""
    height, width = image_hw
    if region is None:
        x0, y0, x1, y1 = 0, 0, width, height
    else:
        if len(region) != 4:
            raise ValueError(f"region must be (x0, y0, x1, y1), got {region!r}")
        x0, y0, x1, y1 = (int(v) for v in region)
        if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
            raise ValueError(f"region {tuple(region)} is outside the {width}x{height} image "
                             f"or empty (need 0 <= x0 < x1 <= {width}, 0 <= y0 < y1 <= "
                             f"{height})")
    if patch > x1 - x0 or patch > y1 - y0:
        where = "image" if region is None else "region"
        raise ValueError(f"patch {patch} is larger than the {where} "
                         f"({x1 - x0}x{y1 - y0} pixels)")
    xs = np.arange(x0, x1 - patch + 1, stride, dtype=np.int64)
    ys = np.arange(y0, y1 - patch + 1, stride, dtype=np.int64)
    return ys, xs


def _listed_positions(positions: Iterable, image_hw: tuple[int, int],
                      patch: int) -> tuple[np.ndarray, np.ndarray]:
    try:
        array = np.asarray(list(positions), dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError("positions must be a list of (x, y) integer pairs") from exc
    if array.size == 0:
        raise ValueError("positions is empty: give at least one (x, y) position")
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"positions must be a list of (x, y) pairs, got shape {array.shape}")
    height, width = image_hw
    bad = (array[:, 0] < 0) | (array[:, 1] < 0) | (array[:, 0] + patch > width) | \
        (array[:, 1] + patch > height)
    if bad.any():
        x, y = array[np.argmax(bad)]
        raise ValueError(f"position (x={x}, y={y}) puts the {patch}-pixel patch outside the "
                         f"{width}x{height} image")
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
        raise ValueError(f"fill has {len(values)} values but the image has {channels} "
                         f"channels")
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
        raise ValueError(f"model output must be logits of shape (N, classes); for one image "
                         f"it returned {shape}")
    return int(logits.shape[1])


def model_fingerprint(model: nn.Module) -> tuple:
    """Cheap identity of a model's structure and weights.

    Uses each tensor's storage address and PyTorch's in-place version counter, so an
    optimizer step, ``load_state_dict`` or a replaced layer all change it and cached views
    are never reused for different weights.
    """
    modules = tuple((name, id(module)) for name, module in model.named_modules())
    tensors = tuple((t.data_ptr(), t._version) for t in
                    list(model.parameters()) + list(model.buffers()))
    return modules, tensors


def _count_macs_with_hooks(model: nn.Module, image: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Run one image and count conv/linear multiply-accumulates (eq 9) with forward hooks."""
    total = 0

    def hook(module, inputs, output):
        nonlocal total
        if isinstance(module, nn.Conv2d) and output.dim() == 4:
            kh, kw = module.kernel_size
            total += (module.in_channels // module.groups) * kh * kw * output[0].numel()
        elif isinstance(module, nn.Linear):
            total += module.in_features * module.out_features

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        logits = model(image.unsqueeze(0))
    finally:
        for handle in handles:
            handle.remove()
    return logits, total


def _image_key(image: torch.Tensor) -> str:
    data = image.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return f"{tuple(image.shape)}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"


# ---------------------------------------------------------------------------------------
# The explainer
# ---------------------------------------------------------------------------------------


class OcclusionExplainer:
    """Occlusion explanations for one model, keeping its graph and the last image's views.

    Args:
        model: a classifier in eval mode mapping (N, C, H, W) to logits (N, classes).
        device: where to run; defaults to the device of the model's parameters.
    """

    def __init__(self, model: nn.Module, device: torch.device | str | None = None):
        _check_model(model)
        self.model = model
        model_device = _model_device(model)
        self.device = torch.device(device) if device is not None else model_device
        if self.device.type != model_device.type or (
                self.device.index is not None and model_device.index is not None
                and self.device.index != model_device.index):
            raise ValueError(f"model is on {model_device} but device={self.device} was asked "
                             f"for; move the model first (model.to('{self.device}'))")
        self.dtype = _model_dtype(model)
        self._graphs: dict[tuple, IncrementalGraph] = {}
        self._views: tuple[str, MaterializedViews] | None = None
        self._fingerprint: tuple | None = None

    # -- materialisation ----------------------------------------------------------------
    def views_for(self, image: torch.Tensor) -> tuple[IncrementalGraph, MaterializedViews]:
        """Captured graph and materialised views of ``image`` (cached for the last image)."""
        key = _image_key(image)
        fingerprint = model_fingerprint(self.model)
        if fingerprint != self._fingerprint:  # weights or layers changed: start over
            self._graphs.clear()
            self._views = None
            self._fingerprint = fingerprint
        shape = tuple(image.shape)
        graph = self._graphs.get(shape)
        if graph is None:
            graph = IncrementalGraph(self.model, image)
            self._graphs[shape] = graph
        if self._views is None or self._views[0] != key:
            self._views = (key, graph.materialize(image))
        return graph, self._views[1]

    def _prepare(self, image: torch.Tensor) -> torch.Tensor:
        _check_image(image)
        return image.detach().to(self.device, self.dtype)

    # -- the one method -------------------------------------------------------------------
    @torch.inference_mode()
    def explain(self, image: torch.Tensor, *, patch: int = 16, stride: int = 4,
                mode: str = "exact", fill=0.0, label: int | None = None,
                region: Sequence[int] | None = None, positions: Iterable | None = None,
                batch_size: int | None = None,
                progress: ProgressCallback | None = None) -> Heatmap:
        """Occlusion heatmap of ``image``; see :func:`krypton.explain` for the arguments."""
        started = time.perf_counter()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        image = self._prepare(image)
        patch = _positive_int(patch, "patch")
        height, width = image.shape[-2:]
        if positions is not None:
            if region is not None:
                raise ValueError("give either region or positions, not both")
            ys, xs = _listed_positions(positions, (height, width), patch)
            stride_used = None
        else:
            stride_used = _positive_int(stride, "stride")
            grid_ys, grid_xs = grid_positions((height, width), patch, stride_used, region)
            ys = np.repeat(grid_ys, len(grid_xs))
            xs = np.tile(grid_xs, len(grid_ys))
        if batch_size is None:
            batch_size = DEFAULT_BATCH.get(self.device.type, 16)
        batch_size = _positive_int(batch_size, "batch_size")
        if progress is not None and not callable(progress):
            raise TypeError("progress must be callable as progress(done, total)")
        occluder = _occluder(fill, image.shape[0], patch, image.dtype, image.device)
        if label is not None and (isinstance(label, bool)
                                  or not isinstance(label, (int, np.integer))):
            raise TypeError(f"label must be an integer class index, got {label!r}")

        # The one unoccluded inference: gives the label, its probability and (exact) views.
        if mode == "naive":
            logits, macs_per_image = _count_macs_with_hooks(self.model, image)
            graph = views = None
        else:
            graph, views = self.views_for(image)
            logits = views.logits
        classes = _check_logits(logits)
        if label is None:
            label = int(logits[0].argmax())
        elif not 0 <= label < classes:
            raise ValueError(f"label {label} is out of range: the model has {classes} classes "
                             f"(0..{classes - 1})")
        prob = float(torch.softmax(logits[0].float(), dim=0)[label])

        total = len(ys)
        probabilities = np.empty(total, dtype=np.float32)
        if mode == "naive":
            geometry = None
            macs_spent = macs_naive = macs_per_image * total
        else:
            geometry = graph.geometry(ys, xs, patch, patch)
            per_inc, per_full = geometry.macs_per_position(graph)
            macs_spent, macs_naive = per_inc * total, per_full * total
        for begin in range(0, total, batch_size):
            batch = slice(begin, min(begin + batch_size, total))
            if mode == "naive":
                batch_logits = self.model(self._occluded_batch(image, occluder, ys[batch],
                                                               xs[batch]))
            else:
                batch_logits = graph.run_batch(views, geometry, batch, occluder)
            probabilities[batch] = torch.softmax(batch_logits.float(), dim=1)[:, label] \
                .cpu().numpy()
            if progress is not None:
                progress(batch.stop, total)

        unique_xs, col_of = np.unique(xs, return_inverse=True)
        unique_ys, row_of = np.unique(ys, return_inverse=True)
        values = np.full((len(unique_ys), len(unique_xs)), np.nan, dtype=np.float32)
        values[row_of, col_of] = probabilities
        return Heatmap(values=values, xs=unique_xs, ys=unique_ys, label=label, prob=prob,
                       mode=mode, seconds=time.perf_counter() - started, patch=patch,
                       stride=stride_used, positions_evaluated=total, macs_spent=macs_spent,
                       macs_naive=macs_naive)

    def _occluded_batch(self, image: torch.Tensor, occluder: torch.Tensor, ys: np.ndarray,
                        xs: np.ndarray) -> torch.Tensor:
        """Full occluded images (eq 5) for a batch of positions, built in one scatter."""
        count = len(ys)
        device = image.device
        patched = Patched(occluder.unsqueeze(0).expand(count, *occluder.shape),
                          torch.as_tensor(ys, device=device), torch.as_tensor(xs, device=device),
                          None, (1, *image.shape))
        return _scatter_full(patched, image.unsqueeze(0), torch.arange(count, device=device))


_explainers: "weakref.WeakKeyDictionary[nn.Module, OcclusionExplainer]" = \
    weakref.WeakKeyDictionary()


def explain(model: nn.Module, image: torch.Tensor, *, patch: int = 16, stride: int = 4,
            mode: str = "exact", fill=0.0, label: int | None = None,
            region: Sequence[int] | None = None, positions: Iterable | None = None,
            batch_size: int | None = None, device: torch.device | str | None = None,
            progress: ProgressCallback | None = None) -> Heatmap:
    """Occlusion-based explanation of ``model``'s prediction on ``image``.

    Args:
        model: classifier in eval mode, (N, C, H, W) -> logits (N, classes).
        image: (C, H, W) tensor already in the model's input space (normalised).
        patch: side of the square occluding patch, in pixels.
        stride: step between patch positions on the grid.
        mode: "naive" (batched full re-inference) or "exact" (incremental, same numbers).
        fill: occluding value in the input space, a float or one per channel (0.0 is mean
            gray under the usual mean/std normalisation).
        label: class to explain; default the class predicted on the unoccluded image.
        region: (x0, y0, x1, y1) to restrict the grid to; default the whole image.
        positions: explicit list of (x, y) top-left corners instead of a grid.
        batch_size: occluded images per batch; default 16 on CPU, 128 on CUDA.
        device: where to run; default the model's device (the model is not moved).
        progress: called as progress(done, total) after each batch; raising stops the run.

    Returns:
        A :class:`Heatmap` of probabilities of ``label`` with the patch at each position.
    """
    explainer = _explainers.get(model)
    wanted = torch.device(device) if device is not None else None
    if explainer is None or (wanted is not None and explainer.device != wanted):
        explainer = OcclusionExplainer(model, device=device)
        _explainers[model] = explainer
    _check_model(model)
    return explainer.explain(image, patch=patch, stride=stride, mode=mode, fill=fill,
                             label=label, region=region, positions=positions,
                             batch_size=batch_size, progress=progress)
