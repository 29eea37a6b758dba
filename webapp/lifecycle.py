"""A run's life, decided without a browser: :class:`RunLifecycle` goes idle → queued →
running → done | cancelled | failed, with the transitions allowed in one table, the
progress of a running run and its time left, measured from the run's own pace since its
first report. What a run explains and when its result may be shown is the run
package's (webapp.runs.provenance)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from krypton.estimator import format_duration  # one wording for durations

__all__ = [
    "Phase",
    "IllegalTransition",
    "RunLifecycle",
    "format_duration",
]


class Phase(str, Enum):
    IDLE = "idle"
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


# Every allowed step; anything else is a bug in the caller.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.QUEUED, Phase.CANCELLED, Phase.FAILED}),
    Phase.QUEUED: frozenset({Phase.RUNNING, Phase.CANCELLED, Phase.FAILED}),
    Phase.RUNNING: frozenset({Phase.DONE, Phase.CANCELLED, Phase.FAILED}),
    Phase.DONE: frozenset(),
    Phase.CANCELLED: frozenset(),
    Phase.FAILED: frozenset(),
}
FINAL = frozenset({Phase.DONE, Phase.CANCELLED, Phase.FAILED})


class IllegalTransition(RuntimeError):
    """A run was asked to move to a phase it cannot reach from its current one."""


@dataclass
class RunLifecycle:
    """One run of the page: its phase and, while it runs, its progress
    and time left: the positions left at the run's own pace, the positions it advanced
    since its first report over the time since. The first report is where the pace
    starts: cells known from earlier runs come in it at once, and counting them as
    computed made the first figure promise seconds for a run of minutes (3.1 s left,
    93 s to go)."""

    phase: Phase = Phase.IDLE
    history: list[tuple[Phase, float]] = field(default_factory=list)
    reason: str = ""  # why it was cancelled or failed
    done: int = 0
    total: int = 0
    _first: tuple[int, float] | None = field(default=None, repr=False)  # (done, when)
    _latest: float = field(default=0.0, repr=False)

    def advance(self, phase: Phase, reason: str = "") -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"a run cannot go from {self.phase.value} to {phase.value}")
        self.phase, self.reason = phase, reason
        self.history.append((phase, time.monotonic()))

    def queue(self) -> None:
        self.advance(Phase.QUEUED)

    def start(self) -> None:
        self.advance(Phase.RUNNING)
        self._first = None

    def finish(self) -> None:
        self.advance(Phase.DONE)

    def cancel(self, reason: str = "") -> None:
        self.advance(Phase.CANCELLED, reason)

    def fail(self, reason: str) -> None:
        self.advance(Phase.FAILED, reason)

    @property
    def final(self) -> bool:
        return self.phase in FINAL

    def progress(self, done: int, total: int) -> None:
        """``done`` of ``total`` positions are computed (``total`` may be revised)."""
        if self.phase is not Phase.RUNNING:
            raise IllegalTransition(f"progress reported while {self.phase.value}")
        now = time.monotonic()
        if self._first is None:
            self._first = (done, now)
        self._latest = now
        self.done, self.total = done, total

    def seconds_left(self) -> float | None:
        """Time to the end at the run's own pace; None until it has advanced since its
        first report."""
        if self._first is None or self.done <= 0 or self.final:
            return None
        if self.done >= self.total:
            return 0.0
        advanced = self.done - self._first[0]
        elapsed = self._latest - self._first[1]
        if advanced <= 0 or elapsed <= 0:
            return None
        return (self.total - self.done) * elapsed / advanced

    def status(self) -> str:
        """'120 of 400 positions · about 35 s left'."""
        text = f"{self.done} of {self.total} positions"
        left = self.seconds_left()
        if left is not None and self.done < self.total:
            text += f" · about {format_duration(left)} left"
        return text
