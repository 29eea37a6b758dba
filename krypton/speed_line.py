"""The speed line of an exact run: the whole run against a naive run of its positions,
as the page, the CLI, the exports and the benches state it (thesis §7.1.3's estimator
supplies the naive pace where this run's own probe may overstate it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .estimator import (
    NotCalibratedError,
    calibrated_speedup,
    estimate_for_counts,
    format_duration,
    naive_pace,
    probed_naive_pace,
)

__all__ = [
    "SAME_SPEED",
    "RunComparison",
    "bounded_speed",
    "compare_with_naive",
    "heatmap_speed",
    "speed_claim",
    "stated_speed",
    "whole_run_speed",
]


@dataclass(frozen=True)
class RunComparison:
    """A finished run against a naive run of the same positions, both from what this run
    measured: the speed claim the page, the CLI and the exports state."""

    seconds: float  # the whole run, every fixed cost included
    naive_seconds: float  # a naive run of the same positions, estimated
    positions: int
    incremental_ms: float  # per position, timed side by side in this run
    naive_ms: float

    @property
    def ratio(self) -> float:
        """Naive's whole-run time over this run's (above 1: this run was faster)."""
        return self.naive_seconds / self.seconds if self.seconds > 0 else float("inf")


def compare_with_naive(
    seconds: float, positions: int, timing: dict, incremental_only: float = 0.0
) -> RunComparison | None:
    """This run (``seconds`` from start to end) against a naive run of its ``positions``:
    the costs both pay (loading, preprocessing, the out-of-distribution check, per-call
    overheads: what is left of ``seconds`` after the batches of positions and the
    ``incremental_only`` seconds — views, timing the other strategy) plus the positions
    at the naive rate this run measured (``timing``: its ms per position both ways, as
    ``heatmap.extra["plan_timing"]``). The batches' time is the run's own sum
    (``computing_seconds``) where the timing has it, else the positions at the rate that
    ran: one batch's rate, which beside two burners read 38 ms/position in a run whose
    batches averaged 50 and made its naive figure 5 s long. None without a timing."""
    if not timing or positions <= 0:
        return None
    incremental_ms = float(timing["incremental_ms_per_position"])
    naive_ms = float(timing["naive_ms_per_position"])
    ran_ms = naive_ms if timing.get("strategy") == "naive" else incremental_ms
    computing = timing.get("computing_seconds")
    if computing is None:
        computing = positions * ran_ms / 1e3
    common = max(seconds - incremental_only - computing, 0.0)
    return RunComparison(
        seconds, common + positions * naive_ms / 1e3, positions, incremental_ms, naive_ms
    )


SAME_SPEED = 1.1  # within this factor either way, a run says neither faster nor slower

# the bases of a naive figure taken from this host's logged naive runs (bounded_speed):
# runs that met a load like this one's, or runs at any load scaled to it; and from the
# naive probes of this host's exact runs at a like load, where it has timed no naive runs
LOGGED_BASIS = "this host's naive runs at this load"
SCALED_BASIS = "this host's naive runs, scaled to this load"
PROBES_BASIS = "this host's naive probes at this load"


def whole_run_speed(
    timing: dict | None, seconds: float, positions: int, incremental_only: float | None = None
) -> dict | None:
    """What a run timed side by side (``timing``: ``heatmap.extra["plan_timing"]``) with
    the whole run against a naive one (``whole``: :func:`compare_with_naive`), for
    :func:`speed_claim`; None where the run timed nothing. ``incremental_only``: default
    the timing's own ``incremental_only_seconds``. The page's image and volume runs and
    :func:`heatmap_speed` all state it this way."""
    if not timing:
        return None
    if incremental_only is None:
        incremental_only = timing.get("incremental_only_seconds", 0.0)
    compared = compare_with_naive(seconds, positions, timing, incremental_only)
    return dict(timing) if compared is None else dict(timing, whole=asdict(compared))


def heatmap_speed(heatmap) -> dict | None:
    """:func:`whole_run_speed` of one exact ``heatmap``'s call."""
    timing = heatmap.extra.get("plan_timing")
    if timing and "computing_seconds" in heatmap.extra:
        timing = dict(timing, computing_seconds=heatmap.extra["computing_seconds"])
    return whole_run_speed(
        timing,
        heatmap.seconds,
        heatmap.positions_evaluated,
        heatmap.extra.get("incremental_only_seconds", 0.0),
    )


def bounded_speed(
    speed: dict | None,
    model_name: str | None,
    patch,
    load: float | None = None,
    calibrated: bool = True,
    paced: bool = False,
) -> dict | None:
    """``speed`` (:func:`heatmap_speed`) with its whole-run naive figure from what has
    timed whole naive runs where there is such a thing (``paced``: a run of the surface
    whose naive runs the log holds, the page's). The run's own figure comes from
    one early naive probe of a few positions, which a busy neighbour catches at a fast or
    a slow moment: 533 ms/position probed where a naive run right after took 350, and
    beside two burners 121 probed where the naive run took 148 (the line said 2.1x, the
    stopwatch 2.5x). So where three or more of this host's logged naive runs of the
    model and patch met a load like ``load`` (cores other work keeps busy), the figure
    is this run's costs around its batches and the positions at the pace of those runs'
    batches (:func:`krypton.estimator.naive_pace`), above or below the probe's: they
    timed whole naive runs. (Their own costs around the batches are not this run's: the
    page decodes and checks a volume the CLI's explain() was handed ready, and the CLI's
    line said 8.0x where its stopwatch gave 7.2x when it took the page's whole runs. Nor
    is their pace: the page's naive volume batches took 98 ms/position beside two
    burners, explain()'s in the CLI 84, and the line said 8.3x for 7.2x; so only
    ``paced`` runs take it.) Where it has timed none there but three or more exact runs
    of the model and patch at a like load, this one among them, the positions take the
    median of those runs' naive probes the same way
    (:func:`krypton.estimator.probed_naive_pace`): beside two burners three runs' probes
    of the chest-CT model read 52, 93 and 102 ms/position where naive runs took 97.
    With neither at a like load, this host's naive runs at any load, scaled to this one,
    only lower the probe's figure; without them the probe stands, no higher than the
    model's calibration says (with ``calibrated``): beside two burners the CLI's volume
    line once said 11.3x where the stopwatch gave 8.4x. The speed dict keeps the probed
    figure and says which basis was used (``naive_basis``).

    A calibration that no run on this host has adjusted was timed on another machine:
    it bounds the speed-up it measured for these positions (:func:`calibrated_speedup`),
    not its seconds. On a host slower than the calibration's its seconds cut a naive
    figure to what that machine would take: a fresh 2-core host's CLI said 3.3x beside
    two burners where the stopwatch gave 5.5x."""
    if not speed or not speed.get("whole") or model_name is None:
        return speed
    whole = dict(speed["whole"])
    side = int(patch[0] if isinstance(patch, (tuple, list)) else patch)
    probed = dict(speed, naive_basis="probed in this run")
    counts = (int(whole["positions"]), 0)
    if paced and load is not None:
        found = _paced(whole, model_name, side, load)
        if found is not None:
            return dict(speed, whole=found[0], naive_basis=found[1])
    try:
        other = estimate_for_counts(model_name, "naive", side, counts, load=load)
        logged = other.source.startswith("this host's")
        figure, basis = other.seconds, SCALED_BASIS
        # the point estimate's own words (after ";" the range may cite this host's runs
        # of another patch, which leave this patch's calibration unadjusted)
        point = other.source.split(";")[0]
        if not logged and "this host's" not in point:  # another machine's timing
            figure = whole["seconds"] * calibrated_speedup(model_name, side, counts)
            basis = f"the speed-up of the model's {point}"
        elif not logged:
            basis = other.source
    except (NotCalibratedError, ValueError):  # RegistryError is a ValueError
        return probed
    if not (logged or calibrated) or figure >= whole["naive_seconds"]:  # a bound only
        return probed
    whole["probed_naive_seconds"] = whole["naive_seconds"]
    whole["naive_seconds"] = figure
    return dict(speed, whole=whole, naive_basis=basis)


def _paced(whole: dict, model_name: str, side: int, load: float) -> tuple[dict, str] | None:
    """``whole`` (a run's :func:`compare_with_naive` as a dict) with its positions at the
    naive pace of this host's logged naive runs at a like load
    (:func:`krypton.estimator.naive_pace`), else at the median of its exact runs' naive
    probes there, this run's among them (:func:`krypton.estimator.probed_naive_pace`),
    above or below this run's own probe; its costs around the batches stay its own. With
    the basis taken; None where the log has neither."""
    probe_ms = float(whole["naive_ms"])
    pace, basis, probes = naive_pace(model_name, side, load), LOGGED_BASIS, None
    if pace is None:
        found = probed_naive_pace(model_name, side, load, probe_ms)
        if found is None:
            return None
        (pace, probes), basis = found, PROBES_BASIS
    positions = int(whole["positions"])
    common = max(whole["naive_seconds"] - positions * probe_ms / 1e3, 0.0)
    paced = dict(whole, probed_naive_seconds=whole["naive_seconds"])
    paced.update(naive_seconds=common + positions * pace, naive_pace_ms=pace * 1e3)
    if probes is not None:
        paced["naive_probes"] = probes
    return paced, basis


def stated_speed(
    heatmap,
    model_name: str | None,
    load: float | None = None,
    calibrated: bool = True,
    paced: bool = False,
) -> dict | None:
    """The speed a run states (the page, the CLI and the benches alike): its whole run
    against a naive one (:func:`heatmap_speed`: ``heatmap.seconds`` is what the user
    waited), its naive figure as :func:`bounded_speed` takes it at ``load``: from this
    host's logged naive runs (``paced``: the page's own runs), or no higher than they
    (with ``calibrated``, or the calibration) say."""
    return bounded_speed(heatmap_speed(heatmap), model_name, heatmap.patch, load, calibrated, paced)


def speed_claim(speed: dict) -> str:
    """The speed line of an exact run (the page, the CLI, the exports and team mode all
    say this): the whole run against a naive run of its positions where ``speed`` has it
    (``whole``: :func:`compare_with_naive` as a dict), per position otherwise, saying which.
    ``speed``: ``heatmap.extra["plan_timing"]``, what this run timed side by side."""
    incremental = speed["incremental_ms_per_position"]
    naive = speed["naive_ms_per_position"]
    per_ratio = naive / incremental if incremental > 0 else float("inf")
    per_position = (
        f"measured in this run on the same positions: {incremental:.1f} ms/position "
        f"incremental vs {naive:.1f} ms naive"
    )
    if speed.get("switched"):
        # the run changed strategy when the other measured faster: the latest timing
        return (
            f"Switched to {speed.get('strategy')} during the run, when it measured faster: "
            f"incremental at {per_ratio:.2f}× naive's speed per position, {per_position}."
        )
    if speed.get("strategy") == "naive":
        return (
            f"Ran naive: incremental was {per_ratio:.2f}× naive's speed per position, "
            f"{per_position}."
        )
    whole = speed.get("whole")
    if not whole:
        return _claim(per_ratio, f"per position, {per_position}")
    ratio = whole["naive_seconds"] / whole["seconds"] if whole["seconds"] > 0 else 1.0
    return _claim(
        ratio,
        f"the whole run: {format_duration(whole['seconds'])} here, about "
        f"{format_duration(whole['naive_seconds'])} for a naive run of its "
        f"{whole['positions']} positions{_naive_source(speed)}, every fixed cost counted "
        f"({per_position})",
    )


def _naive_source(speed: dict) -> str:
    """Where a naive figure not this run's probe came from, in the speed line's words:
    the per-position figures after it are the probe's, and may not add up to it."""
    basis = speed.get("naive_basis")
    if basis == LOGGED_BASIS:
        pace = speed["whole"].get("naive_pace_ms")
        at = f": {pace:.1f} ms/position" if pace else ""
        return f" (going by naive runs on this machine at a like load{at})"
    if basis == PROBES_BASIS:
        whole = speed["whole"]
        earlier = int(whole.get("naive_probes", 1)) - 1
        return (
            f" (going by the naive timings of this and {earlier} earlier runs on this "
            f"machine at a like load: {whole['naive_pace_ms']:.1f} ms/position)"
        )
    if basis == SCALED_BASIS:
        return " (going by naive runs on this machine)"
    return ""


def _claim(ratio: float, basis: str) -> str:
    if ratio >= SAME_SPEED:
        return f"{ratio:.1f}× faster than naive, {basis}."
    if ratio <= 1 / SAME_SPEED:
        return f"{1 / ratio:.1f}× slower than naive, {basis}."
    return f"About as fast as naive (within 10%), {basis}."
