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
inter-position. So a :class:`ScheduleChooser` times the batches it runs anyway: each
schedule once at the start, then the fastest, trying another every
:data:`EXPLORE_EVERY` batches in case the load has changed. No position is computed
twice to decide. On a card there is one schedule (intra-op: the card's own streams).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .engine.capture_lock import CAPTURE_LOCK
from .host import HostShare, current_share

__all__ = [
    "INTRA",
    "INTER",
    "EXPLORE_EVERY",
    "Schedule",
    "schedule_options",
    "ScheduleChooser",
    "shard_length",
    "shards",
    "run_scheduled",
    "Schedules",
]

INTRA, INTER = "intra-op", "inter-position"

# every this many batches a run tries the schedule it has not timed for longest, among
# those within CLOSE of the fastest; one further behind only every SLOW_EVERY such turns
# (one thread ran 2x slower than two idle: tried as often, it cost 5% of a run)
EXPLORE_EVERY = 6
CLOSE = 1.25
SLOW_EVERY = 4
# another schedule replaces the expected fastest (the first option) only when it is at
# least this much faster: r3d_18's five batches flipped to the slower one on noise
LEAD_MARGIN = 0.9


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


@dataclass
class ScheduleChooser:
    """The seconds per position each schedule took on one kind of batch (a model, an
    input shape, a batch size, incremental or naive), kept from call to call, and the
    choice they make."""

    pace: dict[Schedule, float] = field(default_factory=dict)
    last_run: dict[Schedule, int] = field(default_factory=dict)
    batches: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def pick(self, options: list[Schedule]) -> Schedule:
        """The schedule for the next batch: any option not timed yet, in order; else the
        fastest, except every :data:`EXPLORE_EVERY` batches another (the one timed
        longest ago among those close to the fastest, or any left untimed for long)."""
        with self.lock:
            self.batches += 1
            untimed = [option for option in options if option not in self.pace]
            if untimed:
                return untimed[0]
            fastest = min(options, key=lambda option: self.pace[option])
            if self.pace[fastest] > LEAD_MARGIN * self.pace[options[0]]:
                fastest = options[0]  # the expected fastest keeps a near tie (noise)
            if self.batches % EXPLORE_EVERY:
                return fastest
            others = [
                option
                for option in options
                if option != fastest
                and (
                    self.pace[option] <= CLOSE * self.pace[fastest]
                    or self.batches - self.last_run.get(option, 0) >= SLOW_EVERY * EXPLORE_EVERY
                )
            ]
            if not others:
                return fastest
            return min(others, key=lambda option: self.last_run.get(option, -1))

    def ran(self, schedule: Schedule, positions: int, seconds: float) -> None:
        """Record one batch: its pace is averaged with the schedule's earlier one (half
        each), so a change of load shows within a few batches."""
        if positions <= 0:
            return
        pace = seconds / positions
        with self.lock:
            before = self.pace.get(schedule)
            self.pace[schedule] = pace if before is None else (before + pace) / 2
            self.last_run[schedule] = self.batches


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
    autocast, one torch thread, and the shared capture lock its caller holds."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
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
) -> torch.Tensor:
    """``compute(positions)`` for the positions of ``batch`` on ``schedule``: intra-op
    in this thread on its threads, or inter-position as shards (:func:`shard_length`)
    over the workers (the first shard in this thread, the others on the pool's workers),
    concatenated in order. ``prepare(shard)`` runs for every shard in this thread first
    (compiling its indices: the workers only read them). The run's host share counts the
    positions per schedule."""
    count = batch.stop - batch.start
    length = shard_length(schedule.threads, count, batch_size, prepare is not None)
    if schedule.kind == INTER and count <= length:  # one shard: one thread
        schedule = Schedule(INTRA, 1)
    current_share().schedules[str(schedule)] += count
    if schedule.kind == INTRA:
        if torch.get_num_threads() != schedule.threads:
            torch.set_num_threads(schedule.threads)
        return compute(batch)
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
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
    """One explainer's :class:`ScheduleChooser` per kind of batch, and the one way its
    runs compute a batch of positions (:meth:`run`)."""

    def __init__(self) -> None:
        self._choosers: dict[tuple, ScheduleChooser] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget every timing (the model changed, or the caller asks to measure again)."""
        with self._lock:
            self._choosers.clear()

    def chooser(self, key: tuple) -> ScheduleChooser:
        with self._lock:
            return self._choosers.setdefault(key, ScheduleChooser())

    def run(
        self,
        key: tuple,
        device: torch.device,
        batch: slice,
        batch_size: int,
        compute: Callable[[slice], torch.Tensor],
        prepare: Callable[[slice], None] | None = None,
    ) -> torch.Tensor:
        """One batch of the kind ``key`` (e.g. incremental, an input shape, a batch size)
        on the schedule its chooser picks from the run's options, timed for the next."""
        options = schedule_options(current_share(), batch_size, device)
        if len(options) == 1:
            return run_scheduled(options[0], batch, batch_size, compute, prepare)
        chooser = self.chooser(key)
        schedule = chooser.pick(options)
        count = batch.stop - batch.start
        length = shard_length(schedule.threads, count, batch_size, prepare is not None)
        if prepare is not None:  # compiling indices is not the schedule's pace
            inter = schedule.kind == INTER
            for piece in shards(batch.start, batch.stop, length) if inter else [batch]:
                prepare(piece)
        began = time.perf_counter()
        values = run_scheduled(schedule, batch, batch_size, compute, prepare)
        if schedule.kind == INTRA or count > length:
            chooser.ran(schedule, count, time.perf_counter() - began)  # else it ran as one
        return values
