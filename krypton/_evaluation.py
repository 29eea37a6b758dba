"""One explain() call's evaluation of positions, batch by batch: exact values by the
cheaper of incremental and naive inference (timed side by side in this call), the
progress it reports and the MACs it spends."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
from torch import nn

from .engine import ExecutionPlan
from .engine.capture_lock import CAPTURE_LOCK
from .engine.monitor import StrategyMonitor
from .engine.plan import PatchGeometry, measured_plan, naive_probe_size, reused_plan


class Explaining(Protocol):
    """What a run reads of its OcclusionExplainer: the model, the plans this host
    measured, and how it builds full occluded images."""

    model: nn.Module
    measured_plans: dict
    monitors: dict

    def _occluded_batch(
        self, image: torch.Tensor, occluder: torch.Tensor, corners: np.ndarray
    ) -> torch.Tensor: ...


class _Run:
    """Evaluates batches of positions for one explain() call and keeps its accounting.

    Positions are ``corners``: an (N, rank) array of each patch's first cell per spatial
    axis, in the tensor's order ((y, x) for an image, (z, y, x) for a volume); ``patch``
    is its extent per axis."""

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
        # seconds spent only to choose the strategy (timing the other one on positions
        # already computed): work a naive run does not do, for the whole-run comparison
        self.deciding_seconds = 0.0

    def timing(self) -> dict | None:
        """Both strategies' ms per position, when this call timed them on the same
        positions (None otherwise)."""
        if not self.timed_in_this_call or self.plan is None or self.plan.timings is None:
            return None
        incremental_seconds, naive_seconds = self.plan.timings
        return {
            "incremental_ms_per_position": incremental_seconds * 1e3,
            "naive_ms_per_position": naive_seconds * 1e3,
            "strategy": self.plan.strategy,  # what ran at the end
            "switched": "switched to" in self.plan.reason,  # during this run
        }

    def _full_macs(self, corners: np.ndarray, patch: tuple[int, ...]) -> int:
        """MACs of one full inference, from the captured graph (eq 10)."""
        geometry = self.graph.geometry(tuple(corners[:1].T), patch)
        return self.graph.macs_per_position(geometry)[1]

    def expect(self, total: int) -> None:
        """Set the total reported to progress (drill-down refines it after stage one)."""
        self.total = max(total, self.evaluated)

    def evaluate_exact(
        self, corners: np.ndarray, patch: tuple[int, ...], strategy: str = "auto"
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Exact probabilities by the faster of incremental and naive inference.

        The static plan (:func:`krypton.engine.plan.static_plan`) rules out incremental
        inference where the FLOPs it can avoid cannot pay for its own work. Otherwise,
        when the run has at least two batches and this host has not timed this model
        yet, the first batch runs incrementally and is timed against a naive inference of
        the same positions, and the faster per position goes on. While the run goes on, a
        :class:`~krypton.engine.monitor.StrategyMonitor` times the other strategy on a
        batch now and then and switches when it is measurably faster under the load of
        the moment (``self.plan`` says what ran and why). Both are exact; they round
        differently in the last bit, so a heatmap's bytes depend on the strategy: a run
        that never switches gives the same bytes as the last one. ``strategy``
        "incremental" or "naive" forces one.
        """
        geometry = self.graph.geometry(tuple(corners.T), patch)
        static = self.graph.plan(geometry)
        if strategy != "auto":
            forced = "incremental" if strategy == "incremental" else "naive"
            self.plan = dataclasses.replace(
                static, strategy=forced, reason=f"forced (strategy='{strategy}'); {static.reason}"
            )
            return self.evaluate(corners, patch, naive=forced == "naive", geometry=geometry)
        key = (tuple(self.image.shape), patch, self.batch_size)
        known = self.explainer.measured_plans.get(key)
        count, batch = len(corners), self.batch_size
        if not static.incremental or count < 2 * batch:
            self.plan = static if (not static.incremental or known is None) else reused_plan(known)
            return self.evaluate(corners, patch, naive=not self.plan.incremental, geometry=geometry)
        if known is not None:  # measured by an earlier call: probed on, as it spaced them
            self.plan = reused_plan(known)
            monitor = self.explainer.monitors.get(key)
            if monitor is None or monitor.strategy != self.plan.strategy:
                monitor = StrategyMonitor(
                    self.plan.strategy, batches=-(-count // batch), pace=_pace(known)
                )
            else:
                monitor.next_call()
            values = self.evaluate(corners, patch, geometry=geometry, monitor=monitor)
            self._conclude(key, monitor)
            return values
        first, incremental_seconds, naive_seconds = self._time_first_batch(
            corners, patch, static, geometry
        )
        current, other = (
            (incremental_seconds, naive_seconds)
            if self.plan.incremental
            else (naive_seconds, incremental_seconds)
        )
        monitor = StrategyMonitor(
            self.plan.strategy,
            ratio=other / current if current > 0 else None,  # the other's time over this one's
            batches=-(-(count - batch) // batch),
            pace=current,
        )
        monitor.positions[self.plan.strategy] += batch
        rest = self.evaluate(
            corners[batch:],
            patch,
            monitor=monitor,
            geometry=geometry.take(slice(batch, None)),
        )
        self._conclude(key, monitor)
        probabilities = np.concatenate([first[0], rest[0]])
        every = None
        if first[1] is not None:
            every = np.concatenate([first[1], rest[1]])
        return probabilities, every

    def _time_first_batch(
        self, corners: np.ndarray, patch: tuple[int, ...], static, geometry: PatchGeometry
    ):
        """The first batch's values, timed both ways on the same positions: (values,
        incremental and naive seconds per position); sets ``self.plan``. ``geometry``:
        all the call's positions (a batch sized on its own could round differently)."""
        batch = self.batch_size
        first_batch = geometry.take(slice(0, batch))
        clock = self.explainer.clock
        deciding = clock.now()
        if clock.cold(("incremental", tuple(self.image.shape), batch)):  # a card's warm-up
            self.graph.run_batch(self.views, first_batch, slice(0, batch), self.occluder)
        began = clock.now()
        self.deciding_seconds += began - deciding
        first = self.evaluate(corners[:batch], patch, geometry=first_batch)
        deciding = clock.now()
        incremental_seconds = (deciding - began) / batch
        probe = naive_probe_size(batch, static.theoretical_speedup)
        naive_seconds, check = self._time_naive(corners[:probe])
        self.plan = measured_plan(static, incremental_seconds, naive_seconds)
        if not self.plan.incremental:
            # Overturning the static plan: one stall in the first timing (a page
            # rendering, a collector) must not decide it. Time both once more and keep
            # the faster of each.
            began = clock.now()  # as the first timing
            self.graph.run_batch(self.views, first_batch, slice(0, batch), self.occluder)
            incremental_seconds = min(incremental_seconds, (clock.now() - began) / batch)
            naive_again, check = self._time_naive(corners[:batch])  # the whole batch
            naive_seconds = min(naive_seconds, naive_again)
            self.plan = measured_plan(static, incremental_seconds, naive_seconds, repeats=2)
        self.timed_in_this_call = True
        self.deciding_seconds += clock.now() - deciding
        if not self.plan.incremental:  # the first batch's values by the chosen strategy too
            softmax = torch.softmax(check.float(), dim=1).cpu().numpy()
            first = (
                softmax[:, self.label].astype(np.float32),
                None if first[1] is None else softmax.astype(first[1].dtype),
            )
        return first, incremental_seconds, naive_seconds

    def _conclude(self, key: tuple, monitor: StrategyMonitor) -> None:
        """The plan as it ran (a switch says when and why; the latest side-by-side timing
        is this call's), and the verdict kept for this explainer's later calls."""
        assert self.plan is not None
        kept = self.plan
        if monitor.last_pair is not None:
            self.timed_in_this_call = True
            self.plan = dataclasses.replace(self.plan, timings=monitor.last_pair)
        if monitor.switches:
            self.plan = dataclasses.replace(
                self.plan, strategy=monitor.strategy, reason=f"{kept.reason}; {monitor.summary()}"
            )
            kept = dataclasses.replace(
                kept,
                strategy=monitor.strategy,
                reason=f"{kept.reason}; then {monitor.strategy} proved faster, timed on the "
                f"same positions",
                timings=monitor.last_pair,
            )
        self.explainer.measured_plans[key] = kept
        self.explainer.monitors[key] = monitor

    def _naive_logits(self, corners: np.ndarray) -> torch.Tensor:
        """Logits of full inferences of the image occluded at these positions."""
        occluded = self.explainer._occluded_batch(self.image, self.occluder, corners)
        with CAPTURE_LOCK.shared():
            return self.explainer.model(occluded)

    def _time_naive(self, corners: np.ndarray) -> tuple[float, torch.Tensor]:
        """Seconds per position of a naive inference of these positions, and its logits
        (after an untimed warm-up the first time on a card)."""
        clock = self.explainer.clock
        if clock.cold(("naive", tuple(self.image.shape), len(corners))):
            self._naive_logits(corners)
        began = clock.now()
        logits = self._naive_logits(corners)
        return (clock.now() - began) / len(corners), logits

    def evaluate(
        self,
        corners: np.ndarray,
        patch: tuple[int, ...],
        tau: float = 1.0,
        naive: bool = False,
        geometry=None,
        on_batch: Callable[[int, np.ndarray], None] | None = None,
        monitor: StrategyMonitor | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Probabilities of the label with the patch at each corner, batch by batch, and
        (when kept) every class's: (count,), (count, classes) or None. ``on_batch(done,
        probabilities)`` sees the first ``done`` values after each batch. With a
        ``monitor`` (exact mode), each batch runs on the monitor's strategy, which its
        probes may change (``naive`` is then ignored)."""
        count = len(corners)
        probabilities = np.empty(count, dtype=np.float32)
        every = None
        if count == 0:
            return probabilities, every
        if geometry is None and (monitor is not None or not naive):
            geometry = self.graph.geometry(tuple(corners.T), patch, tau)
        if geometry is not None:
            incremental_macs, full_macs = self.graph.macs_per_position(geometry)
        else:
            incremental_macs = full_macs = (
                self.macs_per_image if self.graph is None else self._full_macs(corners, patch)
            )
        for begin in range(0, count, self.batch_size):
            batch = slice(begin, min(begin + self.batch_size, count))
            size = batch.stop - batch.start
            batch_naive = naive if monitor is None else monitor.strategy == "naive"
            clock = self.explainer.clock
            began = clock.now()
            logits = self._logits(corners, batch, geometry, batch_naive)
            seconds = clock.now() - began
            if monitor is not None:
                monitor.ran(size, seconds)
                if monitor.probe_due():  # the other strategy on the same positions
                    kind = "naive" if not batch_naive else "incremental"
                    if clock.cold((kind, tuple(self.image.shape), size)):  # a card's warm-up
                        self._logits(corners, batch, geometry, not batch_naive)
                    began = clock.now()
                    self._logits(corners, batch, geometry, not batch_naive)
                    other_seconds = clock.now() - began
                    self.deciding_seconds += other_seconds
                    monitor.probe(seconds / size, other_seconds / size, self.evaluated + size)
            self.macs_spent += (full_macs if batch_naive else incremental_macs) * size
            self.macs_naive += full_macs * size
            softmax = torch.softmax(logits.float(), dim=1)
            probabilities[batch] = softmax[:, self.label].cpu().numpy()
            if self.keep_all:
                if every is None:
                    large = count * softmax.shape[1] > 1_000_000
                    every = np.empty(
                        (count, softmax.shape[1]), dtype=np.float16 if large else np.float32
                    )
                every[batch] = softmax.cpu().numpy()
            self.evaluated += size
            if self.progress is not None:
                self.progress(self.evaluated, max(self.total, self.evaluated))
            if on_batch is not None:
                on_batch(batch.stop, probabilities)
        return probabilities, every

    def _logits(self, corners: np.ndarray, batch: slice, geometry, naive: bool) -> torch.Tensor:
        """Logits of one batch of positions, by naive or incremental inference."""
        if naive:
            return self._naive_logits(corners[batch])
        return self.graph.run_batch(self.views, geometry, batch, self.occluder)


def _pace(plan: ExecutionPlan) -> float | None:
    """Seconds per position of a measured plan's own strategy when it was timed."""
    if plan.timings is None:
        return None
    incremental_seconds, naive_seconds = plan.timings
    return incremental_seconds if plan.incremental else naive_seconds
