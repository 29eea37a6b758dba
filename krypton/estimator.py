"""Runtime estimation (thesis §7.1.3): a linear cost model per (model, patch, mode).

With model, patch size and mode fixed, run time is close to linear in the number of patch
positions evaluated. Calibration times explain() on this host over configurations with
different position counts and fits scikit-learn's LinearRegression; approximate mode gets
two features, the stage-one and stage-two position counts (both planned in advance, so the
estimate needs nothing that only running would reveal).
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .approximate import drilldown
from .approximate.settings import DEFAULTS
from .explainer import grid
from .host import (
    host_load,
    load_factor,
    max_threads,
    threads_for_load,
)
from .load_range import UNCERTAIN, widened_for_load
from .registry.models import CALIBRATION_PATCHES
from .run_errors import (  # the ranges' parts, as before they moved
    CONFORMAL_RUNS,
    COVERAGE,
    MIN_SPREAD,
    SIMILAR_LOAD,
    at_similar_load,
    conformal_ratios,
    fit_seconds,
    fitted_to_runs,
    grows_with_positions,
    offset_or_pace,
    ratio_bounds,
    row_load_factor,
    runs_at_like_load,
)
from .runtime_log import RECENT_RUNS, as_naive, logged_runs, record_run, runtime_log_path

if TYPE_CHECKING:
    from .registry.entries import RegistryEntry

__all__ = [  # the runtime log's functions too (krypton.runtime_log), as before it moved
    "NotCalibratedError",
    "for_a_first_run",
    "calibrated_speedup",
    "planned_positions",
    "positions_grid",
    "estimate_seconds",
    "CALIBRATION_PATCHES",
    "Estimate",
    "estimate",
    "record_run",
    "naive_equivalent",
    "host_load",
    "format_duration",
    "plain_basis",
    "logged_runs",
    "runtime_log_path",
    "estimate_for_counts",
    "load_factor",
    "threads_for_load",
    "row_load_factor",
    "recent_estimate",
    "forward_seconds",
    "max_threads",
    "conformal_ratios",
    "ratio_bounds",
    "with_host_range",
    "at_similar_load",
    "runs_at_like_load",
    "naive_pace",
    "probed_naive_pace",
    "calibrated_step",
    "fit_seconds",
    "COVERAGE",
    "SIMILAR_LOAD",
    "MIN_SPREAD",
]


class NotCalibratedError(LookupError):
    """No cost model exists for this model, patch size and mode on this host."""


def positions_grid(
    input_size: Sequence[int], patch, stride, region: Sequence[int] | None
) -> tuple[np.ndarray, ...]:
    """The grid's first corners along each axis (tensor order) of a run over an input of
    ``input_size`` (:func:`krypton.explainer.grid`: any rank, the region in any form it
    takes)."""
    return grid(tuple(int(s) for s in input_size), patch, stride, region)


def planned_positions(
    image_size: Sequence[int],
    patch: int,
    stride: int,
    region: Sequence[int] | None = None,
    mode: str = "exact",
    r_drill_down: float = DEFAULTS.r_drill_down,
    target_speedup: float = DEFAULTS.target_speedup,
    s1: int | None = None,
) -> tuple[int, int]:
    """(stage-one, stage-two) positions a run over an image (H, W) or a volume (D, H, W)
    will evaluate; stage two is 0 except for approximate mode with drill-down, where it is
    the expected count (eq 28's reasoning: the chosen fraction of stage-one cells, each
    covering (S1/S2)^rank positions)."""
    axes = positions_grid(image_size, patch, stride, region)
    rank = len(axes)
    total = int(np.prod([len(a) for a in axes]))
    if mode != "approximate" or r_drill_down >= 1.0 or all(len(a) < 2 for a in axes):
        return total, 0
    if s1 is None:
        if region is None:
            width = min(image_size)
        else:
            width = min(region[rank + axis] - region[axis] for axis in range(rank))
        s1 = drilldown.check_drill_down(target_speedup, r_drill_down, stride, width, rank)
    stage_one = int(np.prod([len(drilldown.stage_one_axis(a, s1)) for a in axes]))
    chosen = max(1, math.ceil(r_drill_down * stage_one))
    per_block = total / stage_one
    stage_two = min(total - stage_one, round(chosen * per_block - chosen))
    return stage_one, max(0, stage_two)


def _features(mode: str, counts: tuple[int, int]) -> list[float]:
    return [float(counts[0]), float(counts[1])] if mode == "approximate" else [float(counts[0])]


def estimate_seconds(
    model_name: str,
    *,
    patch: int,
    stride: int,
    region: Sequence[int] | None = None,
    mode: str = "exact",
    image_size: Sequence[int] | None = None,
    r_drill_down: float = DEFAULTS.r_drill_down,
    target_speedup: float = DEFAULTS.target_speedup,
    s1: int | None = None,
    directory: Path | None = None,
) -> float:
    """Estimated seconds for an explain() call, from the model's calibration on this host.

    Raises NotCalibratedError (with the command that fixes it) when no cost model exists,
    and ValueError for settings explain() itself would refuse.
    """
    from .registry.entries import find_entry

    path, entry = find_entry(model_name, directory)
    image_size = tuple(image_size or entry["input_size"])
    counts = planned_positions(
        image_size, patch, stride, region, mode, r_drill_down, target_speedup, s1
    )
    return _calibrated_seconds(entry, model_name, mode, patch, counts)


def _calibration_fit(entry: RegistryEntry, patch: int, mode: str) -> dict | None:
    """The registry entry's calibrated cost model for (patch, mode), or None."""
    return entry.get("calibration", {}).get("models", {}).get(str(patch), {}).get(mode)


def _calibrated_seconds(
    entry: RegistryEntry, model_name: str, mode: str, patch: int, counts: tuple[int, int]
) -> float:
    model = _calibration_fit(entry, patch, mode)
    if model is None:
        raise NotCalibratedError(
            f"no runtime calibration for model '{model_name}' with patch {patch} in {mode} "
            f"mode; run `krypton calibrate --model {model_name}`"
        )
    # a negative fixed term (a fit over large runs) would give small runs nothing: 0.0 s
    # shown for 49 naive positions that took 1.6 s
    intercept = max(float(model["intercept"]), 0.0)
    return max(intercept + float(np.dot(model["coefficients"], _features(mode, counts))), 0.0)


def calibrated_speedup(model_name: str, patch: int, counts: tuple[int, int]) -> float:
    """A naive run of ``counts`` positions against an exact one, both as the model's
    calibration timed them (one machine, so its speed-up holds where its seconds do not)."""
    from .registry.entries import find_entry

    _, entry = find_entry(model_name, None)
    exact = _calibrated_seconds(entry, model_name, "exact", patch, counts)
    naive = _calibrated_seconds(entry, model_name, "naive", patch, counts)
    if exact <= 0:
        raise NotCalibratedError(f"model '{model_name}' has no exact calibration to divide by")
    return naive / exact


# ---------------------------------------------------------------------------------------
# Learning on the host: every finished run is logged, and the estimate refits from the log
# ---------------------------------------------------------------------------------------

MIN_LOGGED_RUNS = 3


def format_duration(seconds: float) -> str:
    """'45 s', '2.5 min', '1.3 h': one unit, chosen by size."""
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def plain_basis(source: str) -> str:
    """What an estimate rests on, in words a user reads (its ``source`` keeps the
    estimator's factors for the logs and the details): 'from this machine's last 6 runs',
    'from the model's calibration, adjusted to this machine's 4 recent runs'."""
    runs = re.search(r"this host's last (\d+) ([^;,]+)", source)
    recent = re.search(r"this host's (\d+) recent runs?", source)
    first = f" ({FIRST_RUNS})" if FIRST_RUNS in source else ""
    if source.startswith("calibration"):
        if recent:
            count = recent.group(1)
            like = f" {AT_LIKE_LOAD}" if AT_LIKE_LOAD in source else ""
            said = (f"from the model's calibration, adjusted to this machine's {count} "
                    f"recent run{'s' * (count != '1')}{like}{first}")  # fmt: skip
        else:
            said = f"from the model's calibration ({FIRST_RUNS})"
    elif runs:  # what was logged: 'runs', 'run with every cell known', 'gradient steps'
        said = f"from this machine's last {runs.group(1)} {runs.group(2).strip()}{first}"
    else:
        said = f"from this machine's earlier runs{first}"
    if FIRST_IN_PROCESS in source:
        said += f"; {FIRST_IN_PROCESS}"
    if UNCERTAIN in source:  # krypton.load_range: the range reaches for an unmet load
        said += "; uncertain: no run it learned from met a load like this one"
    return said


@dataclass(frozen=True)
class Estimate:
    """Seconds a run should take, a plausible range, and where the numbers come from."""

    seconds: float
    low: float
    high: float
    source: str  # "this host's last N runs" or "calibration (DATE)"


FIRST_RUNS = "first runs on this machine"  # an estimate's words before MIN_CONFORMAL_RUNS


# A run's range comes from the errors of (actual + this) ÷ (estimate + this) seconds: a
# run's fixed costs jitter by tenths of a second whatever its length, so a short run's
# plain ratio says little of a long one's (a 0.7 s estimate met in 1.3 s, ratio 1.9, made
# the next 25 s exact run's range 21-48 s); shifted, the short run counts as 1.35
CONFORMAL_SHIFT = 1.0
# seconds either way on top: a run's fixed costs (loading, preprocessing, the picture)
# jitter by a few tenths of a second on a shared host, which dominates short runs
ABSOLUTE_SLACK = 0.3
HOST_RUNS = 10  # recent runs that show how this host compares with the calibration
# a learned spread factor above this (the range a ratio of 3 either way) says the recent
# runs scatter too much to fit; a calibrated model then uses its calibration, scaled by
# the host's recent runs and widened to cover them
LEARNED_SPREAD_LIMIT = 3.0


def _ratio_range(
    seconds: float, factor: float, ratios: Sequence[float] = ()
) -> tuple[float, float]:
    """(low, high) around ``seconds``: a factor either way (never negative), widened to
    cover every ratio of actual to predicted time in ``ratios``."""
    low, high = seconds / factor, seconds * factor
    if len(ratios):
        low, high = min(low, seconds * min(ratios)), max(high, seconds * max(ratios))
    return max(low - ABSOLUTE_SLACK, 0.0), high + ABSOLUTE_SLACK


def naive_equivalent(
    model_name: str,
    mode: str,
    patch: int,
    counts: tuple[int, int],
    found: Estimate,
    positions: int,
    directory: Path | None = None,
) -> float | None:
    """Seconds a naive run of ``positions`` (the grid naive would compute) would take,
    computed as ``found`` (``mode``'s estimate for ``counts``) was: its seconds times the
    calibration's naive-over-``mode`` ratio (both timed side by side on one host). None
    without a calibration of both."""
    from .registry.entries import RegistryError, find_entry

    try:
        _, entry = find_entry(model_name, directory)
        this = _calibrated_seconds(entry, model_name, mode, patch, counts)
        naive = _calibrated_seconds(entry, model_name, "naive", patch, (positions, 0))
    except (RegistryError, NotCalibratedError):
        return None
    if this <= 0:
        return None
    return found.seconds * naive / this


def _fit_log(
    rows: list[dict], mode: str, counts: tuple[int, int], now: float = 1.0
) -> tuple[Estimate, float] | None:
    """The estimate refitted from logged runs, and its spread factor (a ratio either
    way); None with too few runs to fit. Each run's seconds are brought to an idle
    host's (÷ its :func:`load_factor`) and the prediction to this moment's (× ``now``):
    runs fitted while the host was busy kept the estimate 4-6x too high once it was not."""
    features = np.array([_features(mode, (r["stage_one"], r["stage_two"])) for r in rows])
    seconds = np.array([r["seconds"] / row_load_factor(r) for r in rows])
    seconds = np.maximum(seconds, 1e-3)
    if len(rows) < MIN_LOGGED_RUNS or len({tuple(f) for f in features}) < 2:
        return None
    fit = fit_seconds(features, seconds)
    if not grows_with_positions(fit, features):
        return None
    predicted = float(fit.predict([_features(mode, counts)])[0])
    predicted = max(predicted, 1e-3)
    # The range: how far each logged run fell from a fit on the *other* runs (leave one
    # out), as a ratio, 90th percentile. In-sample residuals of a two-parameter fit on
    # a handful of runs are near zero and made the range far too narrow.
    held_out = np.empty_like(seconds)
    for index in range(len(rows)):
        others = np.arange(len(rows)) != index
        fit = fit_seconds(features[others], seconds[others])
        held_out[index] = fit.predict(features[index : index + 1])[0]
    log_errors = np.abs(np.log(seconds / np.maximum(held_out, 1e-3)))
    factor = max(float(np.exp(np.quantile(log_errors, 0.9))), MIN_SPREAD)
    predicted *= now
    low, high = _ratio_range(predicted, factor)
    return Estimate(predicted, low, high, f"this host's last {len(rows)} runs"), factor


def estimate(
    model_name: str,
    *,
    patch: int,
    stride: int,
    region: Sequence[int] | None = None,
    mode: str = "exact",
    image_size: Sequence[int] | None = None,
    r_drill_down: float = DEFAULTS.r_drill_down,
    target_speedup: float = DEFAULTS.target_speedup,
    s1: int | None = None,
    directory: Path | None = None,
    log_path: Path | None = None,
    cached: int = 0,
    load: float | None = None,
    stated: bool = False,
    loads: Sequence[float] | None = None,
) -> Estimate:
    """Estimated run time with a range: refit from this host's logged runs when there are
    enough, else the model's calibration (``make calibrate``). Raises NotCalibratedError
    when neither exists. ``cached``: positions of the grid already computed, which exact
    and naive runs reuse (time = fixed + positions left x per-position cost: a run with
    every cell cached costs its fixed part). ``load``: cores other work keeps busy now
    (None: as over the logged runs). ``stated``, ``loads``: :func:`estimate_for_counts`."""
    from .registry.entries import find_entry

    path, entry = find_entry(model_name, directory)
    image_size = tuple(image_size or entry["input_size"])
    counts = planned_positions(
        image_size, patch, stride, region, mode, r_drill_down, target_speedup, s1
    )
    if mode != "approximate":
        counts = (max(counts[0] - int(cached), 0), counts[1])
    return estimate_for_counts(
        model_name, mode, patch, counts, directory, log_path, load, stated=stated, loads=loads
    )


PROPORTIONAL_SPREAD = 2.0  # the range of an estimate from one or two runs: 2x either way


def recent_estimate(
    model_name: str,
    mode: str,
    patch: int,
    load: float | None,
    what: tuple[str, str],
    path: Path | None = None,
    *,
    limit: int = 5,
    mean: bool = False,
) -> Estimate | None:
    """Seconds of a step whose time does not grow with positions (the gradient step after
    the occlusion, a run with every cell known), from this host's last ``limit`` logged
    ones of (model, mode, patch): their median (``mean``: their mean, the estimate of a sum
    of several), each at an idle host's pace and scaled to ``load``; the range spans
    them, widened as the narrowest range is, or as an estimate from one or two runs is
    while fewer than MIN_LOGGED_RUNS are logged (one gradient step does not know how many
    Integrated Gradients steps the next image needs: beside two burners a Compare step
    took 55 s where one logged step scaled to the load said 37-50 s). Where ``limit`` of
    them met a load like ``load``'s, those (:func:`at_similar_load`). None before the
    first is logged. ``what`` names one and several of them in the source."""
    rows = logged_runs(model_name, mode, patch, path, limit=limit * 4, warm=True)
    rows = at_similar_load(rows, load, limit)[-limit:]
    if not rows:
        return None
    now = load_factor(load)
    idle = np.array([r["seconds"] / row_load_factor(r) for r in rows])
    spread = MIN_SPREAD if len(rows) >= MIN_LOGGED_RUNS else PROPORTIONAL_SPREAD
    return Estimate(
        float(np.mean(idle) if mean else np.median(idle)) * now,
        max(float(idle.min()) * now / spread - ABSOLUTE_SLACK, 0.0),
        float(idle.max()) * now * spread + ABSOLUTE_SLACK,
        f"this host's last {len(rows)} {what[len(rows) > 1]}",
    )


def forward_seconds(model_name: str, directory: Path | None = None) -> float | None:
    """Seconds of one forward pass of one image on an idle host: the calibration's naive
    cost per position (one occluded image's forward), averaged over its patch sizes;
    None without a calibration."""
    from .registry.entries import RegistryError, find_entry

    try:
        _, entry = find_entry(model_name, directory)
    except RegistryError:
        return None
    fits = entry.get("calibration", {}).get("models", {})
    costs = [fit["naive"]["coefficients"][0] for fit in fits.values() if "naive" in fit]
    return float(np.mean(costs)) if costs else None


def calibrated_step(
    model_name: str, classes: int, load: float | None = None, directory: Path | None = None
) -> Estimate | None:
    """Seconds of the Compare view's gradient step for ``classes`` classes before this
    host has logged one: the calibration's per-class timings
    (:func:`krypton.calibration.time_gradient_step`), their median at ``load``; the range
    spans them, PROPORTIONAL_SPREAD wider either way (Integrated Gradients takes more
    steps on some inputs). None without such a calibration."""
    from .registry.entries import RegistryError, find_entry

    try:
        _, entry = find_entry(model_name, directory)
    except RegistryError:
        return None
    step = entry.get("calibration", {}).get("gradient_step") or {}
    timed = np.array(step.get("seconds_per_class") or [], dtype=float)
    if not len(timed) or classes < 1:
        return None
    idle = timed * classes / load_factor(None, threads=step.get("threads"))
    now = load_factor(load)
    return Estimate(
        float(np.median(idle)) * now,
        max(float(idle.min()) * now / PROPORTIONAL_SPREAD - ABSOLUTE_SLACK, 0.0),
        float(idle.max()) * now * PROPORTIONAL_SPREAD + ABSOLUTE_SLACK,
        f"calibration ({step.get('date', 'undated')})",
    )


def _proportional(rows: list[dict], mode: str, counts: tuple[int, int], now: float) -> Estimate:
    """With no calibration and too few runs to fit (a volume model's first runs here):
    the positions at the logged runs' own pace (idle seconds per position, median), at
    this load, with a range of PROPORTIONAL_SPREAD either way."""
    paces = [
        r["seconds"]
        / row_load_factor(r)
        / max(sum(_features(mode, (r["stage_one"], r["stage_two"]))), 1.0)
        for r in rows
    ]
    seconds = float(np.median(paces)) * max(sum(_features(mode, counts)), 1.0) * now
    low, high = _ratio_range(seconds, PROPORTIONAL_SPREAD)
    runs = f"{len(rows)} run{'s' * (len(rows) > 1)}"
    return Estimate(seconds, low, high, f"this host's last {runs}, in proportion")


def naive_pace(
    model_name: str, patch: int, load: float, log_path: Path | None = None
) -> float | None:
    """Seconds per position of a naive run of (model, patch) at ``load``, as the batches
    of this host's logged naive runs that met a load like it took (their median, each
    brought to this load: :func:`runs_at_like_load`); None with fewer than
    MIN_LOGGED_RUNS of them. The batches alone: what a surface pays around them (the
    page's decoding, the CLI's) is each run's own."""
    rows = [
        row
        for row in runs_at_like_load(logged_runs(model_name, "naive", patch, log_path), load)
        if row.get("computed_positions") and row.get("computing_seconds")
    ]
    if len(rows) < MIN_LOGGED_RUNS:
        return None
    now = load_factor(load)
    paces = [
        row["computing_seconds"] / row["computed_positions"] / row_load_factor(row) * now
        for row in rows
    ]
    return float(np.median(paces))


# An exact run times naive on a few positions (4-8) beside its first batch. Beside two
# burners such a probe of the chest-CT model read 52, 93 and 102 ms/position in three
# runs where naive runs took 97: one probe can be half the pace, the median of a few
# holds. PROBED_RUNS: the most recent exact runs' probes the median takes.
PROBED_RUNS = 8


def probed_naive_pace(
    model_name: str, patch: int, load: float, probe_ms: float, log_path: Path | None = None
) -> tuple[float, int] | None:
    """Seconds per position of naive inference of (model, patch) at ``load`` as the
    naive probes of this host's exact runs read it: the median of this run's
    (``probe_ms``, ms per position) and those logged by its last PROBED_RUNS - 1 exact
    runs at a like load (:func:`runs_at_like_load`; each brought to this load), with how
    many it took; None with fewer than MIN_LOGGED_RUNS. For a host that has timed no
    naive runs (:func:`naive_pace` is the better figure: whole runs)."""
    rows = [
        row
        for row in runs_at_like_load(logged_runs(model_name, "exact", patch, log_path), load)
        if row.get("naive_probe_ms")
    ][-(PROBED_RUNS - 1) :]
    if not (probe_ms > 0 and math.isfinite(probe_ms)) or len(rows) + 1 < MIN_LOGGED_RUNS:
        return None
    now = load_factor(load)
    paces = [row["naive_probe_ms"] / 1e3 / row_load_factor(row) * now for row in rows]
    return float(np.median(paces + [probe_ms / 1e3])), len(paces) + 1


def _now_factor(rows: list[dict], load: float | None) -> float:
    """The :func:`load_factor` to predict with: at ``load``, or where it is not known,
    the mean of the logged runs' (the estimate then speaks of the load they met)."""
    if load is not None:
        return load_factor(load)
    factors = [row_load_factor(r) for r in rows[-HOST_RUNS:]]
    return float(np.mean(factors)) if factors else 1.0


def estimate_for_counts(
    model_name: str,
    mode: str,
    patch: int,
    counts: tuple[int, int],
    directory: Path | None = None,
    log_path: Path | None = None,
    load: float | None = None,
    *,
    stated: bool = False,
    loads: Sequence[float] | None = None,
) -> Estimate:
    """:func:`estimate` for given (stage-one, stage-two) position counts: the point
    estimate (:func:`_point_estimate`) with, once this host has logged enough runs with
    their estimates, the range their errors give (:func:`conformal_ratios`). ``stated``
    (naive only): the naive figures exact runs' speed lines stated count as naive runs
    (:func:`record_run`' ``stated_naive``), so the page says one naive figure for a run
    before and after it (7.3 min shown before a run, 4.8 min in its speed line); the
    speed line's own bound (:func:`bounded_speed`) never reads them. ``loads``: the host's
    recent load samples, whose spread widens the range (:func:`with_host_range`)."""
    found = _point_estimate(
        model_name, mode, patch, counts, directory, log_path, load, stated and mode == "naive"
    )
    return with_host_range(found, model_name, mode, log_path, load, loads)


def with_host_range(
    found: Estimate,
    model_name: str,
    mode: str,
    log_path: Path | None = None,
    load: float | None = None,
    loads: Sequence[float] | None = None,
) -> Estimate:
    """``found`` with the 80% range its point estimate gets from the errors of this
    host's logged runs of ``mode`` (:func:`conformal_ratios` of times shifted by
    CONFORMAL_SHIFT), at least MIN_SPREAD either way; before MIN_CONFORMAL_RUNS of them,
    its own range, said to rest on the first runs on this machine. ``load``: from the runs
    met at a load like it, where enough were (:func:`at_similar_load`); where they were
    not, the range reaches as far as ``load`` is from the loads the estimate rests on,
    and as far as the host's recent ``loads`` spread (krypton.load_range)."""
    bounds = conformal_ratios(model_name, log_path, mode=mode, shift=CONFORMAL_SHIFT, load=load)
    # runs at a like load set the range, or the point rests on them alone: no distance
    like_load = (bounds is not None and bounds.like_load) or found.source.endswith(AT_LIKE_LOAD)
    # the runs whose loads the estimate rests on: read only where the distance counts
    logged = (
        []
        if load is None or like_load
        else logged_runs(model_name, None, None, log_path, CONFORMAL_RUNS * 4)
    )
    if bounds is None:
        found = dataclasses.replace(found, source=f"{found.source}; {FIRST_RUNS}")
        return widened_for_load(found, load, logged, like_load, loads)
    low, high, runs, _ = bounds
    shifted = found.seconds + CONFORMAL_SHIFT
    ranged = Estimate(
        found.seconds,
        max(shifted * min(low, 1 / MIN_SPREAD) - CONFORMAL_SHIFT, 0.0),
        shifted * max(high, MIN_SPREAD) - CONFORMAL_SHIFT,
        f"{found.source}; range from the errors of this host's last {runs} {mode} estimates"
        + (f" {AT_LIKE_LOAD}" if bounds.like_load else ""),
    )
    return widened_for_load(ranged, load, logged, like_load, loads)


def _point_estimate(
    model_name: str,
    mode: str,
    patch: int,
    counts: tuple[int, int],
    directory: Path | None,
    log_path: Path | None,
    load: float | None,
    stated: bool = False,
) -> Estimate:
    """The estimate from the log's refit or the calibration, at ``load`` (None: the
    logged runs' own), with the fit's own range; ``stated``: a naive estimate that also
    learns from the naive figures exact runs stated (:func:`estimate_for_counts`)."""
    from .registry.entries import RegistryError, find_entry

    history = logged_runs(model_name, None, patch, log_path, sys.maxsize, warm=True)
    rows = [row for row in history if row.get("mode") == mode][-RECENT_RUNS:]
    if stated:
        exact = [row for row in history if row.get("mode") == "exact"][-RECENT_RUNS:]
        said = [as_naive(row) for row in exact if row.get("naive_seconds")]
        rows = sorted(rows + said, key=lambda row: row.get("when", 0.0))[-RECENT_RUNS:]
    like = _like_load_estimate(model_name, mode, patch, counts, directory, history, load, stated)
    if like is not None:
        return like
    now = _now_factor(rows, load)
    learned = _fit_log(rows, mode, counts, now)
    if learned is not None and learned[1] <= LEARNED_SPREAD_LIMIT:
        return learned[0]
    # No learned fit, or one whose runs scatter too far to say much (a load that comes
    # and goes): the calibration where there is one, scaled by this host's recent runs
    try:
        _, entry = find_entry(model_name, directory)
    except RegistryError:
        if learned is not None:
            return learned[0]
        if rows:
            return _proportional(rows, mode, counts, now)
        raise
    fit = _calibration_fit(entry, patch, mode)
    if learned is not None and fit is None:
        return learned[0]  # wide, but all there is
    if fit is None and rows:
        return _proportional(rows, mode, counts, now)
    seconds = _calibrated_seconds(entry, model_name, mode, patch, counts) * now
    calibration = entry.get("calibration", {})
    error = ((fit or {}).get("held_out_median_abs_error_percent") or 25.0) / 100
    source = f"calibration ({calibration.get('date', 'undated')})"
    pairs = _host_pairs(entry, model_name, patch, history[-HOST_RUNS:], stated)
    if not pairs:
        low, high = _ratio_range(seconds, max(1 + 2 * error, MIN_SPREAD))
        return Estimate(seconds, low, high, source)
    corrected, spread, how = _host_correction(pairs, seconds, now)
    runs = f"{len(pairs)} recent run{'s' * (len(pairs) > 1)}"
    # one or two runs, most of other modes, say little of this one: modes differ from
    # their calibrations by up to 2x here (approximate runs 2.5-3x, naive 1.5x)
    factor = max(1 + 2 * error, MIN_SPREAD, PROPORTIONAL_SPREAD * (len(pairs) < MIN_LOGGED_RUNS))
    low, high = _ratio_range(corrected, factor, spread)
    return Estimate(corrected, low, high, f"{source}, {how} and widened by this host's {runs}")


# Warm runs at a like load (any mode) that an estimate rests on: the calibration fitted
# to what those runs took, the load model only stepping from their loads to this one.
LIKE_LOAD_RUNS = MIN_LOGGED_RUNS
AT_LIKE_LOAD = "at a like load"  # an estimate's source, where it rests on such runs


def _like_load_estimate(
    model_name: str,
    mode: str,
    patch: int,
    counts: tuple[int, int],
    directory: Path | None,
    history: list[dict],
    load: float | None,
    stated: bool,
) -> Estimate | None:
    """The estimate from this host's last warm runs at a load like ``load``'s alone,
    where LIKE_LOAD_RUNS of them were logged (of ``mode`` where that many were, else of
    every mode, each against its own calibration): the calibration's idle seconds for
    ``counts``, fitted to what those runs took over theirs (:func:`fitted_to_runs`, each
    at an idle host's pace and the fit brought to the load now: a short step, as they
    met a like load), its range from their errors. Beside two burners the estimates ran
    twice the time the runs took (22.4 s shown, 11.3 s taken): the load model carried
    runs from every load, each logged with the process's threads instead of its own.
    None without a calibration or with fewer such runs."""
    from .registry.entries import RegistryError, find_entry

    if load is None or not math.isfinite(load):
        return None
    like = runs_at_like_load(history[-CONFORMAL_RUNS:], load)
    if len(like) < LIKE_LOAD_RUNS:  # too few: the registry is not read for nothing
        return None
    same = [row for row in like if row.get("mode") == mode]
    try:
        _, entry = find_entry(model_name, directory)
        seconds = _calibrated_seconds(entry, model_name, mode, patch, counts)
    except (RegistryError, NotCalibratedError):
        return None
    rows = same if len(same) >= LIKE_LOAD_RUNS else like
    pairs = _host_pairs(entry, model_name, patch, rows, stated)  # at an idle host's pace
    if len(pairs) < LIKE_LOAD_RUNS:
        return None
    point, low, high, how = fitted_to_runs(pairs, seconds)
    now = load_factor(load)  # within SIMILAR_LOAD of each run's: a short step back
    corrected, low, high = point * now, low * now, high * now
    date = entry.get("calibration", {}).get("date", "undated")
    which = f" of {mode}" if rows is same else ""
    return Estimate(
        corrected, low, high,
        f"calibration ({date}), {how} by this host's {len(pairs)} recent runs{which} "
        f"{AT_LIKE_LOAD}",
    )  # fmt: skip


# How far past its estimate the first run of a mode in a process may go: it also loads
# the model, captures its graph and measures its batch schedule. On a fresh 2-core host
# such runs took up to 3.8x their estimates (bench.estimates: 3.3 s against 1.1 s, 9.9 s
# against 2.6 s), and a process's very first, small run 4.2 s more (5.0 s against 0.8 s):
# the high end reaches the larger of both; logged first runs that went further, further.
FIRST_RUN_FACTOR = 4.0
FIRST_RUN_SECONDS = 5.0
FIRST_IN_PROCESS = "the first run of its mode in this process: it also loads and measures"
COLD_RUNS = 5  # this host's logged first runs that say how far one may reach


def for_a_first_run(found: Estimate, model_name: str, log_path: Path | None = None) -> Estimate:
    """``found`` for a run that will be its process's first of its mode (one-off costs:
    :func:`krypton.runtime_log.record_run`'s ``cold``): its high end reaching
    FIRST_RUN_FACTOR times its estimate and FIRST_RUN_SECONDS past it, or as far as the
    last COLD_RUNS such runs logged here went past theirs where one went further; the
    source says so."""
    cold = [
        (row["seconds"] / row["estimated"], row["seconds"] - row["estimated"])
        for row in logged_runs(model_name, None, None, log_path, CONFORMAL_RUNS * 4)
        if row.get("cold") and row.get("estimated", 0) > 0
    ][-COLD_RUNS:]
    factor = max([FIRST_RUN_FACTOR, *(ratio for ratio, _ in cold)])
    extra = max([FIRST_RUN_SECONDS, *(over for _, over in cold)])
    return dataclasses.replace(
        found,
        high=max(found.high, found.seconds * factor, found.seconds + extra),
        source=f"{found.source}; {FIRST_IN_PROCESS}",
    )


def _host_pairs(
    entry: RegistryEntry,
    model_name: str,
    patch: int,
    recent: list[dict],
    stated: bool = False,
) -> list[tuple[float, float]]:
    """(calibration's prediction, actual seconds at an idle host's pace) of this host's
    ``recent`` runs of the model and patch (its log's rows), every mode each against its
    own calibration: the load they met is this one's too, and a mode's first run here was
    otherwise estimated at the calibration's idle pace (beside a 2-core burner: 1.4 s
    shown, 3.5 s taken).
    ``stated``: an exact run that stated a naive figure counts as that naive run."""
    pairs = []
    for row in recent:
        if stated and row.get("mode") == "exact" and row.get("naive_seconds"):
            row = as_naive(row)
        try:
            predicted = _calibrated_seconds(
                entry, model_name, row["mode"], patch, (row["stage_one"], row["stage_two"])
            )
        except NotCalibratedError:
            continue
        if predicted > 0:
            pairs.append((predicted, row["seconds"] / row_load_factor(row)))
    return pairs


def _host_correction(
    pairs: list[tuple[float, float]], seconds: float, now: float
) -> tuple[float, list[float], str]:
    """The calibration's ``seconds`` (at the load now, × ``now``) corrected by this
    host's recent runs (``pairs``: predicted, actual at an idle host's pace): in
    proportion (the machine or its pace changed since) or by a fixed amount (the page's
    run pays costs explain() alone does not), as :func:`offset_or_pace` chooses.
    (corrected, the ratios of the runs' actual to corrected time that widen its range,
    what was done)."""
    predicted, actual = (np.array(side) for side in zip(*pairs))
    guess, how = offset_or_pace(predicted, actual)
    every = np.ones(len(actual), dtype=bool)
    corrected = max(guess(every, seconds / now) * now, 1e-3)  # a fixed amount x the load
    return corrected, [a / max(guess(every, p), 1e-3) for p, a in pairs], how
