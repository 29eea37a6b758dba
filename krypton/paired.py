"""Paired tests between two explanation methods scored on the same inputs.

Every method in a comparison runs on the same images, so their scores are paired: the
question is not whether two shares' intervals overlap but whether, input by input, one
method does better than the other more often than chance allows.

* pointing (a hit or a miss per input): McNemar's exact test — a two-sided binomial test
  on the discordant inputs (one method hits, the other misses) with p = 1/2;
* a score per input (deletion or insertion AUC): the mean of the paired differences with a
  95% bootstrap interval over inputs (``scipy.stats.bootstrap``, percentile, seeded);
* many pairs at once: Holm's step-down correction of the p-values (family-wise error).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["holm", "mcnemar", "paired_difference"]


def mcnemar(first: Sequence[bool], second: Sequence[bool]) -> dict:
    """McNemar's exact test of two methods' hits on the same inputs: ``only_first`` and
    ``only_second`` (the discordant inputs) and the two-sided ``p`` (1.0 where no input is
    discordant: nothing tells them apart)."""
    from scipy.stats import binomtest

    if len(first) != len(second):
        raise ValueError(f"paired scores need the same inputs: {len(first)} and {len(second)}")
    a, b = np.asarray(first, dtype=bool), np.asarray(second, dtype=bool)
    only_first, only_second = int(np.sum(a & ~b)), int(np.sum(~a & b))
    discordant = only_first + only_second
    p = 1.0 if discordant == 0 else float(binomtest(only_first, discordant, 0.5).pvalue)
    return {"only_first": only_first, "only_second": only_second, "p": p, "n": len(a)}


def paired_difference(
    first: Sequence[float], second: Sequence[float], seed: int = 0, resamples: int = 2000
) -> dict:
    """The mean of ``first - second`` over the same inputs with its 95% paired bootstrap
    interval (``low``, ``high``; NaN with fewer than two inputs or no spread)."""
    from scipy.stats import bootstrap

    if len(first) != len(second):
        raise ValueError(f"paired scores need the same inputs: {len(first)} and {len(second)}")
    differences = np.asarray(first, dtype=np.float64) - np.asarray(second, dtype=np.float64)
    mean = float(differences.mean()) if len(differences) else math.nan
    if len(differences) < 2 or np.ptp(differences) == 0:
        return {"mean": mean, "low": math.nan, "high": math.nan, "n": len(differences)}
    result = bootstrap(
        (differences,),
        np.mean,
        n_resamples=resamples,
        confidence_level=0.95,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    interval = result.confidence_interval
    return {"mean": mean, "low": float(interval.low), "high": float(interval.high),
            "n": len(differences)}  # fmt: skip


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the smallest times m, the
    next times m - 1, ..., each at least the one before and at most 1."""
    order = np.argsort(p_values, kind="stable")
    adjusted = [0.0] * len(p_values)
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * float(p_values[index])))
        adjusted[int(index)] = running
    return adjusted
