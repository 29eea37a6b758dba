"""One heatmap run of the app, orchestrated without a browser.

The Run callback calls :func:`execute`; everything a run decides — reusing known cells on
any grid (snapping a new region to the last grid), coarse-to-fine chunks for exact and
naive runs, the live partial picture of approximate runs, the runtime log the estimator
learns from, and the truthful result line — happens here and is tested without Chromium.
Tensor algebra stays in the engine (krypton); the page stays in webapp/panels/
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

import krypton
from krypton.approximate.settings import DEFAULTS
from krypton.approximate.tuning import DEFAULT_TARGET_SSIM
from krypton.estimator import (
    ABSOLUTE_SLACK,
    MIN_SPREAD,
    Estimate,
    NotCalibratedError,
    bounded_speed,
    estimate,
    forward_seconds,
    host_load,
    load_factor,
    recent_estimate,
    record_run,
    speed_claim,
    threads_for_load,
    whole_run_speed,
)
from krypton.explainer import grid_positions, snap_start
from krypton.registry import RegistryError

from . import comparison, exports, helpers, model_card
from .helpers import InputError
from .lifecycle import Provenance, format_duration

__all__ = [
    "RunRequest",
    "result_heatmap",
    "PlannedRun",
    "plan_run",
    "CellCache",
    "Partial",
    "execute",
    "relabel",
    "summary_lines",
    "Reporter",
]


@dataclass(frozen=True)
class Partial:
    """The picture so far: the label's values on the whole grid (NaN where unknown)."""

    values: np.ndarray
    xs: np.ndarray
    ys: np.ndarray
    patch: int
    label_name: str
    prob: float


# report(done, total, picture so far or None): called after every batch; raising stops
Reporter = Callable[[int, int, "Partial | None"], None]
FIRST_CHUNK = 16  # positions in the first batch: the first picture comes within a second
LARGEST_CHUNK = 256


@dataclass(frozen=True)
class RunRequest:
    """What the user asked for on the page."""

    image_key: str
    image_name: str
    model: str
    patch: int
    stride: int
    mode: str
    fill_rgb: tuple[float, float, float]
    label: int | None = None
    region: tuple[int, int, int, int] | None = None
    target_ssim: float | None = DEFAULT_TARGET_SSIM
    r_drill_down: float = DEFAULTS.r_drill_down
    target_speedup: float = DEFAULTS.target_speedup
    snap: bool = True  # move a new region's grid onto the last run's grid to reuse it
    compare: bool = False  # also Grad-CAM and Integrated Gradients on the run's grid
    compare_layer: str | None = None  # Grad-CAM's (None: the deepest conv block)
    # the page's record of a DICOM image (window, frame, spacing; no identity), or None
    dicom: dict | None = field(default=None, compare=False, hash=False)


class Services(Protocol):  # what webapp.services.Services provides
    images: helpers.ImageStore
    results: helpers.ResultStore
    cells: CellCache

    def model(self, name: str) -> krypton.LoadedModel: ...
    def explainer(self, name: str) -> krypton.OcclusionExplainer: ...
    def probabilities(self, name: str, tensor: torch.Tensor) -> tuple[np.ndarray, str | None]: ...
    def weights_checksum(self, name: str) -> str: ...


@dataclass
class _Known:
    # position -> every class's probability: (x, y) for an image, (z, y, x) for a volume
    cells: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)
    origin: tuple[int, ...] | None = None  # a position of the last grid
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
    """Every position computed, per (image, model weights, patch, colour, mode): the
    probabilities of every class, so any later grid, region or class can reuse them.
    Keyed by what determines a cell's value, not by tab (as team mode's RedisCellCache):
    a reloaded page or a second tab on the same image reuses them. Bounded: the most
    recent ``max_keys`` settings, and ``max_bytes`` of cells together (least recently
    used settings go first)."""

    def __init__(self, max_keys: int = 64, max_bytes: int = 512 * 2**20):
        self.max_keys, self.max_bytes = max_keys, max_bytes
        self._known: OrderedDict[tuple, _Known] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> _Known:
        with self._lock:
            known = self._known.get(key)
            if known is None:
                known = self._known[key] = _Known(max_bytes=self.max_bytes)
            self._known.move_to_end(key)
            while len(self._known) > 1 and (
                len(self._known) > self.max_keys
                or sum(k.nbytes for k in self._known.values()) > self.max_bytes
            ):
                self._known.popitem(last=False)
            return known

    def peek(self, key: tuple) -> _Known | None:
        """The cells kept for ``key``, or None; unlike :meth:`get`, adds nothing and moves
        nothing (the page's estimate asks often)."""
        with self._lock:
            return self._known.get(key)

    def usage(self) -> tuple[int, int]:
        """(settings, bytes) kept."""
        with self._lock:
            return len(self._known), sum(k.nbytes for k in self._known.values())


def snap_region(
    region: tuple[int, int, int, int], origin: tuple[int, int], stride: int, patch: int
) -> tuple[tuple[int, int, int, int], tuple[int, int]]:
    """Move the region's first position onto the grid through ``origin``
    (:func:`krypton._inputs.snap_start`): (snapped region, shift in pixels)."""
    x0, y0, x1, y1 = region
    left = snap_start(x0, x1, origin[0], stride, patch)
    top = snap_start(y0, y1, origin[1], stride, patch)
    return (left, top, x1, y1), (left - x0, top - y0)


def execute(
    services: Services,
    session: str,
    request: RunRequest,
    report: Reporter,
    stage: comparison.Stage | None = None,
) -> dict:
    """Run one heatmap and return its result record (also stored for the session); with
    ``request.compare``, the gradient methods on its grid after it (``stage`` hears of
    each step; webapp.comparison)."""
    if request.mode not in krypton.MODES:
        raise InputError(f"unknown mode {request.mode!r}")
    # timed whole, as the user waits (loading, preprocessing, the OOD check included)
    started = time.perf_counter()
    loaded = services.model(request.model)
    size = loaded.input_size
    height, width = size
    region = tuple(request.region) if request.region else (0, 0, width, height)
    helpers.check_region(list(region), size, request.patch, request.stride)
    fill = helpers.normalised_fill(request.fill_rgb, loaded.mean, loaded.std)
    original = services.images.get(request.image_key)
    tensor = loaded.preprocess(original)
    base_probs, capture_error = services.probabilities(request.model, tensor)
    if capture_error and request.mode != "naive":
        raise InputError(
            f"{request.mode} mode needs a model torch.fx can capture, and this "
            f"one cannot be ({capture_error}); choose Naive"
        )
    label = int(np.argmax(base_probs)) if request.label is None else int(request.label)
    if not 0 <= label < len(base_probs):
        raise InputError(f"class {label} does not exist for {request.model}")

    provenance = Provenance.make(
        image=request.image_key,
        model=request.model,
        weights=services.weights_checksum(request.model),
        region=request.region,
        patch=request.patch,
        stride=request.stride,
        mode=request.mode,
        colour=request.fill_rgb,
        label=label,
        approximate=(request.target_ssim, request.r_drill_down, request.target_speedup),
    )
    known, region, note = _known_cells(services, request, region)
    whole = region == (0, 0, width, height)
    grid_ys, grid_xs = grid_positions(
        size, request.patch, request.stride, None if whole else region
    )

    # what the page showed: the positions of this grid not known yet
    cached = count_known(known, (grid_ys, grid_xs))
    load = host_load()  # before this run computes: what it competes with
    run_threads(load)
    planned = _estimate(
        request, None if whole else region, cached, load, grid_ys.size * grid_xs.size
    )

    def live(done: int, total: int, values: np.ndarray | None = None) -> None:
        report(
            done,
            total,
            None
            if values is None
            else Partial(
                values,
                grid_xs,
                grid_ys,
                request.patch,
                loaded.class_name(label),
                float(base_probs[label]),
            ),
        )

    explainer = services.explainer(request.model)
    if request.mode == "exact":
        # This run times incremental against naive itself (on its second batch of
        # positions): its speed claim and its plan rest on this run's load, not a past one.
        explainer.forget_plans()
    extra: dict = {}
    class_values = None
    plan_line = speed = None
    if known is not None:
        had_cells = bool(known.cells)
        values, class_values, reused, evaluated, plan_line, speed = run_cells(
            explainer, tensor, (grid_ys, grid_xs), request.patch, request.mode, fill, label,
            known, live,
        )  # fmt: skip
        if not reused and not note and had_cells:
            note = "no cells reused: none of the earlier positions lies on this grid"
        known.set_origin((int(grid_xs[0]), int(grid_ys[0])))
        counts = (evaluated, 0)
    else:
        heatmap = _approximate(
            explainer, tensor, request, fill, label, None if whole else region,
            bool(loaded.tuning), live,
        )  # fmt: skip
        values, evaluated, reused = heatmap.values, heatmap.positions_evaluated, 0
        extra = dict(heatmap.extra)
        counts = (extra.get("stage_one_positions", evaluated), extra.get("stage_two_positions", 0))
    ood = services.explainer(request.model).ood_report(tensor)
    seconds = time.perf_counter() - started
    speed = finished_run(request.model, request.mode, request.patch, (speed, seconds),
                         (evaluated, counts), planned, load)  # fmt: skip
    methods = None
    if request.compare:  # after the occlusion's clock: its seconds stay its own
        methods = comparison.compute_methods(
            loaded, tensor, (grid_ys, grid_xs), request.patch, fill, label, stage, load,
            request.compare_layer,
        )  # fmt: skip

    result = {
        "id": uuid.uuid4().hex,
        "provenance": provenance.as_dict(),
        "mode": request.mode,
        "model": request.model,
        "weights_checksum": services.weights_checksum(request.model),
        "image": request.image_name,
        "image_key": request.image_key,
        "label": label,
        "label_name": loaded.class_name(label),
        "classes": list(loaded.classes),
        "prob": float(base_probs[label]),
        "base_probs": base_probs.tolist(),
        "patch": request.patch,
        "stride": request.stride,
        "input_size": list(size),
        "region": None if whole else list(region),
        "fill_rgb": list(request.fill_rgb),
        "xs": grid_xs.tolist(),
        "ys": grid_ys.tolist(),
        "values": values,
        "class_values": class_values,
        "seconds": seconds,
        "evaluated": evaluated,
        "reused": reused,
        "reuse_note": note,
        "approximate": extra,
        "plan": plan_line or extra.get("plan"),
        "estimate": planned,
        "speed": speed,  # incremental vs naive, timed side by side in this run, or None
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "dicom": request.dicom,
        "ood": ood,
        "methods": methods,  # Grad-CAM and Integrated Gradients (webapp.comparison), or None
    }
    services.results.put(session, result)
    return result


def finished_run(
    model: str,
    mode: str,
    patch: int,
    timed: tuple[dict | None, float],
    work: tuple[int, tuple[int, int]],
    planned: dict | None,
    load: float,
) -> dict | None:
    """A finished run's speed line and its row in the runtime log, for the image and the
    volume panel alike. ``timed``: (the run's side-by-side timing, its whole seconds);
    ``work``: (positions computed, planned stage counts). The speed is the whole run
    against a naive one (krypton.estimator.whole_run_speed), never above what this host's
    naive runs at this load say (:func:`measured_speed`); the log row keeps the estimate
    shown and the load met, which the next estimates learn from."""
    timing, seconds = timed
    evaluated, counts = work
    speed = measured_speed(whole_run_speed(timing, seconds, evaluated), model, patch, load)
    estimated = (planned or {}).get("seconds")
    if evaluated:
        record_run(model, mode, patch, counts, seconds, estimated=estimated, load=load)
    else:  # every cell was known: a run of its own kind (runs.cached_estimate)
        record_run(model, CACHED_MODE, 0, (0, 0), seconds, estimated=estimated, load=load)
    return speed


def _approximate(
    explainer: krypton.OcclusionExplainer,
    tensor: torch.Tensor,
    request: RunRequest,
    fill,
    label: int,
    region,
    tuned: bool,
    live: Callable,
) -> krypton.Heatmap:
    """An approximate run in one call, with its stage-one picture and its progress."""
    return explainer.explain(
        tensor,
        patch=request.patch,
        stride=request.stride,
        mode="approximate",
        fill=fill,
        label=label,
        region=region,
        progress=lambda done, total: live(done, total),
        partial=lambda values: live(0, 0, values),
        # The slider's quality target where the model has a tuned SSIM(τ) curve; else
        # the τ policy (krypton.approximate.tuning.choose_tau) decides, in the explainer
        # built from the LoadedModel.
        target_ssim=request.target_ssim if tuned else None,
        r_drill_down=request.r_drill_down,
        target_speedup=request.target_speedup,
    )


def check_grid(size: tuple[int, int], patch: int, stride: int, region) -> None:
    """Refuse, in the page's words, settings whose grid explain() would refuse."""
    helpers.check_region(region, size, patch, stride)
    grid_positions(size, patch, stride, region)


def grid_count(size: tuple[int, int], patch: int, stride: int, region) -> int:
    """Positions on the grid these settings make, as drawn (before any snapping)."""
    ys, xs = grid_positions(size, patch, stride, region)
    return len(ys) * len(xs)


def cell_key(request: RunRequest, weights: str, preprocessing: tuple = ()) -> tuple:
    """What determines a computed cell's value, so the key of the cells a run may reuse
    (both cell caches, embedded and team mode): image, ``weights`` (the weights
    checksum, so a model replaced under the same name never reuses its predecessor's
    cells), the model's ``preprocessing`` (LoadedModel.preprocessing: one checkpoint
    under two entries with other sizes or normalisations sees other inputs), patch,
    occluder colour and mode. No tab: a reload keeps them."""
    colour = tuple(round(c, 6) for c in request.fill_rgb)
    return (request.image_key, weights, preprocessing, request.patch, colour, request.mode)


def request_cell_key(services: Services, request: RunRequest) -> tuple:
    """:func:`cell_key` of ``request`` with its model's weights and preprocessing: the
    one key a run's cells and the page's estimate of them are looked up by."""
    preprocessing = services.model(request.model).preprocessing
    return cell_key(request, services.weights_checksum(request.model), preprocessing)


def _known_cells(
    services: Services, request: RunRequest, region: tuple, peek: bool = False
) -> tuple[_Known | None, tuple, str]:
    """Exact and naive runs: the cells known for these settings, the region (moved onto
    the last run's grid when snapping reuses its cells) and what the page says about it.
    Approximate runs keep no cells: (None, region, ""). ``peek``: look without keeping
    an entry (None where there is none), as the estimate does before a run."""
    if request.mode not in ("exact", "naive"):
        return None, region, ""
    key = request_cell_key(services, request)
    known = services.cells.peek(key) if peek else services.cells.get(key)
    if known is None or known.origin is None or not known.cells:
        return known, region, ""
    offset = (
        (region[0] - known.origin[0]) % request.stride,
        (region[1] - known.origin[1]) % request.stride,
    )
    if not any(offset):
        return known, region, ""
    if request.snap:
        region, shift = snap_region(region, known.origin, request.stride, request.patch)
        note = (
            f"the region's grid was moved by {shift[0]} px right and {shift[1]} px down "
            f"onto the last run's grid, to reuse its cells"
            if any(shift)
            else ""
        )
        return known, region, note
    return (
        known,
        region,
        (
            f"no cells reused: the new region's grid is offset by {offset[0]} px across and "
            f"{offset[1]} px down from the last run's; turn on 'snap to the last grid' to "
            f"reuse them"
        ),
    )


@dataclass(frozen=True)
class PlannedRun:
    """A run as it will happen, before it starts: the region on the grid it will use
    (snapped onto the last run's grid where that reuses cells), the grid's positions
    and how many of them are known already (exact and naive runs reuse them)."""

    region: tuple[int, int, int, int] | None  # None: the whole image
    positions: int
    known: int

    @property
    def to_compute(self) -> int:
        return self.positions - self.known


def plan_run(services: Services, request: RunRequest) -> PlannedRun:
    """:class:`PlannedRun` of ``request``, as :func:`execute` will run it (the page's
    estimate counts these positions, and a run with nothing to compute skips the
    queue)."""
    height, width = services.model(request.model).input_size
    region = tuple(request.region) if request.region else (0, 0, width, height)
    helpers.check_region(list(region), (height, width), request.patch, request.stride)
    known, region, _ = _known_cells(services, request, region, peek=True)
    whole = region == (0, 0, width, height)
    ys, xs = grid_positions(
        (height, width), request.patch, request.stride, None if whole else region
    )
    return PlannedRun(None if whole else region, len(ys) * len(xs), count_known(known, (ys, xs)))


def count_known(known: _Known | None, axes: tuple) -> int:
    """Positions of the grid ``axes`` ((ys, xs) or (zs, ys, xs)) whose cells ``known``
    holds (keys as :func:`run_cells` makes them)."""
    if known is None or not known.cells:
        return 0
    return sum(key in known.cells for key in _grid_cells(axes)[2])


def _grid_cells(axes: tuple) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    """The cells of the grid ``axes``: (grid index (N, rank), first pixel or voxel
    (N, rank), key). A cell's key is also the explainer's position for it: (x, y) for an
    image, (z, y, x) for a volume, as their regions."""
    shape = tuple(len(axis) for axis in axes)
    index = np.stack([grid.ravel() for grid in np.indices(shape)], axis=1)  # (N, rank)
    corners = np.stack([np.asarray(axis)[index[:, k]] for k, axis in enumerate(axes)], axis=1)
    keys = [tuple(c[::-1]) if len(axes) == 2 else tuple(c) for c in corners.tolist()]
    return index, corners, keys


def run_cells(
    explainer,
    tensor,
    axes: tuple,
    patch: int,
    mode: str,
    fill,
    label: int,
    known: _Known,
    report: Callable[..., None],
):
    """Exact or naive over the grid ``axes`` ((ys, xs) for an image, (zs, ys, xs) for a
    volume) — one loop for both: known cells first, then the unknown ones in coarse-to-fine
    chunks (16 positions, doubling to 256), each one call of the explainer with their
    positions ((x, y) for an image, (z, y, x) for a volume, as their regions), so the
    picture covers the region from the first chunk and sharpens. Every cell computed is
    kept in ``known``. Returns (values, class_values, reused, evaluated, plan line, speed)."""
    shape = tuple(len(axis) for axis in axes)
    index, corners, keys = _grid_cells(axes)
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
    todo = np.array(todo, dtype=int)
    if len(todo):
        todo = todo[helpers.order_coarse_to_fine(index[todo])]
    total = len(keys)
    done = reused
    if reused:
        report(done, total, values.copy())
    chunk, begin = FIRST_CHUNK, 0
    plan_line = speed = None
    incremental_only = 0.0  # seconds a naive run would not have spent (views, probes)
    while begin < len(todo):
        part = todo[begin : begin + chunk]
        offset = done
        heatmap = explainer.explain(
            tensor,
            patch=patch,
            mode=mode,
            fill=fill,
            label=label,
            positions=[keys[n] for n in part],
            progress=lambda d, t, offset=offset: report(offset + d, total),
        )
        plan = heatmap.extra.get("plan", "")
        incremental_only += heatmap.extra.get("incremental_only_seconds", 0.0)
        if "plan_timing" in heatmap.extra:  # this chunk timed both strategies side by side
            speed = heatmap.extra["plan_timing"]  # the run's latest timing
            if "measured in this call" in plan:  # the chunk that planned the run
                plan_line = plan.replace("in this call", "in this run", 1)
            elif "switched to" in plan:  # a later chunk changed strategy
                plan_line = (
                    f"{plan_line or plan.split(';')[0]}; {plan[plan.index('switched to') :]}"
                )
        elif speed is None:
            plan_line = plan or plan_line
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
            known.add(dict(zip((keys[n] for n in part), every)))
        done += len(part)
        begin += len(part)
        chunk = min(chunk * 2, LARGEST_CHUNK)
        report(done, total, values.copy())
    if speed is not None:
        speed = dict(speed, incremental_only_seconds=incremental_only)
    return values, class_values, reused, len(todo), plan_line, speed


CACHED_MODE = "cached"  # the runtime log's rows of runs that computed nothing


def cached_estimate(model: str, load: float | None) -> Estimate | None:
    """How long a run with every cell known takes here: prediction, the OOD verdict and
    the picture, from this host's last such runs of the model (none before the first)."""
    found = recent_estimate(
        model, CACHED_MODE, 0, load, ("run with every cell known", "runs with every cell known")
    )
    forward = forward_seconds(model)
    if found is not None or forward is None:
        return found
    # none logged yet: its two forward passes (the prediction and the OOD check) at the
    # calibration's naive pace, at this load
    seconds = 2 * forward * load_factor(load)
    return Estimate(
        seconds, 0.0, seconds * MIN_SPREAD + ABSOLUTE_SLACK, "two forward passes (calibration)"
    )


def measured_speed(speed: dict | None, model: str, patch: int, load: float) -> dict | None:
    """A run's speed against naive (krypton.estimator.whole_run_speed), saying less
    where this host's own naive runs of the model and patch at this load say less
    (krypton.estimator.bounded_speed on logged runs alone: the page's figure is never
    bounded by a calibration from another day)."""
    return bounded_speed(speed, model, patch, load, calibrated=False)


def run_threads(load: float) -> int:
    """Set this process's torch threads for a run starting beside ``load`` busy cores
    (krypton.estimator.threads_for_load: the cores left, at least one) and return them:
    beside two burners on two cores a second thread made exact runs 1.9x slower."""
    threads = threads_for_load(load)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


def find_estimate(
    model: str,
    patch: int,
    stride: int,
    mode: str,
    region,
    r_drill_down: float,
    target_speedup: float,
    cached: int = 0,
    load: float | None = None,
    positions: int | None = None,
) -> Estimate | None:
    """The run-time estimate the page shows, or None where there is none (not calibrated,
    settings explain() would refuse, an unknown model). ``cached``: positions of the grid
    already computed (exact and naive reuse them): the estimate is for the rest, so a
    run with every cell cached is estimated at its fixed cost. ``positions``: the grid's
    (where all are ``cached``, the estimate is of a run that computes nothing:
    :func:`cached_estimate`)."""
    if positions is not None and cached >= positions and mode in ("exact", "naive"):
        return cached_estimate(model, host_load() if load is None else load)  # nothing to do
    try:
        return estimate(
            model,
            patch=patch,
            stride=stride,
            mode=mode,
            region=region,
            r_drill_down=r_drill_down,
            target_speedup=target_speedup,
            cached=cached,
            load=host_load() if load is None else load,
        )
    except (NotCalibratedError, ValueError, RegistryError):
        return None


def _estimate(
    request: RunRequest, region, cached: int, load: float, positions: int | None = None
) -> dict | None:
    found = find_estimate(
        request.model,
        request.patch,
        request.stride,
        request.mode,
        region,
        request.r_drill_down,
        request.target_speedup,
        cached,
        load,
        positions,
    )
    return None if found is None else dataclasses.asdict(found)


def estimate_text(found: dict | None) -> str:
    """'4.0 s (3.1–5.6 s)': the estimate and its range, in one unit (the range's)."""
    if not found:
        return "unknown"
    low, seconds, high = (max(0.0, float(found[k])) for k in ("low", "seconds", "high"))
    if high < 90:
        return f"{seconds:.1f} s ({low:.1f}–{high:.1f} s)"
    if high < 5400:
        return f"{seconds / 60:.1f} min ({low / 60:.1f}–{high / 60:.1f} min)"
    return f"{seconds / 3600:.1f} h ({low / 3600:.1f}–{high / 3600:.1f} h)"


def format_seconds(seconds: float | None) -> str:
    return "unknown" if seconds is None else format_duration(seconds)


def speed_text(speed: dict | None, mode: str) -> str:
    """The speed claim of an exact run: only what this run timed side by side."""
    if mode != "exact":
        return ""
    if not speed:
        return (
            "No speed comparison: this run did not time naive inference beside it "
            "(too few positions to compute, or the plan ruled incremental out)."
        )
    return speed_claim(speed)


_PLAN_TIMING = re.compile(r"; measured (?:in this (?:run|call)|at [\d:]+) [^;]*?per position\)")


def plan_text(plan: str, speed: dict | None) -> str:
    """A run's plan line: its strategy and why; where the run has a speed line, without
    the timing of the chunk that planned it (an early, colder one), so that the summary
    states one measurement, the speed line's latest."""
    return _PLAN_TIMING.sub("", plan) if speed else plan


def result_heatmap(result: dict) -> krypton.Heatmap:
    """A kept result, an image's or a volume's, as the library's :class:`krypton.Heatmap`
    (the exports and what is sent to a PACS)."""
    return krypton.Heatmap(
        values=np.asarray(result["values"], np.float32),
        xs=np.asarray(result["xs"]),
        ys=np.asarray(result["ys"]),
        zs=np.asarray(result["zs"]) if result.get("zs") is not None else None,
        label=int(result["label"]),
        prob=float(result["prob"]),
        mode=result["mode"],
        seconds=float(result["seconds"]),
        patch=int(result["patch"]),
        stride=int(result["stride"]),
        positions_evaluated=int(result["evaluated"]),
        macs_spent=0,
        macs_naive=0,
        extra={"ood": result.get("ood"), "plan": result.get("plan")},
        base_probs=np.asarray(result["base_probs"]),
    )


def summary_lines(result: dict) -> list[str]:
    """The result as the page states it: label, what ran and how long, against what."""
    lines = [f"{result['label_name']}: p = {result['prob']:.3f}"]
    warning = model_card.ood_text(result.get("ood"))
    if warning:
        lines.append(warning)
    if result["evaluated"]:
        line = (
            f"{result['mode']} · {result['evaluated']} positions computed in "
            f"{format_seconds(result['seconds'])}"
        )
        if result.get("estimate"):
            line += f" (estimated {estimate_text(result['estimate'])})"
        lines.append(line)
        speed = speed_text(result.get("speed"), result["mode"])
        if speed:
            lines.append(speed)
    else:
        lines.append(f"{result['mode']} · nothing computed: every cell was known from earlier runs")
    if result.get("plan") and result["mode"] == "exact":
        lines.append(f"Plan: {plan_text(result['plan'], result.get('speed'))}")
    if result["reused"]:
        lines.append(f"Reused {result['reused']} cells from earlier runs")
    if result.get("reuse_note"):
        lines.append(result["reuse_note"][0].upper() + result["reuse_note"][1:])
    return lines


def relabel(result: dict, label: int) -> dict:
    """The same result for another class, from the probabilities kept for every class."""
    if result.get("class_values") is None and result.get("classes_dropped"):
        raise InputError(result["classes_dropped"] + "; press Run to explain the new class")
    if result.get("class_values") is None:
        raise InputError(
            "this heatmap was computed for one class only (approximate "
            "mode chooses its positions by the class); press Run to explain "
            "the new class"
        )
    if not 0 <= label < len(result["classes"]):
        raise InputError(f"class {label} does not exist")
    provenance = result.get("provenance")
    if provenance is not None:  # the same run, now explaining this class
        provenance = Provenance.from_dict(provenance).with_label(label).as_dict()
    return dict(
        result,
        provenance=provenance,
        label=label,
        label_name=result["classes"][label],
        prob=float(result["base_probs"][label]),
        values=np.asarray(result["class_values"])[..., label].astype(np.float32),
    )


def export_summary(result: dict) -> str:
    """The JSON export: settings and result, without the arrays and without the keys
    that name the server's stored files (a file that leaves the server names none)."""
    skipped = ("values", "class_values", "base_probs", "image_key", "methods")
    summary = {k: v for k, v in result.items() if k not in skipped}
    summary["warnings"] = [text for text in (model_card.ood_text(result.get("ood")),) if text]
    compared = comparison.comparison_json(result)
    if compared is not None:  # the three maps for the class shown, and their agreement
        summary["comparison"] = compared
    if summary.get("provenance"):  # its image is the stored image's key
        summary["provenance"] = {k: v for k, v in summary["provenance"].items() if k != "image"}
    if summary.get("dicom"):
        summary["dicom"] = {k: v for k, v in summary["dicom"].items() if k != "source"}
    return json.dumps(summary, indent=2, default=exports.jsonable)
