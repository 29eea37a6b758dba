"""One explain() call's evaluation of positions, batch by batch: exact values by the
cheaper of incremental and naive inference (timed side by side in this call), the
progress it reports and the MACs it spends."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from . import host
from .engine import ExecutionPlan
from .engine.capture_lock import CAPTURE_LOCK
from .engine.monitor import PACE_BATCHES, StrategyMonitor
from .engine.plan import PatchGeometry, measured_plan, naive_probe_size, reused_plan
from .host import current_share
from .schedule import Schedules, measuring_seconds

# Where incremental can gain less than this (FLOPs), the first naive timing is a whole
# batch when naive's schedule is not decided yet, so that it is decided (measured) there:
# timed on the schedule expected fastest instead, mnasnet0_5's naive read 4.0 ms a
# position where naive runs took 2.9, and exact ran incrementally at naive's speed.
FAIR_PROBE_BELOW = 4.0
# A first timing where incremental leads naive by less than this is taken again: both
# strategies on whole batches, alternated, VERDICT_ROUNDS readings each, median kept.
CLEAR_LEAD = 2.0
VERDICT_ROUNDS = 3


class Explaining(Protocol):
    """What a run reads of its OcclusionExplainer: the model, the plans this host
    measured, and how it builds full occluded images."""

    model: nn.Module
    measured_plans: dict
    monitors: dict
    schedules: Schedules

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
        # seconds the batches of positions took, by whichever strategy ran them: what is
        # left of a run's time beyond these and ``deciding_seconds`` a naive run pays too
        self.computing_seconds = 0.0
        # seconds spent measuring batch schedules (krypton.schedule), once per decision:
        # kept out of the batches' times (``pending``: not yet taken off a batch's)
        self.scheduling_seconds = 0.0
        self._pending_scheduling = 0.0
        self._loads: list[float] = []  # others' load per settled batch (exact)
        self._others = host.OthersLoad()
        # one pass's values by position as its batches settle (keep_settled): what a
        # run stopped part-way (krypton.StopRun) computed
        self.settled: _Values | None = None

    def keep_settled(self, count: int) -> None:
        """Keep each settled batch's values at its place among the pass's ``count``
        positions (NaN until computed), for :meth:`settled_so_far`."""
        self.settled = _Values(np.full(count, np.nan, dtype=np.float32), None)

    def settled_so_far(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The kept values (:meth:`keep_settled`): the label's and, where kept, every
        class's, NaN at positions no settled batch computed."""
        assert self.settled is not None, "keep_settled() was not called"
        return self.settled.probabilities, self.settled.every

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
        # a verdict holds at the threads it was measured with, which the load band sets
        # (krypton.host.load_band): a run given other threads times both strategies again,
        # as it measures schedules again
        key = (tuple(self.image.shape), patch, self.batch_size, current_share().threads)
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
        first, incremental_seconds, naive_seconds, lead = self._time_first_batch(
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
            batches=-(-(count - lead) // batch),
            pace=current,
        )
        monitor.positions[self.plan.strategy] += lead
        rest = self.evaluate(
            corners[lead:], patch, monitor=monitor, geometry=geometry, placed_from=lead
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
        incremental and naive seconds per position, positions the values cover); sets
        ``self.plan``. A close verdict is timed again (CLEAR_LEAD, VERDICT_ROUNDS).
        ``geometry``: all the call's positions (a batch sized on its own could round
        differently).

        On a card a run's batches overlap (the host queues one while the card computes
        the one before), so a lone batch, launched and then waited for, reads slower than
        a run goes: there the first two batches run incrementally, pipelined, and the
        second one's time is incremental's; naive, a few large kernels, is timed on one
        whole batch."""
        batch = self.batch_size
        clock = self.explainer.clock
        lead = 2 * batch if clock.queued else batch
        deciding = clock.now()
        if clock.cold(("incremental", tuple(self.image.shape), batch)):  # a card's warm-up
            self.graph.run_batch(self.views, geometry, slice(0, batch), self.occluder)
        timings: list[tuple[int, float]] = []
        began = clock.now()
        self.deciding_seconds += began - deciding
        first = self.evaluate(corners[:lead], patch, geometry=geometry, timings=timings)
        deciding, scheduling = clock.now(), self.scheduling_seconds
        size, seconds = timings[-1]  # a schedule's measurement taken off (krypton.schedule)
        incremental_seconds = seconds / size
        # a card's time per position depends on the batch (a part-batch leaves it partly
        # idle, so naive would read slower than it runs): there the probe is a whole batch
        probe = batch if clock.queued else naive_probe_size(batch, static.theoretical_speedup)
        schedules, device = self.explainer.schedules, self.image.device
        if static.theoretical_speedup < FAIR_PROBE_BELOW and schedules.undecided(
            self._kind(True), batch, device
        ):  # naive timed on its own schedule, decided on this whole batch
            probe = batch
        naive_seconds, check = self._time_naive(corners[:probe])
        repeats = 1
        if naive_seconds < CLEAR_LEAD * incremental_seconds:
            # Close, or naive ahead (which overturns the static plan for the process):
            # one timing each is a coin toss beside busy neighbours (shufflenet_v2_x0_5
            # beside two burners read 1.45x for incremental where its runs were 0.76x
            # naive's speed, and a fresh-clone CI's stall once pinned VGG16 to naive). Both
            # are timed again on whole batches, alternated, and the verdict rests on the
            # median of VERDICT_ROUNDS each: a run's pace is its typical batch's.
            # The first batch is the grid's top edge, where an occlusion's update region
            # is clipped: the readings again are of a middle batch, as most of a run is,
            # on the run's batch boundaries (a grid's indices are compiled for those once)
            start = min(len(corners) // 2, len(corners) - batch) // batch * batch
            middle = slice(start, start + batch)
            incremental_readings, naive_readings = [incremental_seconds], [naive_seconds]
            for _ in range(VERDICT_ROUNDS - 1):
                naive_readings.append(self._time_naive(corners[middle])[0])
                began = clock.now()  # on the schedule decided for it, as the first timing
                self._logits(corners[middle], middle, geometry, naive=False)
                again = clock.now() - began - self._scheduling_taken()
                incremental_readings.append(again / batch)
            incremental_seconds = statistics.median(incremental_readings)
            naive_seconds = statistics.median(naive_readings)
            repeats = VERDICT_ROUNDS
        self.plan = measured_plan(static, incremental_seconds, naive_seconds, repeats)
        self.timed_in_this_call = True
        self.deciding_seconds += clock.now() - deciding - (self.scheduling_seconds - scheduling)
        if not self.plan.incremental:  # the leading values by the chosen strategy too
            if len(check) < batch:  # the first naive timing was a part-batch
                check = self._naive_logits(corners[:batch])
            if lead > batch:
                check = torch.cat([check, self._naive_logits(corners[batch:lead])])
            softmax = torch.softmax(check.float(), dim=1).cpu().numpy()
            first = (
                softmax[:, self.label].astype(np.float32),
                None if first[1] is None else softmax.astype(first[1].dtype),
            )
        return first, incremental_seconds, naive_seconds, lead

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
        logits = self._logits(corners, slice(0, len(corners)), None, naive=True)
        seconds = clock.now() - began - self._scheduling_taken()
        return seconds / len(corners), logits

    def evaluate(
        self,
        corners: np.ndarray,
        patch: tuple[int, ...],
        tau: float = 1.0,
        naive: bool = False,
        geometry=None,
        on_batch: Callable[[int, np.ndarray], None] | None = None,
        monitor: StrategyMonitor | None = None,
        timings: list[tuple[int, float]] | None = None,
        placed_from: int = 0,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Probabilities of the label with the patch at each corner, batch by batch, and
        (when kept) every class's: (count,), (count, classes) or None. ``on_batch(done,
        probabilities)`` sees the first ``done`` values after each batch. With a
        ``monitor`` (exact mode), each batch runs on the monitor's strategy, which its
        probes may change (``naive`` is then ignored). ``timings`` receives each batch's
        (positions, seconds). ``geometry`` may hold more positions than ``corners``:
        theirs start at ``placed_from`` (a run in parts keeps one geometry, and the indices
        compiled for it).

        On a card the batches are pipelined: batch k+1 is queued before the host waits
        for batch k (its end mark, its values copied to pinned memory), so the launches
        of one batch overlap the work of the one before. Progress, ``on_batch`` and the
        monitor see a batch once it has finished; a switch of strategy applies one batch
        later than on the CPU, where each batch is settled as soon as it has run."""
        count = len(corners)
        out = _Values(np.empty(count, dtype=np.float32), None)
        if count == 0:
            return out.probabilities, out.every
        if geometry is None and (monitor is not None or not naive):
            geometry = self.graph.geometry(tuple(corners.T), patch, tau)
        if geometry is not None:
            macs = self.graph.macs_per_position(geometry)
        else:
            full = self.macs_per_image if self.graph is None else self._full_macs(corners, patch)
            macs = (full, full)
        clock = self.explainer.clock
        queued: _Queued | None = None
        probed = False  # the batch just settled was probed: its probe's work is queued
        for begin in range(0, count, self.batch_size):
            batch = slice(begin, min(begin + self.batch_size, count))
            batch_naive = naive if monitor is None else monitor.strategy == "naive"
            placed = slice(batch.start + placed_from, batch.stop + placed_from)
            # on a card a batch's time runs from the end of the one before (the host's
            # work between batches, settling and preparing, delays the card too), unless
            # a probe's work came in between
            began = queued.ended if queued is not None and not probed else clock.mark()
            logits = self._logits(corners[batch], placed, geometry, batch_naive)
            following = self._queue(logits, batch, placed, batch_naive, began)
            if queued is not None:
                probed = self._settle(
                    queued, out, corners, geometry, macs, monitor, on_batch, timings
                )
            queued = following
            if not clock.queued:  # the CPU has nothing to overlap: settled at once
                self._settle(queued, out, corners, geometry, macs, monitor, on_batch, timings)
                queued = None
        if queued is not None:
            self._settle(queued, out, corners, geometry, macs, monitor, on_batch, timings)
        return out.probabilities, out.every

    def _queue(
        self, logits: torch.Tensor, batch: slice, placed: slice, naive: bool, began
    ) -> _Queued:
        """A batch's probabilities on their way to the host, and its end mark."""
        clock = self.explainer.clock
        softmax = torch.softmax(logits.float(), dim=1)
        label = softmax[:, self.label]
        every = softmax if self.keep_all else None
        if clock.queued:  # copied to pinned memory behind the batch's work, not waited for
            label = _to_host(label)
            every = None if every is None else _to_host(every)
        return _Queued(batch, placed, naive, began, clock.mark(), label, every)

    def _settle(
        self,
        queued: _Queued,
        out: _Values,
        corners: np.ndarray,
        geometry,
        macs: tuple[int, int],
        monitor: StrategyMonitor | None,
        on_batch: Callable[[int, np.ndarray], None] | None,
        timings: list[tuple[int, float]] | None,
    ) -> bool:
        """Once a queued batch has finished: its values, timing, probe, MACs, progress.
        Whether it was probed (the other strategy ran on its positions)."""
        clock = self.explainer.clock
        batch, size = queued.batch, queued.batch.stop - queued.batch.start
        seconds = clock.between(queued.began, queued.ended) - self._scheduling_taken()
        self.computing_seconds += seconds
        if timings is not None:
            timings.append((size, seconds))
        probed = False
        if monitor is not None:
            monitor.ran(size, seconds)
            self._note_load()
            if monitor.probe_due() and monitor.pace_changed and not self._load_moved():
                monitor.pace_held()  # the pace moved, the host's load did not
            if monitor.probe_due():  # the other strategy on the same positions
                probed = True
                kind = "naive" if not queued.naive else "incremental"
                other = (corners[batch], queued.placed, geometry, not queued.naive)
                if clock.cold((kind, tuple(self.image.shape), size)):  # a card's warm-up
                    self._logits(*other)
                began = clock.mark()
                self._logits(*other)
                other_seconds = clock.between(began, clock.mark()) - self._scheduling_taken()
                self.deciding_seconds += other_seconds
                monitor.probe(seconds / size, other_seconds / size, self.evaluated + size)
        incremental_macs, full_macs = macs
        self.macs_spent += (full_macs if queued.naive else incremental_macs) * size
        self.macs_naive += full_macs * size
        out.probabilities[batch] = queued.label.cpu().numpy()
        if queued.every is not None:
            if out.every is None:
                count, classes = len(out.probabilities), queued.every.shape[1]
                large = count * classes > 1_000_000
                out.every = np.empty((count, classes), dtype=np.float16 if large else np.float32)
            out.every[batch] = queued.every.cpu().numpy()
        if self.settled is not None:
            self._keep(queued.placed, out.probabilities[batch], out.every, batch)
        self.evaluated += size
        if self.progress is not None:
            self.progress(self.evaluated, max(self.total, self.evaluated))
        if on_batch is not None:
            on_batch(batch.stop, out.probabilities)
        return probed

    def _keep(
        self, placed: slice, label: np.ndarray, every: np.ndarray | None, batch: slice
    ) -> None:
        """One settled batch's values at its place in the pass (``placed``: its positions
        among the pass's; ``batch``: among this evaluate call's)."""
        kept = self.settled
        assert kept is not None
        kept.probabilities[placed] = label
        if every is not None:
            if kept.every is None:
                kept.every = np.full((len(kept.probabilities), every.shape[1]), np.nan, every.dtype)
            kept.every[placed] = every[batch]

    def _kind(self, naive: bool) -> tuple:
        """The kind of batch this run computes, as its schedule decision is kept."""
        return ("naive" if naive else "incremental", tuple(self.image.shape), self.batch_size)

    def _logits(self, corners: np.ndarray, placed: slice, geometry, naive: bool) -> torch.Tensor:
        """Logits of one batch of positions (``corners``; ``placed`` in ``geometry``), by
        naive or incremental inference, on the schedule the explainer's timings of this
        kind of batch choose (:mod:`krypton.schedule`)."""
        key = self._kind(naive)
        device = self.image.device
        share = current_share()
        before = measuring_seconds(share)
        if naive:

            def compute(piece: slice) -> torch.Tensor:
                return self._naive_logits(
                    corners[piece.start - placed.start : piece.stop - placed.start]
                )

            logits = self.explainer.schedules.run(
                key, device, placed, self.batch_size, compute, between=self._still_wanted
            )
        else:

            def incremental(piece: slice) -> torch.Tensor:
                return self.graph.run_batch(self.views, geometry, piece, self.occluder)

            def prepare(piece: slice) -> None:
                self.graph.prepare_batch(self.views, geometry, piece, device)

            logits = self.explainer.schedules.run(
                key, device, placed, self.batch_size, incremental, prepare, self._still_wanted
            )
        self._pending_scheduling += measuring_seconds(share) - before
        return logits

    def _still_wanted(self) -> None:
        """Between a schedule measurement's runs of one batch: progress, unchanged, so a
        caller whose callback stops the run (the app's Cancel) need not wait for all of
        them."""
        if self.progress is not None:
            self.progress(self.evaluated, max(self.total, self.evaluated))

    def _note_load(self) -> None:
        """The other processes' load over the batch just settled (krypton.host
        .OthersLoad), kept for :meth:`_load_moved`; only where the load chose the
        run's threads (its band is known)."""
        if current_share().band is not None:
            load = self._others.read()
            if load is not None:
                self._loads.append(load)

    def _load_moved(self) -> bool:
        """Whether the other processes' load over the last PACE_BATCHES batches is
        BAND_HYSTERESIS or more away from what it was earlier in this run: a moved pace
        then is a change of load worth a probe. Both are read while this run computes (on
        a saturated host the others' share reads low while it does, the same way each
        time). A run whose threads the caller set has no band: there every change of
        pace counts, as before; without readings (no psutil) none does."""
        if current_share().band is None:
            return True
        recent, earlier = self._loads[-PACE_BATCHES:], self._loads[:-PACE_BATCHES]
        if not earlier:  # nothing to compare with: a stall at the start, not a new load
            return False
        now = sum(recent) / len(recent)
        return abs(now - float(np.median(earlier))) >= host.BAND_HYSTERESIS

    def _scheduling_taken(self) -> float:
        """Seconds of schedule measurement since last asked: to take off a batch's time."""
        taken, self._pending_scheduling = self._pending_scheduling, 0.0
        self.scheduling_seconds += taken
        return taken


@dataclass
class _Values:
    """A run's probabilities of the label, and every class's when kept."""

    probabilities: np.ndarray
    every: np.ndarray | None


@dataclass
class _Queued:
    """A batch whose work is queued: its positions, strategy, marks, and its values
    (on the host once ``ended`` is reached)."""

    batch: slice
    placed: slice  # the same positions in the run's geometry
    naive: bool
    began: Any
    ended: Any
    label: torch.Tensor
    every: torch.Tensor | None


def _to_host(values: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of ``values``, queued behind the work that computes them."""
    pinned = values.device.type == "cuda"
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=pinned)
    return host.copy_(values, non_blocking=True)


def _pace(plan: ExecutionPlan) -> float | None:
    """Seconds per position of a measured plan's own strategy when it was timed."""
    if plan.timings is None:
        return None
    incremental_seconds, naive_seconds = plan.timings
    return incremental_seconds if plan.incremental else naive_seconds
