"""Keeps an exact run on the faster of its two strategies while it runs.

Incremental and naive inference compute the same numbers; which is faster depends on the
network, the patch, the batch and the load on the host, and the load can change during a
run. The run starts on the planned strategy. Every so often it also times the other one
on the batch it has just computed (the same positions: a fair comparison under whatever
load there is now), keeps the current strategy's values, and switches when the other is
measurably faster: twice in a row by MEASURED_MARGIN, or once by a wide margin. Probes are
spaced so that, on a strategy k times slower, they cost about PROBE_BUDGET of the run's
time (a probe costs k batches of the current strategy: ``ceil(k / PROBE_BUDGET)``
batches apart, within [MIN_INTERVAL, MAX_INTERVAL]). A verdict from an earlier call is
checked after EARLY_PROBE batches in runs of at least EARLY_PROBE_MIN_BATCHES.

The load can change between probes: a neighbour starts burning the cores, and a
strategy of many small operations (DenseNet's incremental plan) slows far more than one of
few large ones. So the monitor also watches the pace of the strategy it runs: when
PACE_BATCHES full batches in a row take over PACE_CHANGE times (or under 1/PACE_CHANGE of)
the time per position it was last timed at, it probes at once, even in a short call (the
verdict is carried into later calls, where a switch pays). Such pace probes back off: each
one that keeps the strategy doubles the batches before the next may run, so a load that
flickers costs a bounded number of probes; a change of PACE_CHANGE squared (2.25x) is
probed whatever the back-off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .plan import MEASURED_MARGIN

__all__ = ["StrategyMonitor", "PROBE_BUDGET", "WIDE_MARGIN"]

PROBE_BUDGET = 0.05  # share of a run's time its probes may cost
MIN_INTERVAL, MAX_INTERVAL = 8, 128  # batches between probes
WIDE_MARGIN = 1.25  # one probe this decisive is enough to switch
CONFIRM_AFTER = 1  # batches until a probe that favoured the other strategy is repeated
EARLY_PROBE = 2  # batches until the first probe of a plan measured by an earlier call
# ... in a run of at least this many batches: a probe of a strategy k times slower costs k
# batches, so a shorter run would spend more than PROBE_BUDGET on it
EARLY_PROBE_MIN_BATCHES = round(2 / PROBE_BUDGET)
PACE_CHANGE = 1.5  # a batch this much slower (or faster) per position than last timed ...
PACE_BATCHES = 2  # ... this many full batches in a row: the load changed, probe now
CONFIRMED = 10**9  # batches until the next scheduled probe of a verdict a probe confirmed


def other(strategy: str) -> str:
    return "naive" if strategy == "incremental" else "incremental"


@dataclass
class StrategyMonitor:
    """The strategy each batch runs on, and the probes that may change it.

    ``strategy``: "incremental" or "naive". ``ratio``: the other strategy's time per
    position over this one's, as last measured (None: not measured in this call).
    """

    strategy: str
    ratio: float | None = None
    batches: int | None = None  # how many batches the run has (None: unknown)
    until_probe: int = EARLY_PROBE
    agreeing: int = 0  # consecutive probes in which the other strategy was faster
    switches: list[str] = field(default_factory=list)
    last_pair: tuple[float, float] | None = None  # (incremental, naive) s/position
    probes: int = 0
    ran_batches: int = 0
    positions: dict[str, int] = field(default_factory=lambda: {"incremental": 0, "naive": 0})
    pace: float | None = None  # seconds per position of ``strategy`` when last timed
    off_pace: int = 0  # full batches in a row off that pace
    pace_changed: bool = False  # the next probe is due to a change of pace
    pace_spacing: int = PACE_BATCHES  # batches since the last probe before a pace probe
    since_probe: int = 0
    largest_batch: int = 0
    held_until: int = 0  # the scheduled probe's countdown a pace probe brought forward
    latest_pace: float | None = None  # seconds per position of the last full batch

    def __post_init__(self) -> None:
        if self.ratio is not None:
            self.until_probe = self.interval(self.ratio)
        elif self.batches is not None and self.batches < EARLY_PROBE_MIN_BATCHES:
            self.until_probe = self.interval(1.0)  # too short to check early

    @staticmethod
    def interval(ratio: float) -> int:
        """Batches between probes when the other strategy is ``ratio`` times slower."""
        return max(MIN_INTERVAL, min(MAX_INTERVAL, math.ceil(max(ratio, 1.0) / PROBE_BUDGET)))

    def probe_due(self) -> bool:
        """A probe now; never in a run's last MIN_INTERVAL batches, where a switch could
        not pay for itself (runs of unknown length: whenever one is due)."""
        left = None if self.batches is None else self.batches - self.ran_batches
        return self.until_probe <= 0 and (self.pace_changed or left is None or left >= MIN_INTERVAL)

    def ran(self, count: int, seconds: float | None = None) -> None:
        """A batch of ``count`` positions ran on the current strategy (in ``seconds``,
        when timed: its pace is watched)."""
        self.positions[self.strategy] += count
        self.ran_batches += 1
        self.until_probe -= 1
        self.since_probe += 1
        if seconds is not None:
            self._watch_pace(count, seconds)

    def _watch_pace(self, count: int, seconds: float) -> None:
        """Bring the next probe forward when the current strategy's pace has moved."""
        self.largest_batch = max(self.largest_batch, count)
        if 2 * count < self.largest_batch:  # a short last batch runs at another pace
            return
        now = seconds / count
        self.latest_pace = now
        if self.pace is None:
            self.pace = now
            return
        moved = now > self.pace * PACE_CHANGE or now * PACE_CHANGE < self.pace
        self.off_pace = self.off_pace + 1 if moved else 0
        # a change of PACE_CHANGE squared is no flicker: it ignores the back-off
        large = now > self.pace * PACE_CHANGE**2 or now * PACE_CHANGE**2 < self.pace
        if self.off_pace >= PACE_BATCHES and (large or self.since_probe >= self.pace_spacing):
            self.held_until = max(self.until_probe, 0)
            self.until_probe, self.pace_changed, self.off_pace = 0, True, 0

    def pace_held(self) -> None:
        """The pace moved but the host's load stayed in its band (the caller checked):
        noise, a stall or a neighbour's flicker, not a change of load. No probe: the new
        pace is taken as the one to watch, the scheduled countdown resumes, and the next
        pace probe waits twice as long, as after a probe that found nothing. Beside two
        burners, shufflenet_v2_x0_5's exact run on a naive plan probed incremental
        inference on such noise and read 0.87x naive."""
        self.pace_changed = False
        self.until_probe = self.held_until
        self.pace = self.latest_pace if self.latest_pace is not None else self.pace
        self.since_probe = 0
        self.pace_spacing = min(2 * self.pace_spacing, MAX_INTERVAL)

    def next_call(self) -> None:
        """Carried into a later call on the same model and shape (a run in chunks, or
        images one after another): probes keep their spacing across calls until one has
        confirmed the verdict; after that only a change of pace probes (the load moved).
        Probing on schedule in every call cost an exact run whose plan is naive up to
        PROBE_BUDGET of each call, for the same verdict each time."""
        if self.probes and not self.pace_changed:
            self.until_probe = CONFIRMED
        self.batches, self.ran_batches, self.switches = None, 0, []
        self.positions = {"incremental": 0, "naive": 0}
        self.off_pace = 0

    def probe(self, current_seconds: float, other_seconds: float, done: int) -> None:
        """Both strategies timed on the same batch (seconds per position); ``done``:
        positions computed so far. Switches when the other is measurably faster."""
        self.probes += 1
        self.since_probe, self.off_pace = 0, 0
        ratio = other_seconds / current_seconds if current_seconds > 0 else float("inf")
        pair = (current_seconds, other_seconds)
        self.last_pair = pair if self.strategy == "incremental" else pair[::-1]
        self.ratio, self.pace = ratio, current_seconds
        if ratio * MEASURED_MARGIN > 1.0:  # the other is not measurably faster
            if self.pace_changed:  # a pace probe that found nothing: back off
                self.pace_spacing = min(2 * self.pace_spacing, MAX_INTERVAL)
            self.agreeing, self.pace_changed = 0, False
            self.until_probe = self.interval(ratio)
            return
        self.agreeing += 1
        if self.agreeing < 2 and ratio * WIDE_MARGIN > 1.0:
            self.until_probe = CONFIRM_AFTER  # look again before switching
            return
        new = other(self.strategy)
        evidence = "twice in a row" if self.agreeing >= 2 else "by a wide margin"
        if self.pace_changed:
            evidence += ", probed when its pace changed"
        self.switches.append(
            f"switched to {new} after {done} positions: {self.strategy} took "
            f"{1 / ratio:.2f}x {new}'s time on the same positions ({evidence}, under the "
            f"load at the time)"
        )
        self.strategy, self.agreeing = new, 0
        self.ratio, self.pace = 1.0 / ratio, other_seconds
        self.pace_changed, self.pace_spacing = False, PACE_BATCHES
        self.until_probe = self.interval(self.ratio)

    def summary(self) -> str:
        """What ran: '; switched to naive after 96 positions: ...' (empty: no switch)."""
        if not self.switches:
            return ""
        counts = ", ".join(f"{n} {name}" for name, n in self.positions.items() if n)
        return "; ".join(self.switches) + f" (positions computed: {counts})"
