"""One heatmap run of an image or a volume, from the request to the kept result record:
the one body both panels' Run buttons call (:func:`execute`), and the plan of it the
page shows before Run (:func:`plan_run`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import krypton
from krypton.estimator import Estimate
from krypton.explainer import grid

from .. import comparison, gradient_steps
from ..helpers import InputError
from ..jobs import JobCancelled
from ..result_schema import ResultRecord
from . import records, timing
from .cells import KnownCells, count_known, run_cells, snap_bounds
from .regions import Bounds, check_bounds, whole
from .request import Partial, Reporter, RunRequest
from .subjects import Services, Subject, cell_key, results_key, subject_for

__all__ = ["PlannedRun", "plan_run", "is_light", "shown_estimate", "execute", "compare_left"]


@dataclass(frozen=True)
class PlannedRun:
    """A run as it will happen, before it starts: the region on the grid it will use, in
    the panel's flat form (snapped onto the last run's grid where that reuses cells;
    None: the whole input), the grid's positions and how many of them are known already
    (exact and naive runs reuse them)."""

    region: tuple[int, ...] | None
    positions: int
    known: int

    @property
    def to_compute(self) -> int:
        return self.positions - self.known


@dataclass
class _Grid:
    """Where a run computes: its bounds (snapped), the grid's axes (tensor order), the
    known cells (None for approximate runs) and what the page says of the snapping."""

    bounds: Bounds
    axes: tuple[np.ndarray, ...]
    known: KnownCells | None
    note: str

    def region(self, subject: Subject) -> tuple[int, ...] | None:
        """The bounds in the panel's flat form, None for the whole input."""
        return None if self.bounds == whole(subject.size) else subject.flat(self.bounds)


def _grid(services: Services, subject: Subject, peek: bool = False) -> _Grid:
    """The run's grid: exact and naive runs look up the cells known for these settings
    and, where snapping reuses them, move the region's grid onto the last run's.
    ``peek``: look without keeping an entry (None where there is none)."""
    request = subject.request
    bounds = subject.bounds()
    check_bounds(bounds, subject.size, request.patch, request.stride)
    known, note = None, ""
    if request.mode in ("exact", "naive"):
        weights = services.weights_checksum(request.model)
        key = cell_key(request, weights, subject.loaded.preprocessing)
        known = services.cells.peek(key) if peek else services.cells.get(key)
    if known is not None and known.origin is not None and known.cells:
        offset = tuple((a - o) % request.stride for a, o in zip(bounds[0], known.origin))
        if any(offset) and request.snap:
            snapped = snap_bounds(bounds, known.origin, request.stride, request.patch)
            if snapped != bounds:
                note = subject.snapped_note(bounds, snapped)
                bounds = snapped
                check_bounds(bounds, subject.size, request.patch, request.stride)
        elif any(offset):
            note = subject.offset_note(offset)
    axes = grid(subject.size, request.patch, request.stride, bounds)
    return _Grid(bounds, tuple(np.asarray(a) for a in axes), known, note)


def plan_run(services: Services, request: RunRequest, session: str = "") -> PlannedRun:
    """:class:`PlannedRun` of ``request``, as :func:`execute` will run it (the page's
    estimate counts these positions, and a run with nothing to compute skips the
    queue)."""
    subject = subject_for(services, session, request)
    found = _grid(services, subject, peek=True)
    positions = int(np.prod([len(a) for a in found.axes]))
    return PlannedRun(found.region(subject), positions, count_known(found.known, found.axes))


def is_light(services: Services, request: RunRequest, session: str = "") -> bool:
    """Whether ``request`` computes nothing: every position of its grid is known and, for
    a Compare run, every gradient map (:func:`compare_left`). Such a run does not
    wait in the queue (webapp.jobs: a light job). Planned as :func:`execute` will run
    it, so a region the run would refuse is refused here, before any queueing."""
    planned = plan_run(services, request, session)
    if planned.positions == 0 or planned.to_compute:
        return False
    return not request.compare or compare_left(services, request, session) == []


def compare_left(
    services: Services, request: RunRequest, session: str = ""
) -> list[tuple[str, int]] | None:
    """The gradient maps a Compare run of ``request`` would compute, those known from an
    earlier run left out (webapp.comparison.maps_left); None where that cannot be told
    (the input or model cannot be read: the page says so elsewhere)."""
    try:
        subject = subject_for(services, session, request)
        weights = services.weights_checksum(request.model)
        label = request.label
        if label is None and len(subject.loaded.classes) > gradient_steps.EVERY_CLASS_UP_TO:
            label = int(np.argmax(subject.predict(subject.tensor()).probabilities))
        source = cell_key(request, weights, subject.loaded.preprocessing)[:4]
        return comparison.maps_left(
            subject.loaded, services.gradients, source, subject.fill(), label or 0,
            request.compare_layer, request.compare_steps,
        )  # fmt: skip
    except (InputError, KeyError, TypeError, ValueError):
        return None


def _estimate_key(request: RunRequest, planned: PlannedRun) -> list:
    """What an estimate was made for: the model, mode, patch, stride, the approximate
    settings (in approximate mode) and the plan."""
    region = None if planned.region is None else [int(v) for v in planned.region]
    approximate = (
        [float(request.r_drill_down), float(request.target_speedup)]
        if request.mode == "approximate"
        else None
    )
    return [request.model, request.mode, int(request.patch), int(request.stride), approximate,
            region, int(planned.positions), int(planned.known)]  # fmt: skip


def shown_estimate(request: RunRequest, planned: PlannedRun, found: Estimate | None) -> dict:
    """The estimate a panel shows for ``request`` as the run strip keeps it for Run (a
    JSON record): the run keeps it, and the runtime log learns from it, where the run
    has the same plan; else the run estimates itself (:func:`execute`)."""
    return {"for": _estimate_key(request, planned), "estimate": timing.as_record(found)}


def _estimate(subject: Subject, found: _Grid, load: float) -> dict | None:
    """The estimate of this run: the one the page showed for it (``request.estimate``,
    made for the same plan), else its own at ``load``; kept with the result and in the
    runtime log."""
    request = subject.request
    positions = int(np.prod([len(a) for a in found.axes]))
    cached = count_known(found.known, found.axes)
    shown = request.estimate or {}
    planned = PlannedRun(found.region(subject), positions, cached)
    if shown.get("for") == _estimate_key(request, planned):
        return shown.get("estimate")  # what the page showed: not estimated again
    if request.mode in ("exact", "naive"):
        return timing.as_record(
            timing.counts_estimate(
                request.model, request.mode, request.patch, positions, cached, load
            )  # fmt: skip
        )
    if request.rank != 2:  # approximate stages are planned on an image's grid only
        return None
    return timing.as_record(
        timing.find_estimate(
            request.model,
            request.patch,
            request.stride,
            request.mode,
            found.region(subject),
            request.r_drill_down,
            request.target_speedup,
            0,
            load,
            positions,
        )  # fmt: skip
    )


def execute(
    services: Services,
    session: str,
    request: RunRequest,
    report: Reporter,
    stage: comparison.Stage | None = None,
    shown: Callable[[ResultRecord], None] | None = None,
) -> ResultRecord:
    """Run one heatmap of an image or a volume and return its result record (also kept
    for the session); with ``request.compare``, the gradient methods on its grid after
    it (``stage`` hears of each step; webapp.comparison): the heatmap is kept and
    ``shown`` the record as soon as it is done, and again as each gradient map joins
    it."""
    if request.mode not in krypton.MODES:
        raise InputError(f"unknown mode {request.mode!r}")
    # timed whole, as the user waits (loading, preprocessing, the OOD check included)
    started = time.perf_counter()
    subject = subject_for(services, session, request)
    found = _grid(services, subject)
    tensor = subject.tensor()
    # the one unoccluded prediction, with its out-of-distribution verdict: a run served
    # from known cells warns as well (the explainer checks an input once, however many
    # calls ask)
    prediction = subject.predict(tensor)
    base_probs = prediction.probabilities
    label = int(np.argmax(base_probs)) if request.label is None else int(request.label)
    if not 0 <= label < len(base_probs):
        raise InputError(f"class {label} does not exist for {request.model}")
    # before this run computes: what it competes with, and the torch threads it leaves
    # (beside two burners on two cores a second thread made exact runs 1.9x slower)
    load = timing.share_host()
    planned = _estimate(subject, found, load)

    def as_run(heatmap: krypton.Heatmap) -> krypton.Heatmap:
        # the run as the library's heatmap: its seconds are the whole run's, as the user
        # waited; its probabilities the run's one prediction
        return dataclasses.replace(
            heatmap, seconds=time.perf_counter() - started, prob=float(base_probs[label]),
            base_probs=base_probs, stride=request.stride,
        )  # fmt: skip

    def live(done: int, total: int, values: np.ndarray | None = None) -> None:
        partial = None
        if values is not None:
            name, prob = subject.loaded.class_name(label), float(base_probs[label])
            partial = Partial.of(values, found.axes, request.patch, name, prob)
        report(done, total, partial)

    explainer = services.explainer(request.model, rank=request.rank)
    fill = subject.fill()
    reused = 0
    key = results_key(session, request.rank)
    if found.known is not None:
        had_cells = bool(found.known.cells)

        def stopped(so_far: krypton.Heatmap, reused: int, why: BaseException) -> None:
            # a cancelled run's cells so far, kept for the page's Cancel to show
            # (webapp.run_strip.partial_after_cancel)
            known = int(np.isfinite(so_far.values).sum())
            if isinstance(why, JobCancelled) and known:
                kept = _record(services, subject, found, as_run(so_far), prediction, reused)
                kept["partial"] = records.partial_fields(known, so_far.values.size)
                services.results.put(key, kept)

        heatmap, reused = run_cells(
            explainer, tensor, found.axes, request.patch, request.mode, fill, label,
            found.known, live, stopped,
        )  # fmt: skip
        if not reused and not found.note and had_cells:
            found.note = "no cells reused: none of the earlier positions lies on this grid"
        counts = (heatmap.positions_evaluated, 0)
    else:
        heatmap = _approximate(explainer, tensor, subject, fill, label, found, live)
        counts = (
            heatmap.extra.get("stage_one_positions", heatmap.positions_evaluated),
            heatmap.extra.get("stage_two_positions", 0),
        )
    heatmap = as_run(heatmap)
    speed = timing.finished_run(request, heatmap, counts, planned, load)
    weights = services.weights_checksum(request.model)
    result = _record(services, subject, found, heatmap, prediction, reused, planned, speed)
    if not request.compare:
        services.results.put(key, result)
        return result
    # The heatmap is kept and shown now; the gradient maps join it one by one after
    # the occlusion's clock (its seconds stay its own), the explained class first.
    source = cell_key(request, weights, subject.loaded.preprocessing)[:4]
    stream = _Stream(services.results, key, result, subject.loaded, load, shown)

    def compute(keep: comparison.Shown) -> dict:
        return comparison.compute_methods(
            subject.loaded, tensor, found.axes, request.patch, fill, label, stage, load,
            request.compare_layer, source=source, shown=keep, kept=services.gradients,
            budget=request.compare_steps,
        )  # fmt: skip

    return stream.run(comparison.compare_steps(subject.loaded, label), compute)


def _record(
    services: Services,
    subject: Subject,
    found: _Grid,
    heatmap: krypton.Heatmap,
    prediction: krypton.Prediction,
    reused: int,
    planned: dict | None = None,
    speed: dict | None = None,
) -> ResultRecord:
    """The result record of a run's ``heatmap`` (:func:`webapp.runs.records.result_record`)
    with the subject's fields, how the run reused cells, what the page estimated
    (``planned``), the speed timed side by side in the run and the OOD verdict."""
    request = subject.request
    weights = services.weights_checksum(request.model)
    result = records.result_record(
        request, subject.loaded, weights, heatmap, found.region(subject), subject.dicom
    )
    result.update(subject.record())
    result.update(
        {
            "reused": reused,
            "reuse_note": found.note,
            "estimate": planned,  # what the page estimated for the positions left
            "speed": speed,  # incremental vs naive, timed side by side in this run, or None
            "ood": prediction.ood,
            "methods": None,  # Grad-CAM and Integrated Gradients (webapp.comparison)
        }
    )
    return result


@dataclass
class _Stream:
    """A Compare run's record as its gradient maps come: kept with the maps pending and
    shown (``shown``, the page's early handle) at once, then again with each map done. A
    run stopped between maps keeps the maps done, the rest marked as stopped. The kept
    record is updated in place (webapp.runs.records.update_kept: a class switched
    meanwhile stays switched)."""

    results: object
    key: str
    result: ResultRecord
    model: krypton.LoadedModel
    load: float
    shown: Callable[[ResultRecord], None] | None

    def keep(
        self, methods: dict, left: list, stopped: bool = False, first: bool = False
    ) -> ResultRecord:
        found = comparison.step_estimate(self.model, self.load, left) if left else None
        fields = {"methods": methods,
                  "methods_pending": comparison.pending_record(left, found, stopped)}  # fmt: skip
        self.result.update(fields)  # type: ignore[typeddict-item]
        return records.update_kept(self.results, self.key, self.result, fields, first)

    def run(self, steps: list, compute: Callable[[comparison.Shown], dict]) -> ResultRecord:
        """Keep and show the record, then ``compute`` its maps, each kept and shown."""
        current = self.keep({}, steps, first=True)
        if self.shown is not None:
            self.shown(current)

        def one_more(so_far: dict, left: list) -> None:
            current = self.keep(so_far, left)
            if self.shown is not None:
                self.shown(current)

        try:
            methods = compute(one_more)
        except BaseException:
            pending = self.result["methods_pending"] or {}
            self.keep(self.result["methods"] or {}, pending.get("steps", []), stopped=True)
            raise
        return self.keep(methods, [])


def _approximate(
    explainer: krypton.OcclusionExplainer,
    tensor: torch.Tensor,
    subject: Subject,
    fill,
    label: int,
    found: _Grid,
    live: Callable,
) -> krypton.Heatmap:
    """An approximate run in one call, with its stage-one picture and its progress."""
    request = subject.request
    return explainer.explain(
        tensor,
        patch=request.patch,
        stride=request.stride,
        mode="approximate",
        fill=fill,
        label=label,
        region=found.region(subject),
        progress=lambda done, total: live(done, total),
        partial=lambda values: live(0, 0, np.asarray(values, np.float32)),
        # The slider's quality target where the model has a tuned SSIM(τ) curve; else
        # the τ policy (krypton.approximate.tuning.choose_tau) decides, in the explainer
        # built from the LoadedModel.
        target_ssim=request.target_ssim if subject.loaded.tuning else None,
        r_drill_down=request.r_drill_down,
        target_speedup=request.target_speedup,
    )
