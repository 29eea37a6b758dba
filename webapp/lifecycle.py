"""A run's life and what it may show, decided without a browser.

* :class:`Provenance`: what a run explains (image content, model and weights, region,
  patch, stride, mode, occluder colour, class). Every result carries the provenance of
  its request; the page shows a result, its summary and its downloads only while what is
  on screen has the same provenance (:func:`result_view`).
* :class:`RunLifecycle`: idle → queued → running → done | cancelled | failed, with the
  transitions allowed in one table, the progress of a running run and its time left,
  measured from the run's own pace since its first report.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from enum import Enum

from krypton.estimator import format_duration  # one wording for durations

__all__ = [
    "Provenance",
    "ResultView",
    "result_view",
    "Phase",
    "IllegalTransition",
    "RunLifecycle",
    "format_duration",
]

_NAMES = {
    "image": "the image",
    "model": "the model",
    "weights": "the model's weights",
    "region": "the region",
    "patch": "the patch size",
    "stride": "the stride",
    "mode": "the mode",
    "colour": "the occluder colour",
    "label": "the class",
    "approximate": "the approximate-mode settings",
}


@dataclass(frozen=True)
class Provenance:
    """What a heatmap explains; two are equal exactly when they explain the same thing."""

    image: str  # the image's (or volume's) content key
    model: str
    weights: str  # the weights checksum of the model that ran
    # as requested (None: the whole input): (x0, y0, x1, y1), a volume's (z0, y0, x0, z1, y1, x1)
    region: tuple[int, ...] | None
    patch: int
    stride: int
    mode: str
    colour: tuple[float, ...]  # the occluder's; () where the model's own fill is used
    label: int | None  # None: the top class, before the run decides it
    # approximate mode's quality target, drill-down fraction and speedup target (None in
    # the other modes, which do not read them)
    approximate: tuple[float | None, ...] | None = None

    @classmethod
    def make(cls, **fields) -> Provenance:
        """Normalised: a region as a tuple of ints, numbers rounded to 6 places, the
        approximate settings only in approximate mode."""
        region = fields.get("region")
        fields["region"] = None if not region else tuple(int(v) for v in region)
        fields["colour"] = tuple(round(float(c), 6) for c in fields.get("colour") or ())
        fields["patch"], fields["stride"] = int(fields["patch"]), int(fields["stride"])
        label = fields.get("label")
        fields["label"] = None if label is None else int(label)
        approximate = fields.get("approximate")
        fields["approximate"] = (
            tuple(None if v is None else round(float(v), 6) for v in approximate)
            if fields["mode"] == "approximate" and approximate is not None
            else None
        )
        return cls(**fields)

    @classmethod
    def from_dict(cls, data: dict) -> Provenance:
        return cls.make(**{f.name: data.get(f.name) for f in dataclasses.fields(cls)})

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["region"] = None if self.region is None else list(self.region)
        data["colour"] = list(self.colour)
        data["approximate"] = None if self.approximate is None else list(self.approximate)
        return data

    def with_label(self, label: int) -> Provenance:
        return dataclasses.replace(self, label=int(label))

    def differences(self, other: Provenance) -> list[str]:
        """What differs from ``other``, in the page's words ('the image', 'the stride')."""
        return [
            _NAMES[f.name]
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
            and not (f.name == "weights" and self.model != other.model)
        ]


@dataclass(frozen=True)
class ResultView:
    """Whether the result panel shows the kept result, and if not, why."""

    show: bool
    reason: str = ""


def result_view(result: Provenance | None, screen: Provenance | None) -> ResultView:
    """The page shows a result only beside what it explains: the same image, model,
    weights, region, patch, stride, mode, colour and class as on screen."""
    if result is None:
        return ResultView(False, "")
    if screen is None:
        return ResultView(False, "The last heatmap is hidden: it explained another image.")
    differ = result.differences(screen)
    if not differ:
        return ResultView(True)
    if "the image" in differ or "the model" in differ or "the model's weights" in differ:
        what = [d for d in differ if d in ("the image", "the model", "the model's weights")]
        return ResultView(
            False,
            f"The last heatmap is hidden: it explained {_and(what)} that is no longer "
            f"on screen. Press Run to explain this one.",
        )
    return ResultView(
        False,
        f"The last heatmap is hidden: {_and(differ)} changed since it was computed. "
        f"Press Run for these settings, or set them back to see it.",
    )


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


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
    """One run of the page: its provenance, its phase and, while it runs, its progress
    and time left: the positions left at the run's own pace, the positions it advanced
    since its first report over the time since. The first report is where the pace
    starts: cells known from earlier runs come in it at once, and counting them as
    computed made the first figure promise seconds for a run of minutes (3.1 s left,
    93 s to go)."""

    provenance: Provenance | None = None
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
