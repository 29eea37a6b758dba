"""What a hostile request costs the server: peak RSS growth (psutil, sampled every 20 ms)
and the slowest answer a light callback from another tab got meanwhile. Used by the
security tests and ``make bench-hostile``."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

from bench.dash_client import Server, Tab, light_callback

__all__ = [
    "Cost", "closed_by_peer", "light_callback", "light_limit", "measured", "slow_sockets",
    "trickle",
]  # fmt: skip


def light_limit(idle_seconds: float) -> float:
    """The bar for a light callback's answer while a hostile request runs: ``idle_seconds``
    on a host with a core free, times the runnable processes per core over the last minute
    where there are more (each answer then waits its turn for a core: beside four burners
    and a test suite, load 6-7 on 2 cores, one answer in eleven took 1.09 s while the
    export it ran beside never held the interpreter lock over 17 ms). A request that
    stalls the server stalls it at any load and still shows; on an idle host the bar is
    ``idle_seconds`` itself."""
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return idle_seconds * max(1.0, per_core)


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


def slow_sockets(port: int, count: int, address: str = "127.0.0.2") -> list[socket.socket]:
    """``count`` connections from ``address``, each having sent one byte of a request."""
    opened = []
    for _ in range(count):
        connection = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        connection.settimeout(5)
        try:
            connection.bind((address, 0))
            connection.connect(("127.0.0.1", port))
            connection.sendall(b"G")
        except OSError:
            connection.close()
            continue
        opened.append(connection)
    return opened


def trickle(connections: list[socket.socket], data: bytes = b"E") -> int:
    """One more byte on each connection still open; how many took it."""
    alive = 0
    for connection in connections:
        try:
            connection.sendall(data)
            alive += 1
        except OSError:
            pass
    return alive


def closed_by_peer(connection: socket.socket) -> bool:
    """True when the other end has closed ``connection`` (EOF or reset) within 3 s."""
    connection.settimeout(3)
    try:
        return connection.recv(4096) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
