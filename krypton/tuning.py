"""Tuning the projective-field threshold τ for a visual-quality target (paper §4.3).

Offline: on sample images from the application domain, compute SSIM between the exact and
the thresholded heatmap for τ = 1.0, 0.9, ..., 0.4 and fit a second-degree polynomial
SSIM(τ). Online: for a target SSIM pick the lowest τ whose predicted SSIM meets it.

SSIM compares the heatmaps as the user sees them: both clipped to the display range
0.75p .. min(1, 1.25p) and compared with that range as ``data_range``.
"""

from __future__ import annotations

import datetime
import platform
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from skimage.metrics import structural_similarity

from .imaging import heatmap_limits

__all__ = ["TauTuning", "heatmap_ssim", "tune_tau", "DEFAULT_TAUS"]

DEFAULT_TAUS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
TAU_GRID = np.round(np.arange(1.0, 0.3999, -0.01), 2)  # from 1 down to the lowest sampled


@dataclass(frozen=True)
class TauTuning:
    """A fitted SSIM(τ) curve: SSIM = a τ² + b τ + c."""

    coefficients: tuple[float, float, float]

    def predicted_ssim(self, tau: float) -> float:
        return float(np.polyval(self.coefficients, tau))

    def tau_for(self, target_ssim: float) -> float:
        """Lowest τ whose predicted SSIM meets the target, walking down from τ = 1 in
        0.01 steps and stopping at the first miss (1.0 if even 0.99 misses).

        Stopping at the first miss keeps τ on the part of the curve the samples support:
        a convex fit rises again at low τ, which is extrapolation, not quality.
        """
        if not 0.0 < target_ssim <= 1.0:
            raise ValueError(f"target_ssim must be in (0, 1], got {target_ssim}")
        chosen = 1.0
        for tau in TAU_GRID[1:]:
            if self.predicted_ssim(tau) < target_ssim:
                break
            chosen = float(tau)
        return chosen

    @classmethod
    def from_entry(cls, entry: dict | None) -> "TauTuning | None":
        """From a registry entry's "tuning" record, if it has one."""
        if not entry or "tuning" not in entry:
            return None
        return cls(tuple(float(c) for c in entry["tuning"]["coefficients"]))


def heatmap_ssim(exact: np.ndarray, approximate: np.ndarray, prob: float) -> float:
    """SSIM of two heatmaps in the display range (skimage, explicit data_range)."""
    low, high = heatmap_limits(prob)
    first = np.clip(np.nan_to_num(exact, nan=high), low, high)
    second = np.clip(np.nan_to_num(approximate, nan=high), low, high)
    side = min(first.shape)
    win_size = min(7, side if side % 2 else side - 1)
    if win_size < 3:
        raise ValueError(f"heatmaps of shape {first.shape} are too small for SSIM")
    return float(structural_similarity(first, second, data_range=high - low, win_size=win_size))


def tune_tau(
    model: torch.nn.Module,
    images: Sequence[torch.Tensor],
    *,
    patch: int = 16,
    stride: int = 4,
    fill=0.0,
    taus: Sequence[float] = DEFAULT_TAUS,
    held_out: Sequence[torch.Tensor] = (),
    target_ssim: float = 0.9,
    log: Callable[[str], None] = print,
) -> dict:
    """Fit SSIM(τ) on ``images``; check the chosen τ for ``target_ssim`` on ``held_out``.

    Returns the record stored in the model's registry file under "tuning".
    """
    from .explainer import OcclusionExplainer

    explainer = OcclusionExplainer(model)
    points: list[tuple[float, float]] = []
    started = time.perf_counter()

    def curve_for(image: torch.Tensor, tau_values: Sequence[float]) -> list[float]:
        exact = explainer.explain(image, patch=patch, stride=stride, fill=fill)
        scores = []
        for tau in tau_values:
            if tau >= 1.0:
                scores.append(1.0)
                continue
            approx = explainer.explain(
                image,
                patch=patch,
                stride=stride,
                fill=fill,
                mode="approximate",
                tau=tau,
                r_drill_down=1.0,
                label=exact.label,
            )
            scores.append(heatmap_ssim(exact.values, approx.values, exact.prob))
        return scores

    for index, image in enumerate(images):
        scores = curve_for(image, taus)
        points.extend(zip(taus, scores))
        log(
            f"image {index + 1}/{len(images)}: SSIM "
            + " ".join(f"{t:.1f}:{s:.3f}" for t, s in zip(taus, scores))
        )
    tau_array, ssim_array = np.array(points).T
    coefficients = np.polyfit(tau_array, ssim_array, 2)
    tuning = TauTuning(tuple(float(c) for c in coefficients))
    chosen = tuning.tau_for(target_ssim)
    record = {
        "coefficients": [float(c) for c in coefficients],
        "taus": list(taus),
        "patch": patch,
        "stride": stride,
        "sample_images": len(images),
        "mean_ssim_by_tau": {f"{t:.1f}": float(np.mean(ssim_array[tau_array == t])) for t in taus},
        "tau_for_target": {str(target_ssim): chosen},
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip()
        + f", {torch.get_num_threads()} threads",
    }
    if held_out:
        actual = [curve_for(image, [chosen])[0] for image in held_out]
        shortfall = [target_ssim - value for value in actual]
        record["held_out"] = {
            "images": len(held_out),
            "target_ssim": target_ssim,
            "tau": chosen,
            "fraction_at_or_above": float(np.mean([v >= target_ssim for v in actual])),
            "worst_shortfall": float(max(0.0, max(shortfall))),
            "mean_ssim": float(np.mean(actual)),
        }
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record
