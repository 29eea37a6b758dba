"""A drop-in for Captum's ``Occlusion``: the same call, the same numbers, computed
incrementally.

    from krypton.captum import Occlusion      # instead of: from captum.attr import Occlusion

    attributions = Occlusion(model).attribute(images, sliding_window_shapes=(3, 16, 16),
                                              strides=(3, 4, 4), target=label)

Semantics are Captum's (``captum.attr.Occlusion``, 0.9): windows slide over every input
dimension — channels included — at the given strides, ``ceil((D - w) / s) + 1`` positions
per dimension, the last one cropped at the border; each window is replaced by the
baseline (a scalar, per-channel values or a whole tensor, e.g. a blurred copy); the
difference of the forward's raw output for the target, unoccluded minus occluded, is
added to every feature the window covers, and each feature's sum is divided by the number
of windows covering it.

Where the incremental engine applies — a 4-D image batch, an ``nn.Module`` torch.fx can
capture that returns (N, classes), no ``additional_forward_args`` — every window becomes
one occluded image computed incrementally (a window cropped at the border, or covering
some channels only, is a full-size patch whose pixels are partly the image's own).
Anything else is handed to Captum itself, with one warning saying why: the results are the
same either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from .dropin import DropIn
from .engine import UnsupportedModelError
from .engine.capture_lock import CAPTURE_LOCK
from .explainer import OcclusionExplainer

__all__ = ["Occlusion"]


class Occlusion(DropIn):
    """Captum's ``Occlusion`` with the same constructor and ``attribute()``.

    Args:
        forward_func: the model (an ``nn.Module`` in eval mode for the incremental engine;
            any callable works through Captum).
    """

    name = "krypton.captum.Occlusion"
    library = "Captum's own Occlusion"
    library_key = "captum"

    def __init__(self, forward_func: Callable[..., torch.Tensor]):
        super().__init__()
        self.forward_func = forward_func
        self._explainer: OcclusionExplainer | None = None

    # ------------------------------------------------------------------------------------
    def attribute(
        self,
        inputs: torch.Tensor | tuple[torch.Tensor, ...],
        sliding_window_shapes: tuple[int, ...] | tuple[tuple[int, ...], ...],
        strides: int | tuple[int, ...] | tuple[tuple[int, ...], ...] | None = None,
        baselines: Any = None,
        target: Any = None,
        additional_forward_args: Any = None,
        perturbations_per_eval: int = 1,
        show_progress: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Occlusion attributions shaped like ``inputs`` (Captum's arguments and meaning).

        Args:
            inputs: (N, C, H, W) images, or anything Captum takes (tuples go to Captum).
            sliding_window_shapes: window shape over the dimensions after the batch, e.g.
                (3, 16, 16) to occlude all three channels of a 16 x 16 square.
            strides: an int or one per dimension; default 1.
            baselines: what a window is replaced with: a number, a tensor broadcastable to
                one example (per-channel values, a baseline image) or to the batch.
            target: output index for each example: an int, a 1-tuple, a list or a tensor
                with one index per example; None for a (N,) output.
            additional_forward_args: further forward arguments (handed to Captum).
            perturbations_per_eval: occluded images per forward pass (the batch size).
            show_progress: a tqdm progress bar.
        """
        reason = self._why_not_incremental(
            inputs, sliding_window_shapes, strides, baselines, target, additional_forward_args
        )

        def incremental():
            return self._attribute_incrementally(
                inputs,
                tuple(sliding_window_shapes),
                strides,
                baselines,
                target,
                max(1, int(perturbations_per_eval)),
                show_progress,
            )

        def delegate():
            from captum.attr import Occlusion as CaptumOcclusion

            return CaptumOcclusion(self.forward_func).attribute(
                inputs,
                sliding_window_shapes=sliding_window_shapes,
                strides=strides,
                baselines=baselines,
                target=target,
                additional_forward_args=additional_forward_args,
                perturbations_per_eval=perturbations_per_eval,
                show_progress=show_progress,
            )

        return self._run(reason, incremental, delegate)

    # ------------------------------------------------------------------------------------
    def _why_not_incremental(
        self, inputs, windows, strides, baselines, target, additional_forward_args
    ) -> str | None:
        if not isinstance(inputs, torch.Tensor) or inputs.dim() != 4:
            return "the incremental engine takes one 4-D image batch (N, C, H, W)"
        if not isinstance(self.forward_func, nn.Module):
            return "forward_func is not an nn.Module"
        if any(module.training for module in self.forward_func.modules()):
            return "the model is in training mode"
        if additional_forward_args is not None:
            return "additional_forward_args are given"
        if not (
            isinstance(windows, tuple)
            and len(windows) == 3
            and all(isinstance(w, int) for w in windows)
        ):
            return "sliding_window_shapes is not one (C, h, w) tuple"
        if (
            strides is not None
            and not isinstance(strides, int)
            and not (
                isinstance(strides, tuple)
                and len(strides) == 3
                and all(isinstance(s, int) for s in strides)
            )
        ):
            return "strides is not an int or one (C, h, w) tuple"
        if not inputs.is_floating_point():
            return "inputs are not floating point"
        if baselines is not None and not isinstance(baselines, (int, float, torch.Tensor)):
            return "baselines are not a number or a tensor"
        if isinstance(baselines, torch.Tensor):
            try:
                torch.broadcast_shapes(baselines.shape, inputs.shape)
            except RuntimeError:
                return "baselines do not broadcast to the inputs"
            if baselines.dim() == 4 and baselines.shape[0] not in (1, inputs.shape[0]):
                return "baselines do not broadcast to the inputs"
        if target is not None and not isinstance(target, (int, tuple, list, torch.Tensor)):
            return "target is not an int, tuple, list or tensor"
        if isinstance(target, tuple) and len(target) != 1:
            return "target tuples index outputs with more than two dimensions"
        return None

    def _targets(self, target, count: int) -> list[int | None]:
        if target is None:
            return [None] * count
        if isinstance(target, tuple):
            target = target[0]
        if isinstance(target, int):
            return [target] * count
        values = target.flatten().tolist() if isinstance(target, torch.Tensor) else list(target)
        if len(values) == 1:
            return [int(values[0])] * count
        if len(values) != count:
            raise ValueError(f"target has {len(values)} entries for {count} examples")
        return [int(v) for v in values]

    def _attribute_incrementally(
        self, inputs, windows, strides, baselines, target, batch_size, show_progress
    ) -> torch.Tensor:
        module: nn.Module = self.forward_func
        if self._explainer is None or self._explainer.model is not module:
            self._explainer = OcclusionExplainer(module)
        count, channels, height, width = inputs.shape
        shape = (channels, height, width)
        strides = (strides,) * 3 if isinstance(strides, int) else (strides or (1, 1, 1))
        for window, stride, size in zip(windows, strides, shape):
            if window > size:
                raise AssertionError(
                    f"Sliding window dimensions {windows} cannot exceed input dimensions {shape}."
                )
            if stride > window and window < size:
                raise AssertionError("Stride dimension cannot be larger than sliding window")
        # Captum's window starts: k * stride for k < ceil((D - w) / s) + 1 (last cropped)
        starts = [
            np.arange(math.ceil((size - window) / stride) + 1) * stride
            for window, stride, size in zip(windows, strides, shape)
        ]
        c0, y0, x0 = (a.ravel() for a in np.meshgrid(*starts, indexing="ij"))
        c1, y1, x1 = (
            np.minimum(start + w, size) for start, w, size in zip((c0, y0, x0), windows, shape)
        )
        _, patch_h, patch_w = windows
        # Each window is a full-size patch kept inside the image: its pixels outside the
        # window (cropped border, other channels) are the image's own.
        top = np.minimum(y0, height - patch_h)
        left = np.minimum(x0, width - patch_w)
        device = inputs.device
        channel = torch.arange(channels, device=device)[None, :, None, None]
        row = torch.arange(patch_h, device=device)[None, None, :, None]
        col = torch.arange(patch_w, device=device)[None, None, None, :]

        def column(values) -> torch.Tensor:
            return torch.as_tensor(values, device=device)[:, None, None, None]

        mask = (
            (channel >= column(c0))
            & (channel < column(c1))
            & (row >= column(y0 - top))
            & (row < column(y1 - top))
            & (col >= column(x0 - left))
            & (col < column(x1 - left))
        )
        rows_index = torch.as_tensor(top, device=device)[:, None] + torch.arange(
            patch_h, device=device
        )
        cols_index = torch.as_tensor(left, device=device)[:, None] + torch.arange(
            patch_w, device=device
        )

        def windows_of(tensor: torch.Tensor) -> torch.Tensor:
            """(C, H, W) -> (P, C, h, w): the pixels under every patch."""
            gathered = tensor[:, rows_index[:, :, None], cols_index[:, None, :]]
            return gathered.permute(1, 0, 2, 3)

        base = (
            torch.zeros((), dtype=inputs.dtype, device=device)
            if baselines is None
            else torch.as_tensor(baselines, dtype=inputs.dtype, device=device)
        )
        base = torch.broadcast_to(base, inputs.shape) if base.dim() else base
        targets = self._targets(target, count)
        attributions = torch.zeros_like(inputs)
        # how many windows cover each feature: the same for every example
        covered = torch.zeros(shape, dtype=inputs.dtype, device=device)
        flat = self._flat_indices(top, left, windows, shape, device)
        covered.view(-1).index_add_(0, flat, mask.reshape(-1).to(inputs.dtype))
        bar = None
        if show_progress:
            from tqdm import tqdm

            bar = tqdm(total=count * len(top), desc="Occlusion (krypton)")
        with torch.inference_mode():
            for example in range(count):
                image = inputs[example]
                baseline = base[example] if base.dim() else base
                own = windows_of(image)
                replaced = windows_of(baseline) if base.dim() else baseline.expand_as(own)
                patches = torch.where(mask, replaced, own)
                outputs = self._explainer.occluded_outputs(
                    image, top, left, patches, batch_size=batch_size
                )
                with CAPTURE_LOCK.shared():
                    unoccluded = module(image.unsqueeze(0))
                wanted = targets[example]
                if outputs.dim() != 2 and not (outputs.dim() == 1 and wanted is None):
                    raise UnsupportedModelError("the forward returns more than (N, classes)")
                if wanted is None:
                    if outputs.dim() == 2 and outputs.shape[1] != 1:
                        raise ValueError("target is needed: the model returns several outputs")
                    difference = unoccluded.reshape(-1)[0] - outputs.reshape(len(top), -1)[:, 0]
                else:
                    difference = unoccluded[0, wanted] - outputs[:, wanted]
                contribution = mask.to(inputs.dtype) * difference[:, None, None, None].to(
                    inputs.dtype
                )
                total = torch.zeros(shape, dtype=inputs.dtype, device=device)
                total.view(-1).index_add_(0, flat, contribution.reshape(-1))
                attributions[example] = total / covered
                if bar is not None:
                    bar.update(len(top))
        if bar is not None:
            bar.close()
        return attributions

    @staticmethod
    def _flat_indices(top, left, windows, shape, device) -> torch.Tensor:
        """Flat (C*H*W) index of every element of every (C, h, w) patch, in patch order."""
        channels, height, width = shape
        _, patch_h, patch_w = windows
        channel = torch.arange(channels, device=device)[None, :, None, None]
        row = (
            torch.as_tensor(top, device=device)[:, None, None, None]
            + torch.arange(patch_h, device=device)[None, None, :, None]
        )
        col = (
            torch.as_tensor(left, device=device)[:, None, None, None]
            + torch.arange(patch_w, device=device)[None, None, None, :]
        )
        return ((channel * height + row) * width + col).reshape(-1)
