"""Where each position's update lands in every tensor, what it costs, and which plan runs.

``propagate`` pushes the occlusion patch of every position through the classified graph at
once (numpy over all positions, eqs 13-16, 20, 21-27, 31). ``PatchGeometry`` holds the
result and the MAC counts of eqs 9-12. ``choose_plan`` weighs the incremental plan against
naive inference for the requested positions, so exact mode never runs the slower of the two.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from .classify import NodeKind, Step, first_input
from .geometry import LocalStep, Window, bounding_window, local_step
from .program import Program

__all__ = [
    "PatchGeometry",
    "ExecutionPlan",
    "propagate",
    "remap_window",
    "remap_centre",
    "static_plan",
    "naive_probe_size",
    "measured_plan",
    "MIN_THEORETICAL_SPEEDUP",
]

# Below this theoretical (MAC) speedup the incremental plan's own work — gathering read-in
# contexts, materialising at the first global op, one kernel call per layer on small
# tensors — costs more than it saves on every host we measured (make bench, "plan" table).
MIN_THEORETICAL_SPEEDUP = 1.25
# Measured plans switch to naive when incremental inference is not at least this much
# faster per position: timing noise on a shared machine stays on the safe side.
MEASURED_MARGIN = 1.05


@dataclass
class PatchGeometry:
    """Windows of every patched node for a set of positions (numpy, all positions)."""

    windows: dict[fx.Node, tuple[Window, Window]]
    local_steps: dict[fx.Node, tuple[LocalStep, LocalStep]]
    scatter_ok: dict[fx.Node, bool]  # overlay by scatter (patch inside read-in context)
    aligned: set[tuple[fx.Node, fx.Node]]  # (merge, input) pairs already on the merge's window
    positions: int
    # (merge, input) pairs whose window lies inside the merge's: overlay by scatter
    contained: set[tuple[fx.Node, fx.Node]] = field(default_factory=set)

    def take(self, index: slice) -> PatchGeometry:
        """The same windows for a slice of the positions. Lengths stay those of all the
        positions, so a batch computes the same cells (and rounds the same) whichever
        call it belongs to; the alignment facts, true for all positions, hold for any."""

        def cut(step: LocalStep) -> LocalStep:
            centre = None if step.centre is None else step.centre[index]
            return LocalStep(
                step.input.take(index), step.read.take(index), step.output.take(index), centre
            )

        return dataclasses.replace(
            self,
            windows={n: (r.take(index), c.take(index)) for n, (r, c) in self.windows.items()},
            local_steps={n: (cut(r), cut(c)) for n, (r, c) in self.local_steps.items()},
            positions=len(range(*index.indices(self.positions))),
        )

    def macs_per_position(self, steps: list[Step], shapes: dict) -> tuple[int, int]:
        """(incremental, full) conv+linear MACs for one occluded image (eqs 9-12)."""
        incremental = sum(self.step_macs(step, shapes) for step in steps)
        return incremental, sum(step.macs_full for step in steps)

    def step_macs(self, step: Step, shapes: dict) -> int:
        """One step's conv+linear MACs for one occluded image, incrementally (eq 11)."""
        if step.kind == NodeKind.LOCAL and step.local.kind == "conv":
            out_rows, out_cols = self.windows[step.node]
            channels = shapes[step.node][1]
            return step.local.conv_macs_per_output * channels * out_rows.length * out_cols.length
        if step.kind == NodeKind.POINTWISE and step.macs_full:
            # a linear layer over a channels-last patch: its share of the cells
            out_rows, out_cols = self.windows[step.node]
            rows, cols = step.spatial_dims
            cells = shapes[step.node][rows] * shapes[step.node][cols]
            return step.macs_full * out_rows.length * out_cols.length // cells
        return step.macs_full


def _same(first: Window, second: Window) -> bool:
    return first.length == second.length and np.array_equal(first.start, second.start)


def _inside(inner: Window, outer: Window) -> bool:
    return bool(np.all(inner.start >= outer.start) and np.all(inner.stop <= outer.stop))


def remap_window(index_map: np.ndarray, incoming: Window) -> Window:
    """Output window of a copy op along one axis: every output cell whose source cell lies
    in the incoming window, as one uniform-length window per position (clamped as eq 31).

    Reflect padding near a border copies a changed cell twice (its own place and its
    mirror image); the window covers both, so no changed output is left out.
    """
    size = len(index_map)
    starts = incoming.start[:, None]
    hit = (index_map[None, :] >= starts) & (index_map[None, :] < starts + incoming.length)
    any_hit = hit.any(axis=1)
    first = np.argmax(hit, axis=1)
    last = size - 1 - np.argmax(hit[:, ::-1], axis=1)
    spans = np.where(any_hit, last - first + 1, 1)
    length = int(min(max(int(spans.max(initial=1)), 1), size))
    start = np.where(any_hit, first, 0)
    return Window(np.minimum(start, size - length).astype(np.int64), length)


def remap_centre(index_map: np.ndarray, centre: np.ndarray) -> np.ndarray:
    """Where a copy op puts the cell at ``centre`` (its first copy; the nearest copied
    cell where that one was cropped away)."""
    valid = np.nonzero(index_map >= 0)[0]
    distance = np.abs(index_map[valid][None, :] - np.round(centre)[:, None])
    return valid[np.argmin(distance, axis=1)].astype(np.float64)


def propagate(
    steps: list[Step],
    shapes: dict[fx.Node, tuple[int, ...]],
    ys: np.ndarray,
    xs: np.ndarray,
    patch_h: int,
    patch_w: int,
    tau: float = 1.0,
    tight: bool = True,
) -> PatchGeometry:
    """Propagate the occlusion patch at every position through the graph (vectorised).

    ``tight=False``: eq 14's output lengths for any offset to the stride, what the
    paper's per-query limit counts; by default the least lengths these positions need
    (``geometry.tight_output_length``)."""
    ys = np.asarray(ys, dtype=np.int64)
    xs = np.asarray(xs, dtype=np.int64)
    windows: dict[fx.Node, tuple[Window, Window]] = {}
    local_steps: dict[fx.Node, tuple[LocalStep, LocalStep]] = {}
    scatter_ok: dict[fx.Node, bool] = {}
    aligned: set[tuple[fx.Node, fx.Node]] = set()
    contained: set[tuple[fx.Node, fx.Node]] = set()
    # Where the patch's centre lies in each tensor: projective-field thresholding crops
    # around it (eq 25), wherever the border clamp (eq 31) has moved the window.
    centres: dict[fx.Node, tuple[np.ndarray, np.ndarray]] = {}
    for step in steps:
        node = step.node
        if step.kind == NodeKind.INPUT:
            windows[node] = (Window(ys, patch_h), Window(xs, patch_w))
            centres[node] = (ys + (patch_h - 1) / 2, xs + (patch_w - 1) / 2)
        elif step.kind == NodeKind.LOCAL:
            in_rows, in_cols = windows[first_input(node)]
            centre_rows, centre_cols = centres[first_input(node)]
            row_step = local_step(step.local.rows, in_rows, tau, centre_rows, tight)
            col_step = local_step(step.local.cols, in_cols, tau, centre_cols, tight)
            local_steps[node] = (row_step, col_step)
            windows[node] = (row_step.output, col_step.output)
            centres[node] = (row_step.centre, col_step.centre)
            # Untruncated patch wholly inside its read-in context: overlay by scatter.
            scatter_ok[node] = (
                _same(row_step.input, in_rows)
                and _same(col_step.input, in_cols)
                and _inside(in_rows, row_step.read)
                and _inside(in_cols, col_step.read)
            )
        elif step.kind == NodeKind.REMAP:
            in_rows, in_cols = windows[first_input(node)]
            windows[node] = (
                remap_window(step.remap.row_map, in_rows),
                remap_window(step.remap.col_map, in_cols),
            )
            centre_rows, centre_cols = centres[first_input(node)]
            centres[node] = (
                remap_centre(step.remap.row_map, centre_rows),
                remap_centre(step.remap.col_map, centre_cols),
            )
        elif step.kind == NodeKind.POINTWISE:
            parts = [windows[a] for a in step.patched_args]
            centres[node] = (
                np.mean([centres[a][0] for a in step.patched_args], axis=0),
                np.mean([centres[a][1] for a in step.patched_args], axis=0),
            )
            if len(parts) == 1:
                windows[node] = parts[0]
            else:
                rows, cols = step.spatial_dims
                height, width = shapes[node][rows], shapes[node][cols]
                windows[node] = (
                    bounding_window([p[0] for p in parts], height),
                    bounding_window([p[1] for p in parts], width),
                )
            out_rows, out_cols = windows[node]
            for arg, (rows_w, cols_w) in zip(step.patched_args, parts):
                if _same(rows_w, out_rows) and _same(cols_w, out_cols):
                    aligned.add((node, arg))
                elif _inside(rows_w, out_rows) and _inside(cols_w, out_cols):
                    contained.add((node, arg))
    return PatchGeometry(windows, local_steps, scatter_ok, aligned, len(ys), contained)


@dataclass(frozen=True)
class ExecutionPlan:
    """What exact mode runs and why: ``str(plan)`` is the line the app and CLI show."""

    strategy: str  # "incremental" or "naive"
    reason: str
    theoretical_speedup: float  # full / incremental MACs for the requested positions
    first_global: str | None
    share_before_first_global: float  # of the conv/linear MACs
    measured: bool = False  # decided from timings of both plans on this host
    # seconds per position (incremental, naive) of that timing, and when it was taken
    # (time.time()): a plan reused by a later call says so instead of repeating the claim
    timings: tuple[float, float] | None = None
    measured_at: float | None = None

    def __str__(self) -> str:
        return f"{self.strategy}: {self.reason}"

    @property
    def incremental(self) -> bool:
        return self.strategy == "incremental"


def static_plan(graph: Program, geometry: PatchGeometry) -> ExecutionPlan:
    """The plan from static analysis alone (eqs 9-12 for these positions).

    Naive when the MACs incremental inference can avoid are too few to pay for its own
    work; otherwise incremental, to be confirmed by :func:`measured_plan` where the run is
    long enough to time both.
    """
    incremental, full = geometry.macs_per_position(graph.steps, graph.shapes)
    theoretical = full / incremental if incremental else float("inf")
    first, share = graph.first_global()
    where = (
        f"the first global op is {first}, {share:.0%} of the FLOPs before it"
        if first is not None
        else "every op is incremental"
    )
    if theoretical < MIN_THEORETICAL_SPEEDUP:
        return ExecutionPlan(
            "naive",
            f"{where}; at most {theoretical:.2f}x to gain, less than incremental "
            f"inference's own overhead",
            theoretical,
            first,
            share,
        )
    return ExecutionPlan(
        "incremental", f"{where}; up to {theoretical:.2f}x fewer FLOPs", theoretical, first, share
    )


def naive_probe_size(batch: int, theoretical_speedup: float) -> int:
    """Positions the first naive timing runs: about one incremental batch's worth of
    time if the FLOP ratio holds (``batch / ratio``), at least 2, at most the batch. A
    whole naive batch cost VGG16 (ratio 6.5) 3.9 s of a 7.2 s first call over 100
    positions; where the two are close, and the timing matters, it is the whole batch."""
    return max(2, min(batch, math.ceil(batch / max(theoretical_speedup, 1.0))))


def measured_plan(
    plan: ExecutionPlan, incremental_seconds: float, naive_seconds: float, repeats: int = 1
) -> ExecutionPlan:
    """Confirm or overturn a static plan with per-position timings of both plans (each
    the best of ``repeats``)."""
    ratio = naive_seconds / incremental_seconds if incremental_seconds > 0 else float("inf")
    timing = (
        f"measured in this call {incremental_seconds * 1e3:.1f} ms/position incremental vs "
        f"{naive_seconds * 1e3:.1f} naive" + (f", best of {repeats}" if repeats > 1 else "")
    )
    where = plan.reason.split(";")[0]
    if ratio >= MEASURED_MARGIN:
        strategy, verdict = "incremental", f"{ratio:.2f}x faster"
    else:
        strategy, verdict = "naive", f"incremental only {ratio:.2f}x"
    return ExecutionPlan(
        strategy,
        f"{where}; {timing} ({verdict})",
        plan.theoretical_speedup,
        plan.first_global,
        plan.share_before_first_global,
        measured=True,
        timings=(incremental_seconds, naive_seconds),
        measured_at=time.time(),
    )


def reused_plan(plan: ExecutionPlan) -> ExecutionPlan:
    """A measured plan as a later call states it: when it was measured, not 'in this
    call' (the load may have changed since)."""
    if not plan.measured or plan.measured_at is None:
        return plan
    when = time.strftime("%H:%M:%S", time.localtime(plan.measured_at))
    return dataclasses.replace(
        plan, reason=plan.reason.replace("measured in this call", f"measured at {when}", 1)
    )
