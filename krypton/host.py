"""This host as a run meets it: the cores its other work keeps busy now
(:func:`host_load`), the torch threads a run starting beside that work gets
(:func:`threads_for_load`, set by :func:`share_host`) and how much longer the run takes
there than on an idle host (:func:`load_factor`). The estimator scales its estimates by
these; the app's and workers' runs share the host through :func:`share_host`."""

from __future__ import annotations

import math
import os

import torch

__all__ = [
    "LOAD_SAMPLE_SECONDS",
    "host_load",
    "max_threads",
    "threads_for_load",
    "load_factor",
    "share_host",
]

LOAD_SAMPLE_SECONDS = 0.1


def host_load(interval: float = LOAD_SAMPLE_SECONDS) -> float | None:
    """Cores this host's work keeps busy now (every process, this one's other runs
    included), sampled over ``interval`` seconds: what a run starting now competes with
    (None without psutil). Estimates scale to it and each logged run records it."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.cpu_percent(interval=interval) / 100 * (psutil.cpu_count() or 1)


_MAX_THREADS: list[int] = []  # the process's torch threads when first asked


def max_threads() -> int:
    """The torch threads this process was set up with (OMP_NUM_THREADS, a worker's
    KRYPTON_TORCH_THREADS, else every core), read once, before any run lowers them."""
    if not _MAX_THREADS:
        _MAX_THREADS.append(torch.get_num_threads())
    return _MAX_THREADS[0]


def threads_for_load(load: float | None, cores: int | None = None) -> int:
    """Torch threads for a run that starts while other work keeps ``load`` cores busy:
    the cores left, at least one, at most :func:`max_threads`. Beside two burners on two
    cores, exact mode took 18.4 s with two threads (each op waits at a barrier for a
    thread the scheduler has put aside) and 9.6 s with one; naive 30.2 s and 26.5 s."""
    cores = cores or os.cpu_count() or 1
    busy = 0 if load is None or not math.isfinite(load) else max(0, round(load))
    return max(1, min(max_threads(), cores - busy))


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
    """Take this host's share for a run starting now: sample the cores its other work
    keeps busy (:func:`host_load`, unless ``load`` is given) and set this process's torch
    threads to the cores left (:func:`threads_for_load`). Returns the load, which the
    run's estimate scales to and its log row records."""
    load = host_load() if load is None else load
    threads = threads_for_load(load)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return load
