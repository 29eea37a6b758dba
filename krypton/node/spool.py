"""The AI node's spool: the instances a PACS routed to the node, on disk by series, and
what became of each series, kept across restarts.

A series is *receiving* while instances arrive; once none has arrived for the stable
time it is *queued*, then *done* (its result is in the study, or was already),
*skipped* (no model here is made for it, or it is one of Krypton's own results) or
*failed*, each with its reason (a series skipped or failed is taken again when it is
delivered again: more of it may have come). The state is one JSON file written atomically
(``state.json``); a node that stops mid-run finds the series *queued* again on restart
and explains it again, and the result key (:func:`krypton.pacs.results.result_key`)
keeps the PACS from receiving it twice. An instance of a series that is done already is
not kept. The spool never holds more than its quota: an instance that would pass it is
refused before it is written. A series' files are removed once its result is stored.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["SeriesState", "Spool", "STATES"]

STATES = ("receiving", "queued", "done", "skipped", "failed")


@dataclass
class SeriesState:
    """One series the node received: its study, modality, how many instances and bytes,
    when the last arrived, who sent it, its state and the reason for it."""

    series: str
    study: str
    modality: str
    caller: str
    instances: int = 0
    size: int = 0
    last_received: float = 0.0
    state: str = "receiving"
    reason: str = ""
    updated: float = field(default_factory=time.time)


class Spool:
    """Received instances under ``folder`` (one folder per series), at most
    ``quota_bytes`` of them on disk at once; a series is stable ``stable_seconds`` after
    its last instance."""

    def __init__(self, folder: Path, quota_bytes: int, stable_seconds: float) -> None:
        self.folder = Path(folder)
        self.quota_bytes = int(quota_bytes)
        self.stable_seconds = float(stable_seconds)
        self._lock = threading.Lock()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._series: dict[str, SeriesState] = self._read()
        for state in self._series.values():  # a run the node did not finish: again
            if state.state in ("queued", "receiving"):
                state.state, state.last_received = "receiving", 0.0
        self._write()

    def _read(self) -> dict[str, SeriesState]:
        path = self.folder / "state.json"
        if not path.exists():
            return {}
        rows = json.loads(path.read_text())
        return {row["series"]: SeriesState(**row) for row in rows}

    def _write(self) -> None:
        """The state, replaced in one rename: a node killed while writing leaves the old."""
        temporary = self.folder / "state.json.tmp"
        temporary.write_text(json.dumps([asdict(s) for s in self._series.values()], indent=1))
        os.replace(temporary, self.folder / "state.json")

    def used_bytes(self) -> int:
        """Bytes of instances on disk now."""
        return sum(s.size for s in self._series.values() if self.series_folder(s.series).exists())

    def series_folder(self, series: str) -> Path:
        return self.folder / "series" / series

    def receive(self, dataset_bytes: bytes, series: str, study: str, sop: str,
                modality: str, caller: str) -> str:  # fmt: skip
        """Keep one instance (its encoded bytes): "" when kept or not needed (its
        series is done already), else the reason it is refused (the quota)."""
        with self._lock:
            state = self._series.get(series)
            if state is not None and state.state == "done":
                return ""  # re-delivered: explained once, nothing more to keep
            if self.used_bytes() + len(dataset_bytes) > self.quota_bytes:
                return (
                    f"the spool is full: {self.used_bytes() / 2**20:.0f} MB of its "
                    f"{self.quota_bytes / 2**20:.0f} MB quota held"
                )
            folder = self.series_folder(series)
            if state is None or state.state in ("failed", "skipped"):  # delivered again
                state = SeriesState(series, study, modality, caller)
                held = list(folder.glob("*.dcm"))  # a failed series' files stay: counted once
                state.instances, state.size = len(held), sum(p.stat().st_size for p in held)
                self._series[series] = state
            folder.mkdir(parents=True, exist_ok=True)
            target = folder / f"{sop}.dcm"
            replaced = target.stat().st_size if target.exists() else None  # sent again
            temporary = folder / f".{sop}.part"
            temporary.write_bytes(dataset_bytes)
            os.replace(temporary, target)  # never half an instance under its name
            state.instances += replaced is None
            state.size += len(dataset_bytes) - (replaced or 0)
            state.last_received, state.state, state.updated = time.time(), "receiving", time.time()
            self._write()
            return ""

    def take_stable(self, now: float | None = None) -> list[SeriesState]:
        """The series no instance has reached for the stable time, marked queued."""
        now = time.time() if now is None else now
        with self._lock:
            ready = [
                s for s in self._series.values()
                if s.state == "receiving" and now - s.last_received >= self.stable_seconds
            ]  # fmt: skip
            for state in ready:
                state.state, state.updated = "queued", now
            if ready:
                self._write()
            return ready

    def mark(self, series: str, state: str, reason: str = "") -> None:
        """Record what became of ``series``; its files go once it is done or skipped."""
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        with self._lock:
            found = self._series[series]
            found.state, found.reason, found.updated = state, reason, time.time()
            if state in ("done", "skipped"):
                shutil.rmtree(self.series_folder(series), ignore_errors=True)
            self._write()

    def rows(self) -> list[SeriesState]:
        """Every series the node has received, oldest first."""
        with self._lock:
            return sorted(self._series.values(), key=lambda s: s.updated)
