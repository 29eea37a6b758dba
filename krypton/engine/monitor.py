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
        return self.until_probe <= 0 and (left is None or left >= MIN_INTERVAL)

    def ran(self, count: int) -> None:
        """A batch of ``count`` positions ran on the current strategy."""
        self.positions[self.strategy] += count
        self.ran_batches += 1
        self.until_probe -= 1

    def next_call(self) -> None:
        """Carried into a later call on the same model and shape (a run in chunks, or
        images one after another): probes keep their spacing across calls."""
        self.batches, self.ran_batches, self.switches = None, 0, []
        self.positions = {"incremental": 0, "naive": 0}

    def probe(self, current_seconds: float, other_seconds: float, done: int) -> None:
        """Both strategies timed on the same batch (seconds per position); ``done``:
        positions computed so far. Switches when the other is measurably faster."""
        self.probes += 1
        ratio = other_seconds / current_seconds if current_seconds > 0 else float("inf")
        pair = (current_seconds, other_seconds)
        self.last_pair = pair if self.strategy == "incremental" else pair[::-1]
        self.ratio = ratio
        if ratio * MEASURED_MARGIN > 1.0:  # the other is not measurably faster
            self.agreeing = 0
            self.until_probe = self.interval(ratio)
            return
        self.agreeing += 1
        if self.agreeing < 2 and ratio * WIDE_MARGIN > 1.0:
            self.until_probe = CONFIRM_AFTER  # look again before switching
            return
        new = other(self.strategy)
        evidence = "twice in a row" if self.agreeing >= 2 else "by a wide margin"
        self.switches.append(
            f"switched to {new} after {done} positions: {self.strategy} took "
            f"{1 / ratio:.2f}x {new}'s time on the same positions ({evidence}, under the "
            f"load at the time)"
        )
        self.strategy, self.agreeing = new, 0
        self.ratio = 1.0 / ratio
        self.until_probe = self.interval(self.ratio)

    def summary(self) -> str:
        """What ran: '; switched to naive after 96 positions: ...' (empty: no switch)."""
        if not self.switches:
            return ""
        counts = ", ".join(f"{n} {name}" for name, n in self.positions.items() if n)
        return "; ".join(self.switches) + f" (positions computed: {counts})"
