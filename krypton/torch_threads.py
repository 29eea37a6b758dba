"""Torch's intra-op threads for one thread of the caller's process, and no other.

``torch.set_num_threads(n)`` sets the calling thread's OpenMP and MKL counts *and* a
process-wide count that every thread copies when it first runs torch work. A run that
lowered its threads that way pinned a server's request thread whose first torch work fell
inside the run to one thread for its life (21 of 24 concurrent calls). So a run sets its
own thread's counts only (:func:`threads_for_this_thread`: OpenMP's ``omp_set_num_threads``
and MKL's ``mkl_set_num_threads_local``, both per thread, through torch's own libraries)
and restores them when it ends; the process count stays the caller's.

The same per-thread counts tell what the caller chose (:func:`callers_count`): torch
stores a count set with ``torch.set_num_threads`` as this thread's MKL count, and a thread
started later copies it, so a count set before ``import krypton``, or equal to torch's
default, reads as set; a process that never set one reads as unset.

Where torch's libraries do not show these functions (a build on another threading
runtime), the count is set process-wide as ``torch.set_num_threads`` does and restored
after the run, and :func:`scope` says so: the run's host record carries it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "THIS_THREAD",
    "PROCESS",
    "scope",
    "callers_count",
    "process_count",
    "set_for_this_thread",
    "threads_for_this_thread",
]

THIS_THREAD, PROCESS = "this thread", "process"

_RUNTIME: list = []  # [ctypes handle or None], found once


def _runtime():  # type: ignore[no-untyped-def]
    """torch's CPU library, where it exports OpenMP's and MKL's per-thread setters; else
    None."""
    if not _RUNTIME:
        handle = None
        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        try:
            library = ctypes.CDLL(path)
            for name in ("omp_set_num_threads", "MKL_Set_Num_Threads_Local"):
                getattr(library, name)
            library.MKL_Set_Num_Threads_Local.restype = ctypes.c_int
            library.MKL_Set_Num_Threads_Local.argtypes = [ctypes.c_int]
            library.omp_set_num_threads.argtypes = [ctypes.c_int]
            handle = library
        except (OSError, AttributeError):
            handle = None
        _RUNTIME.append(handle)
    return _RUNTIME[0]


def scope() -> str:
    """Where a run's thread count applies: :data:`THIS_THREAD`, or :data:`PROCESS` on a
    torch build without the per-thread setters."""
    return THIS_THREAD if _runtime() is not None else PROCESS


def _mkl_local() -> int:
    """This thread's MKL count as torch set it (0: none set), read without changing it."""
    runtime = _runtime()
    torch.get_num_threads()  # torch's first look in a thread copies the process count
    previous = runtime.MKL_Set_Num_Threads_Local(0)
    runtime.MKL_Set_Num_Threads_Local(previous)
    return int(previous)


def process_count() -> tuple[int, bool]:
    """The torch threads a thread started now gets, and whether a caller set that count
    (``torch.set_num_threads``, anywhere in the process): read in a fresh thread."""
    seen: list[tuple[int, bool]] = []

    def look() -> None:
        local = _mkl_local() if _runtime() is not None else 0
        seen.append((torch.get_num_threads(), local > 0))

    probe = threading.Thread(target=look, name="krypton-thread-probe", daemon=True)
    probe.start()
    probe.join()
    return seen[0] if seen else (torch.get_num_threads(), False)


def callers_count() -> int | None:
    """The count the caller set with ``torch.set_num_threads`` (before or after importing
    Krypton, equal to torch's default or not): this thread's, else the one the process's
    new threads copy; None where none was set (or this build cannot tell: then
    :mod:`krypton.host` compares with the count at import)."""
    if _runtime() is None:
        return None
    if _mkl_local() > 0:
        return torch.get_num_threads()
    count, was_set = process_count()
    return count if was_set else None


def set_for_this_thread(count: int) -> None:
    """Run this thread's torch work on ``count`` threads; other threads, and the count new
    threads copy, keep theirs (process-wide on a build without per-thread setters)."""
    runtime = _runtime()
    if runtime is None:
        if torch.get_num_threads() != count:
            torch.set_num_threads(count)
        return
    torch.get_num_threads()  # torch's first look in a thread would overwrite the count
    runtime.omp_set_num_threads(int(count))
    runtime.MKL_Set_Num_Threads_Local(int(count))


@contextmanager
def threads_for_this_thread(count: int) -> Iterator[str]:
    """Within: this thread's torch work on ``count`` threads (:func:`set_for_this_thread`);
    after: this thread's counts as they were. Yields :func:`scope`."""
    runtime = _runtime()
    before = torch.get_num_threads()
    mkl_before = _mkl_local() if runtime is not None else 0
    set_for_this_thread(count)
    try:
        yield scope()
    finally:
        if runtime is None:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
        else:
            runtime.omp_set_num_threads(before)
            runtime.MKL_Set_Num_Threads_Local(mkl_before)
