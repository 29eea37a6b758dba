"""How one run's batches use the threads its host share allows (:mod:`krypton.host`).

Three schedules compute the same values:

- **intra-op**: torch's threads split each operator of the batch;
- **one thread**: intra-op with a single thread, nothing to wait for;
- **inter-position**: the batch's positions are cut into shards, each computed by its own
  single-threaded worker at the same time. The positions of a run are independent, so
  this is the task-parallel schedule ZNNi uses on multi-core CPUs for many small
  convolutions, where splitting each small operator across threads makes every thread
  wait at its barrier for the slowest one.

Which is fastest depends on the model, the batch and what else the host runs: beside six
CPU burners on two cores, ResNet18's exact run over 169 positions took 14.1 s intra-op on
two threads, 9.3 s on one and 5.8 s inter-position on two; idle, 1.4 s intra-op and 1.4 s
inter-position; torchvision's mnasnet0_5 ran naive batches in 9.1 s intra-op and 5.0 s
inter-position on an idle host. So the choice is measured, once: the first full batch of a
kind (naive or incremental, an input shape, a batch size) on a thread budget (which the
load band sets, :func:`krypton.host.load_band`) runs on every option, alternated,
:data:`MEASURE_ROUNDS` times each, and the fastest (best of its rounds) is kept for the
process: a :class:`ScheduleDecision`. It is measured again only when the load moves to a
band that gives the run other threads.
Choosing batch by batch from the batches a run computed anyway made one call vary by a
third from run to run (mnasnet0_5's naive 3.5 s then 4.7 s: its batches split between
the schedules differently each time, on noise). On a card there is one schedule
(intra-op: the card's own streams).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .engine.capture_lock import CAPTURE_LOCK
from .host import HostShare, current_share
from .torch_threads import set_for_this_thread

__all__ = [
    "INTRA",
    "INTER",
    "MEASURE_ROUNDS",
    "Schedule",
    "schedule_options",
    "ScheduleDecision",
    "decide",
    "measuring_seconds",
    "shard_length",
    "shards",
    "run_scheduled",
    "Schedules",
]

INTRA, INTER = "intra-op", "inter-position"

# each option runs this many times on the measured batch, alternated (A B A B): the best
# of two keeps a first run's warm-up (its buffers, oneDNN's kernels for a thread count) out
MEASURE_ROUNDS = 2
# another option replaces the expected fastest (the first) only when it is at least this
# much faster: a near tie keeps the expectation, so two processes choose alike
LEAD_MARGIN = 0.92


@dataclass(frozen=True)
class Schedule:
    """One way to compute a batch: ``kind`` (:data:`INTRA` or :data:`INTER`) on
    ``threads`` threads (for inter-position, that many single-threaded workers)."""

    kind: str
    threads: int

    def __str__(self) -> str:
        if self.kind == INTER:
            return f"inter-position on {self.threads} threads"
        return "one thread" if self.threads == 1 else f"intra-op on {self.threads} threads"


def schedule_options(share: HostShare, batch_size: int, device: torch.device) -> list[Schedule]:
    """The schedules a run may choose from, the one expected fastest first: on a CPU,
    intra-op on the share's threads (one thread beside a busy host) and inter-position
    on its whole budget (where the batch splits evenly into that many shards: each
    shard's indices are compiled once per run); on a card, intra-op alone. One thread
    on an idle host is not offered: it ran 1.8x slower than either there."""
    intra = Schedule(INTRA, share.threads)
    if device.type != "cpu":
        return [intra]
    workers = share.budget
    if workers < 2 or batch_size < workers or batch_size % workers:
        return [intra]
    inter = Schedule(INTER, workers)
    # a share below its budget means the host is busy: there the workers usually win
    # (and intra-op is then one thread); on an idle host intra-op on every core leads
    return [inter, intra] if share.threads < workers else [intra, inter]


@dataclass(frozen=True)
class ScheduleDecision:
    """The schedule one kind of batch runs on, for the process, at one thread budget (the
    ``band`` it was measured in gave it): ``chosen``, and the seconds per position each
    option took when measured (the best of :data:`MEASURE_ROUNDS`), ``at`` (time.time())
    and ``extra_seconds``: what the measurement cost beyond computing the batch once."""

    chosen: Schedule
    paces: dict
    band: int | None
    at: float
    extra_seconds: float

    @property
    def margin(self) -> float:
        """The next option's time over the chosen one's (under 1.0: a near tie kept)."""
        others = [pace for option, pace in self.paces.items() if option != self.chosen]
        mine = self.paces[self.chosen]
        return min(others) / mine if others and mine > 0 else 1.0

    def record(self, measured_now: bool) -> dict:
        """The decision as a run's ``heatmap.extra["host"]["decisions"]`` states it."""
        when = "in this run" if measured_now else time.strftime(
            "at %H:%M:%S", time.localtime(self.at)
        )  # fmt: skip
        record = {
            "schedule": str(self.chosen),
            "margin": round(self.margin, 3),
            "ms_per_position": {str(o): round(p * 1e3, 3) for o, p in self.paces.items()},
            "band": self.band,
            "measured": when,
        }
        if measured_now:
            record["measuring_seconds"] = self.extra_seconds
        return record


def decide(paces: dict[Schedule, float], options: list[Schedule]) -> Schedule:
    """The fastest option by its measured pace; the expected fastest (the first) keeps a
    near tie (within :data:`LEAD_MARGIN`)."""
    fastest = min(options, key=lambda option: paces[option])
    if paces[fastest] > LEAD_MARGIN * paces[options[0]]:
        return options[0]
    return fastest


def measuring_seconds(share: HostShare) -> float:
    """Seconds the run of ``share`` has spent measuring schedules (beyond computing each
    measured batch once): work a run pays once per decision, kept apart from the pace of
    its batches."""
    return sum(record.get("measuring_seconds", 0.0) for record in share.decisions.values())


def shard_length(threads: int, count: int, batch_size: int, aligned: bool) -> int:
    """Positions per shard of a ``count``-position batch over ``threads`` workers: with
    compiled indices (``aligned``) every batch's shards line up with the run's layout
    (``batch_size`` / threads, so a short last batch may have fewer shards); else the
    batch split evenly (MONAI's 81 positions in a 128 batch: 41 and 40, not 64 and 17)."""
    if aligned:
        return max(1, batch_size // threads)
    return max(1, -(-count // threads))


def shards(start: int, stop: int, length: int) -> list[slice]:
    """Positions ``start:stop`` cut into shards of ``length`` (the last may be shorter)."""
    return [slice(first, min(first + length, stop)) for first in range(start, stop, length)]


def _in_worker(
    compute: Callable[[slice], torch.Tensor], piece: slice, autocast: tuple | None
) -> torch.Tensor:
    """One shard on a worker thread, in the caller's numerics: inference mode, its
    autocast, one torch thread (this worker's own: the count new threads start with is
    left alone), and the shared capture lock its caller holds."""
    set_for_this_thread(1)
    with torch.inference_mode(), CAPTURE_LOCK.lent():
        if autocast is None:
            return compute(piece)
        with torch.autocast(device_type=autocast[0], dtype=autocast[1]):
            return compute(piece)


def run_scheduled(
    schedule: Schedule,
    batch: slice,
    batch_size: int,
    compute: Callable[[slice], torch.Tensor],
    prepare: Callable[[slice], None] | None = None,
    counted: bool = True,
) -> torch.Tensor:
    """``compute(positions)`` for the positions of ``batch`` on ``schedule``: intra-op
    in this thread on its threads, or inter-position as shards (:func:`shard_length`)
    over the workers (the first shard in this thread, the others on the pool's workers),
    concatenated in order. ``prepare(shard)`` runs for every shard in this thread first
    (compiling its indices: the workers only read them). The run's host share counts the
    positions per schedule (``counted``; a measurement's repeats are not)."""
    count = batch.stop - batch.start
    length = shard_length(schedule.threads, count, batch_size, prepare is not None)
    if schedule.kind == INTER and count <= length:  # one shard: one thread
        schedule = Schedule(INTRA, 1)
    if counted:
        current_share().ran(str(schedule), schedule.threads, count)
    if schedule.kind == INTRA:  # this thread's count only; its run's host_share restores it
        set_for_this_thread(schedule.threads)
        return compute(batch)
    set_for_this_thread(1)
    autocast = (
        ("cpu", torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else None
    )
    pieces = shards(batch.start, batch.stop, length)
    if prepare is not None:
        for piece in pieces:
            prepare(piece)
    # The batch's own workers, ended with it: a process-wide pool kept its threads between
    # runs, and a host that stops every thread it did not start (Dash's test server does,
    # by raising SystemExit in each) left it with dead workers whose shards waited forever.
    with CAPTURE_LOCK.shared():  # the workers compute under this thread's hold
        workers = ThreadPoolExecutor(len(pieces) - 1, thread_name_prefix="krypton-shard")
        try:
            pending = [workers.submit(_in_worker, compute, piece, autocast)
                       for piece in pieces[1:]]  # fmt: skip
            first = compute(pieces[0])
            return torch.cat([first, *(future.result() for future in pending)])
        finally:  # within the hold the workers borrow
            workers.shutdown(wait=True, cancel_futures=True)


class Schedules:
    """One explainer's schedule decisions (:class:`ScheduleDecision`), per kind of batch
    and thread budget, and the one way its runs compute a batch of positions
    (:meth:`run`)."""

    def __init__(self) -> None:
        self._decisions: dict[tuple, ScheduleDecision] = {}
        self._measuring: dict[tuple, threading.Lock] = {}
        self._lock = threading.Lock()
        self.measurements = 0  # how many decisions were measured (tests, the bench)

    def clear(self) -> None:
        """Forget every decision (the model changed, or the caller asks to measure again)."""
        with self._lock:
            self._decisions.clear()

    def undecided(self, key: tuple, batch_size: int, device: torch.device) -> bool:
        """Whether the next full batch of kind ``key`` would be measured first."""
        options = schedule_options(current_share(), batch_size, device)
        with self._lock:
            return len(options) > 1 and self._where(key, options) not in self._decisions

    @staticmethod
    def _where(key: tuple, options: list[Schedule]) -> tuple:
        """Where a decision holds: a kind of batch and the options the run's threads
        give. The load band sets those threads, so a band that changes them measures
        again; the top bands of a host (one thread left, beside one or two burners on
        two cores) share one: a saturated host's load reading flips between them."""
        return (key, tuple(options))

    def run(
        self,
        key: tuple,
        device: torch.device,
        batch: slice,
        batch_size: int,
        compute: Callable[[slice], torch.Tensor],
        prepare: Callable[[slice], None] | None = None,
        between: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """One batch of the kind ``key`` (its first item names it: "naive", "incremental";
        then an input shape, a batch size) on the schedule decided for it, measured on
        this batch first if undecided and whole (a short batch runs on the expected
        fastest: a part-batch's pace is not a whole one's). ``between``: called between
        a measurement's runs of the batch, where the caller may stop (its Cancel)."""
        share = current_share()
        options = schedule_options(share, batch_size, device)
        if len(options) == 1:
            return run_scheduled(options[0], batch, batch_size, compute, prepare)
        where = self._where(key, options)
        with self._lock:
            decision = self._decisions.get(where)
            if decision is None:
                measuring = self._measuring.setdefault(where, threading.Lock())
        if decision is None and batch.stop - batch.start == batch_size:
            with measuring:  # one measurement per decision; a second run waits for it
                with self._lock:
                    decision = self._decisions.get(where)
                if decision is None:
                    values, decision = self._measure(
                        options, batch, batch_size, compute, prepare, between
                    )
                    with self._lock:
                        self._decisions[where] = decision
                        self.measurements += 1
                    share.decisions[str(key[0])] = decision.record(measured_now=True)
                    return values
        if decision is None:
            return run_scheduled(options[0], batch, batch_size, compute, prepare)
        share.decisions.setdefault(str(key[0]), decision.record(measured_now=False))
        return run_scheduled(decision.chosen, batch, batch_size, compute, prepare)

    @staticmethod
    def _measure(
        options: list[Schedule],
        batch: slice,
        batch_size: int,
        compute: Callable[[slice], torch.Tensor],
        prepare: Callable[[slice], None] | None,
        between: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, ScheduleDecision]:
        """Time ``batch`` on every option, alternated, :data:`MEASURE_ROUNDS` times each
        (compiling a shard's indices is not timed); the chosen option's values and the
        decision. Only the chosen option's values are returned, so a run never mixes
        schedules (they may round differently in the last bit). ``between`` runs after
        each run but the last: a Cancel waited for all of them (5.8 s beside burners)."""
        paces: dict[Schedule, float] = {}
        values: dict[Schedule, torch.Tensor] = {}
        count = batch.stop - batch.start
        began_all = time.perf_counter()
        runs_left = MEASURE_ROUNDS * len(options)
        for _ in range(MEASURE_ROUNDS):
            for option in options:
                if prepare is not None:
                    length = shard_length(option.threads, count, batch_size, True)
                    inter = option.kind == INTER
                    for piece in shards(batch.start, batch.stop, length) if inter else [batch]:
                        prepare(piece)
                began = time.perf_counter()
                values[option] = run_scheduled(
                    option, batch, batch_size, compute, prepare, counted=False
                )
                seconds = time.perf_counter() - began
                paces[option] = min(paces.get(option, math.inf), seconds / count)
                runs_left -= 1
                if between is not None and runs_left:
                    between()
        chosen = decide(paces, options)
        current_share().ran(str(chosen), chosen.threads, count)
        spent = time.perf_counter() - began_all
        extra = spent - paces[chosen] * count
        band = current_share().band
        return values[chosen], ScheduleDecision(chosen, paces, band, time.time(), extra)
