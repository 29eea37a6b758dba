"""This host as a run meets it: the cores its other work keeps busy now
(:func:`host_load`), the torch threads a run starting beside that work gets
(:func:`threads_for_load`) and how much longer the run takes there than on an idle host
(:func:`load_factor`). The estimator scales its estimates by these. Every run of the
engine takes its share through :func:`host_share`: the caller's own thread setting wins;
else the load decides, for the run's own thread and its duration only
(:mod:`krypton.torch_threads`). The app samples the load first (:func:`share_host`).
Krypton's load samples leave psutil's ``cpu_percent`` state, which a caller may read
too, alone."""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from . import torch_threads
from ._environment import library_setting

__all__ = [
    "LOAD_SAMPLE_SECONDS",
    "BAND_HYSTERESIS",
    "host_load",
    "recent_loads",
    "load_band",
    "OthersLoad",
    "max_threads",
    "threads_for_load",
    "load_factor",
    "share_host",
    "HostShare",
    "host_share",
    "current_share",
    "describe_share",
]

LOAD_SAMPLE_SECONDS = 0.1


def _cpu_times() -> tuple[float, float] | None:
    """The host's CPU seconds so far, all cores: (total, busy), counted as psutil's
    ``cpu_percent`` counts them (guest time is in user time; idle and I/O wait are not
    busy); None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    times = psutil.cpu_times()
    total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    return total, total - times.idle - getattr(times, "iowait", 0.0)


_HOST_TIMES: list[tuple[float, float]] = []  # the counters at Krypton's last host_load
RUN_QUEUE_READS = 5  # reads of the run queue over a load sample, whose median counts


def _others_runnable() -> int | None:
    """Threads of other processes that are running or waiting for a core now: Linux's
    ``procs_running`` (/proc/stat) less this process's own running threads; None where
    the kernel does not say. Busy cores stop at the host's cores; this does not, so a
    host with six burners on two cores reads 6, not 2 (beside six burners the estimates
    were those of two, and 4 of 10 ranges held)."""
    try:
        with open("/proc/stat", "rb") as handle:
            running = next(
                int(line.split()[1]) for line in handle if line.startswith(b"procs_running")
            )
        own = 0
        for task in os.scandir("/proc/self/task"):
            try:
                with open(f"{task.path}/stat", "rb") as handle:
                    own += handle.read().rpartition(b")")[2].split()[0] == b"R"
            except OSError:  # a thread that ended meanwhile
                continue
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return max(0, running - own)


def _queued_beyond_cores(interval: float) -> float | None:
    """Over ``interval`` seconds (slept in RUN_QUEUE_READS steps): the median of the
    other processes' runnable threads where it exceeds this host's cores; else None (the
    busy cores say as much)."""
    reads = []
    for _ in range(RUN_QUEUE_READS):
        time.sleep(interval / RUN_QUEUE_READS)
        read = _others_runnable()
        if read is not None:
            reads.append(read)
    queued = float(sorted(reads)[len(reads) // 2]) if reads else 0.0
    return queued if queued > (os.cpu_count() or 1) else None


def _busy_cores(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """Cores kept busy between two :func:`_cpu_times` readings (None: too short to say)."""
    total = after[0] - before[0]
    if total <= 0:
        return None
    return (after[1] - before[1]) / total * (os.cpu_count() or 1)


def host_load(interval: float | None = LOAD_SAMPLE_SECONDS) -> float | None:
    """Cores this host's work keeps busy now (every process, this one's other runs
    included), sampled over ``interval`` seconds (None: since Krypton's previous sample,
    without waiting): what a run starting now competes with (None without psutil). Where
    other processes have more threads runnable than the host has cores, that count
    (:func:`_others_runnable`): the demand beyond the cores, which busy cores cannot show.
    Estimates scale to it and each logged run records it. Read from psutil's cumulative
    counters: the caller's own ``psutil.cpu_percent(interval=None)`` runs on undisturbed."""
    first = _cpu_times()
    if first is None:
        return None
    queued = None
    if interval is None and _HOST_TIMES:
        before, after = _HOST_TIMES[0], first
    else:
        queued = _queued_beyond_cores(interval or LOAD_SAMPLE_SECONDS)
        before, after = first, _cpu_times() or first
    _HOST_TIMES[:] = [after]
    busy = _busy_cores(before, after)
    load = 0.0 if busy is None else max(0.0, busy)
    if queued is not None:  # more work than cores: the run queue says how much more
        load = max(load, queued)
    if interval is not None:  # a sample of now, not a window over this process's own run
        with _BAND_LOCK:
            _LOAD_SAMPLES.append((time.monotonic(), load))
    return load


_LOAD_SAMPLES: deque[tuple[float, float]] = deque(maxlen=256)  # (when, load) of host_load
LOAD_MEMORY_SECONDS = 120.0


def recent_loads(seconds: float = LOAD_MEMORY_SECONDS) -> list[float]:
    """The loads :func:`host_load` sampled (over its 0.1 s, not since its last read: that
    window may span this process's own run) in the last ``seconds``, oldest first: how
    far the host's load moves, which an estimate's range reaches for (krypton.load_range).
    Counting the reads that spanned its own runs made idle ranges 6-11x wide."""
    since = time.monotonic() - seconds
    with _BAND_LOCK:
        return [load for when, load in _LOAD_SAMPLES if when >= since]


_MAX_THREADS: list[int] = []  # the process's torch threads when first asked
_BAND: list[int] = []  # the host's load band as runs last met it (load_band)
_BAND_LOCK = threading.Lock()
# a load this far from its band's centre moves the band: 0.75 busy cores, so a load that
# hovers near a half core (a browser, a call) does not flip it, and one burner does
BAND_HYSTERESIS = 0.75
_LAST_LOAD: list[tuple[float, float | None]] = []  # (when, load): reused for 2 s
# torch's count when Krypton was imported: on a torch build that cannot say whether the
# caller set a count (krypton.torch_threads), another count at a run's start was set
_TORCH_DEFAULT = torch.get_num_threads()


def max_threads() -> int:
    """The torch threads this process's threads start with (OMP_NUM_THREADS, a worker's
    KRYPTON_TORCH_THREADS, else every core), read once: a run changes only its own
    thread's count, never this one."""
    if not _MAX_THREADS:
        _MAX_THREADS.append(torch_threads.process_count()[0])
    return _MAX_THREADS[0]


def threads_for_load(load: float | None, cores: int | None = None) -> int:
    """Torch threads for a run that starts while other work keeps ``load`` cores busy:
    the cores left, at least one, at most :func:`max_threads`. Beside two burners on two
    cores, exact mode took 18.4 s with two threads (each op waits at a barrier for a
    thread the scheduler has put aside) and 9.6 s with one; naive 30.2 s and 26.5 s."""
    cores = cores or os.cpu_count() or 1
    busy = 0 if load is None or not math.isfinite(load) else max(0, round(load))
    return max(1, min(max_threads(), cores - busy))


def load_band(load: float | None) -> int | None:
    """The host's load band for a run starting beside ``load`` busy cores: the whole
    number of cores its other work keeps busy (0 .. this host's cores), kept while the
    load stays within :data:`BAND_HYSTERESIS` of it. The threads a run takes and the
    batch schedule it keeps (:mod:`krypton.schedule`) are decided per band: measured
    once, and again only when the load moves to another band, not on every wobble of
    the 0.1 s sample. None where nothing was sampled."""
    if load is None or not math.isfinite(load):
        return None
    cores = os.cpu_count() or 1
    nearest = max(0, min(cores, round(load)))
    with _BAND_LOCK:
        if not _BAND or abs(load - _BAND[0]) >= BAND_HYSTERESIS:
            _BAND[:] = [nearest]
        return _BAND[0]


def _throughput(threads: int, load: float, cores: int) -> float:
    """Cores' worth of work ``threads`` get beside ``load`` busy cores: each runnable
    thread gets cores / (load + threads) of a core, at most a whole one."""
    return threads * min(1.0, cores / (load + threads))


def load_factor(
    load: float | None,
    cores: int | None = None,
    threads: int | None = None,
    idle_threads: int | None = None,
) -> float:
    """How many times longer a run takes while other work keeps ``load`` cores busy than
    on an idle host: the throughput of ``idle_threads`` (default :func:`max_threads`) on
    idle cores over that of the run's ``threads`` (default :func:`threads_for_load`)
    beside the load (:func:`_throughput`). None or no load: 1."""
    if load is None or not math.isfinite(load) or load <= 0:
        load = 0.0
    cores = cores or os.cpu_count() or 1
    threads = threads or threads_for_load(load, cores)
    idle_threads = idle_threads or max_threads()
    return _throughput(idle_threads, 0.0, cores) / _throughput(threads, load, cores)


def share_host(load: float | None = None) -> float | None:
    """The load a run starting now competes with: the cores this host's other work keeps
    busy (:func:`host_load`, unless ``load`` is given), which the run's estimate scales
    to and its log row records; the run's :func:`host_share` takes its threads from the
    same sample (reused for 2 s). Nothing else changes: the threads are set for the run's
    own thread when it runs, never for the process."""
    if load is None:
        load = host_load()
        _LAST_LOAD[:] = [(time.monotonic(), load)]  # the engine's host_share reuses it
    return load


@dataclass(frozen=True)
class HostShare:
    """What one run took of the host: its torch ``threads``, who decided (``by``: the
    caller's ``threads=`` argument, ``OMP_NUM_THREADS``, ``KRYPTON_TORCH_THREADS``,
    ``torch.set_num_threads``, or the host's ``load``), the load sampled (None where
    the caller decided: nothing was sampled) and ``budget``: the threads the run may keep
    busy at once in any schedule (:mod:`krypton.schedule`): the caller's count, or this
    process's cores where the load decided (beside six burners on two cores, two
    single-threaded workers took 5.8 s where one thread took 9.3 s)."""

    threads: int
    by: str
    load: float | None
    budget: int = 1
    band: int | None = None  # load_band(load) where the load decided, else None
    # positions the run computed per schedule (krypton.schedule counts them as they run)
    schedules: Counter = field(default_factory=Counter, compare=False)
    # per kind of batch ("naive", "incremental"): the schedule decision it ran on, when
    # and on what timings it was taken (krypton.schedule.ScheduleDecision.record)
    decisions: dict = field(default_factory=dict, compare=False)
    # the most threads its batches kept busy at once: intra-op threads, or inter-position
    # workers of one thread each (krypton.schedule.run_scheduled raises it)
    peak: list = field(default_factory=lambda: [0], compare=False)
    # where the threads were set: krypton.torch_threads.THIS_THREAD, or PROCESS on a torch
    # build without per-thread setters (host_share fills it)
    scope: list = field(default_factory=list, compare=False)

    def ran(self, schedule: str, threads: int, positions: int) -> None:
        """Count ``positions`` computed on ``schedule``, which kept ``threads`` busy."""
        self.schedules[schedule] += positions
        self.peak[0] = max(self.peak[0], threads)

    def as_dict(self) -> dict:
        return {
            "threads": self.threads,
            "peak_threads": self.peak[0] or self.threads,
            "scope": self.scope[0] if self.scope else torch_threads.THIS_THREAD,
            "by": self.by,
            "load": self.load,
            "band": self.band,
            "budget": self.budget,
            "schedules": dict(self.schedules),
            "decisions": {kind: dict(record) for kind, record in self.decisions.items()},
        }


# the share of the run this thread is in (host_share sets it): what its batches schedule on
_CURRENT: ContextVar[HostShare | None] = ContextVar("krypton_host_share", default=None)


def current_share() -> HostShare:
    """The share of the run this thread is in, or torch's threads as they are outside one
    (a caller of the engine's internals that did not go through :func:`host_share`)."""
    share = _CURRENT.get()
    if share is None:
        threads = torch.get_num_threads()
        return HostShare(threads, "torch.set_num_threads", None, threads)
    return share


def describe_share(share: dict | None) -> str:
    """One line for a run's ``heatmap.extra["host"]``: its threads, why, and the
    schedules its positions ran on (:mod:`krypton.schedule`)."""
    if not share:
        return ""
    threads = f"{share['threads']} torch thread{'s' if share['threads'] != 1 else ''}"
    peak = share.get("peak_threads") or share["threads"]
    if peak > share["threads"]:
        threads += f" ({peak} at once as inter-position workers of one thread each)"
    if share.get("scope") == torch_threads.PROCESS:
        threads += " (set process-wide: this torch build has no per-thread setting)"
    if share.get("by") == "load":
        load = share.get("load")
        beside = "" if load is None else f" beside a load of {load:.1f}"
        line = f"{threads}: the cores left of {os.cpu_count()}{beside}"
    else:
        line = f"{threads}: as the caller set ({share.get('by')})"
    ran = share.get("schedules") or {}
    if len(ran) > 1 or any(not name.startswith(("one thread", "intra-op")) for name in ran):
        total = sum(ran.values())
        parts = [f"{name} {count} of {total}" for name, count in ran.items()]
        line += "; positions on " + ", ".join(parts)
    for kind, record in (share.get("decisions") or {}).items():
        line += f"; {kind} batches on {_decision_text(record)}"
    return line


def _decision_text(record: dict) -> str:
    """One schedule decision in words: the schedule, its margin, when it was measured."""
    text = str(record.get("schedule"))
    margin = record.get("margin")
    if margin is not None:
        text += (
            f" ({margin:.2f}x faster than the next" if margin >= 1.0
            else f" (kept at {margin:.2f}x the next: a near tie"
        )  # fmt: skip
        text += f", measured {record.get('measured')})"
    return text


_SELF: list = []  # psutil's handle on this process, kept so its samples run on
_IN_FLIGHT = [0]  # runs of this process inside host_share now
_IN_FLIGHT_LOCK = threading.Lock()


def _own_cores() -> float:
    """Cores this process kept busy since the last call (0.0 on the first, or without
    psutil)."""
    try:
        return _process().cpu_percent(interval=None) / 100
    except ImportError:
        return 0.0


def _process():  # type: ignore[no-untyped-def]
    """psutil's handle on this process, made once (its cpu_percent samples run on)."""
    import psutil

    if not _SELF:
        _SELF.append(psutil.Process())
    return _SELF[0]


def _others_load(interval: float | None) -> float | None:
    """The host's load (:func:`host_load` over ``interval``) less what this process did
    itself in the same window when none of its runs is in flight: a run's own earlier
    runs are not work it competes with. Timing loops that alternated runs read their own
    naive runs as a busy host and ran exact on one thread on an idle one (ResNet18
    alone: 2.34x naive where 3.0x had been measured). While another run of this process
    is in flight (the app's second tab), everything counts, as before."""
    if interval is not None:
        _own_cores()  # the window starts now (else: at the last sample, as the host's)
    load = host_load(interval=interval)
    own = _own_cores()
    with _IN_FLIGHT_LOCK:
        alone = _IN_FLIGHT[0] == 0
    if load is None or not alone:
        return load
    return max(0.0, load - own)


class OthersLoad:
    """The cores other processes keep busy between successive :meth:`read` calls, from
    psutil's cumulative counters (host and this process): its ``cpu_percent`` state,
    which the caller's own readings and :func:`host_load` use, is left alone. What an
    exact run reads after each batch, to tell a change of load from noise when its pace
    moves. On a saturated host the others' share reads low while a run computes (beside
    two burners on two cores: about half their demand), the same way at each read."""

    def __init__(self) -> None:
        self._last: tuple[float, float, float] | None = None

    @staticmethod
    def _snapshot() -> tuple[float, float, float] | None:
        host = _cpu_times()
        if host is None:
            return None
        own = _process().cpu_times()
        return host[0], host[1], own.user + own.system

    def read(self) -> float | None:
        """Other processes' busy cores since the last read; None on the first read, for
        a window too short to say, or without psutil."""
        now = self._snapshot()
        last, self._last = self._last, now
        if now is None or last is None:
            return None
        wall = (now[0] - last[0]) / (os.cpu_count() or 1)  # seconds the window spans
        busy = _busy_cores(last[:2], now[:2])
        if busy is None or wall < 0.02:
            return None
        return max(0.0, busy - (now[2] - last[2]) / wall)


def _recent_load() -> float | None:
    """The load a run starting now competes with (:func:`_others_load`): the last sample
    if under 2 s old; else, if the last is under a minute old, the cores busy since it
    (psutil's counters, no wait); else a fresh 0.1 s sample. A drop-in called in a loop
    pays nothing for it: a 0.1 s sample per call made MONAI's ResNet18 64² call 0.24 s
    against MONAI's own 0.18 s."""
    now = time.monotonic()
    if _LAST_LOAD and now - _LAST_LOAD[0][0] < 2.0:
        return _LAST_LOAD[0][1]
    if _LAST_LOAD and now - _LAST_LOAD[0][0] < 60.0:
        load = _others_load(interval=None)
    else:
        load = _others_load(interval=LOAD_SAMPLE_SECONDS)
    _LAST_LOAD[:] = [(now, load)]
    return load


def _callers_threads(threads: int | None) -> tuple[int, str] | None:
    """The thread count the caller chose, and how, the most specific first: the
    ``threads`` argument, ``KRYPTON_TORCH_THREADS``, a count set with
    ``torch.set_num_threads`` (any time before the call, equal to torch's default or not:
    :func:`krypton.torch_threads.callers_count`), ``OMP_NUM_THREADS``; None where it chose
    none (the load decides)."""
    if threads is not None:
        if int(threads) < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        return int(threads), "threads="
    krypton_threads = int(library_setting("KRYPTON_TORCH_THREADS"))  # 0: not set
    if krypton_threads > 0:
        return krypton_threads, "KRYPTON_TORCH_THREADS"
    if torch_threads.scope() == torch_threads.THIS_THREAD:
        counted = torch_threads.callers_count()
    else:  # this build cannot tell a set count from the default: another count was set
        counted = torch.get_num_threads()
        counted = counted if counted != _TORCH_DEFAULT else None
    if counted is not None:
        return counted, "torch.set_num_threads"
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text), "OMP_NUM_THREADS"
    return None


@contextmanager
def host_share(threads: int | None = None) -> Iterator[HostShare]:
    """Around one run: torch's threads are the caller's choice where it made one
    (:func:`_callers_threads`), else the cores this host's other work leaves free
    (:func:`threads_for_load`). Beside two busy cores on two, exact mode with two threads
    took 62.1 s where one took 17.3 s (each small op waits at a barrier for a thread the
    scheduler put aside). The count is set for this thread only and restored when the
    run ends (:func:`krypton.torch_threads.threads_for_this_thread`): other threads, and
    the count new threads start with, are never touched."""
    chosen = _callers_threads(threads)
    if chosen is not None:
        share = HostShare(chosen[0], chosen[1], None, chosen[0])
    else:
        load = _recent_load()
        band = load_band(load)
        threads = threads_for_load(load if band is None else band)
        share = HostShare(threads, "load", load, max(1, max_threads()), band)
    with torch_threads.threads_for_this_thread(share.threads) as scope:
        share.scope[:] = [scope]
        token = _CURRENT.set(share)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT[0] += 1
        try:
            yield share
        finally:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT[0] -= 1
            _CURRENT.reset(token)
