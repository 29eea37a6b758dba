"""A drop-in for MONAI's ``OcclusionSensitivity`` that *is* MONAI's class: the same
call, the same numbers, each occluded image computed by Krypton's engine.

    from krypton.monai import OcclusionSensitivity   # instead of monai.visualize's

    occ_map, most_probable_class = OcclusionSensitivity(model)(image)

``krypton.monai.OcclusionSensitivity`` subclasses ``monai.visualize.OcclusionSensitivity``
and keeps what makes the results MONAI's: its constructor and checks, the bounding-box
crop of the coordinate grid (``crop_meshgrid``), the window positions of
``sliding_window_inference`` at the given overlap, the Gaussian or constant weighting
that blends overlapping windows, and the kernels of ``gaussian_occlusion`` and
``constant_occlusion``. Krypton replaces only the predictor: where MONAI runs the whole
network on each occluded copy, the engine recomputes what each window changes, on 2-D
images and 3-D volumes alike, in batches sized from its memory budget (an ``n_batch``
the caller passes, 16 included, caps the windows per forward; left out, the engine's
batch is 128).
A subclass that overrides MONAI's ``predictor`` is run by MONAI's code, with a warning.
The model runs in eval mode and goes back to its own mode,
as MONAI does. Extra forward arguments, callable modes, inputs whose dtype or device is
not the model's and models torch.fx cannot capture go to MONAI's own code, with one
warning.

MONAI is optional: Krypton imports without it; this class needs ``pip install monai``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..engine import UnsupportedModelError
from ..engine.capture_lock import CAPTURE_LOCK
from ..engine.kernels import window_index
from ..host import host_share
from .shared import LastCall, LibraryDefault, explainer_for, warn_once, windows_per_forward

__all__ = ["OcclusionSensitivity"]

# Windows the engine computes per call: at least one engine batch, and at least an
# eighth of the map's, so MONAI's progress bar moves as the work is done.
PROGRESS_STEPS = 8

try:
    from monai.visualize import OcclusionSensitivity as _MonaiOcclusionSensitivity
except ImportError:  # Krypton itself does not need MONAI
    _MonaiOcclusionSensitivity = None


_MONAI_PREDICTOR = getattr(_MonaiOcclusionSensitivity, "predictor", None)
MONAI_N_BATCH = 16  # MONAI's default n_batch


class _MissingMonai:
    """Stands in for the class where MONAI is not installed: says what to install."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError("krypton.monai needs MONAI: pip install monai")


class OcclusionSensitivity(LastCall, _MonaiOcclusionSensitivity or _MissingMonai):  # type: ignore[misc]
    """``monai.visualize.OcclusionSensitivity`` whose occluded forwards the engine
    computes: the same constructor, ``__call__``, checks and results.

    Args:
        nn_module: the classifier (an ``nn.Module``).
        mask_size: side of the occluded box, one number or one per spatial dimension.
        n_batch: windows per forward in MONAI's own runs; in the engine's, a cap where
            passed (left out: 128 a forward, within its memory budget).
        verbose: MONAI's progress bar, moving as the engine computes.
        mode: "gaussian" (multiply by 1 - a Gaussian), "mean_patch", "mean_img", a float,
            or a callable (MONAI's own code runs it).
        overlap: overlap of neighbouring windows, in [0, 1).
        activate: softmax (sigmoid for one input channel, as MONAI does), False, or a
            callable.
    """

    def __init__(
        self,
        nn_module: nn.Module,
        mask_size: int | Sequence[int] = 16,
        n_batch: int = LibraryDefault(MONAI_N_BATCH),
        verbose: bool = True,
        mode: str | float | Callable = "gaussian",
        overlap: float = 0.6,
        activate: bool | Callable = True,
    ) -> None:
        super().__init__(
            nn_module=nn_module,
            mask_size=mask_size,
            n_batch=n_batch,
            verbose=verbose,
            mode=mode,
            overlap=overlap,
            activate=activate,
        )
        # per thread: one instance may serve several threads at once
        self._local = threading.local()
        self._warned: set[str] = set()

    def __call__(
        self, x: torch.Tensor, b_box: Sequence[int] | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(occlusion map, most probable class), exactly as MONAI returns them."""
        reason = self._why_not_incremental(x, kwargs)
        if reason is None:
            try:  # the host's share as krypton.explain takes it (the caller's threads win)
                with host_share() as share:
                    result = self._incremental(x, b_box)
                self._local.host = share.as_dict()
            except UnsupportedModelError as exc:
                reason = f"the model cannot be captured as a graph ({exc})"
            else:
                self._local.engine = "krypton"
                return result
        if reason:
            warn_once(
                self._warned,
                f"krypton.monai.OcclusionSensitivity: {reason}; MONAI's own code runs it "
                f"(same results, no incremental speedup)",
            )
        self._local.engine, self._local.host = "monai", None
        return super().__call__(x, b_box, **kwargs)

    def _why_not_incremental(self, x: Any, kwargs: dict) -> str | None:
        """Why the engine does not run this call ("" when MONAI's checks will refuse
        it anyway), or None."""
        if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5):
            return "the engine takes images (B, C, H, W) or volumes (B, C, D, H, W)"
        if x.shape[0] != 1:
            return ""  # MONAI refuses a batch larger than one: let it say so
        if kwargs:
            return "extra forward arguments are given"
        if callable(self.mode):
            return "mode is a callable"
        if not isinstance(self.nn_module, nn.Module):
            return "nn_module is not an nn.Module"
        if getattr(type(self), "predictor", None) is not _MONAI_PREDICTOR:
            # MONAI's __call__ names OcclusionSensitivity.predictor, not self.predictor:
            # what a subclass's override does there is MONAI's to decide
            return (
                "the class overrides MONAI's predictor (MONAI's own __call__ calls "
                "OcclusionSensitivity.predictor, so it decides what the override does)"
            )
        explainer = explainer_for(self.nn_module)
        if x.dtype != explainer.dtype or x.device != explainer.device:
            return "the input's dtype or device is not the model's"
        return None

    def _incremental(self, x: torch.Tensor, b_box) -> tuple[torch.Tensor, torch.Tensor]:
        import numpy as np
        from monai.data.meta_tensor import MetaTensor
        from monai.inferers import sliding_window_inference
        from monai.networks.utils import eval_mode
        from monai.transforms import SpatialCrop
        from monai.utils import ensure_tuple_rep

        rank = x.dim() - 2  # spatial axes: 2 for an image, 3 for a volume
        mask_size: Sequence = ensure_tuple_rep(self.mask_size, rank)
        grid = MetaTensor(
            np.stack(np.meshgrid(*[np.arange(0, i) for i in x.shape[2:]], indexing="ij"))[None],
            device=x.device,
            dtype=x.dtype,
        )
        cropper = None
        if b_box is not None:
            grid, cropper, mask_size = self.crop_meshgrid(grid, b_box, mask_size)
        if any(m > g for g, m in zip(grid.shape[2:], mask_size)):
            raise ValueError(
                f"Image (spatial shape) {grid.shape[2:]} should be bigger than mask {mask_size}."
            )
        sliding = dict(
            roi_size=mask_size,
            sw_batch_size=self.n_batch,
            overlap=self.overlap,
            mode="gaussian" if self.mode == "gaussian" else "constant",
        )
        with eval_mode(self.nn_module):  # as MONAI runs it, the caller's mode restored after
            explainer = explainer_for(self.nn_module)
            image = x[0].as_subclass(torch.Tensor).detach()
            graph = explainer.captured_graph(image)
            classes = graph.output_shape[1]
            # Pass 1: where MONAI's sliding window puts its windows, in its order.
            found: list[torch.Tensor] = []

            def record(cropped_grid: torch.Tensor) -> torch.Tensor:
                found.append(cropped_grid[(slice(None), slice(None), *[0] * rank)].round().long())
                return torch.zeros(  # on the input's device: MONAI adds it to its own buffers
                    (cropped_grid.shape[0], classes, *mask_size),
                    dtype=x.dtype,
                    device=cropped_grid.device,
                )

            sliding_window_inference(grid, predictor=record, progress=False, **sliding)
            corners = torch.cat(found)
            windows = _Windows(self, x, corners, list(mask_size), graph)
            position = [0]

            def replay(cropped_grid: torch.Tensor) -> torch.Tensor:
                """Pass 2: each window's outputs, computed by the engine a chunk at a
                time as MONAI asks for them, spread over the window as MONAI does."""
                count = cropped_grid.shape[0]
                out = windows.outputs(position[0], position[0] + count)
                position[0] += count
                for m in mask_size:
                    out = torch.repeat_interleave(out.unsqueeze(-1), m, dim=-1)
                return out

            sensitivity = sliding_window_inference(
                grid, predictor=replay, progress=self.verbose, **sliding
            )
        if b_box is not None:
            sensitivity = cropper.inverse(sensitivity[0])[None]
            bbox_min = [max(b, 0) for b in b_box[::2]]
            bbox_max = [b if b > 0 else s for b, s in zip(b_box[1::2], x.shape[2:])]
            sensitivity = SpatialCrop(roi_start=bbox_min, roi_end=bbox_max)(sensitivity[0])[None]
        return sensitivity, sensitivity.argmax(dim=1, keepdim=True)


class _Windows:
    """The activated outputs (P, classes) of every window of one call, computed by the
    engine a chunk at a time: incremental where static analysis (eqs 9-12) says it pays,
    whole occluded images batched where it does not."""

    def __init__(
        self,
        owner: OcclusionSensitivity,
        x: torch.Tensor,
        corners: torch.Tensor,
        mask_size: list[int],
        graph: Any,
    ) -> None:
        self.owner, self.x, self.mask_size = owner, x, mask_size
        self.image = x[0].as_subclass(torch.Tensor)
        self.starts = corners.cpu().numpy()  # (P, rank) first cell of each window
        self.explainer = explainer_for(owner.nn_module)
        plan = self.explainer.position_plan(self.image, list(self.starts.T), mask_size, graph)
        self.mode = "exact" if plan.incremental else "naive"
        count = len(self.starts)
        # MONAI's default 16 (not passed): the engine's batch; a count passed is a cap
        self.batch = windows_per_forward(owner.n_batch)
        self.chunk = max(owner.n_batch, self.batch, -(-count // PROGRESS_STEPS))
        self.done: list[torch.Tensor] = []
        self.computed = 0
        mode = owner.mode
        self.mul: Any = None
        self.add: Any = None
        if isinstance(mode, float):
            self.mul, self.add = owner.constant_occlusion(x, mode, mask_size)
        elif mode == "mean_img":
            self.mul, self.add = owner.constant_occlusion(x, x.mean().item(), mask_size)
        elif mode == "gaussian":
            self.mul, self.add = owner.gaussian_occlusion(x, mask_size)

    def outputs(self, begin: int, end: int) -> torch.Tensor:
        while self.computed < end:
            stop = min(self.computed + self.chunk, len(self.starts))
            self.done.append(self._compute(self.computed, stop))
            self.computed = stop
        if len(self.done) > 1:
            self.done = [torch.cat(self.done)]
        return self.done[0][begin:end]

    def _compute(self, begin: int, end: int) -> torch.Tensor:
        starts = self.starts[begin:end]
        rank = starts.shape[1]
        device = self.image.device
        index = window_index(
            [torch.as_tensor(starts[:, axis], device=device) for axis in range(rank)],
            self.mask_size,
        )
        # (C, P, *mask) -> (P, C, *mask)
        windows = self.image[(slice(None), *index)].movedim(1, 0)
        if self.owner.mode == "mean_patch":
            # What MONAI 1.6 computes: its predictor unpacks constant_occlusion's
            # (multiplicative, additive) = (0, mean) as (add, mul), so the box is
            # *multiplied* by its mean rather than replaced by it. Same numbers as MONAI.
            patches = windows * windows.mean(dim=tuple(range(1, rank + 2)), keepdim=True)
        else:
            patches = windows * self.mul + self.add
        out = self.explainer.occluded_outputs(
            self.image,
            starts[:, -2],
            starts[:, -1],
            torch.as_tensor(patches).as_subclass(torch.Tensor),
            zs=starts[:, 0] if rank == 3 else None,
            mode=self.mode,
            batch_size=self.batch,
        )
        activate = self.owner.activate
        if callable(activate):
            with CAPTURE_LOCK.shared():
                out = activate(out)
        elif activate:
            out = out.sigmoid() if self.x.shape[1] == 1 else out.softmax(1)
        return out
