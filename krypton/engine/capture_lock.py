"""One process-wide lock between graph capture and model execution.

``torch.fx.symbolic_trace`` patches ``nn.Module.__call__`` (and ``__getattr__``) for the
whole process while it traces. Two captures at once corrupt each other, and a model that
runs in another thread during a capture is routed into the tracer and fails. So capture
takes this lock exclusively, and every forward pass Krypton makes takes it shared: forwards
run in parallel with each other, never during a capture. Writers are preferred, so a
capture waits only for the forward passes already running (one batch each), never for a
whole occlusion run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CaptureLock", "CAPTURE_LOCK"]


class CaptureLock:
    """A writer-preferring readers-writer lock; shared holds are re-entrant per thread."""

    def __init__(self) -> None:
        self._condition = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer: int | None = None  # thread id holding it exclusively
        self._writers_waiting = 0
        self._local = threading.local()

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Held while a model runs (forward passes may overlap each other)."""
        me = threading.get_ident()
        depth = getattr(self._local, "depth", 0)
        if depth or self._writer == me:  # nested, or inside our own capture
            self._local.depth = depth + 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        with self._condition:
            while self._writer is not None or self._writers_waiting:
                self._condition.wait()
            self._readers += 1
        self._local.depth = 1
        try:
            yield
        finally:
            self._local.depth = 0
            with self._condition:
                self._readers -= 1
                if not self._readers:
                    self._condition.notify_all()

    @contextmanager
    def lent(self) -> Iterator[None]:
        """Held by a worker thread computing part of a batch for a thread that holds the
        shared lock and waits for it: counts as that hold (no capture can start until the
        lender releases it), so a waiting capture cannot block the worker."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held while a graph is captured: no other capture and no forward pass runs."""
        me = threading.get_ident()
        if getattr(self._local, "depth", 0):
            raise RuntimeError(
                "a graph capture was started while this thread runs a model; capture before running"
            )
        with self._condition:
            self._writers_waiting += 1
            try:
                while self._writer is not None or self._readers:
                    self._condition.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = me
        try:
            yield
        finally:
            with self._condition:
                self._writer = None
                self._condition.notify_all()


CAPTURE_LOCK = CaptureLock()
