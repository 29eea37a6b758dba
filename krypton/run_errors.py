"""How far this host's runs fall from what was expected, and which of them count now.

A run's estimate (:mod:`krypton.estimator`) learns from this host's logged runs
(:mod:`krypton.runtime_log`). This module says which of those runs met a load like the
one now (their :func:`row_load_factor`), fits their seconds to a prediction (a fixed
cost and a pace, never negative), and turns their errors into a range that holds a new
run with the share aimed at: split-conformal order statistics where there are enough,
a log-normal prediction interval where there are not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from scipy.stats import t as student_t
from sklearn.linear_model import LinearRegression

from .host import load_factor
from .runtime_log import logged_runs

__all__ = [
    "COVERAGE",
    "FIXED_OFFSET_LIMIT",
    "CONFORMAL_RUNS",
    "MIN_CONFORMAL_RUNS",
    "MIN_SPREAD",
    "SIMILAR_LOAD",
    "ErrorBounds",
    "at_similar_load",
    "conformal_ratios",
    "fit_seconds",
    "fitted_to_runs",
    "offset_or_pace",
    "grows_with_positions",
    "ratio_bounds",
    "row_load_factor",
    "runs_at_like_load",
]

CONFORMAL_RUNS = 20  # this host's recent runs whose errors set the range
MIN_CONFORMAL_RUNS = 5  # fewer: the range is the fit's own (krypton.estimator)
COVERAGE = 0.8  # the share of runs the range is meant to hold


MIN_SPREAD = 1.15  # the narrowest range: ± 15 % (timing noise on an idle host)


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
        for row in logged_runs(model_name, mode, None, path, CONFORMAL_RUNS * 4, warm=True)
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


def grows_with_positions(fit: LinearRegression, features: np.ndarray) -> bool:
    """Whether ``fit`` (seconds = fixed + positions x cost, eq. thesis §7.1.3) has time
    that grows with the positions: its position term is at least MIN_POSITION_SHARE of
    its prediction for the largest logged run."""
    largest = features[int(np.argmax(features.sum(axis=1)))]
    position_seconds = float(np.dot(fit.coef_, largest))
    total = position_seconds + max(float(fit.intercept_), 0.0)
    return total > 0 and position_seconds >= MIN_POSITION_SHARE * total


def row_load_factor(row: dict) -> float:
    """A logged run's :func:`load_factor`: at the load it met, with the threads it ran
    (rows logged before either was recorded: idle, at this process's threads)."""
    return load_factor(row.get("load"), threads=row.get("threads"))


# The share of runs the range of a fit to runs at a like load is taken to hold: from a
# handful of runs its leave-one-out errors understate the next run's (on a fresh idle
# host, 20 runs of every mode: 10 of 14 ranges held at 80%, 13 of 14 at 90%, 1.6x wide).
LIKE_LOAD_COVERAGE = 0.9
# runs whose calibrated seconds span less than this cannot tell a fixed cost from a pace
LIKE_LOAD_SPAN = 1.5
# runs a fixed cost and a pace are fitted to (fewer: in proportion): a line through two
# runs, each left out in turn, made a range 18x wide from three
FIT_RUNS = 5


def fitted_to_runs(
    pairs: list[tuple[float, float]], seconds: float
) -> tuple[float, float, float, str]:
    """The calibration's ``seconds`` as this host's runs at this load took theirs
    (``pairs``: calibrated and actual seconds): actual = fixed + pace x calibrated,
    least squares (:func:`fit_seconds`), where FIT_RUNS of them span LIKE_LOAD_SPAN in
    calibrated seconds and the pace carries the time; else by a fixed amount or in
    proportion, whichever the runs' leave-one-out errors favour (:func:`offset_or_pace`).
    The range: the leave-one-out ratios' :func:`ratio_bounds` (at LIKE_LOAD_COVERAGE for
    the fit, at COVERAGE else), at least MIN_SPREAD either way. (point, low, high, what
    was done). A fixed offset alone, learnt on runs of 0.8-1.0 calibrated seconds, said
    3.8 s for a run of 3.1 that took 5.2."""
    predicted, actual = (np.array(side) for side in zip(*pairs))
    features = predicted[:, None]
    spans = len(pairs) >= FIT_RUNS and predicted.max() >= LIKE_LOAD_SPAN * predicted.min()
    fit = fit_seconds(features, actual) if spans else None
    fitted = fit is not None and grows_with_positions(fit, features)
    if fit is not None and fitted:

        def guess(keep: np.ndarray, at: float) -> float:
            return float(fit_seconds(features[keep], actual[keep]).predict([[at]])[0])

        point = float(fit.predict([[seconds]])[0])
        how = f"fitted as {max(float(fit.intercept_), 0.0):.1f} s + {float(fit.coef_[0]):.2f}x"
    else:
        guess, how = offset_or_pace(predicted, actual)
        point = guess(np.ones(len(actual), dtype=bool), seconds)
    held_out = [
        actual[n] / max(guess(np.arange(len(actual)) != n, float(predicted[n])), 1e-3)
        for n in range(len(actual))
    ]
    low, high = ratio_bounds(held_out, LIKE_LOAD_COVERAGE if fitted else COVERAGE)
    point = max(point, 1e-3)
    return point, point * min(low, 1 / MIN_SPREAD), point * max(high, MIN_SPREAD), how


# The most a run's own costs beyond explain() add at an idle host's pace (the prediction,
# the out-of-distribution check, decoding): tenths of a second to 1.5 s on 2 cores. Runs
# further off the calibration than this by a fixed amount are a pace, not a fixed cost
# (runs that took 44-47 s whatever their positions while a load came and went).
FIXED_OFFSET_LIMIT = 2.0


def offset_or_pace(
    predicted: np.ndarray, actual: np.ndarray
) -> tuple[Callable[[np.ndarray, float], float], str]:
    """How a few runs (``predicted``, ``actual`` seconds) differ from their calibration:
    by a fixed amount (the page's own costs: a fresh host's first page runs each took
    0.4-1.5 s more than explain() alone) where it is within FIXED_OFFSET_LIMIT and leaves
    their leave-one-out errors smaller (two runs at least), else in proportion (the
    host's pace). (the correction, from the runs kept and a calibrated time; what it is,
    in words)."""
    offsets, ratios = actual - predicted, actual / predicted

    def by_offset(keep: np.ndarray, at: float) -> float:
        return at + float(np.median(offsets[keep]))

    def by_pace(keep: np.ndarray, at: float) -> float:
        return at * float(np.median(ratios[keep]))

    def error(correct: Callable[[np.ndarray, float], float]) -> float:
        every = np.arange(len(actual))
        return float(np.median([
            abs(math.log(actual[n] / max(correct(every != n, float(predicted[n])), 1e-3)))
            for n in every
        ]))  # fmt: skip

    offset = float(np.median(offsets))
    if len(actual) >= 2 and abs(offset) <= FIXED_OFFSET_LIMIT and error(by_offset) < error(by_pace):
        return by_offset, f"{offset:+.1f} s"
    return by_pace, f"scaled by {float(np.median(ratios)):.2f}"
