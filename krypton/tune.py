"""Tuning τ offline (paper §4.3): heatmaps of sample images at each sampled τ, the fitted
SSIM(τ) curve, and the τ that keeps both SSIM and localisation.

The procedure runs models through the explainer, so it lives here, beside it and apart
from :mod:`krypton.approximate` (the pure curve, metrics and policy the explainer reads):
no import loop between the explainer and the approximate package.
"""

from __future__ import annotations

import datetime
import platform
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .approximate.tuning import (
    DEFAULT_TARGET_SSIM,
    DEFAULT_TAUS,
    LOCALISATION_SHARE,
    TauTuning,
    heatmap_ssim,
    localisation,
)
from .explainer import OcclusionExplainer

__all__ = ["tune_tau"]


def tune_tau(
    model: torch.nn.Module,
    images: Sequence[torch.Tensor],
    *,
    patch: int = 16,
    stride: int = 4,
    fill=0.0,
    taus: Sequence[float] = DEFAULT_TAUS,
    held_out: Sequence[torch.Tensor] = (),
    target_ssim: float = DEFAULT_TARGET_SSIM,
    log: Callable[[str], None] = print,
) -> dict:
    """Fit SSIM(τ) on ``images`` (images (C, H, W) or volumes (C, D, H, W)) and choose τ
    for ``target_ssim``; check it on ``held_out``.

    Models with global-context gates are scored with the gates frozen, as approximate
    mode runs them, so the curve and the choice include that error (then τ 1 is scored
    too). The chosen τ is the lower of the curve's τ for the target and must also keep the
    evidence in place: at every sampled τ at or above it, the exact map's lowest cell stays
    among the approximate map's lowest cells on at least 90% of the tuning images
    (:func:`krypton.tuning.localisation`). Returns the record stored in the model's
    registry file under "tuning".
    """
    explainer = OcclusionExplainer(model)
    started = time.perf_counter()
    # Gates approximate mode freezes (found on one position): their error is in every score.
    gates: list[str] = []
    if images:
        one = (  # one position: a list for an image, a one-patch region for a volume
            {"region": (0, 0, 0, patch, patch, patch)}
            if images[0].dim() == 4
            else {"positions": [(0, 0)]}
        )
        probe = explainer.explain(
            images[0], patch=patch, stride=patch, fill=fill, mode="approximate", tau=1.0, **one
        )
        gates = list(probe.extra["frozen_gates"])

    def scores_for(image: torch.Tensor, tau_values: Sequence[float]) -> list[tuple]:
        """(SSIM, minimum kept, lowest-5% overlap) per τ, against the exact heatmap."""
        exact = explainer.explain(image, patch=patch, stride=stride, fill=fill)
        scores = []
        for tau in tau_values:
            if tau >= 1.0 and not gates:  # approximate at τ 1 is exact
                scores.append((1.0, True, 1.0))
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
            where = localisation(exact.values, approx.values)
            scores.append(
                (
                    heatmap_ssim(exact.values, approx.values, exact.prob),
                    where.minimum_kept,
                    where.lowest_overlap,
                )
            )
        return scores

    table = []  # (tau, ssim, minimum kept, overlap) per image and tau
    for index, image in enumerate(images):
        scores = scores_for(image, taus)
        table.extend((tau, *score) for tau, score in zip(taus, scores))
        log(
            f"image {index + 1}/{len(images)}: SSIM "
            + " ".join(f"{t:.1f}:{s[0]:.3f}{'' if s[1] else '*'}" for t, s in zip(taus, scores))
            + "  (* evidence moved)"
        )
    values = np.array(table, dtype=np.float64)
    tau_array, ssim_array, kept_array, overlap_array = values.T
    coefficients = np.polyfit(tau_array, ssim_array, 2)
    curve_tau = TauTuning(tuple(float(c) for c in coefficients)).tau_for(target_ssim)
    both_array = (ssim_array >= target_ssim) & (kept_array > 0.5)
    by_tau = {
        float(t): {
            "mean_ssim": float(ssim_array[tau_array == t].mean()),
            "minimum_kept": float(kept_array[tau_array == t].mean()),
            "lowest_overlap": float(overlap_array[tau_array == t].mean()),
            "ssim_and_minimum_kept": float(both_array[tau_array == t].mean()),
        }
        for t in taus
    }
    # Quality floor: the lowest sampled τ such that, at it and at every sampled τ above
    # it, SSIM meets the target and the minimum is kept on >= 90% of the images (between
    # samples, the next one up).
    floor = 1.0
    for tau in sorted(taus, reverse=True):
        if by_tau[float(tau)]["ssim_and_minimum_kept"] < LOCALISATION_SHARE:
            break
        floor = float(tau)
    chosen = max(curve_tau, floor)
    at_chosen = min((t for t in by_tau if t >= chosen), default=1.0)
    record = {
        "coefficients": [float(c) for c in coefficients],
        "taus": list(taus),
        "patch": patch,
        "stride": stride,
        "sample_images": len(images),
        "mean_ssim_by_tau": {f"{t:.1f}": v["mean_ssim"] for t, v in by_tau.items()},
        "localisation_by_tau": {
            f"{t:.1f}": {
                "minimum_kept": v["minimum_kept"],
                "lowest_overlap": v["lowest_overlap"],
                "ssim_and_minimum_kept": v["ssim_and_minimum_kept"],
            }
            for t, v in by_tau.items()
        },
        "tau_for_target": {str(target_ssim): chosen},
        "frozen_gates": len(gates),  # approximate mode keeps these at unoccluded values
        "chosen": {
            "tau": chosen,
            "target_ssim": target_ssim,
            "curve_tau": curve_tau,
            "quality_floor": floor,  # per image: SSIM and localisation on >= 90%
            # measured at the nearest sampled τ at or above the chosen one
            "minimum_kept": by_tau[at_chosen]["minimum_kept"],
            "lowest_overlap": by_tau[at_chosen]["lowest_overlap"],
        },
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip()
        + f", {torch.get_num_threads()} threads",
    }
    if held_out:
        actual = [scores_for(image, [chosen])[0] for image in held_out]
        ssims = [a[0] for a in actual]
        record["held_out"] = {
            "images": len(held_out),
            "target_ssim": target_ssim,
            "tau": chosen,
            "fraction_at_or_above": float(np.mean([v >= target_ssim for v in ssims])),
            "worst_shortfall": float(max(0.0, max(target_ssim - v for v in ssims))),
            "mean_ssim": float(np.mean(ssims)),
            "minimum_kept": float(np.mean([a[1] for a in actual])),
            "lowest_overlap": float(np.mean([a[2] for a in actual])),
        }
    record["seconds"] = round(time.perf_counter() - started, 1)
    return record
