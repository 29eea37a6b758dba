"""Every position a run computed, kept per setting so that a later run on any grid, region
or class reuses it; and the one loop that runs exact and naive over a grid of any rank:
known cells first, the rest in coarse-to-fine chunks."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import krypton
from krypton.explainer import snap_start

from .regions import Bounds
from .request import FIRST_CHUNK, LARGEST_CHUNK

__all__ = ["KnownCells", "CellCache", "grid_cells", "count_known", "run_cells", "snap_bounds"]


@dataclass
class KnownCells:
    """The cells known for one setting: position -> every class's probability, a
    position being a cell's first pixel or voxel per axis in tensor order ((y, x) or
    (z, y, x)); ``origin`` a position of the last grid (where a new region snaps to)."""

    cells: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)
    origin: tuple[int, ...] | None = None
    max_bytes: int | None = None  # a setting's cells stop growing past this

    def add(self, new: dict[tuple[int, ...], np.ndarray]) -> None:
        """Cells one batch computed (team mode's store writes them through); past the
        byte limit the rest are not kept (they are computed again if needed)."""
        if self.max_bytes is not None and self.nbytes > self.max_bytes:
            return
        self.cells.update(new)

    def set_origin(self, origin: tuple[int, ...]) -> None:
        self.origin = origin

    @property
    def nbytes(self) -> int:
        first = next(iter(self.cells.values()), None)
        return 0 if first is None else len(self.cells) * int(np.asarray(first).nbytes)


class CellCache:
    """Every position computed, per setting (:func:`webapp.runs.subjects.cell_key`: the
    input, the model's weights and preprocessing, patch, fill and mode): the
    probabilities of every class, so any later grid, region or class can reuse them.
    Keyed by what determines a cell's value, not by tab (as team mode's RedisCellCache):
    a reloaded page or a second tab on the same input reuses them. Bounded: the most
    recent ``max_keys`` settings, and ``max_bytes`` of cells together (least recently
    used settings go first)."""

    def __init__(self, max_keys: int = 64, max_bytes: int = 512 * 2**20):
        self.max_keys, self.max_bytes = max_keys, max_bytes
        self._known: OrderedDict[tuple, KnownCells] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> KnownCells:
        with self._lock:
            known = self._known.get(key)
            if known is None:
                known = self._known[key] = KnownCells(max_bytes=self.max_bytes)
            self._known.move_to_end(key)
            while len(self._known) > 1 and (
                len(self._known) > self.max_keys
                or sum(k.nbytes for k in self._known.values()) > self.max_bytes
            ):
                self._known.popitem(last=False)
            return known

    def peek(self, key: tuple) -> KnownCells | None:
        """The cells kept for ``key``, or None; unlike :meth:`get`, adds nothing and moves
        nothing (the page's estimate asks often)."""
        with self._lock:
            return self._known.get(key)

    def usage(self) -> tuple[int, int]:
        """(settings, bytes) kept."""
        with self._lock:
            return len(self._known), sum(k.nbytes for k in self._known.values())


def snap_bounds(bounds: Bounds, origin: tuple[int, ...], stride: int, patch: int) -> Bounds:
    """A region's (low, high) corners, tensor order, with its first position moved forward
    onto the grid through ``origin`` on every axis (:func:`krypton.explainer.snap_start`:
    never outside the region)."""
    low, high = bounds
    moved = tuple(snap_start(a, b, o, stride, patch) for a, b, o in zip(low, high, origin))
    return moved, tuple(high)


def grid_cells(axes: tuple) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    """The cells of the grid ``axes`` (first pixels or voxels per axis, tensor order):
    (grid index (N, rank), first pixel or voxel (N, rank), key). A cell's key is its
    first pixel or voxel, tensor order, for either rank."""
    shape = tuple(len(axis) for axis in axes)
    index = np.stack([grid.ravel() for grid in np.indices(shape)], axis=1)  # (N, rank)
    corners = np.stack([np.asarray(axis)[index[:, k]] for k, axis in enumerate(axes)], axis=1)
    return index, corners, [tuple(c) for c in corners.tolist()]


def count_known(known: KnownCells | None, axes: tuple) -> int:
    """Positions of the grid ``axes`` whose cells ``known`` holds."""
    if known is None or not known.cells:
        return 0
    return sum(key in known.cells for key in grid_cells(axes)[2])


def order_coarse_to_fine(cells: np.ndarray) -> np.ndarray:
    """Order grid cells (``cells``: (N, rank) indices on the grid, rows and columns, or
    slices, rows and columns) so a coarse sub-grid comes first: the first batches already
    cover the whole region and later ones sharpen it."""
    cells = np.asarray(cells)
    level = np.zeros(len(cells), dtype=int)
    # down to one cell at the coarsest level: on a 224-px image at stride 4 (53 x 53
    # cells) the first 16 positions are then the 16-cell grid spread over the image
    for step in (64, 32, 16, 8, 4, 2, 1):
        on_grid = (cells % step == 0).all(axis=1) & (level == 0)
        level[on_grid] = step
    return np.argsort(-level, kind="stable")


def _library_position(key: tuple[int, ...]) -> tuple[int, ...]:
    # explain()'s listed positions are public in the panels' own order: an image's (x, y),
    # a volume's (z, y, x) — as their regions
    return key[::-1] if len(key) == 2 else key


def run_cells(
    explainer,
    tensor,
    axes: tuple,
    patch: int,
    mode: str,
    fill,
    label: int,
    known: KnownCells,
    report: Callable[..., None],
    stopped: Callable[[krypton.Heatmap, int, BaseException], None] | None = None,
):
    """Exact or naive over the grid ``axes`` (tensor order, any rank): known cells first,
    then the unknown ones in coarse-to-fine chunks (16 positions, doubling to 256), each
    one call of the explainer with its positions, so the picture covers the region from
    the first chunk and sharpens. Every cell computed is kept in ``known``. ``report(done,
    total, values so far or None)``. Returns the grid's heatmap (its positions computed
    in this run; ``extra``: the run's plan line and its latest side-by-side timing; the
    caller states its probability and seconds) and how many cells were known. A run
    stopped by an exception (a Cancel, raised by ``report``) hands ``stopped`` the grid as
    far as it got (cells not computed are NaN), the cells known and the exception, which
    then goes on. A run that ends keeps its grid's first position as ``known``'s origin.
    """
    shape = tuple(len(axis) for axis in axes)
    index, corners, keys = grid_cells(axes)
    values = np.full(shape, np.nan, dtype=np.float32)
    class_values = None
    todo = []
    for n, key in enumerate(keys):
        cell = known.cells.get(key)
        if cell is None:
            todo.append(n)
            continue
        if class_values is None:
            class_values = np.full(shape + (len(cell),), np.nan, dtype=np.float32)
        class_values[tuple(index[n])] = cell
        values[tuple(index[n])] = cell[label]
    reused = len(keys) - len(todo)
    todo_cells = np.array(todo, dtype=int)
    if len(todo_cells):
        todo_cells = todo_cells[order_coarse_to_fine(index[todo_cells])]
    total = len(keys)
    done = reused
    if reused:
        report(done, total, values.copy())
    chunk, begin = FIRST_CHUNK, 0
    plan_line = speed = None
    incremental_only = 0.0  # seconds a naive run would not have spent (views, probes)
    computing = 0.0  # seconds the batches of positions took
    decisions: dict = {}  # the batch schedules the chunks ran on (krypton.schedule)
    host: dict = {}  # the threads the last chunk ran with, who chose them (krypton.host)

    def heatmap_so_far(extra: dict) -> krypton.Heatmap:
        return _grid_heatmap(values, class_values, axes, label, mode, patch, begin, extra)

    stops: list[Exception] = []  # what ended a chunk part-way (a Cancel), once kept

    def counted(done_in_chunk: int, _: int, offset: int) -> None:
        try:
            report(offset + done_in_chunk, total)
        except Exception as why:  # the chunk returns what it computed, then this goes on
            stops.append(why)
            raise krypton.StopRun(str(why)) from why

    try:
        while begin < len(todo_cells):
            part = todo_cells[begin : begin + chunk]
            offset = done
            heatmap = explainer.explain(
                tensor,
                patch=patch,
                mode=mode,
                fill=fill,
                label=label,
                positions=[_library_position(keys[n]) for n in part],
                # an exact run times incremental against naive itself (from its first chunk
                # on): its speed claim and its plan rest on this run's load, not a past one
                strategy="measure" if mode == "exact" and begin == 0 else "auto",
                progress=lambda d, t, offset=offset: counted(d, t, offset),
            )
            plan_line, speed = _chunk_plan(heatmap.extra, plan_line, speed)
            incremental_only += heatmap.extra.get("incremental_only_seconds", 0.0)
            computing += heatmap.extra.get("computing_seconds", 0.0)
            host = heatmap.extra.get("host") or host
            for kind, record in host.get("decisions", {}).items():
                decisions.setdefault(kind, record)  # the first says if this run measured it
            found = tuple(
                np.searchsorted(axis, corners[part, k]) for k, axis in enumerate(heatmap.axes)
            )
            cells = tuple(index[part].T)
            values[cells] = heatmap.values[found]
            if heatmap.class_values is not None:
                every = heatmap.class_values[found].astype(np.float32)
                if class_values is None:
                    class_values = np.full(shape + (every.shape[1],), np.nan, dtype=np.float32)
                class_values[cells] = every
                computed = np.isfinite(every).all(axis=1)  # all, unless the chunk stopped
                known.add({keys[n]: row for n, row, ok in zip(part, every, computed) if ok})
            if stops:  # a Cancel inside the chunk: its computed cells are kept above
                begin += int(np.isfinite(heatmap.values[found]).sum())  # as evaluated
                raise stops[0]
            done += len(part)
            begin += len(part)
            chunk = min(chunk * 2, LARGEST_CHUNK)
            report(done, total, values.copy())
    except BaseException as exc:
        if stopped is not None:
            stopped(heatmap_so_far({"plan": plan_line}), reused, exc)
        raise
    known.set_origin(tuple(int(axis[0]) for axis in axes))  # where a next region snaps to
    extra: dict = {
        "plan": plan_line,
        "incremental_only_seconds": incremental_only,
        "computing_seconds": computing,
        "schedule_decisions": decisions,
        "host": dict(host, decisions=decisions) if host else None,
    }
    if speed is not None:
        extra["plan_timing"] = dict(
            speed, incremental_only_seconds=incremental_only, computing_seconds=computing
        )
    return heatmap_so_far(extra), reused


def _grid_heatmap(
    values: np.ndarray,
    class_values: np.ndarray | None,
    axes: tuple,
    label: int,
    mode: str,
    patch: int,
    computed: int,
    extra: dict,
) -> krypton.Heatmap:
    """The grid's values as the library's heatmap (``computed``: its positions computed in
    this run; the caller states its probability, seconds and stride)."""
    *zs, ys, xs = (np.asarray(axis) for axis in axes)
    return krypton.Heatmap(
        values=values, xs=xs, ys=ys, zs=zs[0] if zs else None, label=label, prob=float("nan"),
        mode=mode, seconds=0.0, patch=patch, stride=None, positions_evaluated=computed,
        macs_spent=0, macs_naive=0, extra=extra, class_values=class_values,
    )  # fmt: skip


def _chunk_plan(extra: dict, plan_line: str | None, speed: dict | None):
    """The run's plan line and latest side-by-side timing after one more chunk."""
    plan = extra.get("plan", "")
    if "plan_timing" in extra:  # this chunk timed both strategies side by side
        speed = extra["plan_timing"]  # the run's latest timing
        if "measured in this call" in plan:  # the chunk that planned the run
            plan_line = plan.replace("in this call", "in this run", 1)
        elif "switched to" in plan:  # a later chunk changed strategy
            plan_line = f"{plan_line or plan.split(';')[0]}; {plan[plan.index('switched to') :]}"
    elif speed is None:
        plan_line = plan or plan_line
    return plan_line, speed
