"""Background callbacks that run in threads of the server process.

Dash's DiskcacheManager starts each background job in a forked process. PyTorch's CPU
thread pool (OpenMP) does not survive fork: the first parallel operation in the child
deadlocks. Running jobs in threads instead avoids that and lets every job share the loaded
models, captured graphs and materialised views held by this process — which is what makes
refinement reuse work. Results, progress and the signing secret still go through the
diskcache, so this is Dash's own background-callback protocol with a different executor.

Threads cannot be killed, so cancellation is cooperative: ``terminate_job`` sets a flag
that the running job reads through :func:`check_cancelled` (the engine calls it from its
progress hook after every batch).
"""
from __future__ import annotations

import itertools
import threading

from dash import DiskcacheManager

__all__ = ["ThreadedDiskcacheManager", "JobCancelled", "check_cancelled"]


class JobCancelled(Exception):
    """Raised inside a job whose Cancel button was pressed."""


_job_ids = itertools.count(1)
_jobs: dict[int, tuple[threading.Thread, threading.Event]] = {}
_current = threading.local()
_lock = threading.Lock()


def check_cancelled() -> None:
    """Raise JobCancelled if the job running in this thread has been cancelled."""
    event = getattr(_current, "cancel", None)
    if event is not None and event.is_set():
        raise JobCancelled()


class ThreadedDiskcacheManager(DiskcacheManager):
    """DiskcacheManager whose jobs are threads of this process (see module docstring)."""

    def call_job_fn(self, key, job_fn, args, context):
        job = next(_job_ids)
        cancel = threading.Event()

        def run():
            _current.cancel = cancel
            try:
                job_fn(key, self._make_progress_key(key), args, context)
            finally:
                with _lock:
                    _jobs.pop(job, None)

        thread = threading.Thread(target=run, name=f"krypton-job-{job}", daemon=True)
        with _lock:
            _jobs[job] = (thread, cancel)
        thread.start()
        return job

    def terminate_job(self, job):
        if job is None:
            return
        with _lock:
            entry = _jobs.get(int(job))
        if entry is not None:
            entry[1].set()

    def terminate_unhealthy_job(self, job):
        return False  # a thread that ended has already removed itself

    def job_running(self, job):
        with _lock:
            entry = _jobs.get(int(job))
        return entry is not None and entry[0].is_alive()
