"""Public API: occlusion heatmaps, naive or incremental (exact).

``krypton.explain(model, image, ...)`` is the one entry point notebooks, the CLI and the
web app call. ``OcclusionExplainer`` is the same thing as an object that keeps the captured
graph and the materialised views of the last image, so refining a region or re-running with
other positions on the same image skips capture and materialisation.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from ._evaluation import _Run
from ._fingerprint import (
    _count_macs_with_hooks,
    _image_key,
    capped_batch_size,
    model_fingerprint,
)
from ._inputs import Region as Region  # a region: the flat public forms or (low, high) per axis
from ._inputs import (
    _check_image,
    _check_label_type,
    _check_logits,
    _check_model,
    _model_device,
    _model_dtype,
    _occluder,
    _positive_int,
    _where,
)
from ._inputs import grid as grid  # one grid for any rank: the app, the estimator, the methods
from ._inputs import grid_positions as grid_positions  # an image's (ys, xs), as benches read it
from ._inputs import snap_start as snap_start  # one snapping rule for the app's images and volumes
from .approximate import drilldown
from .approximate._plan import _approximate_plan, _ApproximatePlan
from .approximate.tuning import TauTuning
from .devices import check_precision, describe, run_precision
from .engine import (
    ExecutionPlan,
    IncrementalGraph,
    MaterializedViews,
    Patched,
    UnsupportedModelError,
    scatter_full,
)
from .engine.capture_lock import CAPTURE_LOCK
from .engine.clock import DeviceClock
from .engine.monitor import StrategyMonitor
from .engine.plan import static_plan
from .explain_settings import ExplainSettings as ExplainSettings
from .explain_settings import PartialCallback, ProgressCallback, StopRun, settings_signature
from .host import host_share
from .registry.models import LoadedModel
from .schedule import Schedules

__all__ = ["Heatmap", "Prediction", "OcclusionExplainer", "explain", "MODES"]

MODES = ("naive", "exact", "approximate")
# how exact mode runs: planned (a plan measured before, or timed again), or forced
STRATEGIES = ("auto", "incremental", "naive", "measure")
DEFAULT_BATCH = {"cpu": 16, "cuda": 128}

# Every class's probability is kept while positions x classes stays below this (float16
# beyond a million values): 100 MB at most.
ALL_CLASSES_LIMIT = 50_000_000


@dataclass
class Heatmap:
    """Result of one occlusion run.

    ``values[i, j]`` is the softmax probability of ``label`` with the patch's top-left corner
    at ``(xs[j], ys[i])``; NaN where no position was evaluated (sparse position lists).
    For a volume, ``values[k, i, j]`` has the patch's first voxel at
    ``(zs[k], ys[i], xs[j])``, and ``patch`` / ``stride`` are an int for a cube or one
    value per axis (depth, height, width).
    """

    values: np.ndarray
    xs: np.ndarray
    ys: np.ndarray
    label: int
    prob: float
    mode: str
    seconds: float
    patch: int | tuple[int, ...]
    stride: int | tuple[int, ...] | None
    positions_evaluated: int
    macs_spent: int
    macs_naive: int
    extra: dict = field(default_factory=dict)
    class_values: np.ndarray | None = None  # (*values.shape, classes) softmax of every class
    base_probs: np.ndarray | None = None  # (classes,) softmax of the unoccluded image
    zs: np.ndarray | None = None  # a volume's slice coordinates (None for an image)

    def for_label(self, label: int) -> Heatmap:
        """The same run's heatmap for another class, without recomputation.

        Exact and naive runs keep every class's probability at every position (float16
        where the array is large); approximate runs do not, because drill-down chooses
        its positions by the explained class.
        """
        if self.class_values is None or self.base_probs is None:
            reason = (
                "drill-down chose its positions for this class"
                if self.mode == "approximate"
                else "the run kept only one class"
            )
            raise ValueError(
                f"this heatmap cannot be re-coloured for another class "
                f"({reason}); run explain() again with label={label}"
            )
        if not 0 <= label < self.class_values.shape[-1]:
            raise ValueError(
                f"label {label} is out of range: the model has "
                f"{self.class_values.shape[-1]} classes"
            )
        return dataclasses.replace(
            self,
            values=self.class_values[..., label].astype(np.float32),
            label=int(label),
            prob=float(self.base_probs[label]),
        )

    @property
    def flops_spent(self) -> int:
        """Multiply-accumulates spent on occluded images (conv + linear, eq 9/11)."""
        return self.macs_spent

    @property
    def flops_naive(self) -> int:
        """What full re-inference would spend on the same positions."""
        return self.macs_naive

    @property
    def flops_ratio(self) -> float:
        """Naive FLOPs over FLOPs spent: the speedup the arithmetic alone allows."""
        return self.macs_naive / self.macs_spent if self.macs_spent else float("inf")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def is_volume(self) -> bool:
        """Whether this is a volume's heatmap (values (nz, ny, nx))."""
        return self.zs is not None

    @property
    def axes(self) -> tuple[np.ndarray, ...]:
        """The cells' first pixels per axis in tensor order, one array per axis of
        ``values``: (ys, xs) for an image, (zs, ys, xs) for a volume."""
        return (self.ys, self.xs) if self.zs is None else (self.zs, self.ys, self.xs)

    def position_values(self) -> list[tuple[int, int, float]]:
        """(x, y, probability) for every evaluated position of an image's heatmap."""
        if self.is_volume:
            raise ValueError("a volume's heatmap has (z, y, x) positions: read values, zs, ys, xs")
        rows, cols = np.nonzero(~np.isnan(self.values))
        return [
            (int(self.xs[c]), int(self.ys[r]), float(self.values[r, c])) for r, c in zip(rows, cols)
        ]


@dataclass(frozen=True)
class Prediction:
    """The model's answer for an unoccluded input (:meth:`OcclusionExplainer.predict`):
    every class's softmax probability, the out-of-distribution report (None without a
    reference set, or where not asked) and why exact and approximate modes cannot run
    (None where they can)."""

    probabilities: np.ndarray
    ood: dict | None = None
    capture_error: str | None = None


class OcclusionExplainer:
    """Occlusion explanations for one model, keeping its graph and the last image's views.

    Args:
        model: a classifier in eval mode mapping (N, C, H, W) to logits (N, classes), or a
            :class:`LoadedModel` from the registry: its tuned τ curve is then the default
            for approximate mode and its reference set checks each image
            (``heatmap.extra["ood"]``), as :func:`krypton.explain` does.
        device: where to run; defaults to the device of the model's parameters.
    """

    def __init__(self, model: nn.Module | LoadedModel, device: torch.device | str | None = None):
        self.loaded = model if isinstance(model, LoadedModel) else None
        if self.loaded is not None:
            model = self.loaded.module
        _check_model(model)
        self.model = model
        model_device = _model_device(model)
        self.device = torch.device(device) if device is not None else model_device
        if self.device.type != model_device.type or (
            self.device.index is not None
            and model_device.index is not None
            and self.device.index != model_device.index
        ):
            raise ValueError(
                f"model is on {model_device} but device={self.device} was asked "
                f"for; move the model first (model.to('{self.device}'))"
            )
        self.dtype = _model_dtype(model)
        self.clock = DeviceClock(self.device)  # every timing of this model's runs
        self._graphs: dict[tuple, IncrementalGraph | UnsupportedModelError] = {}
        self._views: dict[bool, tuple[str, MaterializedViews]] = {}  # per freeze_gates
        self._fingerprint: tuple | None = None
        self._lock = threading.Lock()  # one capture per shape, shared by every thread
        # Plans confirmed by timing both on this host, per (shape, patch, batch size).
        self.measured_plans: dict[tuple, ExecutionPlan] = {}
        self._position_plans: dict[tuple, ExecutionPlan] = {}  # position_plan's, per graph
        self.monitors: dict[tuple, StrategyMonitor] = {}  # carried from call to call
        self.schedules = Schedules()  # how each kind of batch uses the host's threads
        self._ood: tuple[tuple, dict] | None = None  # the last image's check (its key, report)

    def forget_plans(self) -> None:
        """Time incremental against naive again on the next call long enough to time
        both (a caller that states speed from its own run, under today's load). The batch
        schedules stay decided (:mod:`krypton.schedule`: per load band, measured again
        when the load moves to another); ``self.schedules.clear()`` forgets them too."""
        with self._lock:
            self.measured_plans.clear()
            self.monitors.clear()

    def forget_grids(self) -> None:
        """Drop the kept grids' geometries and compiled indices (memory; or to measure a
        first call on a grid): the next call on a grid propagates and compiles again."""
        with self._lock:
            for graph in self._graphs.values():
                if isinstance(graph, IncrementalGraph):
                    graph.forget_geometries()

    # -- materialisation ----------------------------------------------------------------
    def views_for(
        self, image: torch.Tensor, freeze_gates: bool = False
    ) -> tuple[IncrementalGraph, MaterializedViews]:
        """Captured graph and materialised views of ``image`` (cached for the last image).

        ``freeze_gates``: the graph that keeps global-context gates at their unoccluded
        values (approximate mode); a model without gates gets its ordinary graph.
        Raises :class:`UnsupportedModelError` when the model cannot be captured; the
        failure is remembered, so it is reported again without tracing again.
        """
        # views materialised under one precision (autocast) serve runs of that one only
        key = f"{_image_key(image)}:{_autocast_state(image.device)}"
        with self._lock:
            graph = self._current_graph(image, freeze_gates)
            cached = self._views.get(graph.freeze_gates)
            if cached is None or cached[0] != key:
                self._views[graph.freeze_gates] = cached = (key, graph.materialize(image))
            return graph, cached[1]

    def predict(self, image: torch.Tensor, views: bool = True, ood: bool = True) -> Prediction:
        """The model's answer for the unoccluded ``image`` (C, H, W) or volume (C, D, H, W).
        ``views``: through the captured graph, materialising the views a later exact or
        approximate call reuses; a model torch.fx cannot capture is run plainly and
        ``capture_error`` says why (any other error propagates). ``views=False``: one
        plain forward pass. ``ood``: with the out-of-distribution check
        (:meth:`ood_report`)."""
        with torch.inference_mode():
            prepared = self._prepare(image)
            logits, capture_error = None, None
            if views:
                try:
                    logits = self.views_for(prepared)[1].logits
                except UnsupportedModelError as exc:
                    capture_error = str(exc)
            if logits is None:
                with CAPTURE_LOCK.shared():
                    logits = self.model(prepared.unsqueeze(0))
            probabilities = torch.softmax(logits[0].float(), 0).cpu().numpy()
        return Prediction(probabilities, self.ood_report(image) if ood else None, capture_error)

    def ood_report(self, image: torch.Tensor) -> dict | None:
        """Whether ``image`` (C, H, W) or a volume (C, D, H, W) looks like the registry
        model's training images (``heatmap.extra["ood"]``); None without a reference set.
        Checked once per image and weights: a run in many calls, each asking, costs one
        check (a forward pass under the exclusive capture lock)."""
        if self.loaded is None or self.loaded.ood is None:
            return None
        key = (_image_key(image), model_fingerprint(self.model))
        with self._lock:
            if self._ood is not None and self._ood[0] == key:
                return dict(self._ood[1])
        report = _ood_report(self.loaded, image)
        with self._lock:
            self._ood = (key, report)
        return dict(report)

    def captured_graph(self, image: torch.Tensor) -> IncrementalGraph:
        """The captured graph for images shaped like ``image``, without materialising
        views (no forward pass once captured). Raises :class:`UnsupportedModelError`."""
        with self._lock:
            return self._current_graph(image, False)

    def _current_graph(self, image: torch.Tensor, freeze_gates: bool) -> IncrementalGraph:
        """The graph for ``image``'s shape, after dropping everything the model's last
        fingerprint vouched for if its weights, settings or layers changed (lock held)."""
        fingerprint = model_fingerprint(self.model)
        if fingerprint != self._fingerprint:
            self._graphs.clear()
            self.measured_plans.clear()
            self._position_plans.clear()
            self.monitors.clear()
            if self._fingerprint is not None:  # a naive run's decisions hold for its model
                self.schedules.clear()
            self._views = {}
            self._fingerprint = fingerprint
        shape = tuple(image.shape)
        graph = self._graph(image, shape, False)
        if freeze_gates and graph.gate_candidates:
            graph = self._graph(image, shape, True)
        return graph

    def _graph(self, image: torch.Tensor, shape: tuple, freeze_gates: bool) -> IncrementalGraph:
        graph = self._graphs.get((shape, freeze_gates))
        if graph is None:
            try:
                graph = IncrementalGraph(self.model, image, freeze_gates=freeze_gates)
            except UnsupportedModelError as exc:
                graph = exc
            self._graphs[(shape, freeze_gates)] = graph
        if isinstance(graph, UnsupportedModelError):
            raise graph
        return graph

    def largest_activation_bytes(self, graph: IncrementalGraph) -> int:
        """Bytes of the largest tensor one image produces in ``graph``."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return max(int(np.prod(shape)) * element for shape in graph.shapes.values())

    def _prepare(self, image: torch.Tensor) -> torch.Tensor:
        _check_image(image)
        # A private copy: nothing the engine keeps or writes may alias the caller's tensor.
        return image.detach().to(self.device, self.dtype, copy=True)

    # -- the one method -------------------------------------------------------------------
    def explain(
        self,
        image: torch.Tensor,
        settings: ExplainSettings | None = None,
        *,
        tuning: TauTuning | None = None,
        **options: Any,
    ) -> Heatmap:
        """Occlusion heatmap of ``image`` with ``settings`` (an :class:`ExplainSettings`;
        default its defaults), any of its fields given as keywords changing them.
        ``tuning`` defaults to the registry model's tuned τ curve when the explainer was
        built from a :class:`LoadedModel`."""
        chosen = ExplainSettings.of(settings, options)
        precision = check_precision(chosen.precision)
        with host_share(chosen.threads) as share:  # the caller's threads, else the load's
            with torch.inference_mode(), run_precision(self.device, precision):
                heatmap = self._explain(image, chosen, tuning)
        heatmap.extra["host"] = share.as_dict()
        return heatmap

    def _explain(
        self, image: torch.Tensor, chosen: ExplainSettings, tuning: TauTuning | None
    ) -> Heatmap:
        """:meth:`explain` inside its precision's numerics, under inference mode."""
        patch, stride, mode, fill, label = (
            chosen.patch, chosen.stride, chosen.mode, chosen.fill, chosen.label
        )  # fmt: skip
        region, positions, batch_size, progress = (
            chosen.region, chosen.positions, chosen.batch_size, chosen.progress
        )  # fmt: skip
        strategy, partial, precision = chosen.strategy, chosen.partial, chosen.precision
        started = self.clock.now()
        if tuning is None and self.loaded is not None:
            tuning = self.loaded.tuning
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
        if strategy == "measure":  # "auto" on a plan timed in this call
            self.forget_plans()
            strategy = "auto"
        _check_model(self.model)  # a submodule may have been put in training mode since
        image = self._prepare(image)
        where = _where(image, patch, stride, region, positions, mode)
        patch, stride_used, grid = where.patch, where.stride, where.grid
        if batch_size is None:
            batch_size = DEFAULT_BATCH.get(self.device.type, 16)
        batch_size = _positive_int(batch_size, "batch_size")
        if progress is not None and not callable(progress):
            raise TypeError("progress must be callable as progress(done, total)")
        occluder = _occluder(fill, image.shape[0], where.extent, image.dtype, image.device)
        _check_label_type(label)
        settings = chosen.approximate_settings()
        plan = _approximate_plan(
            mode, settings, tuning, grid, patch, stride_used, region, tuple(image.shape[1:])
        )

        # The one unoccluded inference: gives the label, its probability and (exact) views.
        if mode == "naive":
            logits, macs_per_image, largest = _count_macs_with_hooks(self.model, image)
            graph = views = None
        else:
            freeze = mode == "approximate" and settings.freeze_gates is not False
            views_started = self.clock.now()
            graph, views = self.views_for(image, freeze_gates=freeze)
            views_seconds = self.clock.now() - views_started  # ~0 when kept from before
            logits = views.logits
            largest = self.largest_activation_bytes(graph)
        requested_batch = batch_size
        reserved = 0 if views is None else views.nbytes
        batch_size = capped_batch_size(
            batch_size, largest, reserved, strict=image.dim() == 4, device=self.device
        )
        classes = _check_logits(logits)
        if label is None:
            label = int(logits[0].argmax())
        elif not 0 <= label < classes:
            raise ValueError(
                f"label {label} is out of range: the model has {classes} classes (0..{classes - 1})"
            )
        base_probs = torch.softmax(logits[0].float(), dim=0).cpu().numpy()
        prob = float(base_probs[label])
        keep_all = mode != "approximate" and len(where.corners) * classes <= ALL_CLASSES_LIMIT

        run = _Run(
            self,
            image,
            occluder,
            label,
            batch_size,
            graph,
            views,
            progress,
            macs_per_image if mode == "naive" else 0,
            keep_all,
        )
        extra: dict = {"batch_size": batch_size, "views_mb": round(reserved / 2**20, 1)}
        if batch_size < requested_batch:  # changes speed only, never the numbers
            extra["batch_size_capped_from"] = requested_batch
        class_values = None
        if plan is None or plan.s1 is None:  # one pass over all positions
            tau_used = plan.tau if plan is not None else 1.0
            values, class_values, axes = self._one_pass(
                run, where.corners, where.extent, mode, tau_used, strategy, classes, extra
            )
        else:
            axes = grid
            values = self._drill_down(run, grid, where.extent, plan, extra, partial)
        if mode == "approximate":
            extra["frozen_gates"] = list(graph.frozen)
        if mode == "naive":
            extra["plan"] = "naive: requested (mode='naive')"
        elif mode == "approximate":
            extra["plan"] = "incremental: approximate mode always runs incrementally"
        if plan is not None:
            extra.update(
                tau=plan.tau,
                tau_source=plan.tau_source,
                r_drill_down=plan.r_drill_down if plan.s1 is not None else 1.0,
            )
        if self.loaded is not None and self.loaded.ood is not None:
            extra["ood"] = self.ood_report(image)
        extra.update(device=str(self.device), precision=precision)
        if mode == "exact":  # what a naive run of these positions would not have spent
            extra["incremental_only_seconds"] = views_seconds + run.deciding_seconds
        extra["computing_seconds"] = run.computing_seconds  # the batches of positions
        if run.scheduling_seconds:  # measuring the batch schedules, once per decision
            extra["scheduling_seconds"] = run.scheduling_seconds
        if "plan" in extra:  # the line the page, the CLI and the exports show
            extra["plan"] = f"{extra['plan']} (on {describe(self.device, precision)})"
        return Heatmap(
            values=values,
            xs=axes[-1],
            ys=axes[-2],
            zs=axes[0] if len(axes) == 3 else None,
            label=label,
            prob=prob,
            mode=mode,
            seconds=self.clock.now() - started,
            patch=patch,
            stride=stride_used,
            positions_evaluated=run.evaluated,
            macs_spent=run.macs_spent,
            macs_naive=run.macs_naive,
            extra=extra,
            class_values=class_values,
            base_probs=base_probs,
        )

    def _one_pass(
        self,
        run: _Run,
        corners: np.ndarray,
        patch: tuple[int, ...],
        mode: str,
        tau: float,
        strategy: str,
        classes: int,
        extra: dict,
    ) -> tuple[np.ndarray, np.ndarray | None, tuple[np.ndarray, ...]]:
        """Every position in one pass (no drill-down): the heatmap over the positions'
        coordinates per axis (NaN where none was asked for), every class's values when
        kept, and those coordinates ((ys, xs), or (zs, ys, xs) for a volume). Exact runs
        note their plan in ``extra``."""
        run.expect(len(corners))
        run.keep_settled(len(corners))
        try:
            if mode == "exact":
                probabilities, every = run.evaluate_exact(corners, patch, strategy)
            else:
                probabilities, every = run.evaluate(corners, patch, tau, naive=mode == "naive")
        except StopRun as stop:  # the caller's progress ended it: what was computed
            probabilities, every = run.settled_so_far()
            computed = int(np.isfinite(probabilities).sum())
            extra["stopped"] = {"computed": computed, "of": len(corners), "why": str(stop)}
        if mode == "exact":
            extra["plan"] = str(run.plan or "stopped before a plan was measured")
            if run.timing() is not None:
                extra["plan_timing"] = run.timing()
        axes, cells = zip(*(np.unique(column, return_inverse=True) for column in corners.T))
        shape = tuple(len(axis) for axis in axes)
        values = np.full(shape, np.nan, dtype=np.float32)
        values[cells] = probabilities
        class_values = None
        if every is not None:
            class_values = np.full((*shape, classes), np.nan, dtype=every.dtype)
            class_values[cells] = every
        return values, class_values, tuple(axes)

    @torch.inference_mode()
    def position_plan(
        self,
        image: torch.Tensor,
        starts: Sequence[Sequence[int]],
        extent: Sequence[int],
        graph: IncrementalGraph | None = None,
    ) -> ExecutionPlan:
        """What static analysis (eqs 9-12) says exact mode should run for patches of
        ``extent`` whose first cells are ``starts`` (one sequence per spatial axis):
        incremental, or naive where the FLOPs it can avoid do not pay for its own work.
        ``graph``: the one :meth:`captured_graph` just returned, to skip checking the
        model's fingerprint again. Raises :class:`UnsupportedModelError` when the model
        cannot be captured."""
        if graph is None:  # else the caller's, from captured_graph() in this call
            graph = self.captured_graph(self._prepare(image))
        axes = tuple(np.asarray(axis, dtype=np.int64) for axis in starts)
        patch = tuple(int(e) for e in extent)
        key = (id(graph), patch, tuple(axis.tobytes() for axis in axes))
        with self._lock:  # the same windows on the same graph: the same plan
            known = self._position_plans.get(key)
        if known is None:
            known = static_plan(graph, graph.geometry(axes, patch, 1.0))
            with self._lock:
                if len(self._position_plans) >= 64:
                    self._position_plans.clear()
                self._position_plans[key] = known
        return known

    @torch.inference_mode()
    def occluded_outputs(
        self,
        image: torch.Tensor,
        ys: Sequence[int],
        xs: Sequence[int],
        patches: torch.Tensor,
        *,
        zs: Sequence[int] | None = None,
        mode: str = "exact",
        batch_size: int | None = None,
        progress: ProgressCallback | None = None,
    ) -> torch.Tensor:
        """Model outputs (P, classes) of ``image`` with ``patches[i]`` (C, h, w) pasted with
        its top-left corner at ``(xs[i], ys[i])`` — each position's own pixels (a baseline
        image, a partly occluded window), computed incrementally in exact mode. For a
        volume (C, D, H, W), ``patches`` are (P, C, d, h, w) and ``zs`` gives each
        patch's first slice.
        """
        if mode not in ("naive", "exact"):
            raise ValueError(f"mode must be 'naive' or 'exact', got {mode!r}")
        _check_model(self.model)
        image = self._prepare(image)
        starts = [np.asarray(ys, dtype=np.int64), np.asarray(xs, dtype=np.int64)]
        if image.dim() == 4:
            if zs is None:
                raise ValueError("a volume's patches need zs, each patch's first slice")
            starts.insert(0, np.asarray(zs, dtype=np.int64))
        elif zs is not None:
            raise ValueError("zs is for volumes (C, D, H, W); this image is (C, H, W)")
        count = len(starts[0])
        names = "(z, y, x)" if len(starts) == 3 else "(x, y)"
        if (
            patches.dim() != image.dim() + 1
            or patches.shape[0] != count
            or any(len(axis) != count for axis in starts)
            or patches.shape[1] != image.shape[0]
        ):
            raise ValueError(
                f"patches must be (positions, {image.shape[0]}, "
                f"{'d, h, w' if len(starts) == 3 else 'h, w'}) with one position per "
                f"{names}; got {tuple(patches.shape)} for {count} positions"
            )
        extent = tuple(int(side) for side in patches.shape[2:])
        if count and any(
            axis.min() < 0 or axis.max() + side > size
            for axis, side, size in zip(starts, extent, image.shape[1:])
        ):
            raise ValueError("every patch must lie inside the image")
        patches = patches.detach().to(self.device, self.dtype)
        if batch_size is None:
            batch_size = DEFAULT_BATCH.get(self.device.type, 16)
        batch_size = _positive_int(batch_size, "batch_size")
        if mode == "naive":
            captured = self._graphs.get((tuple(image.shape), False))
            if isinstance(captured, IncrementalGraph):  # its shapes: no forward needed
                largest = self.largest_activation_bytes(captured)
            else:
                _, _, largest = _count_macs_with_hooks(self.model, image)
            graph = views = geometry = None
        else:
            graph, views = self.views_for(image)
            largest = self.largest_activation_bytes(graph)
            geometry = graph.geometry(tuple(starts), extent, 1.0)
        corners = np.stack(starts, axis=1)
        reserved = 0 if views is None else views.nbytes
        batch_size = capped_batch_size(
            batch_size, largest, reserved, strict=image.dim() == 4, device=self.device
        )
        outputs = []
        kind = "incremental" if mode == "exact" else "naive"
        key = (kind, "own patches", tuple(image.shape), batch_size)

        def naive(piece: slice) -> torch.Tensor:
            occluded = self._occluded_batch(image, patches[piece], corners[piece])
            with CAPTURE_LOCK.shared():
                return self.model(occluded)

        def incremental(piece: slice) -> torch.Tensor:
            return graph.run_batch(views, geometry, piece, patches[piece])

        def prepare(piece: slice) -> None:
            graph.prepare_batch(views, geometry, piece, self.device)

        for begin in range(0, count, batch_size):
            batch = slice(begin, min(begin + batch_size, count))
            if mode == "naive":
                outputs.append(self.schedules.run(key, self.device, batch, batch_size, naive))
            else:
                outputs.append(
                    self.schedules.run(key, self.device, batch, batch_size, incremental, prepare)
                )
            if progress is not None:
                progress(batch.stop, count)
        if not outputs:
            return torch.empty(0)
        return torch.cat(outputs)

    def _drill_down(
        self,
        run: _Run,
        grid: tuple[np.ndarray, ...],
        patch: tuple[int, ...],
        plan: _ApproximatePlan,
        extra: dict,
        partial: PartialCallback | None = None,
    ) -> np.ndarray:
        """Adaptive drill-down (§4.2): stage one at S1, stage two at S2 where it matters;
        over an image's grid (ys, xs) or a volume's (zs, ys, xs)."""
        s1, rank = plan.s1, len(grid)
        stage_axes = tuple(drilldown.stage_one_axis(axis, s1) for axis in grid)
        stage_shape = tuple(len(axis) for axis in stage_axes)
        stage_corners = np.stack(
            [c.ravel() for c in np.meshgrid(*stage_axes, indexing="ij")], axis=1
        )
        blocks_per_cell = max(1, round((s1 / plan.s2) ** rank))
        chosen = max(1, int(np.ceil(plan.r_drill_down * len(stage_corners))))
        run.expect(len(stage_corners) + chosen * blocks_per_cell)  # refined after stage one
        blocks = np.ix_(*(drilldown.block_of(g, s) for g, s in zip(grid, stage_axes)))

        def stage_one_so_far(done: int, probabilities: np.ndarray) -> None:
            """A live picture after each stage-one batch: every grid cell shows its
            block's stage-one value (NaN where that block is not computed yet)."""
            if partial is None or done >= len(stage_corners):
                return
            known = np.full(len(stage_corners), np.nan, dtype=np.float32)
            known[:done] = probabilities[:done]
            partial(known.reshape(stage_shape)[blocks])

        stage_one = run.evaluate(stage_corners, patch, plan.tau, on_batch=stage_one_so_far)[
            0
        ].reshape(stage_shape)
        values = drilldown.interpolate_to_grid(stage_axes, stage_one, grid)
        if partial is not None:  # the whole picture, coarse, before stage two
            partial(values.copy())
        refine = drilldown.selected_blocks(stage_one, plan.r_drill_down, plan.refine_by)[blocks]
        # positions computed in stage one keep their values and are not recomputed
        on_stage_one = np.ones(refine.shape, dtype=bool)
        for axis, (g, s) in enumerate(zip(grid, stage_axes)):
            shape = [1] * rank
            shape[axis] = len(g)
            on_stage_one &= np.isin(g, s).reshape(shape)
        cells = np.nonzero(refine & ~on_stage_one)
        run.expect(len(stage_corners) + len(cells[0]))
        refined = np.stack([g[c] for g, c in zip(grid, cells)], axis=1)
        values[cells] = run.evaluate(refined, patch, plan.tau)[0]
        kept = np.nonzero(on_stage_one)
        values[kept] = stage_one[tuple(b.ravel()[c] for b, c in zip(blocks, kept))]
        extra.update(
            s1=s1,
            s2=plan.s2,
            stage_one_positions=len(stage_corners),
            stage_two_positions=len(cells[0]),
            drilled_cells=int(refine.sum()),
            refine_by=plan.refine_by,
            theoretical_drill_down_speedup=drilldown.drill_down_speedup(
                s1, plan.s2, plan.r_drill_down, rank
            ),
        )
        return values

    def _occluded_batch(
        self, image: torch.Tensor, occluder: torch.Tensor, corners: np.ndarray
    ) -> torch.Tensor:
        """Full occluded images or volumes (eq 5) for a batch of positions, built in one
        scatter; ``corners`` (N, rank) holds each patch's first cell per spatial axis."""
        count = len(corners)
        device = image.device
        patched = Patched(
            occluder
            if occluder.dim() == image.dim() + 1
            else occluder.unsqueeze(0).expand(count, *occluder.shape),
            tuple(torch.as_tensor(column, device=device) for column in corners.T),
            (1, *image.shape),
        )
        return scatter_full(patched, image.unsqueeze(0), torch.arange(count, device=device))


def _ood_report(loaded: LoadedModel, image: torch.Tensor) -> dict:
    """Is the image (or volume) like the model's training images? (krypton.registry.ood)
    ``image``: (C, H, W) or (C, D, H, W), or a batch of one of them."""
    unbatched = 4 if loaded.is_volume else 3
    single = image[0] if image.dim() == unbatched + 1 else image
    return loaded.check_ood(single.detach().cpu().float()).as_dict()


_explainers: weakref.WeakKeyDictionary[nn.Module, OcclusionExplainer] = weakref.WeakKeyDictionary()


def explain(
    model: nn.Module | LoadedModel,
    image: torch.Tensor,
    settings: ExplainSettings | None = None,
    *,
    device: torch.device | str | None = None,
    **options: Any,
) -> Heatmap:
    """Occlusion-based explanation of ``model``'s prediction on ``image``.

    Args:
        model: classifier in eval mode, (N, C, H, W) -> logits (N, classes), or
            (N, C, D, H, W) -> logits for volumes; or a :class:`LoadedModel` from the
            registry (its tuned τ curve is then used).
        image: (C, H, W) tensor already in the model's input space (normalised), or a
            volume (C, D, H, W) (naive and exact modes).
        settings: an :class:`~krypton.explain_settings.ExplainSettings`; default its
            defaults.
        device: where to run; default the model's device (the model is not moved).
        options: any field of :class:`~krypton.explain_settings.ExplainSettings` (patch,
            stride, mode, fill, label, region, positions, batch_size, progress, tau,
            target_ssim, r_drill_down, target_speedup, s1, partial, strategy,
            freeze_gates, refine_by, approximate, precision), changing ``settings``;
            its docstring says what each does.

    Returns:
        A :class:`Heatmap` of probabilities of ``label`` with the patch at each position;
        exact and naive runs also keep every class's (``heatmap.for_label(k)``). For a
        registry model with a reference set, ``heatmap.extra["ood"]`` says whether the
        image looks like its training images (score, threshold, flagged, warning).
    """
    chosen = ExplainSettings.of(settings, options)
    tuning = None
    loaded = model if isinstance(model, LoadedModel) else None
    if loaded is not None:
        tuning = loaded.tuning
        model = loaded.module
    _check_model(model)
    # one explainer (graph, views, measured plans) per module, shared by the LoadedModel
    # wrapping it: its tuning is passed here and its reference set checked below
    explainer = _explainers.get(model)
    wanted = torch.device(device) if device is not None else None
    if explainer is None or (wanted is not None and explainer.device != wanted):
        explainer = OcclusionExplainer(model, device=device)
        _explainers[model] = explainer
    heatmap = explainer.explain(image, chosen, tuning=tuning)
    if loaded is not None and loaded.ood is not None:
        heatmap.extra["ood"] = _ood_report(loaded, image)
    return heatmap


_SELF = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
_IMAGE = inspect.Parameter("image", inspect.Parameter.POSITIONAL_OR_KEYWORD)
_MODEL = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD)
_SETTINGS = inspect.Parameter("settings", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
explain.__signature__ = settings_signature(  # type: ignore[attr-defined]
    explain,
    [_MODEL, _IMAGE, _SETTINGS,
     inspect.Parameter("device", inspect.Parameter.KEYWORD_ONLY, default=None)],
)  # fmt: skip
OcclusionExplainer.explain.__signature__ = settings_signature(  # type: ignore[attr-defined]
    OcclusionExplainer.explain,
    [_SELF, _IMAGE, _SETTINGS,
     inspect.Parameter("tuning", inspect.Parameter.KEYWORD_ONLY, default=None)],
)  # fmt: skip


def _autocast_state(device: torch.device) -> str:
    """Whether (and to what) autocast is on for ``device``'s kind: part of a view's key."""
    if not torch.is_autocast_enabled(device.type):
        return "off"
    return str(torch.get_autocast_dtype(device.type))
