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
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from scipy.stats import t as student_t
from sklearn.linear_model import LinearRegression

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
from .runtime_log import RECENT_RUNS, as_naive, logged_runs, record_run, runtime_log_path

if TYPE_CHECKING:
    from .registry.entries import RegistryEntry

__all__ = [  # the runtime log's functions too (krypton.runtime_log), as before it moved
    "NotCalibratedError",
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
            said = (f"from the model's calibration, adjusted to this machine's {count} "
                    f"recent run{'s' * (count != '1')}{first}")  # fmt: skip
        else:
            said = f"from the model's calibration ({FIRST_RUNS})"
    elif runs:  # what was logged: 'runs', 'run with every cell known', 'gradient steps'
        said = f"from this machine's last {runs.group(1)} {runs.group(2).strip()}{first}"
    else:
        said = f"from this machine's earlier runs{first}"
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


CONFORMAL_RUNS = 20  # this host's recent runs whose errors set the range
MIN_CONFORMAL_RUNS = 5  # fewer: the range is the fit's own (below)
COVERAGE = 0.8  # the share of runs the range is meant to hold
FIRST_RUNS = "first runs on this machine"  # an estimate's words before MIN_CONFORMAL_RUNS


def conformal_ratios(
    model_name: str,
    path: Path | None = None,
    coverage: float = COVERAGE,
    mode: str | None = None,
    shift: float = 0.0,
    load: float | None = None,
) -> ErrorBounds | None:
    """Bounds on actual ÷ estimate from this host's recent runs of the model (of
    ``mode``, any patch; None: any mode) that logged the estimate they were given
    (:func:`ratio_bounds` of their ratios, c = ``coverage``), so a new run falls inside
    [low, high] × its estimate with probability ``coverage`` while the host keeps
    behaving as over those runs; None with too few. Per mode: a
    re-run with every cell known or a naive run misses its estimate by other ratios than
    an exact run, and mixing them made every range 3.5-8x wide.
    ``shift``: the ratios are of (actual + shift) ÷ (estimate + shift). ``load``: the
    runs met at a load like it, where MIN_CONFORMAL_RUNS were (:func:`at_similar_load`)."""
    judged = [
        row
        for row in logged_runs(model_name, mode, None, path, CONFORMAL_RUNS * 4)
        if row.get("estimated", 0) > 0 and row.get("seconds", 0) > 0
    ]
    similar = at_similar_load(judged, load, MIN_CONFORMAL_RUNS)
    rows = similar[-CONFORMAL_RUNS:]
    if len(rows) < MIN_CONFORMAL_RUNS:
        return None
    ratios = [(row["seconds"] + shift) / (row["estimated"] + shift) for row in rows]
    low, high = ratio_bounds(ratios, coverage)
    return ErrorBounds(low, high, len(ratios), similar is not judged)


def ratio_bounds(ratios: Sequence[float], coverage: float = COVERAGE) -> tuple[float, float]:
    """(low, high) that hold a new run's actual ÷ estimate with probability ``coverage``,
    from the ``ratios`` (all > 0, at least two) of earlier runs. Where there are enough,
    the split-conformal order statistics, the ⌈(n+1)(1±c)/2⌉-th smallest (no assumption
    on the errors' shape). With fewer (n < 9 at 80%) no order statistic reaches that
    share: [min, max] of n ratios holds only (n−1)/(n+1) of new runs, 67% with five, and a
    Compare step's range held 5 of 8 (bench.estimates). There it is the prediction
    interval of log-normal errors: exp(m ± t · s · √(1 + 1/n)), m and s the log ratios'
    mean and standard deviation, t Student's (1+c)/2 quantile on n−1 degrees of freedom."""
    ordered = np.sort(np.asarray(ratios, dtype=float))
    n = len(ordered)
    upper = math.ceil((n + 1) * (1 + coverage) / 2)
    if upper <= n:
        lower = max(math.floor((n + 1) * (1 - coverage) / 2), 1)
        return float(ordered[lower - 1]), float(ordered[upper - 1])
    logs = np.log(ordered)
    half = student_t.ppf((1 + coverage) / 2, n - 1) * logs.std(ddof=1) * math.sqrt(1 + 1 / n)
    return math.exp(logs.mean() - half), math.exp(logs.mean() + half)


class ErrorBounds(NamedTuple):
    """:func:`conformal_ratios`' answer: actual ÷ estimate is within [low, high] for the
    share of runs aimed at, from the errors of ``runs`` logged runs; ``like_load``: all of
    them met a load like the one asked about (:func:`at_similar_load`)."""

    low: float
    high: float
    runs: int
    like_load: bool = False


# Runs whose load factors (krypton.host.load_factor) are within this ratio of each other
# met a similar load. Beside two burners a Compare step took 3-4x its idle time, more than
# the load factor says, so the errors of busy steps made the next idle step's range
# 3.1-3.2x wide: where enough were logged, an estimate learns from the runs at its load.
SIMILAR_LOAD = 1.5


def at_similar_load(rows: list[dict], load: float | None, minimum: int) -> list[dict]:
    """The logged ``rows`` (oldest first) that met a load like ``load``'s (their
    :func:`row_load_factor` within SIMILAR_LOAD of its own), where at least ``minimum``
    did; else every row (and with ``load`` None)."""
    if load is None:
        return rows
    similar = runs_at_like_load(rows, load)
    return similar if len(similar) >= minimum else rows


def runs_at_like_load(rows: list[dict], load: float) -> list[dict]:
    """The logged ``rows`` whose :func:`row_load_factor` is within SIMILAR_LOAD of
    ``load``'s."""
    now = load_factor(load)
    return [
        row
        for row in rows
        if max(now, factor := row_load_factor(row)) / min(now, factor) <= SIMILAR_LOAD
    ]


MIN_SPREAD = 1.15  # the narrowest range: ± 15 % (timing noise on an idle host)
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


def fit_seconds(
    features: np.ndarray, seconds: np.ndarray, relative: bool = False
) -> LinearRegression:
    """Seconds as a linear function of position counts: coefficients and the fixed
    per-run term never negative (a negative intercept predicted ~0 s for small runs).
    ``relative``: least squares of the errors as a share of each run's time, so one
    slow large run does not set the fixed term for the small ones."""
    weights = 1.0 / np.square(np.maximum(seconds, 1e-3)) if relative else None
    regression = LinearRegression(positive=True).fit(features, seconds, sample_weight=weights)
    if regression.intercept_ < 0:
        regression = LinearRegression(positive=True, fit_intercept=False).fit(
            features, seconds, sample_weight=weights
        )
    return regression


# A fit from the log is used only where positions explain its runs: at the largest run
# logged, the positions' share of the predicted time is at least this. Runs whose time
# did not grow with their positions (a load that came and went, fixed costs that
# dominated) fitted ~0 s per position, and the page then gave 2,916 positions the
# estimate of 49 (45.6 s against 314.5 s measured).
MIN_POSITION_SHARE = 0.5


def _per_position(fit: LinearRegression, features: np.ndarray) -> bool:
    """Whether ``fit`` (seconds = fixed + positions x cost, eq. thesis §7.1.3) has time
    that grows with the positions: its position term is at least MIN_POSITION_SHARE of
    its prediction for the largest logged run."""
    largest = features[int(np.argmax(features.sum(axis=1)))]
    position_seconds = float(np.dot(fit.coef_, largest))
    total = position_seconds + max(float(fit.intercept_), 0.0)
    return total > 0 and position_seconds >= MIN_POSITION_SHARE * total


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
    if not _per_position(fit, features):
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
    rows = logged_runs(model_name, mode, patch, path, limit=limit * 4)
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


def row_load_factor(row: dict) -> float:
    """A logged run's :func:`load_factor`: at the load it met, with the threads it ran
    (rows logged before either was recorded: idle, at this process's threads)."""
    return load_factor(row.get("load"), threads=row.get("threads"))


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
    like_load = bounds is not None and bounds.like_load
    # the runs whose loads the estimate rests on: read only where the distance counts
    logged = (
        []
        if load is None or like_load
        else logged_runs(model_name, None, None, log_path, CONFORMAL_RUNS * 4)
    )
    if bounds is None:
        found = dataclasses.replace(found, source=f"{found.source}; {FIRST_RUNS}")
        return widened_for_load(found, load, logged, False, loads)
    low, high, runs, _ = bounds
    shifted = found.seconds + CONFORMAL_SHIFT
    ranged = Estimate(
        found.seconds,
        max(shifted * min(low, 1 / MIN_SPREAD) - CONFORMAL_SHIFT, 0.0),
        shifted * max(high, MIN_SPREAD) - CONFORMAL_SHIFT,
        f"{found.source}; range from the errors of this host's last {runs} {mode} estimates"
        + (" at a like load" if like_load else ""),
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

    history = logged_runs(model_name, None, patch, log_path, limit=sys.maxsize)  # one read
    rows = [row for row in history if row.get("mode") == mode][-RECENT_RUNS:]
    if stated:
        exact = [row for row in history if row.get("mode") == "exact"][-RECENT_RUNS:]
        said = [as_naive(row) for row in exact if row.get("naive_seconds")]
        rows = sorted(rows + said, key=lambda row: row.get("when", 0.0))[-RECENT_RUNS:]
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
    low, high = _ratio_range(corrected, max(1 + 2 * error, MIN_SPREAD), spread)
    return Estimate(corrected, low, high, f"{source}, {how} and widened by this host's {runs}")


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


# The most a run's own costs beyond explain() add at an idle host's pace (the prediction,
# the out-of-distribution check, decoding): tenths of a second to 1.5 s on 2 cores. Runs
# further off the calibration than this by a fixed amount are a pace, not a fixed cost
# (runs that took 44-47 s whatever their positions while a load came and went).
FIXED_OFFSET_LIMIT = 2.0


def _host_correction(
    pairs: list[tuple[float, float]], seconds: float, now: float
) -> tuple[float, list[float], str]:
    """The calibration's ``seconds`` (at the load now, × ``now``) corrected by this
    host's recent runs (``pairs``: predicted, actual): in proportion (the machine or its
    pace changed since) or by a fixed amount (the page's run pays costs explain() alone
    does not: the prediction, the out-of-distribution check), whichever leaves the
    runs' own leave-one-out errors smaller. (corrected, the ratios of the runs' actual
    to corrected time that widen its range, what was done)."""
    predicted, actual = (np.array(side) for side in zip(*pairs))
    ratios, offsets = actual / predicted, actual - predicted
    offset = float(np.median(offsets))
    if (
        len(pairs) >= 2
        and abs(offset) <= FIXED_OFFSET_LIMIT
        and np.median(_loo_errors(predicted, actual, lambda p, keep: p + np.median(offsets[keep])))
        < np.median(_loo_errors(predicted, actual, lambda p, keep: p * np.median(ratios[keep])))
    ):
        corrected = max(seconds + offset * now, 1e-3)
        spread = [a / max(p + offset, 1e-3) for p, a in pairs]
        return corrected, spread, f"{offset:+.1f} s"
    host = float(np.median(ratios))
    return seconds * host, list(ratios / host), f"scaled by {host:.2f}"


def _loo_errors(predicted: np.ndarray, actual: np.ndarray, correct) -> np.ndarray:
    """Each run's |log(actual / corrected)|, its correction learnt from the other runs
    (``correct(predicted, others)``; two runs at least)."""
    errors = []
    for index in range(len(actual)):
        keep = np.arange(len(actual)) != index
        guess = max(float(correct(predicted[index], keep)), 1e-3)
        errors.append(abs(math.log(actual[index] / guess)))
    return np.array(errors)
