"""Public API: occlusion heatmaps, naive or incremental (exact).

``krypton.explain(model, image, ...)`` is the one entry point notebooks, the CLI and the
web app call. ``OcclusionExplainer`` is the same thing as an object that keeps the captured
graph and the materialised views of the last image, so refining a region or re-running with
other positions on the same image skips capture and materialisation.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import warnings
import weakref
import zlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from . import drilldown
from .capture_lock import CAPTURE_LOCK
from .engine.plan import measured_plan, reused_plan
from .engine import (
    ExecutionPlan,
    IncrementalGraph,
    MaterializedViews,
    Patched,
    UnsupportedModelError,
    scatter_full,
)
from .models import LoadedModel
from .tuning import TauTuning, choose_tau

__all__ = ["Heatmap", "OcclusionExplainer", "explain", "MODES"]

MODES = ("naive", "exact", "approximate")
STRATEGIES = ("auto", "incremental", "naive")  # how exact mode runs: planned, or forced
DEFAULT_BATCH = {"cpu": 16, "cuda": 128}

ProgressCallback = Callable[[int, int], None]
PartialCallback = Callable[[np.ndarray], None]
# Every class's probability is kept while positions x classes stays below this (float16
# beyond a million values): 100 MB at most.
ALL_CLASSES_LIMIT = 50_000_000


@dataclass
class Heatmap:
    """Result of one occlusion run.

    ``values[i, j]`` is the softmax probability of ``label`` with the patch's top-left corner
    at ``(xs[j], ys[i])``; NaN where no position was evaluated (sparse position lists).
    """

    values: np.ndarray
    xs: np.ndarray
    ys: np.ndarray
    label: int
    prob: float
    mode: str
    seconds: float
    patch: int
    stride: int | None
    positions_evaluated: int
    macs_spent: int
    macs_naive: int
    extra: dict = field(default_factory=dict)
    class_values: np.ndarray | None = None  # (rows, cols, classes) softmax of every class
    base_probs: np.ndarray | None = None  # (classes,) softmax of the unoccluded image

    def for_label(self, label: int) -> "Heatmap":
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
    def shape(self) -> tuple[int, int]:
        return self.values.shape

    def position_values(self) -> list[tuple[int, int, float]]:
        """(x, y, probability) for every evaluated position."""
        rows, cols = np.nonzero(~np.isnan(self.values))
        return [
            (int(self.xs[c]), int(self.ys[r]), float(self.values[r, c])) for r, c in zip(rows, cols)
        ]


# ---------------------------------------------------------------------------------------
# Validation: every problem is reported before any inference is done
# ---------------------------------------------------------------------------------------


def _check_model(model: nn.Module) -> None:
    """A module whose every submodule is in eval mode.

    A submodule left in training mode (a Dropout or batch norm under an ``eval()`` parent)
    makes results random or batch-dependent, so exact would differ from naive: refuse it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    training = [
        name or "(the model itself)" for name, module in model.named_modules() if module.training
    ]
    if training:
        shown = ", ".join(training[:5]) + (
            f" and {len(training) - 5} more" if len(training) > 5 else ""
        )
        raise ValueError(
            f"model is in training mode ({shown}); dropout and batch norm "
            f"would make results random or batch-dependent: call model.eval() "
            f"first"
        )


def _check_image(image: torch.Tensor) -> None:
    if not isinstance(image, torch.Tensor):
        raise TypeError(
            f"image must be a torch.Tensor of shape (C, H, W), got {type(image).__name__}"
        )
    if image.dim() != 3:
        raise ValueError(f"image must have shape (C, H, W), got {tuple(image.shape)}")
    if min(image.shape) < 1:
        raise ValueError(f"image is empty: shape {tuple(image.shape)}")
    if not image.is_floating_point():
        raise ValueError(
            f"image must be a floating point tensor in the model's input space, got {image.dtype}"
        )
    if not torch.isfinite(image).all():
        raise ValueError("image contains NaN or infinite values")


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def grid_positions(
    image_hw: tuple[int, int], patch: int, stride: int, region: Sequence[int] | None
) -> tuple[np.ndarray, np.ndarray]:
    """Top-left corners x = x0, x0+stride, ... while x + patch <= x1 (same for y)."""
    height, width = image_hw
    if region is None:
        x0, y0, x1, y1 = 0, 0, width, height
    else:
        if len(region) != 4:
            raise ValueError(f"region must be (x0, y0, x1, y1), got {region!r}")
        x0, y0, x1, y1 = (int(v) for v in region)
        if not (0 <= x0 < x1 <= width and 0 <= y0 < y1 <= height):
            raise ValueError(
                f"region {tuple(region)} is outside the {width}x{height} image "
                f"or empty (need 0 <= x0 < x1 <= {width}, 0 <= y0 < y1 <= "
                f"{height})"
            )
    if patch > x1 - x0 or patch > y1 - y0:
        where = "image" if region is None else "region"
        raise ValueError(f"patch {patch} is larger than the {where} ({x1 - x0}x{y1 - y0} pixels)")
    xs = np.arange(x0, x1 - patch + 1, stride, dtype=np.int64)
    ys = np.arange(y0, y1 - patch + 1, stride, dtype=np.int64)
    return ys, xs


def _listed_positions(
    positions: Iterable, image_hw: tuple[int, int], patch: int
) -> tuple[np.ndarray, np.ndarray]:
    try:
        array = np.asarray(list(positions), dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError("positions must be a list of (x, y) integer pairs") from exc
    if array.size == 0:
        raise ValueError("positions is empty: give at least one (x, y) position")
    if array.ndim != 2 or array.shape[1] != 2:
        raise ValueError(f"positions must be a list of (x, y) pairs, got shape {array.shape}")
    height, width = image_hw
    bad = (
        (array[:, 0] < 0)
        | (array[:, 1] < 0)
        | (array[:, 0] + patch > width)
        | (array[:, 1] + patch > height)
    )
    if bad.any():
        x, y = array[np.argmax(bad)]
        raise ValueError(
            f"position (x={x}, y={y}) puts the {patch}-pixel patch outside the "
            f"{width}x{height} image"
        )
    array = np.unique(array, axis=0)  # duplicates cost time and change nothing
    return array[:, 1], array[:, 0]


def _occluder(fill, channels: int, patch: int, dtype, device) -> torch.Tensor:
    if isinstance(fill, torch.Tensor):
        values = fill.detach().flatten().tolist()
    elif isinstance(fill, (int, float, np.floating, np.integer)) and not isinstance(fill, bool):
        values = [float(fill)]
    elif isinstance(fill, (list, tuple, np.ndarray)):
        values = [float(v) for v in np.asarray(fill).flatten()]
    else:
        raise TypeError(f"fill must be a number or one number per channel, got {fill!r}")
    if len(values) == 1:
        values = values * channels
    if len(values) != channels:
        raise ValueError(f"fill has {len(values)} values but the image has {channels} channels")
    if not all(np.isfinite(values)):
        raise ValueError(f"fill must be finite, got {values}")
    column = torch.tensor(values, dtype=dtype, device=device).view(channels, 1, 1)
    return column.expand(channels, patch, patch).contiguous()


def _model_device(model: nn.Module) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _model_dtype(model: nn.Module) -> torch.dtype:
    for tensor in model.parameters():
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32


def _check_logits(logits) -> int:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != 1:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"model output must be logits of shape (N, classes); for one image it returned {shape}"
        )
    return int(logits.shape[1])


_PLAIN_ATTRIBUTES = (bool, int, float, str, type(None))


def _module_settings(module: nn.Module) -> tuple:
    """A module's plain settings (eps, momentum, stride, inplace, ...), sorted by name."""
    settings = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") and key != "_version":
            continue
        if isinstance(value, _PLAIN_ATTRIBUTES):
            settings.append((key, value))
        elif isinstance(value, tuple) and all(isinstance(v, _PLAIN_ATTRIBUTES) for v in value):
            settings.append((key, value))
    return tuple(settings)


def _tensor_checksum(tensor: torch.Tensor) -> bytes:
    """Digest of a tensor's bytes: edits through ``.data`` or ``copy_`` change it too."""
    tensor = tensor.detach()
    if tensor.numel() == 0:
        return b""
    if tensor.device.type != "cpu":  # checksummed where it lives; no copy to the host
        bits = tensor.contiguous().flatten().view(torch.uint8).to(torch.int64)
        weights = torch.arange(1, bits.numel() + 1, device=bits.device, dtype=torch.int64)
        return repr((int(bits.sum()), int((bits * weights).sum()))).encode()
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    # CRC-32 (zlib's, vectorised): 4-5x faster than a cryptographic hash and catches every
    # edit short of a deliberate collision — it guards against stale caches, not attacks.
    return zlib.crc32(memoryview(data).cast("B")).to_bytes(4, "little")


def model_fingerprint(model: nn.Module) -> tuple:
    """Identity of a model's structure, settings and weights, for cache invalidation.

    Covers the module tree (a replaced layer), every module's mode and plain settings
    (``bn.eps = 10``) and a content checksum of every parameter and buffer, so edits that
    bypass PyTorch's version counter (``param.data.copy_(...)``) are caught as well. The
    checksum reads each weight once: about 10 ms for ResNet18 and 0.1 s for VGG16 on two
    CPU cores (``make bench`` prints it next to the runs).
    """
    modules = tuple(
        (name, id(module), type(module).__qualname__, module.training, _module_settings(module))
        for name, module in model.named_modules()
    )
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(_tensor_checksum(tensor))
    return modules, digest.hexdigest()


def _count_macs_with_hooks(model: nn.Module, image: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Run one image with forward hooks: (logits, conv/linear multiply-accumulates (eq 9),
    bytes of the largest activation a leaf module produced)."""
    total = 0
    largest = image.numel() * image.element_size()

    def hook(module, inputs, output):
        nonlocal total, largest
        if isinstance(output, torch.Tensor):
            largest = max(largest, output.numel() * output.element_size())
        if isinstance(module, nn.Conv2d) and output.dim() == 4:
            kh, kw = module.kernel_size
            total += (module.in_channels // module.groups) * kh * kw * output[0].numel()
        elif isinstance(module, nn.Linear):
            total += module.in_features * module.out_features

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if not any(True for _ in m.children()) and not isinstance(m, torch.jit.ScriptModule)
    ]  # scripted: no hooks
    try:
        with CAPTURE_LOCK.shared():
            logits = model(image.unsqueeze(0))
    finally:
        for handle in handles:
            handle.remove()
    return logits, total, largest


def memory_budget_bytes() -> int:
    """Memory one run may use for its batches: $KRYPTON_MEMORY_BUDGET_MB, default 2048."""
    text = os.environ.get("KRYPTON_MEMORY_BUDGET_MB", "2048")
    try:
        megabytes = float(text)
    except ValueError:
        raise ValueError(f"KRYPTON_MEMORY_BUDGET_MB must be a number, got {text!r}") from None
    if megabytes <= 0:
        raise ValueError(f"KRYPTON_MEMORY_BUDGET_MB must be positive, got {text!r}")
    return int(megabytes * 2**20)


# Live activations at once, as a multiple of the largest one (input, output, a residual
# branch and a workspace): a deliberately generous bound for the batch size cap.
LIVE_ACTIVATION_FACTOR = 4


def capped_batch_size(requested: int, largest_activation_bytes: int) -> int:
    """The batch size that keeps one batch's activations inside the memory budget."""
    per_image = max(1, LIVE_ACTIVATION_FACTOR * largest_activation_bytes)
    return max(1, min(requested, memory_budget_bytes() // per_image))


def _image_key(image: torch.Tensor) -> str:
    data = image.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return f"{tuple(image.shape)}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"


# ---------------------------------------------------------------------------------------
# The explainer
# ---------------------------------------------------------------------------------------


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
        self._graphs: dict[tuple, IncrementalGraph | UnsupportedModelError] = {}
        self._views: dict[bool, tuple[str, MaterializedViews]] = {}  # per freeze_gates
        self._fingerprint: tuple | None = None
        self._lock = threading.Lock()  # one capture per shape, shared by every thread
        # Plans confirmed by timing both on this host, per (shape, patch, batch size).
        self.measured_plans: dict[tuple, ExecutionPlan] = {}

    def forget_plans(self) -> None:
        """Time incremental against naive again on the next call long enough to time
        both (a caller that states speed from its own run, under today's load)."""
        with self._lock:
            self.measured_plans.clear()

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
        key = _image_key(image)
        fingerprint = model_fingerprint(self.model)
        with self._lock:
            if fingerprint != self._fingerprint:  # weights, settings or layers changed
                self._graphs.clear()
                self.measured_plans.clear()
                self._views = {}
                self._fingerprint = fingerprint
            shape = tuple(image.shape)
            graph = self._graph(image, shape, False)
            if freeze_gates and graph.gate_candidates:
                graph = self._graph(image, shape, True)
            cached = self._views.get(graph.freeze_gates)
            if cached is None or cached[0] != key:
                self._views[graph.freeze_gates] = cached = (key, graph.materialize(image))
            return graph, cached[1]

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
    @torch.inference_mode()
    def explain(
        self,
        image: torch.Tensor,
        *,
        patch: int = 16,
        stride: int = 4,
        mode: str = "exact",
        fill=0.0,
        label: int | None = None,
        region: Sequence[int] | None = None,
        positions: Iterable | None = None,
        batch_size: int | None = None,
        progress: ProgressCallback | None = None,
        tau: float | None = None,
        target_ssim: float | None = None,
        r_drill_down: float = 0.25,
        target_speedup: float = 3.0,
        s1: int | None = None,
        tuning: TauTuning | None = None,
        partial: PartialCallback | None = None,
        strategy: str = "auto",
        freeze_gates: bool | None = None,
        refine_by: str = "drop+variation",
    ) -> Heatmap:
        """Occlusion heatmap of ``image``; see :func:`krypton.explain` for the arguments.
        ``tuning`` defaults to the registry model's tuned τ curve when the explainer was
        built from a :class:`LoadedModel`."""
        started = time.perf_counter()
        if tuning is None and self.loaded is not None:
            tuning = self.loaded.tuning
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
        _check_model(self.model)  # a submodule may have been put in training mode since
        image = self._prepare(image)
        patch = _positive_int(patch, "patch")
        height, width = image.shape[-2:]
        if positions is not None:
            if region is not None:
                raise ValueError("give either region or positions, not both")
            ys, xs = _listed_positions(positions, (height, width), patch)
            stride_used = None
            grid = None
        else:
            stride_used = _positive_int(stride, "stride")
            grid = grid_positions((height, width), patch, stride_used, region)
            ys = np.repeat(grid[0], len(grid[1]))
            xs = np.tile(grid[1], len(grid[0]))
        if batch_size is None:
            batch_size = DEFAULT_BATCH.get(self.device.type, 16)
        batch_size = _positive_int(batch_size, "batch_size")
        if progress is not None and not callable(progress):
            raise TypeError("progress must be callable as progress(done, total)")
        occluder = _occluder(fill, image.shape[0], patch, image.dtype, image.device)
        if label is not None and (
            isinstance(label, bool) or not isinstance(label, (int, np.integer))
        ):
            raise TypeError(f"label must be an integer class index, got {label!r}")
        plan = _approximate_plan(
            mode,
            tau,
            target_ssim,
            r_drill_down,
            target_speedup,
            s1,
            tuning,
            grid,
            patch,
            stride_used,
            region,
            (height, width),
            refine_by,
        )

        # The one unoccluded inference: gives the label, its probability and (exact) views.
        if mode == "naive":
            logits, macs_per_image, largest = _count_macs_with_hooks(self.model, image)
            graph = views = None
        else:
            freeze = mode == "approximate" and freeze_gates is not False
            graph, views = self.views_for(image, freeze_gates=freeze)
            logits = views.logits
            largest = self.largest_activation_bytes(graph)
        requested_batch = batch_size
        batch_size = capped_batch_size(batch_size, largest)
        classes = _check_logits(logits)
        if label is None:
            label = int(logits[0].argmax())
        elif not 0 <= label < classes:
            raise ValueError(
                f"label {label} is out of range: the model has {classes} classes (0..{classes - 1})"
            )
        base_probs = torch.softmax(logits[0].float(), dim=0).cpu().numpy()
        prob = float(base_probs[label])
        keep_all = mode != "approximate" and len(ys) * classes <= ALL_CLASSES_LIMIT

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
        extra: dict = {"batch_size": batch_size}
        if batch_size < requested_batch:  # changes speed only, never the numbers
            extra["batch_size_capped_from"] = requested_batch
        class_values = None
        if plan is None or plan.s1 is None:  # one pass over all positions
            tau_used = plan.tau if plan is not None else 1.0
            run.expect(len(ys))
            if mode == "exact":
                probabilities, every = run.evaluate_exact(ys, xs, patch, strategy)
                extra["plan"] = str(run.plan)
                if run.timing() is not None:
                    extra["plan_timing"] = run.timing()
            else:
                probabilities, every = run.evaluate(ys, xs, patch, tau_used, naive=mode == "naive")
            unique_xs, col_of = np.unique(xs, return_inverse=True)
            unique_ys, row_of = np.unique(ys, return_inverse=True)
            values = np.full((len(unique_ys), len(unique_xs)), np.nan, dtype=np.float32)
            values[row_of, col_of] = probabilities
            if every is not None:
                class_values = np.full(
                    (len(unique_ys), len(unique_xs), classes), np.nan, dtype=every.dtype
                )
                class_values[row_of, col_of] = every
        else:
            unique_ys, unique_xs = grid
            values = self._drill_down(run, grid, patch, plan, region, extra, partial)
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
            extra["ood"] = _ood_report(self.loaded, image)
        return Heatmap(
            values=values,
            xs=unique_xs,
            ys=unique_ys,
            label=label,
            prob=prob,
            mode=mode,
            seconds=time.perf_counter() - started,
            patch=patch,
            stride=stride_used,
            positions_evaluated=run.evaluated,
            macs_spent=run.macs_spent,
            macs_naive=run.macs_naive,
            extra=extra,
            class_values=class_values,
            base_probs=base_probs,
        )

    @torch.inference_mode()
    def occluded_outputs(
        self,
        image: torch.Tensor,
        ys: Sequence[int],
        xs: Sequence[int],
        patches: torch.Tensor,
        *,
        mode: str = "exact",
        batch_size: int | None = None,
        progress: ProgressCallback | None = None,
    ) -> torch.Tensor:
        """Model outputs (P, classes) of ``image`` with ``patches[i]`` (C, h, w) pasted with
        its top-left corner at ``(xs[i], ys[i])`` — each position's own pixels (a baseline
        image, a partly occluded window), computed incrementally in exact mode.
        """
        if mode not in ("naive", "exact"):
            raise ValueError(f"mode must be 'naive' or 'exact', got {mode!r}")
        _check_model(self.model)
        image = self._prepare(image)
        ys = np.asarray(ys, dtype=np.int64)
        xs = np.asarray(xs, dtype=np.int64)
        if (
            patches.dim() != 4
            or patches.shape[0] != len(ys)
            or len(ys) != len(xs)
            or patches.shape[1] != image.shape[0]
        ):
            raise ValueError(
                f"patches must be (positions, {image.shape[0]}, h, w) with one position per "
                f"(x, y); got {tuple(patches.shape)} for {len(ys)} positions"
            )
        height, width = patches.shape[-2:]
        if len(ys) and (
            ys.min() < 0
            or xs.min() < 0
            or ys.max() + height > image.shape[1]
            or xs.max() + width > image.shape[2]
        ):
            raise ValueError("every patch must lie inside the image")
        patches = patches.detach().to(self.device, self.dtype)
        if batch_size is None:
            batch_size = DEFAULT_BATCH.get(self.device.type, 16)
        batch_size = _positive_int(batch_size, "batch_size")
        if mode == "naive":
            _, _, largest = _count_macs_with_hooks(self.model, image)
            graph = views = geometry = None
        else:
            graph, views = self.views_for(image)
            largest = self.largest_activation_bytes(graph)
            geometry = graph.geometry(ys, xs, height, width, 1.0)
        batch_size = capped_batch_size(batch_size, largest)
        outputs = []
        for begin in range(0, len(ys), batch_size):
            batch = slice(begin, min(begin + batch_size, len(ys)))
            if mode == "naive":
                occluded = self._occluded_batch(image, patches[batch], ys[batch], xs[batch])
                with CAPTURE_LOCK.shared():
                    outputs.append(self.model(occluded))
            else:
                outputs.append(graph.run_batch(views, geometry, batch, patches[batch]))
            if progress is not None:
                progress(batch.stop, len(ys))
        if not outputs:
            return torch.empty(0)
        return torch.cat(outputs)

    def _drill_down(
        self,
        run: "_Run",
        grid: tuple[np.ndarray, np.ndarray],
        patch: int,
        plan: "_ApproximatePlan",
        region,
        extra: dict,
        partial: PartialCallback | None = None,
    ) -> np.ndarray:
        """Adaptive drill-down (§4.2): stage one at S1, stage two at S2 where it matters."""
        grid_ys, grid_xs = grid
        s1 = plan.s1
        stage_ys = drilldown.stage_one_axis(grid_ys, s1)
        stage_xs = drilldown.stage_one_axis(grid_xs, s1)
        stage_rows, stage_cols = (
            np.repeat(stage_ys, len(stage_xs)),
            np.tile(stage_xs, len(stage_ys)),
        )
        blocks_per_cell = max(
            1, round((s1 / (grid_ys[1] - grid_ys[0] if len(grid_ys) > 1 else s1)) ** 2)
        )
        chosen = max(1, int(np.ceil(plan.r_drill_down * stage_rows.size)))
        run.expect(stage_rows.size + chosen * blocks_per_cell)  # refined after stage one
        block_rows = drilldown.block_of(grid_ys, stage_ys)
        block_cols = drilldown.block_of(grid_xs, stage_xs)

        def stage_one_so_far(done: int, probabilities: np.ndarray) -> None:
            """A live picture after each stage-one batch: every grid cell shows its
            block's stage-one value (NaN where that block is not computed yet)."""
            if partial is None or done >= stage_rows.size:
                return
            known = np.full(stage_rows.size, np.nan, dtype=np.float32)
            known[:done] = probabilities[:done]
            blocks = known.reshape(len(stage_ys), len(stage_xs))
            partial(blocks[block_rows[:, None], block_cols[None, :]])

        stage_one = run.evaluate(
            stage_rows, stage_cols, patch, plan.tau, on_batch=stage_one_so_far
        )[0].reshape(len(stage_ys), len(stage_xs))

        values = drilldown.interpolate_to_grid(stage_ys, stage_xs, stage_one, grid_ys, grid_xs)
        if partial is not None:  # the whole picture, coarse, before stage two
            partial(values.copy())
        refine = drilldown.selected_blocks(stage_one, plan.r_drill_down, plan.refine_by)[
            block_rows[:, None], block_cols[None, :]
        ]
        # positions computed in stage one keep their values and are not recomputed
        on_stage_one = np.isin(grid_ys, stage_ys)[:, None] & np.isin(grid_xs, stage_xs)[None, :]
        rows, cols = np.nonzero(refine & ~on_stage_one)
        run.expect(stage_rows.size + len(rows))
        values[rows, cols] = run.evaluate(grid_ys[rows], grid_xs[cols], patch, plan.tau)[0]
        exact_rows, exact_cols = np.nonzero(on_stage_one)
        values[exact_rows, exact_cols] = stage_one[block_rows[exact_rows], block_cols[exact_cols]]
        extra.update(
            s1=s1,
            s2=int(grid_ys[1] - grid_ys[0]) if len(grid_ys) > 1 else None,
            stage_one_positions=int(stage_rows.size),
            stage_two_positions=int(len(rows)),
            drilled_cells=int(refine.sum()),
            refine_by=plan.refine_by,
            theoretical_drill_down_speedup=drilldown.drill_down_speedup(
                s1, plan.s2, plan.r_drill_down
            ),
        )
        return values

    def _occluded_batch(
        self, image: torch.Tensor, occluder: torch.Tensor, ys: np.ndarray, xs: np.ndarray
    ) -> torch.Tensor:
        """Full occluded images (eq 5) for a batch of positions, built in one scatter."""
        count = len(ys)
        device = image.device
        patched = Patched(
            occluder
            if occluder.dim() == 4
            else occluder.unsqueeze(0).expand(count, *occluder.shape),
            torch.as_tensor(ys, device=device),
            torch.as_tensor(xs, device=device),
            (1, *image.shape),
        )
        return scatter_full(patched, image.unsqueeze(0), torch.arange(count, device=device))


@dataclass
class _ApproximatePlan:
    tau: float
    tau_source: str
    r_drill_down: float
    s1: int | None  # None: no drill-down
    s2: int | None
    refine_by: str = "drop+variation"


def _approximate_plan(
    mode,
    tau,
    target_ssim,
    r_drill_down,
    target_speedup,
    s1,
    tuning,
    grid,
    patch,
    stride,
    region,
    image_hw,
    refine_by: str = "drop+variation",
) -> _ApproximatePlan | None:
    """Validate the approximate-mode settings before any work; None for other modes."""
    if mode != "approximate":
        return None
    if refine_by not in drilldown.REFINE_RULES:
        raise ValueError(
            f"refine_by must be one of {', '.join(drilldown.REFINE_RULES)}; got {refine_by!r}"
        )
    for name, value in (("tau", tau), ("target_ssim", target_ssim)):
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, (int, float, np.floating))
            or not 0.0 < value <= 1.0
        ):
            raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    if (
        isinstance(r_drill_down, bool)
        or not isinstance(r_drill_down, (int, float))
        or not 0.0 < r_drill_down <= 1.0
    ):
        raise ValueError(f"r_drill_down must be in (0, 1], got {r_drill_down!r}")
    if (
        isinstance(target_speedup, bool)
        or not isinstance(target_speedup, (int, float))
        or target_speedup <= 1.0
    ):
        raise ValueError(f"target_speedup must be greater than 1, got {target_speedup!r}")
    choice = choose_tau(tuning, tau, target_ssim)
    if tau is None and target_ssim is None and tuning is None:
        warnings.warn(
            "no tuned tau for this model: using tau=1.0 (no projective-field "
            "thresholding); run `krypton tune` to tune it",
            stacklevel=3,
        )
    tau_value, source = choice.tau, choice.source
    if grid is None or r_drill_down >= 1.0 or (len(grid[0]) < 2 and len(grid[1]) < 2):
        return _ApproximatePlan(tau_value, source, r_drill_down, None, stride, refine_by)
    if s1 is not None:
        s1 = _positive_int(s1, "s1")
        if s1 <= stride:
            raise ValueError(f"s1 ({s1}) must be larger than the stride ({stride})")
    else:
        if region is None:
            width = min(image_hw)
        else:
            width = min(region[2] - region[0], region[3] - region[1])
        s1 = drilldown.check_drill_down(
            float(target_speedup), float(r_drill_down), stride, int(width)
        )
    return _ApproximatePlan(tau_value, source, float(r_drill_down), s1, stride, refine_by)


class _Run:
    """Evaluates batches of positions for one explain() call and keeps its accounting."""

    def __init__(
        self,
        explainer: "OcclusionExplainer",
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


def _ood_report(loaded: LoadedModel, image: torch.Tensor) -> dict:
    """Is the image like the model's training images? (krypton.ood)"""
    single = image[0] if image.dim() == 4 else image
    return loaded.check_ood(single.detach().cpu().float()).as_dict()


_explainers: "weakref.WeakKeyDictionary[nn.Module, OcclusionExplainer]" = (
    weakref.WeakKeyDictionary()
)


def explain(
    model: nn.Module | LoadedModel,
    image: torch.Tensor,
    *,
    patch: int = 16,
    stride: int = 4,
    mode: str = "exact",
    fill=0.0,
    label: int | None = None,
    region: Sequence[int] | None = None,
    positions: Iterable | None = None,
    batch_size: int | None = None,
    device: torch.device | str | None = None,
    progress: ProgressCallback | None = None,
    tau: float | None = None,
    target_ssim: float | None = None,
    r_drill_down: float = 0.25,
    target_speedup: float = 3.0,
    s1: int | None = None,
    partial: PartialCallback | None = None,
    strategy: str = "auto",
    freeze_gates: bool | None = None,
    refine_by: str = "drop+variation",
) -> Heatmap:
    """Occlusion-based explanation of ``model``'s prediction on ``image``.

    Args:
        model: classifier in eval mode, (N, C, H, W) -> logits (N, classes); or a
            :class:`LoadedModel` from the registry (its tuned τ curve is then used).
        image: (C, H, W) tensor already in the model's input space (normalised).
        patch: side of the square occluding patch, in pixels.
        stride: step between patch positions on the grid (S2 in approximate mode).
        mode: "naive" (batched full re-inference), "exact" (incremental, same numbers) or
            "approximate" (incremental with projective-field thresholding and adaptive
            drill-down).
        fill: occluding value in the input space, a float or one per channel (0.0 is mean
            gray under the usual mean/std normalisation).
        label: class to explain; default the class predicted on the unoccluded image.
        region: (x0, y0, x1, y1) to restrict the grid to; default the whole image.
        positions: explicit list of (x, y) top-left corners instead of a grid (approximate
            mode then applies thresholding only: drill-down needs a grid).
        batch_size: occluded images per batch; default 16 on CPU, 128 on CUDA.
        device: where to run; default the model's device (the model is not moved).
        progress: called as progress(done, total) after each batch; raising stops the run.
            In drill-down the total is an estimate until stage one has finished.
        tau: projective-field threshold in (0, 1] (eqs 21-27); 1 changes nothing.
        target_ssim: pick τ from the model's tuned SSIM(τ) curve instead. With neither, τ
            is the tuned value for SSIM 0.9, else 1.0 with a warning.
        r_drill_down: fraction of the stage-one heatmap refined at full resolution; 1
            skips drill-down.
        target_speedup: drill-down speedup that sets the stage-one stride S1 (eq 29);
            infeasible targets (eq 30) raise an error stating the largest achievable one.
        s1: stage-one stride, overriding target_speedup.
        partial: approximate mode with drill-down calls ``partial(values)`` after each
            stage-one batch but the last (each grid cell shows its stage-one block's
            value; NaN where none is computed yet) and once stage one has run, with the
            stage-one heatmap interpolated to the whole grid.
        strategy: how exact mode computes its (identical) numbers: "auto" (default) runs
            incremental inference where it is faster on this host and naive inference
            where it is not (``heatmap.extra["plan"]`` says which and why); "incremental"
            or "naive" forces one.
        freeze_gates: approximate mode keeps global-context gates (squeeze-excitation,
            ECA) at their values on the unoccluded image, so computation stays
            incremental past them; default on where the model has gates, False turns it
            off. ``heatmap.extra["frozen_gates"]`` lists the gates kept.
        refine_by: which stage-one cells drill-down refines: "drop+variation" (default)
            half by the largest drops, half by the largest disagreement with neighbours;
            "drop" the paper's largest drops only. Both refine the same number of cells.

    Returns:
        A :class:`Heatmap` of probabilities of ``label`` with the patch at each position;
        exact and naive runs also keep every class's (``heatmap.for_label(k)``). For a
        registry model with a reference set, ``heatmap.extra["ood"]`` says whether the
        image looks like its training images (score, threshold, flagged, warning).
    """
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
    heatmap = explainer.explain(
        image,
        patch=patch,
        stride=stride,
        mode=mode,
        fill=fill,
        label=label,
        region=region,
        positions=positions,
        batch_size=batch_size,
        progress=progress,
        tau=tau,
        target_ssim=target_ssim,
        r_drill_down=r_drill_down,
        target_speedup=target_speedup,
        s1=s1,
        tuning=tuning,
        partial=partial,
        strategy=strategy,
        freeze_gates=freeze_gates,
        refine_by=refine_by,
    )
    if loaded is not None and loaded.ood is not None:
        heatmap.extra["ood"] = _ood_report(loaded, image)
    return heatmap
