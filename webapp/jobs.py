"""Background callbacks that run in threads of the server process.

Dash's DiskcacheManager starts each background job in a forked process. PyTorch's CPU
thread pool (OpenMP) does not survive fork: the first parallel operation in the child
deadlocks. Running jobs in threads instead avoids that and lets every job share the loaded
models, captured graphs and materialised views held by this process — which is what makes
refinement reuse work. Results, progress and the signing secret still go through the
diskcache, so this is Dash's own background-callback protocol with a different executor.

Threads cannot be killed, so cancellation is cooperative: ``terminate_job`` sets a flag
that the running job reads through :func:`check_cancelled` (the engine calls it from its
progress hook after every batch). The same check cancels a job whose page has stopped
polling for its result (the tab was closed or the client went away) for longer than the
manager's ``abandon_seconds``: nobody would see its result.

:class:`JobQueue` bounds how many jobs run at once, how many wait, and how many one
session may have; a waiting job learns its place in the queue.

A run's life is decided here too, without a browser: :class:`RunLifecycle` goes idle →
queued → running → done | cancelled | failed, with the transitions allowed in one
table, the progress of a running run and its time left, measured from the run's own
pace since its first report. The queue moves it: :meth:`JobQueue.slot` queues it when
it joins, starts it when it has its place and finishes it when it leaves the place
normally. What a run explains and when its result may be shown is the run package's
(webapp.runs.provenance).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

from dash import DiskcacheManager

from krypton.estimator import format_duration  # one wording for durations

__all__ = [
    "Phase",
    "IllegalTransition",
    "RunLifecycle",
    "format_duration",
    "ThreadedDiskcacheManager",
    "JobCancelled",
    "JobQueue",
    "QueueFull",
    "check_cancelled",
    "running_as",
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
    93 s to go). A ``chunked`` run (exact and naive: webapp.runs.run_cells) shows no
    time left until its first chunk is done, and its pace starts there: that chunk warms
    the model and, in exact mode, times naive inference beside it, and the first figure
    it gave was 1.6-1.8x the time left in 7 of 10 runs (bench.time_left)."""

    phase: Phase = Phase.IDLE
    history: list[tuple[Phase, float]] = field(default_factory=list)
    reason: str = ""  # why it was cancelled or failed
    done: int = 0
    total: int = 0
    chunked: bool = False  # its pace starts after its first chunk (a picture)
    _first: tuple[int, float] | None = field(default=None, repr=False)  # (done, when)
    _latest: float = field(default=0.0, repr=False)
    _warmed: bool = field(default=False, repr=False)  # a chunked run's first chunk is done

    def advance(self, phase: Phase, reason: str = "") -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"a run cannot go from {self.phase.value} to {phase.value}")
        self.phase, self.reason = phase, reason
        self.history.append((phase, time.monotonic()))

    def queue(self) -> None:
        self.advance(Phase.QUEUED)

    def start(self) -> None:
        self.advance(Phase.RUNNING)
        self._first, self._warmed = None, False

    def finish(self) -> None:
        self.advance(Phase.DONE)

    def cancel(self, reason: str = "") -> None:
        self.advance(Phase.CANCELLED, reason)

    def fail(self, reason: str) -> None:
        self.advance(Phase.FAILED, reason)

    @property
    def final(self) -> bool:
        return self.phase in FINAL

    def progress(
        self, done: int, total: int, picture: bool = False, now: float | None = None
    ) -> None:
        """``done`` of ``total`` positions are computed (``total`` may be revised);
        ``picture``: the report ends a chunk; ``now``: when (default: the monotonic clock
        now; bench.time_left replays a run's reports with their own times)."""
        if self.phase is not Phase.RUNNING:
            raise IllegalTransition(f"progress reported while {self.phase.value}")
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = (done, now)
        elif picture and self.chunked and not self._warmed and done > self._first[0]:
            self._first, self._warmed = (done, now), True  # the pace starts here
        self._latest = now
        self.done, self.total = done, total

    def seconds_left(self) -> float | None:
        """Time to the end at the run's own pace; None until it has advanced since its
        first report."""
        if self._first is None or self.done <= 0 or self.final:
            return None
        if self.chunked and not self._warmed:
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


class JobCancelled(Exception):
    """Raised inside a job whose Cancel button was pressed or whose page went away."""


class QueueFull(Exception):
    """The server or this session already has as many jobs as it allows."""


class _Job:
    def __init__(self, thread: threading.Thread, abandon_seconds: float):
        self.thread = thread
        self.cancel = threading.Event()
        self.last_poll = time.monotonic()
        self.abandon_seconds = abandon_seconds
        self.ended: float | None = None  # when the thread ended (its result is written)

    def awaits_delivery(self) -> bool:
        """Ended with a result nobody has fetched yet, not long ago, and not cancelled."""
        return (
            self.ended is not None
            and not self.cancel.is_set()
            and time.monotonic() - self.ended < RESULT_GRACE_SECONDS
        )

    def stop_reason(self) -> str | None:
        if self.cancel.is_set():
            return "cancelled"
        if time.monotonic() - self.last_poll > self.abandon_seconds:
            return "abandoned"
        return None


# A job whose thread ended still counts as running until its result is fetched, for at
# most this long (a page that stopped polling never fetches it).
RESULT_GRACE_SECONDS = 30.0
_job_ids = itertools.count(1)
_jobs: dict[int, _Job] = {}
_current = threading.local()
_lock = threading.Lock()


@contextmanager
def running_as(record) -> Iterator[None]:
    """Make ``record`` (anything with ``stop_reason()``) the job of this thread while the
    block runs: team mode's worker jobs use it for their Redis-backed cancel check."""
    previous = getattr(_current, "job", None)
    _current.job = record
    try:
        yield
    finally:
        _current.job = previous


def check_cancelled() -> None:
    """Raise JobCancelled if the job running in this thread was cancelled or abandoned."""
    job = getattr(_current, "job", None)
    if job is not None and job.stop_reason() is not None:
        raise JobCancelled(job.stop_reason())


class JobQueue:
    """At most ``running`` jobs at once, ``waiting`` more in line, ``per_session`` jobs
    (running or waiting) per session and ``per_client`` per client (the user or network
    the request guard names: a client can make up session ids, not its address).

    Fair by client: the next running place goes to the waiting job whose client has the
    fewest jobs running, then fewest in all (first come, first served among equals); a
    client with nothing running or waiting joins a full line. Nine addresses with four
    runs each took all 34 places, and a tenth user was told the server was busy."""

    SESSION_GRACE_SECONDS = 5.0

    def __init__(self, running: int, waiting: int, per_session: int, per_client: int = 4):
        self.running, self.waiting, self.per_session = running, waiting, per_session
        self.per_client = per_client
        self._condition = threading.Condition()
        self._line: list[object] = []  # tickets of waiting jobs, oldest first
        self._active = 0
        self._light = 0  # light jobs under way (outside the line and the running places)
        self._sessions: Counter = Counter()
        self._clients: Counter = Counter()  # running or waiting, per client
        self._running_by: Counter = Counter()  # running, per client
        self._owners: dict[object, str] = {}  # a waiting ticket's client

    def _next_in_line(self) -> list[object]:
        """The line in the order places are given: the client with the fewest jobs
        running first, then the fewest running or waiting, then the oldest."""
        return sorted(
            self._line,
            key=lambda ticket: (
                self._running_by[self._owners[ticket]],
                self._clients[self._owners[ticket]],
            ),
        )

    def status(self) -> dict:
        with self._condition:
            return {"running": self._active, "waiting": len(self._line)}

    @contextmanager
    def slot(
        self,
        session: str,
        on_wait: Callable[[int], None],
        client: str = "",
        light: bool = False,
        lifecycle: RunLifecycle | None = None,
    ) -> Iterator[None]:
        """Hold a run slot; while waiting, ``on_wait(jobs ahead)`` is called about once a
        second (it may raise, e.g. JobCancelled, to give up the place in line). A
        ``light`` job (a run with nothing to compute: every cell is known) counts against
        its session's and client's limits but neither waits in line nor takes a running
        place: it shows its result at once, whatever else queues. ``lifecycle`` follows
        the slot: queued once admitted, running once it has its place, done when the
        block ends normally (a refusal or an exception leaves it for the caller to end
        as failed or cancelled, with its reason)."""
        run = lifecycle or RunLifecycle()
        ticket = self._admit(session, client, light)
        run.queue()
        if not light:
            self._wait_for_place(ticket, session, client, on_wait)
        try:
            run.start()
            yield
        finally:
            with self._condition:
                if light:
                    self._light -= 1
                else:
                    self._active -= 1
                    self._running_by[client] -= 1
                self._sessions[session] -= 1
                self._clients[client] -= 1
                self._condition.notify_all()
        run.finish()  # the block ended normally

    def _admit(self, session: str, client: str, light: bool) -> object:
        """Count a new run against its session's and client's limits and, unless it is
        light, put it in line; its ticket. Refused with QueueFull, in the page's words."""
        ticket = object()
        with self._condition:
            # A cancelled run stops at its next batch: give it that long to leave.
            deadline = time.monotonic() + self.SESSION_GRACE_SECONDS
            while self._sessions[session] >= self.per_session and time.monotonic() < deadline:
                self._condition.wait(timeout=max(0.0, deadline - time.monotonic()))
            if self._sessions[session] >= self.per_session:
                raise QueueFull(
                    "this tab already has a run in progress; wait for it or cancel it first"
                )
            if self._clients[client] >= self.per_client:
                raise QueueFull(
                    f"you already have {self._clients[client]} runs running or waiting on "
                    f"this server (the limit per user is {self.per_client}); wait for one "
                    f"to finish"
                )
            full = self._active >= self.running and len(self._line) >= self.waiting
            if not light and full and self._clients[client]:  # a newcomer still joins
                raise QueueFull(
                    f"the server is busy ({self._active} runs, "
                    f"{len(self._line)} waiting); try again in a minute"
                )
            self._sessions[session] += 1
            self._clients[client] += 1
            if light:
                self._light += 1
            else:
                self._line.append(ticket)
                self._owners[ticket] = client
        return ticket

    def _wait_for_place(
        self, ticket: object, session: str, client: str, on_wait: Callable[[int], None]
    ) -> None:
        """Wait in line until ``ticket`` is first and a running place is free, telling
        ``on_wait`` how many runs are ahead; a job that gives up (``on_wait`` raising)
        leaves the line and its counts."""
        try:
            while True:
                with self._condition:
                    ahead = self._next_in_line().index(ticket)
                    if ahead == 0 and self._active < self.running:
                        self._line.remove(ticket)
                        self._owners.pop(ticket, None)
                        self._active += 1
                        self._running_by[client] += 1
                        self._condition.notify_all()
                        return
                    ahead += self._active - self.running + 1
                on_wait(max(1, ahead))
                with self._condition:
                    self._condition.wait(timeout=1.0)
        except BaseException:
            with self._condition:
                self._line.remove(ticket)
                self._owners.pop(ticket, None)
                self._sessions[session] -= 1
                self._clients[client] -= 1
                self._condition.notify_all()
            raise


class ThreadedDiskcacheManager(DiskcacheManager):
    """DiskcacheManager whose jobs are threads of this process (see module docstring)."""

    def __init__(self, cache, *, abandon_seconds: float = 75.0, **kwargs):
        super().__init__(cache, **kwargs)
        self.abandon_seconds = abandon_seconds

    def call_job_fn(self, key, job_fn, args, context):
        job = next(_job_ids)

        def run():
            _current.job = record
            try:
                job_fn(key, self._make_progress_key(key), args, context)
            finally:
                _current.job = None
                record.ended = time.monotonic()  # kept until its result is fetched

        with _lock:  # jobs whose result nobody will fetch any more
            for number in [n for n, r in _jobs.items() if r.ended and not r.awaits_delivery()]:
                _jobs.pop(number)

        thread = threading.Thread(target=run, name=f"krypton-job-{job}", daemon=True)
        record = _Job(thread, self.abandon_seconds)
        with _lock:
            _jobs[job] = record
        thread.start()
        return job

    def get_result(self, key, job):
        """Called on every poll of the page: the job is still wanted; once its result is
        read, the job is done."""
        if job is not None:
            with _lock:
                record = _jobs.get(_job_number(job))
            if record is not None:
                record.last_poll = time.monotonic()
        result = super().get_result(key, job)
        if job is not None and result is not self.UNDEFINED:
            with _lock:
                _jobs.pop(_job_number(job), None)
        return result

    def terminate_job(self, job):
        if job is None:
            return
        with _lock:
            entry = _jobs.get(_job_number(job))
        if entry is not None:
            entry.cancel.set()

    def terminate_unhealthy_job(self, job):
        return False  # a thread only ends by returning; its record goes once fetched

    def job_running(self, job):
        """Whether the job is still under way. Dash reads a poll's result first and asks
        this after: a thread that wrote its result and ended between the two would look
        cancelled and its result be lost, so an ended job counts until it is fetched."""
        with _lock:
            entry = _jobs.get(_job_number(job))
        return entry is not None and (entry.thread.is_alive() or entry.awaits_delivery())


def _job_number(job) -> int:
    try:
        return int(job)
    except (TypeError, ValueError):
        return -1
