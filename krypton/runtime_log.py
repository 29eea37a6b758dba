"""The per-host runtime log: every finished run, one JSON line each, which the runtime
estimates (krypton.estimator) refit from and calibrate their ranges on. A line holds the
model, mode, patch, positions (stage one, stage two), seconds, when, and where known the
estimate the run was given, the load it met, its torch threads and, for an exact run,
the naive run its speed line stated."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import torch

__all__ = ["RECENT_RUNS", "as_naive", "logged_runs", "record_run", "runtime_log_path"]

RECENT_RUNS = 40  # the estimate follows this host's recent load, not last month's
_log_lock = threading.Lock()


def runtime_log_path() -> Path:
    """The per-host log of finished runs: $KRYPTON_HOME/runtime-log.jsonl."""
    from .registry.entries import krypton_home

    return krypton_home() / "runtime-log.jsonl"


def record_run(
    model_name: str,
    mode: str,
    patch: int,
    counts: tuple[int, int],
    seconds: float,
    path: Path | None = None,
    *,
    estimated: float | None = None,
    load: float | None = None,
    threads: int | None = None,
    stated_naive: tuple[int, float] | None = None,
    computed: tuple[int, float] | None = None,
    naive_probe_ms: float | None = None,
    schedules: dict | None = None,
    cold: bool = False,
) -> None:
    """Append one finished run (positions as planned: stage one, stage two) to the log,
    with the estimate it was given (``estimated`` seconds: the ranges are calibrated on
    these errors, :func:`conformal_ratios`), the cores other work kept busy as it started
    and the torch ``threads`` it ran with (default: this process's now; the fit compares
    runs at one load, :func:`row_load_factor`). ``stated_naive``: an exact run's (positions,
    seconds) of the naive run its speed line stated, which the naive figure shown before
    the next run learns from (krypton.estimator.estimate_for_counts' ``stated``).
    ``computed``: (positions, seconds) its batches of positions took, without the costs
    around them (a naive run's pace per position, krypton.estimator.naive_pace).
    ``naive_probe_ms``: an exact run's naive timing of a few of its positions, per
    position (later speed lines take the median of several:
    krypton.estimator.probed_naive_pace). ``schedules``: the batch schedule each kind of
    batch ran on (``heatmap.extra["host"]["decisions"]``, krypton.schedule): the row keeps
    the schedule, its margin, its load band and whether this run measured it. ``cold``:
    the run paid costs its process pays once (loading the model, capturing its graph,
    measuring a batch schedule): a fresh process's first run took 4.0 s against the 1.1 s
    its like took after, and was learnt from as any run; the estimates leave such rows out
    (:func:`logged_runs`' ``warm``)."""
    path = path or runtime_log_path()
    row = {
        "model": model_name,
        "mode": mode,
        "patch": int(patch),
        "stage_one": int(counts[0]),
        "stage_two": int(counts[1]),
        "seconds": round(float(seconds), 4),
        "when": time.time(),
    }
    if estimated is not None and math.isfinite(estimated) and estimated > 0:
        row["estimated"] = round(float(estimated), 4)
    if load is not None and math.isfinite(load) and load >= 0:
        row["load"] = round(float(load), 3)
        row["threads"] = int(threads or torch.get_num_threads())
    if stated_naive is not None and stated_naive[0] > 0 and stated_naive[1] > 0:
        row["naive_positions"] = int(stated_naive[0])
        row["naive_seconds"] = round(float(stated_naive[1]), 4)
    if computed is not None and computed[0] > 0 and computed[1] > 0:
        row["computed_positions"] = int(computed[0])
        row["computing_seconds"] = round(float(computed[1]), 4)
    if naive_probe_ms is not None and math.isfinite(naive_probe_ms) and naive_probe_ms > 0:
        row["naive_probe_ms"] = round(float(naive_probe_ms), 3)
    if cold:
        row["cold"] = True
    if schedules:
        row["schedules"] = {
            kind: {key: record.get(key) for key in ("schedule", "margin", "band", "measured")}
            for kind, record in schedules.items()
        }
    line = json.dumps(row)
    with _log_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as handle:
            handle.write(line + "\n")


def logged_runs(
    model_name: str,
    mode: str | None,
    patch: int | None,
    path: Path | None = None,
    limit: int = RECENT_RUNS,
    warm: bool = False,
) -> list[dict]:
    """The most recent logged runs of (model, mode, patch), oldest first (``mode`` or
    ``patch`` None: every one); ``warm``: only runs that paid no one-off cost of their
    process (:func:`record_run`'s ``cold``), the ones whose times say how fast runs go."""
    path = path or runtime_log_path()
    if not path.exists():
        return []
    rows = []
    with _log_lock, open(path) as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if (
                row.get("model") == model_name
                and (mode is None or row.get("mode") == mode)
                and (patch is None or row.get("patch") == patch)
                and not (warm and row.get("cold"))
            ):
                rows.append(row)
    return rows[-limit:]


def as_naive(row: dict) -> dict:
    """An exact run's log row as the naive run its speed line stated (its positions and
    seconds), at the load and threads the exact run met; no estimate to judge."""
    naive = {k: v for k, v in row.items() if k not in ("estimated", "naive_seconds")}
    naive.update(mode="naive", stage_one=int(row["naive_positions"]), stage_two=0,
                 seconds=float(row["naive_seconds"]))  # fmt: skip
    return naive
