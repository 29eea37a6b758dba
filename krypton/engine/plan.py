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
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

from .classify import NodeKind, Step, first_input
from .geometry import AxisOp, LocalStep, Window, bounding_window, local_step, padding_needed
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

    windows: dict[fx.Node, tuple[Window, ...]]  # one window per spatial axis
    local_steps: dict[fx.Node, tuple[LocalStep, ...]]
    scatter_ok: dict[fx.Node, bool]  # overlay by scatter (patch inside read-in context)
    aligned: set[tuple[fx.Node, fx.Node]]  # (merge, input) pairs already on the merge's window
    positions: int
    # (merge, input) pairs whose window lies inside the merge's: overlay by scatter
    contained: set[tuple[fx.Node, fx.Node]] = field(default_factory=set)
    # convolutions whose read-in context spans whole padded axes: the padding per axis
    # the convolution adds itself (0 on the other axes), see :func:`implicit_padding`
    implicit_padding: dict[fx.Node, tuple[int, ...]] = field(default_factory=dict)
    # local ops whose input and output windows are the whole tensors for every position:
    # the update patch is the whole occluded tensor, so the op runs as in full inference
    whole: set[fx.Node] = field(default_factory=set)
    # each run's compiled indices (run.batch_index), per device and first position: built
    # once for this geometry and its batches, dropped with it
    compiled: dict[str, dict] = field(default_factory=dict, repr=False, compare=False)

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
            windows={n: tuple(w.take(index) for w in ws) for n, ws in self.windows.items()},
            local_steps={n: tuple(cut(a) for a in ax) for n, ax in self.local_steps.items()},
            positions=len(range(*index.indices(self.positions))),
            compiled={},
        )

    def macs_per_position(self, steps: list[Step], shapes: dict) -> tuple[int, int]:
        """(incremental, full) conv+linear MACs for one occluded image (eqs 9-12)."""
        incremental = sum(self.step_macs(step, shapes) for step in steps)
        return incremental, sum(step.macs_full for step in steps)

    def step_macs(self, step: Step, shapes: dict) -> int:
        """One step's conv+linear MACs for one occluded image, incrementally (eq 11)."""
        if step.kind == NodeKind.LOCAL and step.local.kind == "conv":
            channels = shapes[step.node][1]
            return step.local.conv_macs_per_output * channels * self.cells(step.node)
        if step.kind == NodeKind.POINTWISE and step.macs_full:
            # a linear layer over a channels-last patch: its share of the cells
            cells = math.prod(shapes[step.node][d] for d in step.spatial_dims)
            return step.macs_full * self.cells(step.node) // cells
        return step.macs_full

    def cells(self, node: fx.Node) -> int:
        """Cells of ``node``'s update window, one position's (the product over axes)."""
        return math.prod(window.length for window in self.windows[node])


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
    starts: Sequence[np.ndarray],
    patch: Sequence[int],
    tau: float = 1.0,
    tight: bool = True,
) -> PatchGeometry:
    """Propagate the occlusion patch at every position through the graph (vectorised).

    ``starts``: per spatial axis, every position's first occluded coordinate (rows and
    columns of an image; slices, rows and columns of a volume); ``patch``: the patch's
    extent per axis. ``tight=False``: eq 14's output lengths for any offset to the
    stride, what the paper's per-query limit counts; by default the least lengths these
    positions need (``geometry.tight_output_length``). Every equation applies per axis."""
    starts = [np.asarray(start, dtype=np.int64) for start in starts]
    if len(starts) != len(patch) or len({len(start) for start in starts}) > 1:
        raise ValueError("one start array per patch axis, all of one length")
    windows: dict[fx.Node, tuple[Window, ...]] = {}
    local_steps: dict[fx.Node, tuple[LocalStep, ...]] = {}
    scatter_ok: dict[fx.Node, bool] = {}
    aligned: set[tuple[fx.Node, fx.Node]] = set()
    contained: set[tuple[fx.Node, fx.Node]] = set()
    implicit: dict[fx.Node, tuple[int, ...]] = {}
    whole: set[fx.Node] = set()
    # Where the patch's centre lies in each tensor: projective-field thresholding crops
    # around it (eq 25), wherever the border clamp (eq 31) has moved the window.
    centres: dict[fx.Node, tuple[np.ndarray, ...]] = {}
    for step in steps:
        node = step.node
        if step.kind == NodeKind.INPUT:
            windows[node] = tuple(Window(s, length) for s, length in zip(starts, patch))
            centres[node] = tuple(s + (length - 1) / 2 for s, length in zip(starts, patch))
        elif step.kind == NodeKind.LOCAL:
            incoming, centre = windows[first_input(node)], centres[first_input(node)]
            axis_steps = tuple(
                local_step(op, window, tau, middle, tight)
                for op, window, middle in zip(step.local.axes, incoming, centre)
            )
            local_steps[node] = axis_steps
            windows[node] = tuple(a.output for a in axis_steps)
            centres[node] = tuple(a.centre for a in axis_steps)
            # Untruncated patch wholly inside its read-in context: overlay by scatter.
            scatter_ok[node] = all(
                _same(a.input, window) and _inside(window, a.read)
                for a, window in zip(axis_steps, incoming)
            )
            if _covers(incoming, step.local.axes, "in_size") and _covers(
                windows[node], step.local.axes, "out_size"
            ):
                whole.add(node)
            elif step.local.kind == "conv":
                pads = implicit_padding(step.local.axes, axis_steps)
                if any(pads):
                    implicit[node] = pads
        elif step.kind == NodeKind.REMAP:
            incoming, centre = windows[first_input(node)], centres[first_input(node)]
            windows[node] = tuple(
                remap_window(index_map, window)
                for index_map, window in zip(step.remap.maps, incoming)
            )
            centres[node] = tuple(
                remap_centre(index_map, middle)
                for index_map, middle in zip(step.remap.maps, centre)
            )
        elif step.kind == NodeKind.POINTWISE:
            parts = [windows[a] for a in step.patched_args]
            rank = len(parts[0])
            centres[node] = tuple(
                np.mean([centres[a][axis] for a in step.patched_args], axis=0)
                for axis in range(rank)
            )
            if len(parts) == 1:
                windows[node] = parts[0]
            else:
                windows[node] = tuple(
                    bounding_window([p[axis] for p in parts], shapes[node][dim])
                    for axis, dim in enumerate(step.spatial_dims)
                )
            out = windows[node]
            for arg, part in zip(step.patched_args, parts):
                if all(_same(w, o) for w, o in zip(part, out)):
                    aligned.add((node, arg))
                elif all(_inside(w, o) for w, o in zip(part, out)):
                    contained.add((node, arg))
    positions = len(starts[0]) if starts else 0
    return PatchGeometry(
        windows, local_steps, scatter_ok, aligned, positions, contained, implicit, whole
    )


def _covers(windows: Sequence[Window], axes: Sequence[AxisOp], size: str) -> bool:
    """Whether every position's window is the whole tensor on every axis."""
    return all(
        window.length == getattr(op, size) and not np.any(window.start)
        for window, op in zip(windows, axes)
    )


def implicit_padding(axes: Sequence[AxisOp], steps: Sequence[LocalStep]) -> tuple[int, ...]:
    """Per axis, the padding a convolution can add itself: where every position's read-in
    context spans the whole axis with the same padding on both sides (late layers, whose
    update patch covers the map). The context is then read without that padding, and
    the convolution's own padding skips the products with it: on a volume's 1-slice maps
    (r3d_18's last stage) two thirds of a 3-deep kernel's taps, which an explicitly
    padded context computed at 2.3x the time. The values are the same."""
    pads = []
    for op, axis in zip(axes, steps):
        low, high = padding_needed(op)
        whole = (
            low == high == op.pad_before
            and axis.read.length == op.in_size + low + high
            and bool(np.all(axis.read.start == -low))
        )
        pads.append(low if whole else 0)
    return tuple(pads)


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
    time if the FLOP ratio holds (``batch / ratio``), at least NAIVE_PROBE_MIN, at most
    the batch. A whole naive batch cost VGG16 (ratio 6.5) 3.9 s of a 7.2 s first call
    over 100 positions; where the two are close, and the timing matters, it is the whole
    batch."""
    least = min(NAIVE_PROBE_MIN, batch)
    return max(least, min(batch, math.ceil(batch / max(theoretical_speedup, 1.0))))


# Two positions misread naive's pace: the chest-CT model ran 10.7 ms a position in
# batches of two and 19-21 ms in the batches a naive run uses (4: 17.6), so the volume
# speed line said 4.8x where a stopwatch gave 6.7x.
NAIVE_PROBE_MIN = 4


def measured_plan(
    plan: ExecutionPlan, incremental_seconds: float, naive_seconds: float, repeats: int = 1
) -> ExecutionPlan:
    """Confirm or overturn a static plan with per-position timings of both plans (each
    the median of ``repeats``, alternated)."""
    ratio = naive_seconds / incremental_seconds if incremental_seconds > 0 else float("inf")
    timing = (
        f"measured in this call {incremental_seconds * 1e3:.1f} ms/position incremental vs "
        f"{naive_seconds * 1e3:.1f} naive" + (f", median of {repeats}" if repeats > 1 else "")
    )
    where = plan.reason.split(";")[0]
    if ratio >= MEASURED_MARGIN:
        strategy, verdict = "incremental", f"{ratio:.2f}x faster per position"
    else:
        strategy, verdict = "naive", f"incremental only {ratio:.2f}x per position"
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
