"""One clock for every timing the engine takes (the planner's first-batch and naive
timings, the strategy monitor's probes, the per-layer profile, a run's seconds).

On the CPU it is the wall clock. On a card, kernels run asynchronously: a
``time.perf_counter()`` read right after a launch measures the launch, not the work (on
one H200 the planner's probe read 71 ms per position for r3d_18 where a whole naive run
cost 0.62 ms, and chose the strategy 2.8x slower). So every reading waits for the queued
work to finish first (``torch.cuda.synchronize``), and the first run of each kind on a
card — cuDNN's algorithm search, lazy initialisation — is a warm-up that is not timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch

__all__ = ["DeviceClock"]


class DeviceClock:
    """Seconds of work done on ``device``.

    Args:
        device: where the work runs.
        synchronize: waits for the device's queued work; default
            ``torch.cuda.synchronize(device)`` on a card and nothing on the CPU (tests
            inject their own to see that every reading waits).
        warm_up: whether the first run of each kind is left untimed; default on every
            device but the CPU.
    """

    def __init__(
        self,
        device: torch.device,
        synchronize: Callable[[], None] | None = None,
        warm_up: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        if synchronize is None:
            synchronize = _synchronizer(self.device)
        self._synchronize = synchronize
        self.warm_up = self.device.type != "cpu" if warm_up is None else warm_up
        self._warm: set[Hashable] = set()

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


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
