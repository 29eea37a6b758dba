"""One clock for every timing the engine takes (the planner's first-batch and naive
timings, the strategy monitor's probes, the per-layer profile, a run's seconds).

On the CPU it is the wall clock. On a card, kernels run asynchronously: a
``time.perf_counter()`` read right after a launch measures the launch, not the work (on
one H200 the planner's probe read 71 ms per position for r3d_18 where a whole naive run
cost 0.62 ms, and chose the strategy 2.8x slower). So every reading waits for the queued
work to finish first (``torch.cuda.synchronize``), and the first run of each kind on a
card — cuDNN's algorithm search, lazy initialisation — is a warm-up that is not timed.

A run's batches are timed without draining the queue: :meth:`DeviceClock.mark` records an
event on the card's stream, and the run waits for a batch's end mark only once the next
batch is queued (:meth:`DeviceClock.between`), so the host launches batch k+1 while the
card computes batch k. On the CPU a mark is the time now.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch

__all__ = ["DeviceClock"]


class Event(Protocol):
    """What the clock uses of ``torch.cuda.Event`` (tests pass a stand-in)."""

    def record(self) -> None: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: Any) -> float: ...


class DeviceClock:
    """Seconds of work done on ``device``.

    Args:
        device: where the work runs.
        synchronize: waits for the device's queued work; default
            ``torch.cuda.synchronize(device)`` on a card and nothing on the CPU (tests
            inject their own to see that every reading waits).
        warm_up: whether the first run of each kind is left untimed; default on every
            device but the CPU.
        event: makes the events that :meth:`mark` records in the device's queue; default
            a timing ``torch.cuda.Event`` on a card, none on the CPU (marks read the
            time).
    """

    def __init__(
        self,
        device: torch.device,
        synchronize: Callable[[], None] | None = None,
        warm_up: bool | None = None,
        event: Callable[[], Event] | None = None,
    ) -> None:
        self.device = torch.device(device)
        if synchronize is None:
            synchronize = _synchronizer(self.device)
        self._synchronize = synchronize
        self.warm_up = self.device.type != "cpu" if warm_up is None else warm_up
        self._warm: set[Hashable] = set()
        if event is None and self.device.type == "cuda":
            event = functools.partial(_CardEvent, self.device)
        self._event = event

    @property
    def queued(self) -> bool:
        """Whether work is queued (a card): marks are events, values arrive later."""
        return self._event is not None

    def mark(self) -> Any:
        """A point in the device's queue, not waited for: an event recorded on a card's
        stream, the time now on the CPU."""
        if self._event is None:
            return time.perf_counter()
        event = self._event()
        event.record()
        return event

    def between(self, start: Any, end: Any) -> float:
        """Seconds of device work from mark ``start`` to mark ``end``; waits for the
        work queued before ``end`` only (later work stays queued)."""
        if self._event is None:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def now(self) -> float:
        """A reading taken once the work queued so far has finished."""
        self._synchronize()
        return time.perf_counter()

    def cold(self, kind: Hashable) -> bool:
        """True (once) when work of this ``kind`` (a strategy on a shape) has not run on
        this device yet and must run once untimed before it is timed."""
        if not self.warm_up or kind in self._warm:
            return False
        self._warm.add(kind)
        return True


class _CardEvent:
    """A timing CUDA event recorded on ``device``'s current stream."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event(enable_timing=True)
        self._stream = torch.cuda.current_stream(device)

    def record(self) -> None:
        self._event.record(self._stream)

    def synchronize(self) -> None:
        self._event.synchronize()

    def elapsed_time(self, end: _CardEvent) -> float:
        return self._event.elapsed_time(end._event)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
