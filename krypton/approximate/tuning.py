"""The projective-field threshold τ: its tuned curve, its quality metrics, and the one
policy that picks it (paper §4.3).

Offline (:func:`krypton.tune.tune_tau`): on sample images from the application domain,
SSIM between the exact and the thresholded heatmap for τ = 1.0, 0.9, ..., 0.4, fitted by a
second-degree polynomial SSIM(τ), and the localisation of each thresholded heatmap.
Online (:func:`choose_tau`): the tuned τ for the default target, or the curve's τ for
another target, or 1.0 for an untuned model. The explainer, the CLI, the app and the
benchmark all ask :func:`choose_tau`; nothing else decides τ.

SSIM compares the heatmaps as the user sees them: both clipped to the display range
0.75p .. min(1, 1.25p) and compared with that range as ``data_range``. SSIM can stay high
while the evidence moves, so :func:`localisation` checks where the lowest cells are.

This module is pure (numpy, scikit-image): it imports nothing that runs a model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
from skimage.metrics import structural_similarity

__all__ = [
    "DEFAULT_TARGET_SSIM",
    "DEFAULT_TAUS",
    "LOCALISATION_SHARE",
    "Localisation",
    "TauChoice",
    "TauTuning",
    "choose_tau",
    "heatmap_ssim",
    "localisation",
]

DEFAULT_TAUS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
TAU_GRID = np.round(np.arange(1.0, 0.3999, -0.01), 2)  # from 1 down to the lowest sampled
DEFAULT_TARGET_SSIM = 0.9  # the quality target approximate mode is tuned for by default
LOCALISATION_SHARE = 0.9  # share of tuning images whose evidence must stay in place


@dataclass(frozen=True)
class TauTuning:
    """A model's tuned τ: the fitted SSIM(τ) = a τ² + b τ + c, and the τ chosen for the
    default target so that SSIM and localisation both hold (None in older records, which
    had the curve only)."""

    coefficients: tuple[float, float, float]
    chosen_tau: float | None = None
    target_ssim: float = DEFAULT_TARGET_SSIM
    # at chosen_tau on the tuning images: share keeping the exact minimum among the lowest
    # cells, and mean share of the lowest 5% cells kept
    minimum_kept: float | None = None
    lowest_overlap: float | None = None

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
    def from_record(cls, record: Mapping[str, Any] | None) -> TauTuning | None:
        """From a registry entry's "tuning" record (what tune_tau wrote), if any."""
        if not record:
            return None
        chosen = record.get("chosen") or {}
        return cls(
            cast(tuple[float, float, float], tuple(float(c) for c in record["coefficients"])),
            chosen_tau=chosen.get("tau"),
            target_ssim=float(chosen.get("target_ssim", DEFAULT_TARGET_SSIM)),
            minimum_kept=chosen.get("minimum_kept"),
            lowest_overlap=chosen.get("lowest_overlap"),
        )

    def describe(self) -> str:
        """One line for a model card: the default τ and what it was tuned to keep."""
        choice = choose_tau(self)
        text = f"τ = {choice.tau:.2f} ({choice.source})"
        if self.minimum_kept is not None and self.lowest_overlap is not None:
            text += (
                f"; on the tuning images the exact map's lowest cell stayed among the "
                f"approximate map's lowest in {self.minimum_kept:.0%}, and "
                f"{self.lowest_overlap:.0%} of its lowest 5% of cells were kept"
            )
        return text


@dataclass(frozen=True)
class TauChoice:
    """The τ a run uses, and where it came from (shown with every approximate result)."""

    tau: float
    source: str


def choose_tau(
    tuning: TauTuning | None, tau: float | None = None, target_ssim: float | None = None
) -> TauChoice:
    """The one τ policy: a given τ; else the tuned curve's τ for a given target SSIM; else
    the model's tuned τ for the default target (SSIM and localisation); else 1.0 (no
    thresholding) for a model that was never tuned."""
    if tau is not None and target_ssim is not None:
        raise ValueError("give tau or target_ssim, not both")
    if tau is not None:
        return TauChoice(float(tau), "given")
    if target_ssim is not None:
        if tuning is None:
            raise ValueError(
                "target_ssim needs this model's tuned SSIM(tau) curve, which it does not "
                "have; run `krypton tune --model NAME` or pass tau"
            )
        target_ssim = float(target_ssim)
        if tuning.chosen_tau is not None and target_ssim == tuning.target_ssim:
            return TauChoice(tuning.chosen_tau, f"tuned for SSIM {target_ssim:g} and localisation")
        return TauChoice(tuning.tau_for(target_ssim), f"tuned for SSIM {target_ssim:g}")
    if tuning is None:
        return TauChoice(1.0, "default 1.0 (model not tuned)")
    return choose_tau(tuning, target_ssim=tuning.target_ssim)


@dataclass(frozen=True)
class Localisation:
    """Whether an approximate heatmap keeps the evidence where the exact one has it."""

    minimum_kept: bool  # exact's lowest cell is among approximate's k lowest
    lowest_overlap: float  # share of exact's 5% lowest cells among approximate's 5% lowest


def _lowest(values: np.ndarray, count: int) -> np.ndarray:
    """Flat indices of the ``count`` lowest cells (NaN cells are never among them)."""
    flat = np.where(np.isnan(values), np.inf, values).ravel()
    return np.argsort(flat, kind="stable")[:count]


def _tolerance(values: np.ndarray) -> float:
    """Cells within 1% of a heatmap's range count as tied (saturated probabilities differ
    by 1e-7 where the picture shows one colour)."""
    finite = values[~np.isnan(values)]
    return 0.01 * float(finite.max() - finite.min()) if finite.size else 0.0


def localisation(exact: np.ndarray, approximate: np.ndarray) -> Localisation:
    """Localisation of ``approximate`` against ``exact`` (same grid).

    The minimum criterion: a lowest cell of exact lies among approximate's k lowest
    cells, k = 1% of the cells and at least 3; cells within 1% of a map's range of its
    minimum count as tied for lowest. The overlap: the share of exact's 5% lowest cells
    (at least 1) that are also among approximate's 5% lowest.
    """
    if exact.shape != approximate.shape:
        raise ValueError(f"heatmaps differ in shape: {exact.shape} vs {approximate.shape}")
    cells = int(np.sum(~np.isnan(exact)))
    if cells == 0:
        raise ValueError("the exact heatmap has no values")
    k = max(3, int(np.ceil(0.01 * cells)))
    exact_values = np.where(np.isnan(exact), np.inf, exact)
    approx_values = np.where(np.isnan(approximate), np.inf, approximate)
    exact_lowest = exact_values <= np.min(exact_values) + _tolerance(exact)
    approx_lowest = approx_values <= np.min(approx_values) + _tolerance(approximate)
    approx_lowest.ravel()[_lowest(approximate, k)] = True
    minimum_kept = bool(np.any(exact_lowest & approx_lowest))
    share = max(1, int(np.ceil(0.05 * cells)))
    overlap = len(set(_lowest(exact, share).tolist()) & set(_lowest(approximate, share).tolist()))
    return Localisation(minimum_kept, overlap / share)


def heatmap_limits(prob: float) -> tuple[float, float]:
    """Colour limits of the paper's heatmaps, 0.75p .. min(1, 1.25p) (§5): the range
    quality is measured in here and the range the heatmaps are drawn in."""
    return 0.75 * prob, min(1.0, 1.25 * prob)


def heatmap_ssim(exact: np.ndarray, approximate: np.ndarray, prob: float) -> float:
    """SSIM of two heatmaps in the display range (skimage, explicit data_range)."""
    low, high = heatmap_limits(prob)
    first = np.clip(np.nan_to_num(exact.astype(np.float64), nan=high), low, high)
    second = np.clip(np.nan_to_num(approximate.astype(np.float64), nan=high), low, high)
    side = min(first.shape)
    win_size = min(7, side if side % 2 else side - 1)
    if win_size < 3:
        raise ValueError(f"heatmaps of shape {first.shape} are too small for SSIM")
    return float(structural_similarity(first, second, data_range=high - low, win_size=win_size))
