"""A drop-in for Captum's ``Occlusion`` that *is* Captum's class: the same call, the same
numbers, the occluded forwards computed by Krypton's engine.

    from krypton.captum import Occlusion      # instead of: from captum.attr import Occlusion

    attributions = Occlusion(model).attribute(images, sliding_window_shapes=(3, 16, 16),
                                              strides=(3, 4, 4), target=label)

``krypton.captum.Occlusion`` subclasses ``captum.attr.Occlusion`` and overrides one
thing: where the model's outputs for the occluded inputs come from. Captum's own code
still checks the arguments, orders the windows, crops them at the border, selects the
targets, accumulates and averages the differences, keeps its dtypes and draws its
progress bar, so every inherited method (``NoiseTunnel(Occlusion(model))``,
``attribute_future``, ``get_name``) behaves as Captum's.

Each forward Captum asks for is answered from outputs the engine computes ahead, a chunk
of windows at a time (so the progress bar follows the real work), with one of:

- ``incremental``: one (N, C, H, W) image or (N, C, D, H, W) volume batch, an
  ``nn.Module`` torch.fx can capture, no ``additional_forward_args``: each window is a
  patch the engine pastes into the materialised views, recomputing only what it changes
  (or, where static analysis says that cannot pay, whole images batched).
- ``batched``: any other input form (1-D features, tuples of inputs, extra arguments,
  integer inputs, plain callables): the occluded inputs Captum would build, evaluated in
  batches sized from the engine's memory budget (``perturbations_per_eval``, where the
  caller passes it, caps the windows per forward; left out, the engine asks for 128).

The model runs in eval mode for the computation and goes back to the mode it was in.
A model whose training mode changes its numbers (dropout, batch norm in training), a
forward that returns one value per batch, or anything the engine fails on is evaluated
by Captum's own calls instead, with one warning saying why: the results are Captum's
either way. ``last_engine`` ("krypton" or "captum") and ``last_strategy`` say what ran.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from captum._utils.common import (
    _expand_additional_forward_args,
    _format_additional_forward_args,
    _run_forward,
)
from captum.attr import Occlusion as CaptumOcclusion
from captum.log import log_usage
from torch import nn

from .._fingerprint import LIVE_ACTIVATION_FACTOR, capped_batch_size
from ..engine.capture_lock import CAPTURE_LOCK
from ..engine.kernels import window_index
from ..explainer import DEFAULT_BATCH
from ..host import host_share
from .shared import (
    ENGINE_BATCH,
    LastCall,
    LibraryDefault,
    evaluated,
    explainer_for,
    mode_dependent_modules,
    warn_once,
    windows_per_forward,
)

__all__ = ["Occlusion"]

# Windows the engine computes per call: at least one engine batch, and at least an
# eighth of the attribution's, so Captum's progress bar moves as the work is done.
PROGRESS_STEPS = 8
# Bytes one occluded example is taken to hold while a batched forward runs, per byte of
# its inputs (a convolutional net's activations reach this; the budget does the rest).
BATCHED_ACTIVATION_PER_INPUT_BYTE = 16


SEAM = "_construct_ablated_input_across_tensors"  # Captum 0.9's: each forward's windows
SEAM_MISSING = (
    f"this Captum has no {SEAM} (Captum 0.9 added it; pip install 'captum>=0.9'), so the "
    f"engine cannot see which windows each forward occludes: Captum evaluates them itself"
)


def seam_available() -> bool:
    """Whether Captum's Occlusion builds its ablated inputs in the method this drop-in
    hooks (Captum 0.9 and later); without it the drop-in is Captum, and says so."""
    return callable(getattr(CaptumOcclusion, SEAM, None))


class Occlusion(LastCall, CaptumOcclusion):
    """``captum.attr.Occlusion`` whose occluded forwards the engine computes.

    Args:
        forward_func: the model or any callable, as for Captum.
    """

    def __init__(self, forward_func: Callable[..., torch.Tensor]) -> None:
        # Per-call state lives per thread: one instance may serve several threads at once
        # (a server handling two requests with one explainer). With it on the instance,
        # one thread's call left forward_func pointing at another's finished session.
        self._local = threading.local()
        super().__init__(forward_func)  # sets forward_func: the real one (the setter)
        self._warned: set[str] = set()

    @property  # type: ignore[override]
    def forward_func(self) -> Callable[..., torch.Tensor]:
        """The caller's model; inside this thread's call, its session's forward."""
        session = self._session
        return self._real_forward if session is None else session.forward

    @forward_func.setter
    def forward_func(self, value: Callable[..., torch.Tensor]) -> None:
        self._real_forward = value

    @property
    def _session(self) -> _Session | None:
        return getattr(self._local, "session", None)

    @property
    def last_strategy(self) -> str | None:
        """The engine's strategy in this thread's last call: "incremental" or "batched"."""
        return getattr(self._local, "strategy", None)

    @log_usage(part_of_slo=True)
    def attribute(  # type: ignore[override]
        self,
        inputs: Any,
        sliding_window_shapes: Any,
        strides: Any = None,
        baselines: Any = None,
        target: Any = None,
        additional_forward_args: Any = None,
        perturbations_per_eval: int = LibraryDefault(1),
        show_progress: bool = False,
    ) -> Any:
        """Captum's ``Occlusion.attribute``: the same arguments, checks and result."""
        arguments = dict(
            sliding_window_shapes=sliding_window_shapes, strides=strides, baselines=baselines,
            target=target, additional_forward_args=additional_forward_args,
            perturbations_per_eval=perturbations_per_eval, show_progress=show_progress,
        )  # fmt: skip
        if not seam_available():  # the engine cannot see Captum's windows: Captum's own
            self._local.engine, self._local.strategy = "captum", None
            warn_once(self._warned, f"krypton.captum.Occlusion: {SEAM_MISSING}")
            return CaptumOcclusion(self._real_forward).attribute(inputs, **arguments)
        real = self._real_forward
        session = _Session(real, additional_forward_args, perturbations_per_eval)
        module = real if isinstance(real, nn.Module) else None
        self._local.session = session
        try:  # the host's share as krypton.explain takes it (the caller's threads win)
            with (
                host_share() as share,
                (
                    evaluated(module) if session.may_evaluate(module) else nullcontext()  # type: ignore[arg-type]
                ),
            ):
                result = CaptumOcclusion.attribute.__wrapped__(self, inputs, **arguments)  # type: ignore[attr-defined]
            self._local.host = share.as_dict()
        finally:
            self._local.session = None
        self._local.engine = "captum" if session.strategy == "captum" else "krypton"
        self._local.strategy = session.reported_strategy
        for reason in session.reasons:
            warn_once(self._warned, f"krypton.captum.Occlusion: {reason}")
        return result

    def _construct_ablated_input_across_tensors(  # type: ignore[override]
        self,
        inputs: tuple[torch.Tensor, ...],
        input_mask: Any,
        baselines: Any,
        feature_idxs: list[int],
        feature_idx_to_tensor_idx: dict[int, list[int]],
        current_num_ablated_features: int,
        **kwargs: Any,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
        """Captum's ablated inputs and masks; the session learns which windows the next
        forward is for (and, the first time, how to build any others)."""
        ablated = super()._construct_ablated_input_across_tensors(
            inputs,
            input_mask,
            baselines,
            feature_idxs,
            feature_idx_to_tensor_idx,
            current_num_ablated_features,
            **kwargs,
        )
        if self._session is not None:
            examples = inputs[0].shape[0] // current_num_ablated_features
            self._session.ablating(
                self,
                list(feature_idxs),
                _Ablation(
                    originals=tuple(t[:examples] for t in inputs),
                    input_mask=input_mask,
                    baselines=baselines,
                    feature_tensors=feature_idx_to_tensor_idx,
                    kwargs=kwargs,
                ),
            )
        return ablated


class _Ablation:
    """What Captum passes when it builds ablated inputs: enough to build any window's."""

    def __init__(self, originals, input_mask, baselines, feature_tensors, kwargs) -> None:
        self.originals: tuple[torch.Tensor, ...] = originals  # the N examples
        self.input_mask = input_mask
        self.baselines = baselines
        self.feature_tensors: dict[int, list[int]] = feature_tensors
        self.kwargs: dict[str, Any] = kwargs

    @property
    def examples(self) -> int:
        return int(self.originals[0].shape[0])

    @property
    def features(self) -> int:
        return len(self.feature_tensors)

    @property
    def extent(self) -> tuple[int, ...]:
        """The window's shape over the spatial dims (after the channel dim)."""
        return tuple(self.kwargs["sliding_window_tensors"][0].shape)[1:]

    def window_starts(self, windows: range) -> np.ndarray:
        """(windows, dims) first cell of each window over the dims after the batch, in
        Captum's order (the first dimension fastest, as its ``_occlusion_mask``)."""
        shift_counts = tuple(int(count) for count in self.kwargs["shift_counts"][0])
        strides = self.kwargs["strides"][0]
        steps = np.asarray(
            strides if isinstance(strides, tuple) else (strides,) * len(shift_counts)
        )
        index = np.unravel_index(np.asarray(list(windows), dtype=np.int64), shift_counts, "F")
        return np.stack(index, axis=1) * steps


class _Session:
    """One ``attribute`` call: answers Captum's forwards from the engine's outputs."""

    def __init__(self, real: Callable, additional_forward_args: Any, per_eval: Any) -> None:
        self.real = real
        self.additional = _format_additional_forward_args(additional_forward_args)
        self.per_eval = per_eval if isinstance(per_eval, int) and per_eval > 0 else 1
        # Captum's default 1 (not passed): the engine's batch; a count passed is a cap
        self.engine_batch = windows_per_forward(self.per_eval)
        self.strategy: str | None = None  # decided at the first ablation
        self.reasons: list[str] = []
        self.initial: Any = None  # Captum's unablated forward, as the model returned it
        self.pending: list[int] | None = None
        self.outputs: dict[int, torch.Tensor] = {}
        self.ablation: _Ablation | None = None
        self.owner: Occlusion | None = None
        self.mode = "exact"  # or "naive", where static analysis says so

    @property
    def reported_strategy(self) -> str | None:
        """ "incremental", "naive" (the engine's whole-image batches, where static
        analysis says incremental cannot pay), "batched", or None (Captum evaluated)."""
        if self.strategy == "incremental" and self.mode == "naive":
            return "naive"
        return None if self.strategy in ("captum", None) else self.strategy

    # -- what Captum calls --------------------------------------------------------------
    def forward(self, *args: Any) -> Any:
        """Stands in for the forward function inside Captum's ``attribute``."""
        features, self.pending = self.pending, None
        if features is None or self.strategy == "captum":
            # shared: never while another thread's graph capture patches nn.Module
            with CAPTURE_LOCK.shared():
                output = self.real(*args)
            if features is None and self.initial is None:
                self.initial = output
            return output
        try:
            missing = [feature for feature in features if feature not in self.outputs]
            if missing:
                self._compute(min(missing))
            return torch.cat([self.outputs.pop(feature) for feature in features])
        except Exception as exc:  # the engine failed: Captum's own forwards from here on
            self._give_up(f"the engine failed ({type(exc).__name__}: {exc})")
            with CAPTURE_LOCK.shared():
                return self.real(*args)

    def ablating(self, owner: Occlusion, features: list[int], ablation: _Ablation) -> None:
        self.pending = features
        if self.strategy is None:
            self.owner, self.ablation = owner, ablation
            self.strategy = self._choose(self.real, ablation)

    # -- deciding -----------------------------------------------------------------------
    def may_evaluate(self, module: nn.Module | None) -> bool:
        """Whether the computation may run in eval mode: a model in training mode whose
        numbers do not depend on it. One that depends on it is Captum's to evaluate."""
        if module is None or not any(m.training for m in module.modules()):
            return False
        dependent = mode_dependent_modules(module)
        if dependent:
            shown = ", ".join(dependent[:3]) + (" ..." if len(dependent) > 3 else "")
            self._give_up(f"the model is in training mode and {shown} depend on it")
            return False
        return True

    def _choose(self, forward: Callable, ablation: _Ablation) -> str:
        if self.strategy == "captum":
            return "captum"
        initial = self.initial
        if not isinstance(initial, torch.Tensor) or initial.dim() == 0:
            return self._give_up("the forward does not return a tensor per example")
        if initial.shape[0] != ablation.examples:
            return self._give_up("the forward returns one output per batch, not per example")
        reason = self._why_not_incremental(forward, ablation)
        if reason is None:
            try:
                starts = ablation.window_starts(range(ablation.features))
                corners = _corners(starts, ablation.originals[0].shape[1:], ablation.extent)
                plan = explainer_for(forward).position_plan(  # type: ignore[arg-type]
                    ablation.originals[0][0], list(corners.T), ablation.extent
                )
            except Exception as exc:  # cannot be captured, or the engine refuses it
                reason = f"the engine cannot take this model or input ({exc})"
            else:
                self.mode = "exact" if plan.incremental else "naive"
                return "incremental"
        self.reasons.append(f"{reason}: the engine evaluates whole inputs, batched")
        return "batched"

    def _give_up(self, reason: str) -> str:
        self.reasons.append(f"{reason}; Captum evaluates it (same results)")
        self.strategy = "captum"
        return "captum"

    def _why_not_incremental(self, forward: Callable, ablation: _Ablation) -> str | None:
        inputs = ablation.originals
        if len(inputs) != 1:
            return "the inputs are a tuple of tensors"
        if not isinstance(forward, nn.Module):
            return "forward_func is not an nn.Module"
        if self.additional is not None:
            return "additional_forward_args are given"
        tensor = inputs[0]
        if tensor.dim() not in (4, 5) or not tensor.is_floating_point():
            return "the input is not an image (N, C, H, W) or volume (N, C, D, H, W) batch"
        explainer = explainer_for(forward)
        if tensor.dtype != explainer.dtype or tensor.device != explainer.device:
            return "the input's dtype or device is not the model's"
        if not (isinstance(ablation.baselines, tuple) and len(ablation.baselines) == 1):
            return "the baselines are not one value or tensor"
        return None

    # -- computing ----------------------------------------------------------------------
    def _compute(self, first: int) -> None:
        ablation = self.ablation
        assert ablation is not None
        if self.strategy == "incremental":
            size = max(self.per_eval, self.engine_batch, -(-ablation.features // PROGRESS_STEPS))
            chunk = range(first, min(first + size, ablation.features))
            outputs = self._incremental(chunk, ablation)
        else:
            chunk = range(first, min(first + self._batch(ablation), ablation.features))
            outputs = self._batched(chunk, ablation)
        rest = tuple(self.initial.shape[1:])
        if tuple(outputs.shape[2:]) != rest or outputs.shape[1] != ablation.examples:
            raise RuntimeError(f"outputs {tuple(outputs.shape)} do not match {rest}")
        for offset, feature in enumerate(chunk):
            self.outputs[feature] = outputs[offset].clone()

    def _batch(self, ablation: _Ablation) -> int:
        """Windows per batched forward: from the memory budget, never fewer than the
        caller asked for per evaluation, and no more where the caller set a cap."""
        if self.engine_batch < ENGINE_BATCH:
            return self.engine_batch
        example = sum(t.element_size() * t.numel() for t in ablation.originals)
        device = ablation.originals[0].device
        fits = capped_batch_size(
            DEFAULT_BATCH.get(device.type, 16),
            example * BATCHED_ACTIVATION_PER_INPUT_BYTE // LIVE_ACTIVATION_FACTOR,
            device=device,
        )
        return max(self.per_eval, fits)

    def _batched(self, chunk: range, ablation: _Ablation) -> torch.Tensor:
        """(windows, N, ...) outputs of the occluded inputs Captum would build."""
        count = len(chunk)
        repeated = tuple(torch.cat([t] * count) for t in ablation.originals)
        assert self.owner is not None
        ablated, _ = CaptumOcclusion._construct_ablated_input_across_tensors(
            self.owner,
            repeated,
            ablation.input_mask,
            ablation.baselines,
            list(chunk),
            ablation.feature_tensors,
            count,
            **ablation.kwargs,
        )
        arguments = (
            None
            if self.additional is None
            else _expand_additional_forward_args(self.additional, count)
        )
        with torch.no_grad():
            output = _run_forward(self.real, ablated, None, arguments)
        if not isinstance(output, torch.Tensor) or output.dim() == 0:
            raise RuntimeError("the forward did not return a tensor for a larger batch")
        return output.reshape(count, ablation.examples, *output.shape[1:])

    def _incremental(self, chunk: range, ablation: _Ablation) -> torch.Tensor:
        """(windows, N, ...) outputs computed by the engine: each window (cropped at the
        border, over some channels or all) is a full-size patch kept inside the image,
        whose cells outside the window are the image's own."""
        images = ablation.originals[0]
        shape = tuple(images.shape[1:])
        extent = ablation.extent
        starts = ablation.window_starts(chunk)
        full = np.asarray(tuple(ablation.kwargs["sliding_window_tensors"][0].shape))
        ends = np.minimum(starts + full, np.asarray(shape))
        corners = _corners(starts, shape, extent)
        device = images.device
        mask = _box_mask(starts, ends, corners, shape[0], extent, device)
        index = window_index(
            [torch.as_tensor(corners[:, axis], device=device) for axis in range(len(extent))],
            list(extent),
        )
        baseline = ablation.baselines[0]
        explainer = explainer_for(self.real)  # type: ignore[arg-type]
        per_example = []
        for example in range(ablation.examples):
            image = images[example]
            own = image[(slice(None), *index)].movedim(1, 0)
            if isinstance(baseline, torch.Tensor):
                base = torch.broadcast_to(baseline, (1, *images.shape))[0, example]
                replaced = base.to(image.dtype)[(slice(None), *index)].movedim(1, 0)
            else:
                replaced = torch.full_like(own, float(baseline))
            patches = torch.where(mask, replaced, own)
            per_example.append(
                explainer.occluded_outputs(
                    image,
                    corners[:, -2],
                    corners[:, -1],
                    patches,
                    zs=corners[:, 0] if len(extent) == 3 else None,
                    mode=self.mode,
                    batch_size=self.engine_batch,
                )
            )
        return torch.stack(per_example, dim=1)


def _corners(starts: np.ndarray, shape: Any, extent: tuple[int, ...]) -> np.ndarray:
    """(windows, rank) first cell per spatial axis of each window's full-size patch,
    kept inside the image (a window cropped at the border keeps its patch's size)."""
    sizes = np.asarray(tuple(shape)[1:])
    return np.minimum(starts[:, 1:], sizes - np.asarray(extent))


def _box_mask(
    starts: np.ndarray,
    ends: np.ndarray,
    corners: np.ndarray,
    channels: int,
    extent: tuple[int, ...],
    device: torch.device,
) -> torch.Tensor:
    """(windows, C, *extent) True where each window covers its full-size patch."""
    count, rank = len(starts), len(extent)

    def along(axis: int, size: int, low: np.ndarray, high: np.ndarray) -> torch.Tensor:
        cells = torch.arange(size, device=device).reshape(
            [1] * (axis + 1) + [size] + [1] * (rank - axis)
        )
        shape = [count] + [1] * (rank + 1)
        lows = torch.as_tensor(low, device=device).reshape(shape)
        highs = torch.as_tensor(high, device=device).reshape(shape)
        return (cells >= lows) & (cells < highs)

    mask = along(0, channels, starts[:, 0], ends[:, 0])
    for axis in range(rank):
        low = starts[:, axis + 1] - corners[:, axis]
        high = ends[:, axis + 1] - corners[:, axis]
        mask = mask & along(axis + 1, extent[axis], low, high)
    return mask
