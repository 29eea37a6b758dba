"""How long a run should take, how fast it was, and what the page says of both: the
estimate shown before Run (and kept with the run), the runtime log a finished run adds
to, and the speed line (only what the run timed side by side)."""

from __future__ import annotations

import dataclasses
import os
import re
import threading

from krypton.estimator import (
    ABSOLUTE_SLACK,
    MIN_SPREAD,
    Estimate,
    NotCalibratedError,
    estimate,
    estimate_for_counts,
    for_a_first_run,
    format_duration,
    forward_seconds,
    host_load,
    load_factor,
    recent_estimate,
    record_run,
    with_host_range,
)
from krypton.host import recent_loads, share_host
from krypton.load_range import widened_for_load
from krypton.registry import RegistryError
from krypton.speed_line import bounded_speed, speed_claim, stated_speed

from ..settings import BROKER_ENV

__all__ = [
    "CACHED_MODE",
    "host_load",
    "share_host",
    "cached_estimate",
    "find_estimate",
    "counts_estimate",
    "estimate_text",
    "format_seconds",
    "speed_text",
    "plan_text",
    "finished_run",
    "measured_speed",
]

CACHED_MODE = "cached"  # the runtime log's rows of runs that computed nothing


def cached_estimate(model: str, load: float | None) -> Estimate | None:
    """How long a run with every cell known takes here: prediction, the OOD verdict and
    the picture, from this host's last such runs of the model (none before the first)."""
    found = recent_estimate(
        model, CACHED_MODE, 0, load, ("run with every cell known", "runs with every cell known")
    )
    if found is not None:  # its range from their errors once five are logged, as any run's
        return with_host_range(found, model, CACHED_MODE, load=load, loads=recent_loads())
    forward = forward_seconds(model)
    if forward is None:
        return None
    # none logged yet: its two forward passes (the prediction and the OOD check) at the
    # calibration's naive pace, at this load, reaching for a load the calibration never met
    seconds = 2 * forward * load_factor(load)
    first = Estimate(
        seconds, 0.0, seconds * MIN_SPREAD + ABSOLUTE_SLACK, "calibration: two forward passes"
    )
    return widened_for_load(first, load, [], False, recent_loads())


def counts_estimate(
    model: str, mode: str, patch: int, positions: int, cached: int, load: float
) -> Estimate | None:
    """The estimate of an exact or naive run of ``positions``, ``cached`` of them known:
    the rest at this host's pace for the model, mode and patch, or, where none is left,
    a run that computes nothing (:func:`cached_estimate`); None where there is none yet."""
    if cached >= positions:
        return cached_estimate(model, load)
    try:
        found = estimate_for_counts(
            model, mode, patch, (positions - cached, 0), load=load, stated=mode == "naive",
            loads=recent_loads(),
        )  # fmt: skip
    except (NotCalibratedError, ValueError, RegistryError):
        return None
    return _as_first_run(found, model, mode)


def find_estimate(
    model: str,
    patch: int,
    stride: int,
    mode: str,
    region,
    r_drill_down: float,
    target_speedup: float,
    cached: int = 0,
    load: float | None = None,
    positions: int | None = None,
) -> Estimate | None:
    """The run-time estimate the image panel shows, or None where there is none (not
    calibrated, settings explain() would refuse, an unknown model). ``cached``: positions
    of the grid already computed (exact and naive reuse them): the estimate is for the
    rest, so a run with every cell cached is estimated at its fixed cost. ``positions``:
    the grid's (where all are ``cached``, the estimate is of a run that computes nothing:
    :func:`cached_estimate`)."""
    if positions is not None and cached >= positions and mode in ("exact", "naive"):
        return cached_estimate(model, host_load() if load is None else load)  # nothing to do
    try:
        found = estimate(
            model,
            patch=patch,
            stride=stride,
            mode=mode,
            region=region,
            r_drill_down=r_drill_down,
            target_speedup=target_speedup,
            cached=cached,
            load=host_load() if load is None else load,
            stated=mode == "naive",  # one naive figure: what exact runs' speed lines said
            loads=recent_loads(),  # how far the host's load moves: the range reaches for it
        )
    except (NotCalibratedError, ValueError, RegistryError):
        return None
    return _as_first_run(found, model, mode)


def as_record(found: Estimate | None) -> dict | None:
    """An estimate as a result record keeps it (and the page's store carries it)."""
    return None if found is None else dataclasses.asdict(found)


def estimate_text(found: dict | None) -> str:
    """'4.0 s (3.1–5.6 s)': the estimate and its range, in one unit (the range's)."""
    if not found:
        return "unknown"
    low, seconds, high = (max(0.0, float(found[k])) for k in ("low", "seconds", "high"))
    if high < 90:
        return f"{seconds:.1f} s ({low:.1f}–{high:.1f} s)"
    if high < 5400:
        return f"{seconds / 60:.1f} min ({low / 60:.1f}–{high / 60:.1f} min)"
    return f"{seconds / 3600:.1f} h ({low / 3600:.1f}–{high / 3600:.1f} h)"


def format_seconds(seconds: float | None) -> str:
    return "unknown" if seconds is None else format_duration(seconds)


def speed_text(speed: dict | None, mode: str) -> str:
    """The speed claim of an exact run: only what this run timed side by side."""
    if mode != "exact":
        return ""
    if not speed:
        return (
            "No speed comparison: this run did not time naive inference beside it "
            "(too few positions to compute, or the plan ruled incremental out)."
        )
    return speed_claim(speed)


_PLAN_TIMING = re.compile(r"; measured (?:in this (?:run|call)|at [\d:]+) [^;]*?per position\)")


def plan_text(plan: str, speed: dict | None) -> str:
    """A run's plan line: its strategy and why; where the run has a speed line, without
    the timing of the chunk that planned it (an early, colder one), so that the summary
    states one measurement, the speed line's latest."""
    return _PLAN_TIMING.sub("", plan) if speed else plan


def finished_run(
    request, heatmap, counts: tuple[int, int], planned: dict | None, load: float
) -> dict | None:
    """A finished run's speed line and its row in the runtime log. ``heatmap``: the run
    as the library's (its seconds the whole run's, as the user waited); ``counts``: its
    positions as planned (stage one, stage two). The speed is the one the CLI and the
    benches state (krypton.speed_line.stated_speed: the whole run against a naive one),
    its naive figure from this host's logged naive runs alone (:func:`measured_speed`:
    never from a calibration from another day); the log row keeps the estimate shown and
    the load met, which the next estimates learn from, the naive run the speed line
    states, which the naive figure shown before the next run learns from (one naive
    figure for a run: the page said 7.3 min before a run and 4.8 min in its speed line),
    the time its batches took, a naive run's pace for later speed lines, and an exact
    run's naive probe, whose median over a few runs later lines take where no naive run
    was timed (krypton.estimator.probed_naive_pace)."""
    speed = stated_speed(heatmap, request.model, load, calibrated=False, paced=True)
    estimated = (planned or {}).get("seconds")
    seconds = heatmap.seconds
    whole = (speed or {}).get("whole") or {}
    said = (int(whole["positions"]), float(whole["naive_seconds"])) if whole else None
    schedules = heatmap.extra.get("schedule_decisions") or {}
    # the torch threads the run computed with: the process's count says nothing of a run
    # that set only its own thread's (krypton.torch_threads), and logged as the runs'
    # threads it put every run beside two burners 1.5x off its own load factor
    threads = ((heatmap.extra.get("host") or {}).get("threads")) or None
    kind = request.mode if heatmap.positions_evaluated else CACHED_MODE
    cold = _first_run(request.model, kind) or any(
        record.get("measured") == "in this run" for record in schedules.values()
    )
    if heatmap.positions_evaluated:
        computed = (heatmap.positions_evaluated, heatmap.extra.get("computing_seconds", 0.0))
        record_run(request.model, request.mode, request.patch, counts, seconds,
                   estimated=estimated, load=load, stated_naive=said, computed=computed,
                   naive_probe_ms=whole.get("naive_ms"), schedules=schedules,
                   cold=cold, threads=threads)  # fmt: skip
    else:  # every cell was known: a run of its own kind (cached_estimate)
        record_run(request.model, CACHED_MODE, 0, (0, 0), seconds, estimated=estimated,
                   load=load, cold=cold, threads=threads)  # fmt: skip
    return speed


_RAN: set[tuple[str, str]] = set()  # the (model, mode) this process has finished runs of
_RAN_LOCK = threading.Lock()


def _first_run(model: str, mode: str) -> bool:
    """Whether this is the process's first finished run of ``model`` in ``mode``, and
    mark it run: the one that loaded the model, captured its graph and measured its batch
    schedule (krypton.runtime_log.record_run's ``cold``)."""
    with _RAN_LOCK:
        first = (model, mode) not in _RAN
        _RAN.add((model, mode))
    return first


def _as_first_run(found: Estimate | None, model: str, mode: str) -> Estimate | None:
    """``found``, reaching for a first run's one-off costs where this process has not
    finished a run of ``model`` in ``mode`` and runs here (a team's workers run
    elsewhere: whether theirs is a first run is not known here)."""
    if found is None or os.environ.get(BROKER_ENV):
        return found
    with _RAN_LOCK:
        ran = (model, mode) in _RAN
    return found if ran else for_a_first_run(found, model)


def measured_speed(speed: dict | None, model: str, patch: int, load: float) -> dict | None:
    """A run's speed against naive (krypton.speed_line.heatmap_speed), its naive pace
    from this host's own naive runs of the model and patch at a like load where there
    are three, else lowered where its naive runs at other loads say less
    (krypton.speed_line.bounded_speed on logged runs alone: the page's figure never
    rests on a calibration from another day)."""
    return bounded_speed(speed, model, patch, load, calibrated=False, paced=True)
