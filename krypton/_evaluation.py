"""One explain() call's evaluation of positions, batch by batch: exact values by the
cheaper of incremental and naive inference (timed side by side in this call), the
progress it reports and the MACs it spends."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from torch import nn

from .capture_lock import CAPTURE_LOCK
from .engine import ExecutionPlan
from .engine.plan import measured_plan, reused_plan


class Explaining(Protocol):
    """What a run reads of its OcclusionExplainer: the model, the plans this host
    measured, and how it builds full occluded images."""

    model: nn.Module
    measured_plans: dict

    def _occluded_batch(
        self, image: torch.Tensor, occluder: torch.Tensor, ys: np.ndarray, xs: np.ndarray
    ) -> torch.Tensor: ...


class _Run:
    """Evaluates batches of positions for one explain() call and keeps its accounting."""

    def __init__(
        self,
        explainer: Explaining,
        image,
        occluder,
        label,
        batch_size,
        graph,
        views,
        progress,
        macs_per_image,
        keep_all: bool = False,
    ):
        self.explainer, self.image, self.occluder = explainer, image, occluder
        self.keep_all = keep_all
        self.label, self.batch_size = label, batch_size
        self.graph, self.views, self.progress = graph, views, progress
        self.macs_per_image = macs_per_image
        self.evaluated = self.macs_spent = self.macs_naive = 0
        self.total = 0
        self.plan: ExecutionPlan | None = None
        self.timed_in_this_call = False  # both strategies were timed by this run

    def timing(self) -> dict | None:
        """Both strategies' ms per position, when this call timed them on the same
        positions (None otherwise)."""
        if not self.timed_in_this_call or self.plan is None or self.plan.timings is None:
            return None
        incremental_seconds, naive_seconds = self.plan.timings
        return {
            "incremental_ms_per_position": incremental_seconds * 1e3,
            "naive_ms_per_position": naive_seconds * 1e3,
            "strategy": self.plan.strategy,
        }

    def _full_macs(self, ys: np.ndarray, xs: np.ndarray, patch: int) -> int:
        """MACs of one full inference, from the captured graph (eq 10)."""
        geometry = self.graph.geometry(ys[:1], xs[:1], patch, patch)
        return self.graph.macs_per_position(geometry)[1]

    def expect(self, total: int) -> None:
        """Set the total reported to progress (drill-down refines it after stage one)."""
        self.total = max(total, self.evaluated)

    def evaluate_exact(
        self, ys: np.ndarray, xs: np.ndarray, patch: int, strategy: str = "auto"
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Exact probabilities by the cheaper of incremental and naive inference.

        The static plan (:func:`krypton.engine.plan.static_plan`) rules out incremental
        inference where the FLOPs it can avoid cannot pay for its own work. Otherwise,
        when the run has at least two batches and this host has not timed this model
        yet, the first batch runs incrementally and is timed against a naive inference of
        the same positions, and the faster per position computes every value of the run
        (``self.plan`` says which and why). Both are exact, but they round differently
        in the last bit: one strategy per heatmap keeps a heatmap's bytes independent of
        what the process ran before. ``strategy`` "incremental" or "naive" forces one.
        """
        geometry = self.graph.geometry(ys, xs, patch, patch)
        static = self.graph.plan(geometry)
        if strategy != "auto":
            forced = "incremental" if strategy == "incremental" else "naive"
            self.plan = dataclasses.replace(
                static, strategy=forced, reason=f"forced (strategy='{strategy}'); {static.reason}"
            )
            return self.evaluate(ys, xs, patch, naive=forced == "naive", geometry=geometry)
        key = (tuple(self.image.shape), patch, self.batch_size)
        known = self.explainer.measured_plans.get(key)
        count, batch = len(ys), self.batch_size
        if not static.incremental or known is not None or count < 2 * batch:
            self.plan = static if (not static.incremental or known is None) else reused_plan(known)
            return self.evaluate(ys, xs, patch, naive=not self.plan.incremental, geometry=geometry)
        # Time one batch both ways on this host (the same positions, the same batch size).
        began = time.perf_counter()
        first = self.evaluate(ys[:batch], xs[:batch], patch)
        incremental_seconds = (time.perf_counter() - began) / batch
        naive_seconds, check = self._time_naive(ys[:batch], xs[:batch])
        self.plan = measured_plan(static, incremental_seconds, naive_seconds)
        if not self.plan.incremental:
            # Overturning the static plan pins naive for this process: one stall in the
            # first timing (a page rendering, a collector) must not decide it. Time both
            # once more and keep the faster of each.
            began = time.perf_counter()  # as the first timing: geometry and the batch
            first_batch = self.graph.geometry(ys[:batch], xs[:batch], patch, patch)
            self.graph.run_batch(self.views, first_batch, slice(0, batch), self.occluder)
            incremental_seconds = min(incremental_seconds, (time.perf_counter() - began) / batch)
            naive_seconds = min(naive_seconds, self._time_naive(ys[:batch], xs[:batch])[0])
            self.plan = measured_plan(static, incremental_seconds, naive_seconds, repeats=2)
        self.explainer.measured_plans[key] = self.plan
        self.timed_in_this_call = True
        if not self.plan.incremental:  # the first batch's values by the chosen strategy too
            softmax = torch.softmax(check.float(), dim=1).cpu().numpy()
            first = (
                softmax[:, self.label].astype(np.float32),
                None if first[1] is None else softmax.astype(first[1].dtype),
            )
        rest = self.evaluate(ys[batch:], xs[batch:], patch, naive=not self.plan.incremental)
        probabilities = np.concatenate([first[0], rest[0]])
        every = None
        if first[1] is not None:
            every = np.concatenate([first[1], rest[1]])
        return probabilities, every

    def _naive_logits(self, ys: np.ndarray, xs: np.ndarray) -> torch.Tensor:
        """Logits of full inferences of the image occluded at these positions."""
        occluded = self.explainer._occluded_batch(self.image, self.occluder, ys, xs)
        with CAPTURE_LOCK.shared():
            return self.explainer.model(occluded)

    def _time_naive(self, ys: np.ndarray, xs: np.ndarray) -> tuple[float, torch.Tensor]:
        """Seconds per position of a naive inference of these positions, and its logits."""
        began = time.perf_counter()
        logits = self._naive_logits(ys, xs)
        return (time.perf_counter() - began) / len(ys), logits

    def evaluate(
        self,
        ys: np.ndarray,
        xs: np.ndarray,
        patch: int,
        tau: float = 1.0,
        naive: bool = False,
        geometry=None,
        on_batch: Callable[[int, np.ndarray], None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Probabilities of the label with the patch at each (x, y), batch by batch, and
        (when kept) every class's: (count,), (count, classes) or None. ``on_batch(done,
        probabilities)`` sees the first ``done`` values after each batch."""
        count = len(ys)
        probabilities = np.empty(count, dtype=np.float32)
        every = None
        if count == 0:
            return probabilities, every
        if naive:
            macs = self.macs_per_image if self.graph is None else self._full_macs(ys, xs, patch)
            self.macs_spent += macs * count
            self.macs_naive += macs * count
        else:
            if geometry is None:
                geometry = self.graph.geometry(ys, xs, patch, patch, tau)
            incremental, full = self.graph.macs_per_position(geometry)
            self.macs_spent += incremental * count
            self.macs_naive += full * count
        for begin in range(0, count, self.batch_size):
            batch = slice(begin, min(begin + self.batch_size, count))
            if naive:
                logits = self._naive_logits(ys[batch], xs[batch])
            else:
                logits = self.graph.run_batch(self.views, geometry, batch, self.occluder)
            softmax = torch.softmax(logits.float(), dim=1)
            probabilities[batch] = softmax[:, self.label].cpu().numpy()
            if self.keep_all:
                if every is None:
                    large = count * softmax.shape[1] > 1_000_000
                    every = np.empty(
                        (count, softmax.shape[1]), dtype=np.float16 if large else np.float32
                    )
                every[batch] = softmax.cpu().numpy()
            self.evaluated += batch.stop - batch.start
            if self.progress is not None:
                self.progress(self.evaluated, max(self.total, self.evaluated))
            if on_batch is not None:
                on_batch(batch.stop, probabilities)
        return probabilities, every
