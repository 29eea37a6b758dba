"""How far an estimate's range must reach for the load there is (krypton.estimator).

An estimate is scaled to the load now by :func:`krypton.host.load_factor`, a model of how
threads share cores. Where this host has logged runs at a like load, their errors set the
range (split-conformal) and the model is not leaned on. Where it has not — the shipped
calibration was measured on an idle machine, or the runs logged met other loads — the
model extrapolates, and on a host at load 12-35 its ranges held 1 run of 7 (a Compare
"65.6-87.5 s" took 330 s, a PACS volume "3.4-5.3 s" 28.3 s). So the range also reaches:

- **by the distance** from the loads it learned from: the ratio ``d`` of the load factor
  now to the nearest logged run's (1.0 for the calibration), ``d ** 0.5`` either way:
  the model may be as wrong as half its extrapolation, in either direction;
- **by the load's spread**: the load factors of the host's recent samples, highest over
  the one now on the high side, lowest on the low side: a run meets the load that comes
  while it runs, not the 0.1 s sample before it.

From ``d`` of :data:`UNCERTAIN_DISTANCE` on, the estimate says it is uncertain (no run
here met a load like this), rather than give a narrow range it has no grounds for.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Protocol, TypeVar

from .host import load_factor

__all__ = ["UNCERTAIN_DISTANCE", "UNCERTAIN", "load_distance", "widened_for_load"]

# a load factor this many times the nearest one learned from: the estimate says so
UNCERTAIN_DISTANCE = 2.0
UNCERTAIN = "uncertain: no run here met a load like this one"


class _Ranged(Protocol):  # krypton.estimator.Estimate (a frozen dataclass)
    @property
    def low(self) -> float: ...

    @property
    def high(self) -> float: ...

    @property
    def source(self) -> str: ...


R = TypeVar("R", bound=_Ranged)


def load_distance(load: float, logged: Sequence[dict]) -> float:
    """How many times the load factor at ``load`` is from the nearest of the ``logged``
    runs' (their load and threads; none logged: the calibration's idle machine, 1.0),
    either way: 1.0 at a load met before."""
    now = load_factor(load)
    learned = [load_factor(row.get("load"), threads=row.get("threads")) for row in logged]
    return min((max(now / f, f / now) for f in learned or [1.0]), default=1.0)


def widened_for_load(
    found: R,
    load: float | None,
    logged: Sequence[dict],
    like_load: bool,
    loads: Sequence[float] | None = None,
) -> R:
    """``found`` (an Estimate) with its range reaching for the load: by the distance of
    ``load`` from the ``logged`` runs' loads (none where ``like_load``: its range came
    from runs at a like load) and by the spread of the host's recent ``loads``; its
    source says so, and says "uncertain" from :data:`UNCERTAIN_DISTANCE` on. ``load``
    None: ``found`` as it is."""
    if load is None or not math.isfinite(load):
        return found
    distance = 1.0 if like_load else load_distance(load, logged)
    now = load_factor(load)
    samples = [x for x in loads or () if x is not None and math.isfinite(x)]
    factors = [now, *(load_factor(x) for x in samples)]
    up, down = max(factors) / now, now / min(factors)
    reach = math.sqrt(distance)
    if reach * up <= 1.0001 and reach * down <= 1.0001:
        return found
    notes = []
    if distance > 1.0001:
        notes.append(f"widened {reach:.1f}x for a load {distance:.1f}x from the runs it rests on")
    if up > 1.0001 or down > 1.0001:
        seen = [load, *samples]
        notes.append(
            f"widened for the host's load moving between {min(seen):.1f} and {max(seen):.1f}"
            f" busy cores of {os.cpu_count() or 1}"
        )
    if distance >= UNCERTAIN_DISTANCE:
        notes.append(UNCERTAIN)
    return dataclasses.replace(  # type: ignore[type-var]
        found,
        low=max(found.low / (reach * down), 0.0),
        high=found.high * reach * up,
        source="; ".join([found.source, *notes]),
    )
