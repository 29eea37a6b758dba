"""Calibrating the runtime estimator on this host (thesis §7.1.3): time explain() over
configurations with different position counts and fit one linear cost model per (patch,
mode); time the Compare view's gradient step (Grad-CAM and Integrated Gradients) per
class. Images and volumes alike: the input's rank is the length of its size.

The records are stored under "calibration" in a model's registry file
(:func:`save_calibration`); :mod:`krypton.estimator` reads them.
"""

from __future__ import annotations

import copy
import datetime
import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .approximate.settings import DEFAULTS
from .estimator import _features, fit_seconds, planned_positions, positions_grid
from .explainer import MODES, OcclusionExplainer
from .registry.models import CALIBRATION_PATCHES

__all__ = ["calibrate", "save_calibration", "time_gradient_step", "region_of"]

FRACTIONS = (0.25, 0.4, 0.55, 0.7, 0.85, 1.0)  # of each axis: small to large regions
STRIDES = (4, 8)


def region_of(starts: Sequence[int], ends: Sequence[int]) -> tuple[int, ...]:
    """A region in explain()'s order from per-axis starts and ends in array order: an
    image's (x0, y0, x1, y1), a volume's (z0, y0, x0, z1, y1, x1)."""
    if len(starts) == 2:
        return (starts[1], starts[0], ends[1], ends[0])
    return (*starts, *ends)


def _configurations(input_size: Sequence[int], patch: int) -> list[dict]:
    """Centred regions of growing size at two strides: position counts from small to
    large, for an input of any rank."""
    configs = []
    for fraction in FRACTIONS:
        sides = [min(size, max(patch + 1, int(size * fraction))) for size in input_size]
        starts = [(size - side) // 2 for size, side in zip(input_size, sides)]
        ends = [start + side for start, side in zip(starts, sides)]
        for stride in STRIDES:
            configs.append({"region": region_of(starts, ends), "stride": stride})
    return configs


def calibrate(
    model: nn.Module,
    name: str,
    input_size: Sequence[int],
    *,
    channels: int = 3,
    patches: Sequence[int] = CALIBRATION_PATCHES,
    modes: Sequence[str] = MODES,
    tau: float = 1.0,
    r_drill_down: float = DEFAULTS.r_drill_down,
    target_speedup: float = DEFAULTS.target_speedup,
    held_out_every: int = 3,
    gradient_labels: Sequence[int] = (),
    fill=None,
    log: Callable[[str], None] = print,
) -> dict:
    """Time explain() over several configurations and fit one cost model per (patch, mode).

    ``input_size``: (H, W) for an image model, (D, H, W) for a volume model, whose inputs
    have ``channels`` channels. Every ``held_out_every``-th configuration is kept out of
    the fit and used to report the estimator's error. With ``gradient_labels``, the
    Compare view's gradient step is timed for those classes too
    (:func:`time_gradient_step`, starting from ``fill``). Returns the record stored under
    "calibration" in the registry file.
    """
    explainer = OcclusionExplainer(model)
    generator = torch.Generator().manual_seed(0)
    warm_up = torch.randn(channels, *input_size, generator=generator)
    explainer.explain(warm_up, patch=patches[0], positions=[(0,) * len(input_size)])
    record: dict = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "image_size": list(input_size),
        "tau": tau,
        "r_drill_down": r_drill_down,
        "target_speedup": target_speedup,
        "models": {},
    }
    drill = {"tau": tau, "r_drill_down": r_drill_down, "target_speedup": target_speedup}
    errors = []
    for patch in patches:
        configs = [c for c in _configurations(input_size, patch) if _fits(c, patch, input_size)]
        for mode in modes:
            rows = []
            for index, config in enumerate(configs):
                try:
                    counts = planned_positions(
                        input_size, patch, config["stride"], config["region"], mode,
                        r_drill_down, target_speedup,
                    )  # fmt: skip
                except ValueError:  # drill-down target infeasible on this region
                    continue
                # Each timed run as a user's run: a new image (new views to materialise)
                # and, in exact mode, a new incremental-vs-naive timing. Their cost is the
                # fit's intercept, the fixed per-run term short runs are dominated by.
                image = torch.randn(channels, *input_size, generator=generator)
                explainer.forget_plans()
                started = explainer.clock.now()  # waits for a card's kernels
                explainer.explain(
                    image, patch=patch, stride=config["stride"], mode=mode,
                    region=config["region"], **(drill if mode == "approximate" else {}),
                )  # fmt: skip
                seconds = explainer.clock.now() - started
                held_out = index % held_out_every == held_out_every - 1
                rows.append((held_out, _features(mode, counts), seconds))
            found = _fit(rows)
            if found is None:
                continue
            fitted, held_out_errors = found
            record["models"].setdefault(str(patch), {})[mode] = fitted
            errors.extend(held_out_errors)
            median = fitted["held_out_median_abs_error_percent"]
            log(
                f"{name} patch {patch} {mode}: {fitted['fit_runs']} fit runs, held-out median "
                f"error {float('nan') if median is None else median:.1f}%"
            )
    record["held_out_median_abs_error_percent"] = float(np.median(errors)) if errors else None
    record["held_out_runs"] = len(errors)
    record["held_out_patches"] = [int(patch) for patch in record["models"]]  # the summary's scope
    if gradient_labels:
        step = time_gradient_step(
            model, input_size, channels, patches[0], gradient_labels, fill, generator
        )
        record["gradient_step"] = step
        log(
            f"{name} gradient step: {np.median(step['seconds_per_class']):.1f} s per class "
            f"({len(step['seconds_per_class'])} timed)"
        )
    return record


def _fits(config: dict, patch: int, input_size: Sequence[int]) -> bool:
    """Whether the patch fits inside the configuration's region on every axis."""
    region, rank = config["region"], len(input_size)
    return all(region[rank + axis] - region[axis] >= patch for axis in range(rank))


def _fit(rows: list[tuple[bool, list[float], float]]) -> tuple[dict, list[float]] | None:
    """One (patch, mode)'s cost model from its timed rows (held out, features, seconds)
    and its held-out errors (percent); None with under two fit rows.
    The fit weighs each run's error as a share of its time (:func:`fit_seconds`)."""
    fit_rows = [r for r in rows if not r[0]]
    test_rows = [r for r in rows if r[0]]
    if len(fit_rows) < 2:
        return None
    regression = fit_seconds(
        np.array([r[1] for r in fit_rows]), np.array([r[2] for r in fit_rows]), relative=True
    )
    percent = [abs(regression.predict([r[1]])[0] - r[2]) / r[2] * 100 for r in test_rows]
    return {
        "coefficients": [float(c) for c in regression.coef_],
        "intercept": float(regression.intercept_),
        "fit_runs": len(fit_rows),
        "held_out_runs": len(test_rows),
        "held_out_median_abs_error_percent": float(np.median(percent)) if percent else None,
    }, percent


def time_gradient_step(
    model: nn.Module,
    input_size: Sequence[int],
    channels: int,
    patch: int,
    labels: Sequence[int],
    fill=None,
    generator: torch.Generator | None = None,
    inputs: int = 2,
) -> dict:
    """Seconds per class of the Compare view's gradient step (Grad-CAM and Integrated
    Gradients, :func:`krypton.methods.attribution_maps`, on a grid of ``patch`` cells) on
    ``inputs`` random inputs: one figure per (input, class). Integrated Gradients takes
    more steps where its path is far from complete, so the figures spread."""
    from .methods import attribution_maps

    generator = generator or torch.Generator().manual_seed(0)
    rank = len(input_size)
    axes = positions_grid(input_size, patch, patch, None)
    per_class: list[float] = []
    for _ in range(inputs):
        image = torch.randn(channels, *input_size, generator=generator)
        for label in labels:
            started = time.perf_counter()
            attribution_maps(model, image, axes, (patch,) * rank, [int(label)], fill=fill)
            per_class.append(round(time.perf_counter() - started, 4))
    return {
        "seconds_per_class": per_class,
        "date": datetime.date.today().isoformat(),
        "threads": torch.get_num_threads(),
    }


def save_calibration(path: Path, record: dict, keep_other_patches: bool = False) -> None:
    """Store a calibration record in a registry file, keeping everything else. With
    ``keep_other_patches`` the stored fits of patch sizes this record did not measure stay
    (each fit says the date it was measured; the record's summary error still covers only
    its own ``held_out_patches``), as does a gradient-step timing the record lacks;
    otherwise the record replaces them all."""
    from .registry.entries import update_entry

    entry = json.loads(path.read_text())
    earlier = entry.get("calibration")
    record = copy.deepcopy(record)  # the caller's record stays as calibrate() returned it
    for fits in record["models"].values():
        for fit in fits.values():
            fit.setdefault("date", record["date"])
    if keep_other_patches and isinstance(earlier, dict):
        kept = {
            patch: {mode: {"date": earlier.get("date"), **fit} for mode, fit in fits.items()}
            for patch, fits in earlier.get("models", {}).items()
            if patch not in record["models"]
        }
        record = {
            **record,
            "models": dict(
                sorted({**kept, **record["models"]}.items(), key=lambda item: int(item[0]))
            ),
        }
        if "gradient_step" in earlier and "gradient_step" not in record:
            record["gradient_step"] = earlier["gradient_step"]
    update_entry(path, calibration=record)
