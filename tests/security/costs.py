"""What a hostile request costs the server: peak RSS growth (psutil, sampled every 20 ms)
and the slowest answer a light callback from another tab got meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

from bench.dash_client import Server, Tab, light_callback

__all__ = ["Cost", "light_callback", "measured"]


@dataclass
class Cost:
    baseline_mb: float
    peak_mb: float = 0.0
    light_seconds: list[float] = field(default_factory=list)

    @property
    def growth_mb(self) -> float:
        return self.peak_mb - self.baseline_mb

    @property
    def slowest_light(self) -> float:
        return max(self.light_seconds, default=0.0)


@contextmanager
def measured(server: Server, light: Tab | None = None) -> Iterator[Cost]:
    """While the block runs: the server's peak RSS and a light callback every 0.2 s."""
    process = psutil.Process(server.process.pid)
    cost = Cost(process.memory_info().rss / 2**20)
    cost.peak_mb = cost.baseline_mb
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            cost.peak_mb = max(cost.peak_mb, process.memory_info().rss / 2**20)
            stop.wait(0.02)

    def poke():
        while not stop.is_set():
            cost.light_seconds.append(light_callback(light))
            stop.wait(0.2)

    threads = [threading.Thread(target=sample)]
    if light is not None:
        threads.append(threading.Thread(target=poke))
    for thread in threads:
        thread.start()
    try:
        yield cost
        time.sleep(0.1)  # a last sample after the answer
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
