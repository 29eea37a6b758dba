"""A drop-in for MONAI's ``OcclusionSensitivity``: the same call, the same numbers, each
occluded image computed incrementally.

    from krypton.monai import OcclusionSensitivity   # instead of monai.visualize's

    occ_map, most_probable_class = OcclusionSensitivity(model)(image)

MONAI itself still does what makes its results MONAI's: the bounding-box crop of the
coordinate grid, the window positions of ``sliding_window_inference`` at the given
overlap, the Gaussian or constant weighting that blends overlapping windows, and the
Gaussian kernel of ``mode="gaussian"``. Krypton replaces only the predictor: where MONAI
runs the whole network on each occluded copy, the engine recomputes what each window
changes (its pixels multiplied by MONAI's kernel and offset, or replaced by a patch
mean — content that varies with position), on 2-D images and 3-D volumes alike. Extra
forward arguments, callable modes and models torch.fx cannot capture go to MONAI's own
class, with one warning.

MONAI is optional: Krypton imports without it; this module needs ``pip install monai``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .dropin import DropIn
from .engine.capture_lock import CAPTURE_LOCK
from .engine.kernels import window_index
from .explainer import OcclusionExplainer

__all__ = ["OcclusionSensitivity"]


def _monai_class():
    try:
        from monai.visualize import OcclusionSensitivity as MonaiOcclusionSensitivity
    except ImportError as exc:  # Krypton itself does not need MONAI
        raise ImportError("krypton.monai needs MONAI: pip install monai") from exc
    return MonaiOcclusionSensitivity


class OcclusionSensitivity(DropIn):
    """MONAI's ``OcclusionSensitivity`` with the same constructor and ``__call__``.

    Args:
        nn_module: the classifier (an ``nn.Module``).
        mask_size: side of the occluded box, one number or one per spatial dimension.
        n_batch: occluded images per forward pass.
        verbose: a progress bar.
        mode: "gaussian" (multiply by 1 - a Gaussian), "mean_patch", "mean_img", a float,
            or a callable (handed to MONAI).
        overlap: overlap of neighbouring windows, in [0, 1).
        activate: softmax (sigmoid for one input channel, as MONAI does), False, or a
            callable.
    """

    name = "krypton.monai.OcclusionSensitivity"
    library = "MONAI's own OcclusionSensitivity"
    library_key = "monai"

    def __init__(
        self,
        nn_module: nn.Module,
        mask_size: int | Sequence[int] = 16,
        n_batch: int = 16,
        verbose: bool = True,
        mode: str | float | Callable = "gaussian",
        overlap: float = 0.6,
        activate: bool | Callable = True,
    ) -> None:
        self._monai = _monai_class()(
            nn_module=nn_module,
            mask_size=mask_size,
            n_batch=n_batch,
            verbose=verbose,
            mode=mode,
            overlap=overlap,
            activate=activate,
        )
        super().__init__()
        self.nn_module = nn_module
        self._explainer: OcclusionExplainer | None = None

    def __call__(
        self, x: torch.Tensor, b_box: Sequence[int] | None = None, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(occlusion map, most probable class), exactly as MONAI returns them."""
        reason = self._why_not_incremental(x, kwargs)
        return self._run(
            reason, lambda: self._incremental(x, b_box), lambda: self._monai(x, b_box, **kwargs)
        )

    def _why_not_incremental(self, x, kwargs) -> str | None:
        if not isinstance(x, torch.Tensor) or x.dim() not in (4, 5):
            return "the incremental engine takes images (B, C, H, W) or volumes (B, C, D, H, W)"
        if x.shape[0] != 1:
            return None  # MONAI refuses a batch larger than one: let it say so
        if kwargs:
            return "extra forward arguments are given"
        if callable(self._monai.mode):
            return "mode is a callable"
        if not isinstance(self.nn_module, nn.Module):
            return "nn_module is not an nn.Module"
        return None

    def _incremental(self, x: torch.Tensor, b_box) -> tuple[torch.Tensor, torch.Tensor]:
        import numpy as np
        from monai.data.meta_tensor import MetaTensor
        from monai.inferers import sliding_window_inference
        from monai.networks.utils import eval_mode
        from monai.transforms import SpatialCrop
        from monai.utils import ensure_tuple_rep

        monai_sensitivity = self._monai
        if x.shape[0] > 1:
            raise ValueError("Expected batch size of 1.")
        rank = x.dim() - 2  # spatial axes: 2 for an image, 3 for a volume
        mask_size: Sequence = ensure_tuple_rep(monai_sensitivity.mask_size, rank)
        grid = MetaTensor(
            np.stack(np.meshgrid(*[np.arange(0, i) for i in x.shape[2:]], indexing="ij"))[None],
            device=x.device,
            dtype=x.dtype,
        )
        cropper = None
        if b_box is not None:
            grid, cropper, mask_size = monai_sensitivity.crop_meshgrid(grid, b_box, mask_size)
        if any(m > g for g, m in zip(grid.shape[2:], mask_size)):
            raise ValueError(
                f"Image (spatial shape) {grid.shape[2:]} should be bigger than mask {mask_size}."
            )
        mode = monai_sensitivity.mode
        mul: Any
        add: Any
        if isinstance(mode, float):
            mul, add = monai_sensitivity.constant_occlusion(x, mode, mask_size)
        elif mode == "mean_img":
            mul, add = monai_sensitivity.constant_occlusion(x, x.mean().item(), mask_size)
        elif mode == "gaussian":
            mul, add = monai_sensitivity.gaussian_occlusion(x, mask_size)
        else:  # mean_patch: per window, below
            mul, add = None, None
        sliding = dict(
            roi_size=mask_size,
            sw_batch_size=monai_sensitivity.n_batch,
            overlap=monai_sensitivity.overlap,
            mode="gaussian" if mode == "gaussian" else "constant",
        )
        with eval_mode(self.nn_module):  # as MONAI runs it, the caller's mode restored after
            if self._explainer is None:
                self._explainer = OcclusionExplainer(self.nn_module)
            classes = self._explainer.views_for(x[0].detach().to(self._explainer.dtype))[
                1
            ].logits.shape[1]
            # Pass 1: where MONAI's sliding window puts its windows, in its order.
            corners: list[torch.Tensor] = []

            def record(cropped_grid: torch.Tensor) -> torch.Tensor:
                corners.append(cropped_grid[(slice(None), slice(None), *[0] * rank)].round().long())
                return torch.zeros(  # on the input's device: MONAI adds it to its own buffers
                    (cropped_grid.shape[0], classes, *mask_size),
                    dtype=x.dtype,
                    device=cropped_grid.device,
                )

            sliding_window_inference(grid, predictor=record, progress=False, **sliding)
            # Every window's occluded image at once, incrementally (one capture check,
            # one geometry for all positions), then MONAI blends them as it would.
            outputs = self._outputs(
                x, torch.cat(corners), mul, add, mask_size, mode, monai_sensitivity.activate
            )
            position = [0]

            def replay(cropped_grid: torch.Tensor) -> torch.Tensor:
                count = cropped_grid.shape[0]
                out = outputs[position[0] : position[0] + count]
                position[0] += count
                for m in mask_size:
                    out = torch.repeat_interleave(out.unsqueeze(-1), m, dim=-1)
                return out

            sensitivity = sliding_window_inference(
                grid, predictor=replay, progress=monai_sensitivity.verbose, **sliding
            )
        if b_box is not None:
            sensitivity = cropper.inverse(sensitivity[0])[None]
            bbox_min = [max(b, 0) for b in b_box[::2]]
            bbox_max = [b if b > 0 else s for b, s in zip(b_box[1::2], x.shape[2:])]
            sensitivity = SpatialCrop(roi_start=bbox_min, roi_end=bbox_max)(sensitivity[0])[None]
        return sensitivity, sensitivity.argmax(dim=1, keepdim=True)

    def _outputs(
        self,
        x: torch.Tensor,
        corners: torch.Tensor,
        mul: Any,
        add: Any,
        mask_size: Sequence[int],
        occ_mode: Any,
        activate: bool | Callable,
    ) -> torch.Tensor:
        """What MONAI's predictor returns for each window (first corners, (P, rank)),
        before it is spread over the window: the activated outputs (P, classes)."""
        image = x[0].as_subclass(torch.Tensor)
        rank = corners.shape[1]
        index = window_index([corners[:, axis] for axis in range(rank)], list(mask_size))
        # (C, P, *mask) -> (P, C, *mask)
        windows = image[(slice(None), *index)].movedim(1, 0)
        if occ_mode == "mean_patch":
            # What MONAI 1.6 computes: its predictor unpacks constant_occlusion's
            # (multiplicative, additive) = (0, mean) as (add, mul), so the box is
            # *multiplied* by its mean rather than replaced by it. Same numbers as MONAI.
            patches = windows * windows.mean(dim=tuple(range(1, rank + 2)), keepdim=True)
        else:
            patches = windows * mul + add
        starts = corners.cpu().numpy()
        out = self._explainer.occluded_outputs(
            image,
            starts[:, -2],
            starts[:, -1],
            torch.as_tensor(patches).as_subclass(torch.Tensor),
            zs=starts[:, 0] if rank == 3 else None,
            batch_size=self._monai.n_batch,
        )
        if callable(activate):
            with CAPTURE_LOCK.shared():
                out = activate(out)
        elif activate:
            out = out.sigmoid() if x.shape[1] == 1 else out.softmax(1)
        return out
