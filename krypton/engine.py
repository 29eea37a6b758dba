"""Incremental CNN inference over a torch.fx graph (paper §3, Algorithm 1; thesis §7.2).

``IncrementalGraph`` captures a model once, classifies every node by spatial locality
(:mod:`krypton.ops`) and then, for a batch of occlusion positions, runs each node on its
update patch only:

* ``Patched`` values carry, per batch item, a small window of changed cells plus a
  reference to the materialised tensor of the unoccluded image (the "view");
* local ops (conv/pool) gather their read-in context from the view, overlay the incoming
  patch and run the op without padding (eqs 17-19) — one vectorised gather per layer for
  the whole batch, no loop over items;
* element-wise ops and merges run on the patch (bounding box for merges, eq 20);
* the first global op materialises the full updated tensor; from there inference runs
  normally.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.fx as fx
from torch import nn

from . import ops
from .capture_lock import CAPTURE_LOCK
from .geometry import LocalStep, Window, bounding_window, local_step, padding_needed

__all__ = ["IncrementalGraph", "MaterializedViews", "PatchGeometry", "UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model cannot be run incrementally (it could not be captured as a graph)."""


# Node classes ---------------------------------------------------------------------------
STATIC = "static"  # does not depend on the image: the same for every occluded copy
INPUT = "input"  # the occluded image itself
LOCAL = "local"  # convolution / pooling: read-in context, eqs 13-19
ELEMENTWISE = "elementwise"  # element-wise op or merge on update patches, eq 20
GLOBAL = "global"  # full materialisation, normal inference
SHAPE = "shape"  # python value (size/shape/dim) of an image-dependent tensor
OUTPUT = "output"

_SHAPE_METHODS = {"size", "dim", "ndimension"}
_SHAPE_ATTRIBUTES = {"shape", "ndim", "dtype"}


@dataclass
class Step:
    """One traced node with its class and what executing it needs."""

    node: fx.Node
    kind: str
    call: Callable[..., Any] | None = None  # evaluates the node given concrete args/kwargs
    local: ops.LocalOpSpec | None = None
    patched_args: tuple[fx.Node, ...] = ()  # image-dependent inputs of element-wise ops
    cropped_statics: tuple[fx.Node, ...] = ()  # static inputs with full spatial extent
    macs_full: int = 0  # conv/linear multiply-accumulates for one image (eq 9)


@dataclass
class Patched:
    """A batch of tensors equal to a node's view except inside one window per item."""

    data: torch.Tensor  # (N, *mid, h, w) the update patch
    rows: torch.Tensor  # (N,) window start row per item
    cols: torch.Tensor  # (N,) window start column per item
    view_shape: tuple[int, ...]  # (1, *mid, H, W) of the view supplying the other cells


@dataclass
class MaterializedViews:
    """The tensors of the unoccluded image that incremental inference reads (the views).

    Only what some consumer reads is kept, in the layout it reads: spatial-last copies
    (H + pad, W + pad, M) for read-in contexts — one per node and padding value, padded
    for its most demanding consumer — and plain tensors where a batch is materialised.
    """

    image_shape: tuple[int, ...]
    values: dict[fx.Node, Any]  # static values and views materialised in full
    padded: dict[tuple[fx.Node, float], tuple[torch.Tensor, int, int]]
    logits: torch.Tensor

    def spatial(self, node: fx.Node, pad_value: float = 0.0) -> tuple[torch.Tensor, int, int]:
        """(padded spatial-last view, top padding, left padding) of ``node``."""
        return self.padded[(node, pad_value)]


@dataclass
class PatchGeometry:
    """Windows of every patched node for a set of positions (numpy, all positions)."""

    windows: dict[fx.Node, tuple[Window, Window]]
    local_steps: dict[fx.Node, tuple[LocalStep, LocalStep]]
    scatter_ok: dict[fx.Node, bool]  # overlay by scatter (patch inside read-in context)
    aligned: set[tuple[fx.Node, fx.Node]]  # (merge, input) pairs already on the merge's window
    positions: int

    def macs_per_position(self, graph: "IncrementalGraph") -> tuple[int, int]:
        """(incremental, full) conv+linear MACs for one occluded image (eqs 9-12)."""
        incremental = full = 0
        for step in graph.steps:
            full += step.macs_full
            if step.kind == LOCAL and step.local.kind == "conv":
                out_rows, out_cols = self.windows[step.node]
                channels = graph.shapes[step.node][1]
                incremental += (
                    step.local.conv_macs_per_output * channels * out_rows.length * out_cols.length
                )  # eq 11
            else:
                incremental += step.macs_full
        return incremental, full


def _flatten_nodes(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, lambda n: found.append(n) or n)
    return found


def _out_of_place_name(method: str) -> str:
    """'add_' -> 'add': the engine never lets an operation overwrite its input."""
    return method[:-1] if method.endswith("_") and not method.endswith("__") else method


def _is_full_slice(item: Any) -> bool:
    return isinstance(item, slice) and item == slice(None, None, None)


class IncrementalGraph:
    """A captured model ready for batched incremental inference at one input shape."""

    def __init__(self, model: nn.Module, image: torch.Tensor):
        try:
            with CAPTURE_LOCK.exclusive():  # symbolic_trace patches nn.Module process-wide
                self.module = fx.symbolic_trace(model)
        except Exception as exc:  # torch.fx raises many kinds of errors on dynamic code
            raise UnsupportedModelError(
                f"could not capture {type(model).__name__} as a torch.fx graph "
                f"({type(exc).__name__}: {exc}); exact and approximate modes need a traceable "
                f"model — use mode='naive' for this one"
            ) from exc
        self.nodes = list(self.module.graph.nodes)
        placeholders = [n for n in self.nodes if n.op == "placeholder"]
        if not placeholders:
            raise UnsupportedModelError("the traced model takes no input")
        self.input_node = placeholders[0]
        for extra in placeholders[1:]:
            if not extra.args:  # placeholder args hold the default value, if any
                raise UnsupportedModelError(
                    f"model.forward needs a second input '{extra.target}'; only "
                    f"single-image classifiers can be explained"
                )
        self.image_shape = tuple(image.shape)
        self._users_after = self._last_uses()
        self._calls = {n: self._call_for(n) for n in self.nodes}
        self.steps: list[Step] = []
        self.shapes: dict[fx.Node, tuple[int, ...]] = {}
        self._kinds: dict[fx.Node, str] = {}
        # (node -> pad value -> [top, bottom, left, right]) and nodes kept whole
        self._padding_needs: dict[fx.Node, dict[float, list[int]]] = {}
        self._kept_in_full: set[fx.Node] = set()
        depends: set[fx.Node] = set()

        def classify(node: fx.Node, value: Any, values: dict[fx.Node, Any]) -> None:
            if isinstance(value, torch.Tensor):
                self.shapes[node] = tuple(value.shape)
            step = self._classify_node(node, values, depends, image.dtype, image.device)
            self.steps.append(step)
            self._kinds[node] = step.kind
            self._note_requirements(step)

        # One streaming pass classifies every node and materialises the first image's
        # views: a node's value is released (and its views built) only after all its
        # consumers have been classified, so its requirements are known by then.
        self._first_image = image
        self._first_views: MaterializedViews | None = self._stream(image, classify)

    # ---------------------------------------------------------------------------------
    # Capture and classification
    # ---------------------------------------------------------------------------------
    def _last_uses(self) -> dict[fx.Node, int]:
        last: dict[fx.Node, int] = {}
        for index, node in enumerate(self.nodes):
            for used in _flatten_nodes((node.args, node.kwargs)):
                last[used] = index
        return last

    def _call_for(self, node: fx.Node) -> Callable[..., Any] | None:
        """A callable evaluating ``node`` out of place (cached views must never change)."""
        if node.op == "call_module":
            module = ops.out_of_place_module(self.module.get_submodule(node.target))
            return lambda args, kwargs: module(*args, **kwargs)
        if node.op == "call_function":
            target = node.target

            def call_function(args, kwargs):
                args, kwargs = ops.out_of_place_call(target, args, kwargs)
                return target(*args, **kwargs)

            return call_function
        if node.op == "call_method":
            name = _out_of_place_name(node.target)
            if name != node.target:
                mutated = node.args[0]
                if isinstance(mutated, fx.Node) and len(mutated.users) > 1:
                    raise UnsupportedModelError(
                        f"node '{node.name}' modifies '{mutated.name}' in place "
                        f"(.{node.target}) while other operations still read it"
                    )
            return lambda args, kwargs: getattr(args[0], name)(*args[1:], **kwargs)
        return None

    def _run_full(
        self,
        image: torch.Tensor,
        on_value: Callable[[fx.Node, Any, dict], None],
        on_release: Callable[[fx.Node, Any], None],
    ) -> Any:
        """Ordinary batch-1 inference that streams through the graph.

        ``on_value(node, value, live_values)`` sees each node's value as it is computed;
        ``on_release(node, value)`` sees it when its last user has run and it is freed, as
        in eager execution. Returns the model's output.
        """
        values: dict[fx.Node, Any] = {}
        for index, node in enumerate(self.nodes):
            if node.op == "placeholder":
                value = image.unsqueeze(0) if node is self.input_node else node.args[0]
            elif node.op == "get_attr":
                value = self.module
                for part in node.target.split("."):
                    value = getattr(value, part)
            elif node.op == "output":
                output = fx.node.map_arg(node.args[0], lambda n: values[n])
                on_value(node, output, values)
                for remaining, value in list(values.items()):
                    on_release(remaining, value)
                return output
            else:
                args = fx.node.map_arg(node.args, lambda n: values[n])
                kwargs = fx.node.map_arg(node.kwargs, lambda n: values[n])
                value = self._calls[node](args, kwargs)
            values[node] = value
            on_value(node, value, values)
            for used in _flatten_nodes((node.args, node.kwargs)):
                if self._users_after.get(used, -1) <= index and used in values:
                    on_release(used, values.pop(used))
        raise UnsupportedModelError("the traced model has no output")

    def _classify_node(
        self,
        node: fx.Node,
        values: dict[fx.Node, Any],
        depends: set,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Step:
        """Class of one node, from its inputs' classes and the live values' shapes."""
        inputs = _flatten_nodes((node.args, node.kwargs))
        if node is self.input_node:
            depends.add(node)
            return Step(node, INPUT)
        if node.op == "output":
            return Step(node, OUTPUT)
        if not any(i in depends for i in inputs):
            return Step(node, STATIC)
        depends.add(node)
        step = self._classify_dependent(node, inputs, self._kinds, values, dtype, device)
        step.call = self._calls[node]
        step.macs_full = self._macs(node, values)
        return step

    def _macs(self, node: fx.Node, values: dict[fx.Node, Any]) -> int:
        if node.op != "call_module":
            return 0
        module = self.module.get_submodule(node.target)
        out = values[node]
        if isinstance(module, nn.Conv2d) and isinstance(out, torch.Tensor) and out.dim() == 4:
            kh, kw = module.kernel_size
            per_output = (module.in_channels // module.groups) * kh * kw
            return per_output * out.shape[1] * out.shape[2] * out.shape[3]  # eq 9
        return ops.linear_macs(module)

    def _classify_dependent(
        self, node: fx.Node, inputs: list[fx.Node], kinds: dict, values: dict, dtype, device
    ) -> Step:
        value = values[node]
        dependent_inputs = [i for i in inputs if kinds.get(i, STATIC) != STATIC]
        module = self.module.get_submodule(node.target) if node.op == "call_module" else None

        if not isinstance(value, torch.Tensor):
            is_shape_query = (node.op == "call_method" and node.target in _SHAPE_METHODS) or (
                node.op == "call_function"
                and node.target is getattr
                and len(node.args) > 1
                and node.args[1] in _SHAPE_ATTRIBUTES
            )
            if is_shape_query and all(
                kinds[i] in (INPUT, LOCAL, ELEMENTWISE, GLOBAL) for i in dependent_inputs
            ):
                return Step(node, SHAPE)
            if all(kinds[i] == SHAPE for i in dependent_inputs):
                return Step(node, SHAPE)  # arithmetic on sizes
            return Step(node, GLOBAL)

        patched = {INPUT, LOCAL, ELEMENTWISE}
        all_patched = all(kinds[i] in patched for i in dependent_inputs)
        if not all_patched or value.dim() < 3 or value.shape[0] != 1:
            return Step(node, GLOBAL)

        # Local spatial context: conv/pool whose only image-dependent input is its first.
        first = node.args[0] if node.args else None
        if isinstance(first, fx.Node) and dependent_inputs == [first]:
            spec = ops.local_op_spec(
                node.op,
                node.target,
                module,
                fx.node.map_arg(node.args, lambda n: values[n]),
                fx.node.map_arg(node.kwargs, lambda n: values[n]),
                values[first].shape,
                value.shape,
                dtype,
                device,
            )
            if spec is not None:
                return Step(node, LOCAL, local=spec)
            if module is not None and type(module) in (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d):
                return Step(node, GLOBAL)

        if not self._is_elementwise(node, module, values):
            return Step(node, GLOBAL)
        out_hw = tuple(value.shape[-2:])
        ndim = value.dim()
        reshapes_middle = node.target in (operator.getitem, torch.unsqueeze) or (
            node.op == "call_method" and node.target == "unsqueeze"
        )
        for i in dependent_inputs:
            v = values[i]
            if (v.dim() != ndim and not reshapes_middle) or tuple(v.shape[-2:]) != out_hw:
                return Step(node, GLOBAL)
        cropped = []
        for i in inputs:
            if i in dependent_inputs or not isinstance(values[i], torch.Tensor):
                continue
            static = values[i]
            aligned = (1,) * max(0, ndim - static.dim()) + tuple(static.shape)
            if len(aligned) > ndim or (len(aligned) == ndim and aligned[0] != 1):
                return Step(node, GLOBAL)
            if aligned[-2:] == (1, 1):
                continue
            if aligned[-2:] == out_hw:
                if static.dim() != ndim:
                    return Step(node, GLOBAL)
                cropped.append(i)
                continue
            return Step(node, GLOBAL)
        return Step(
            node,
            ELEMENTWISE,
            patched_args=tuple(dict.fromkeys(dependent_inputs)),
            cropped_statics=tuple(cropped),
        )

    def _is_elementwise(self, node: fx.Node, module: nn.Module | None, values: dict) -> bool:
        value = values[node]
        ndim = value.dim()
        if node.op == "call_module":
            return ops.is_elementwise_module(module)
        args = fx.node.map_arg(node.args, lambda n: values[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: values[n])
        if node.op == "call_method":
            name = _out_of_place_name(node.target)  # in-place methods run out of place
            if name == "unsqueeze":
                return self._mid_dim(args[1] if len(args) > 1 else kwargs.get("dim"), ndim)
            return name in ops.ELEMENTWISE_METHODS
        target = node.target
        if target is torch.cat or target is torch.concat:
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            return self._mid_dim(dim, ndim)
        if target is torch.unsqueeze:
            return self._mid_dim(args[1] if len(args) > 1 else kwargs.get("dim"), ndim)
        if target is operator.getitem:
            index = args[1]
            source_dim = args[0].dim() if isinstance(args[0], torch.Tensor) else 0
            if not isinstance(index, tuple) or len(index) < 2 or not _is_full_slice(index[0]):
                return False
            if len(index) > source_dim - 2:
                return False  # would touch the spatial dimensions
            return all(isinstance(i, (int, slice)) and not isinstance(i, bool) for i in index[1:])
        return ops.is_elementwise_function(target, args, kwargs)

    @staticmethod
    def _mid_dim(dim: Any, ndim: int) -> bool:
        """True if ``dim`` (of the output) is neither the batch nor a spatial dimension."""
        if not isinstance(dim, int):
            return False
        dim = dim + ndim if dim < 0 else dim
        return 1 <= dim <= ndim - 3

    # ---------------------------------------------------------------------------------
    # Views and geometry
    # ---------------------------------------------------------------------------------
    def _note_requirements(self, step: Step) -> None:
        """Record which views ``step`` reads, and how: padding per (input, pad value) for
        read-in contexts; whole tensors where a batch is materialised for a global op.

        A conv output read only by its batch norm, say, needs no view at all: the batch
        norm runs on the patch alone.
        """

        def need(node: fx.Node, pad_value: float, pads: tuple[int, int, int, int]) -> None:
            current = self._padding_needs.setdefault(node, {}).setdefault(pad_value, [0, 0, 0, 0])
            for i, amount in enumerate(pads):
                current[i] = max(current[i], amount)

        if step.kind == LOCAL:
            top, bottom = padding_needed(step.local.rows)
            left, right = padding_needed(step.local.cols)
            need(step.node.args[0], _view_pad_value(step.local), (top, bottom, left, right))
        elif step.kind == ELEMENTWISE:
            if len(step.patched_args) > 1:  # merges may read inputs in a bounding box
                for arg in step.patched_args:
                    need(arg, 0.0, (0, 0, 0, 0))
            for arg in step.cropped_statics:
                need(arg, 0.0, (0, 0, 0, 0))
        elif step.kind in (GLOBAL, OUTPUT):
            for arg in _flatten_nodes((step.node.args, step.node.kwargs)):
                if self._kinds.get(arg) in (INPUT, LOCAL, ELEMENTWISE):
                    self._kept_in_full.add(arg)  # materialised in full for a global op

    def _stream(
        self, image: torch.Tensor, on_value: Callable[[fx.Node, Any, dict], None] | None = None
    ) -> MaterializedViews:
        """One streaming inference that keeps exactly the views incremental runs read."""
        kept: dict[fx.Node, Any] = {}
        padded: dict[tuple[fx.Node, float], tuple[torch.Tensor, int, int]] = {}

        def release(node: fx.Node, value: Any) -> None:
            if self._kinds.get(node) in (STATIC, SHAPE) or node in self._kept_in_full:
                kept[node] = value
            for pad_value, (top, bottom, left, right) in self._padding_needs.get(node, {}).items():
                height, width = value.shape[-2:]
                flat = value.reshape(-1, height, width)
                if top or bottom or left or right:
                    flat = torch.nn.functional.pad(
                        flat, (left, right, top, bottom), value=pad_value
                    )
                padded[(node, pad_value)] = (flat.permute(1, 2, 0).contiguous(), top, left)

        with CAPTURE_LOCK.shared():
            logits = self._run_full(image, on_value or (lambda node, value, values: None), release)
        return MaterializedViews(self.image_shape, kept, padded, logits)

    def materialize(self, image: torch.Tensor) -> MaterializedViews:
        """The views of ``image``: one streaming inference (none for the capture image)."""
        if tuple(image.shape) != self.image_shape:
            raise ValueError(
                f"graph was built for images of shape {self.image_shape}, got {tuple(image.shape)}"
            )
        first, self._first_views = self._first_views, None
        if first is not None and torch.equal(image, self._first_image):
            self._first_image = None
            return first
        self._first_image = None
        return self._stream(image)

    def geometry(
        self, ys: np.ndarray, xs: np.ndarray, patch_h: int, patch_w: int, tau: float = 1.0
    ) -> PatchGeometry:
        """Propagate the occlusion patch at every position through the graph (vectorised)."""
        ys = np.asarray(ys, dtype=np.int64)
        xs = np.asarray(xs, dtype=np.int64)
        windows: dict[fx.Node, tuple[Window, Window]] = {}
        local_steps: dict[fx.Node, tuple[LocalStep, LocalStep]] = {}
        scatter_ok: dict[fx.Node, bool] = {}
        aligned: set[tuple[fx.Node, fx.Node]] = set()
        for step in self.steps:
            node = step.node
            if step.kind == INPUT:
                windows[node] = (Window(ys, patch_h), Window(xs, patch_w))
            elif step.kind == LOCAL:
                in_rows, in_cols = windows[node.args[0]]
                row_step = local_step(step.local.rows, in_rows, tau)
                col_step = local_step(step.local.cols, in_cols, tau)
                local_steps[node] = (row_step, col_step)
                windows[node] = (row_step.output, col_step.output)
                # Untruncated patch wholly inside its read-in context: overlay by scatter.
                scatter_ok[node] = (
                    _same(row_step.input, in_rows)
                    and _same(col_step.input, in_cols)
                    and _inside(in_rows, row_step.read)
                    and _inside(in_cols, col_step.read)
                )
            elif step.kind == ELEMENTWISE:
                parts = [windows[a] for a in step.patched_args]
                if len(parts) == 1:
                    windows[node] = parts[0]
                else:
                    height, width = self.shapes[node][-2:]
                    windows[node] = (
                        bounding_window([p[0] for p in parts], height),
                        bounding_window([p[1] for p in parts], width),
                    )
                out_rows, out_cols = windows[node]
                for arg, (rows, cols) in zip(step.patched_args, parts):
                    if _same(rows, out_rows) and _same(cols, out_cols):
                        aligned.add((node, arg))
        return PatchGeometry(windows, local_steps, scatter_ok, aligned, len(ys))

    # ---------------------------------------------------------------------------------
    # Batched incremental inference
    # ---------------------------------------------------------------------------------
    def run_batch(
        self,
        views: MaterializedViews,
        geometry: PatchGeometry,
        batch: slice,
        occluder: torch.Tensor,
    ) -> torch.Tensor:
        """Logits of the occluded images for positions ``batch`` (Algorithm 1 per layer).

        ``occluder``: (C, patch_h, patch_w) pixels superimposed on the image (eq 5), or
        (count, C, patch_h, patch_w): each position's own pixels.
        """
        with CAPTURE_LOCK.shared():
            return self._run_batch(views, geometry, batch, occluder)

    def _run_batch(
        self,
        views: MaterializedViews,
        geometry: PatchGeometry,
        batch: slice,
        occluder: torch.Tensor,
    ) -> torch.Tensor:
        device = occluder.device
        count = len(range(*batch.indices(geometry.positions)))
        items = torch.arange(count, device=device)
        starts: dict[int, torch.Tensor] = {}

        def start_tensor(array: np.ndarray) -> torch.Tensor:
            key = id(array)
            if key not in starts:
                starts[key] = torch.as_tensor(array[batch], device=device)
            return starts[key]

        env: dict[fx.Node, Any] = {}
        full_cache: dict[fx.Node, torch.Tensor] = {}

        def materialize(node: fx.Node) -> torch.Tensor:
            value = env[node]
            if not isinstance(value, Patched):
                return value
            if node not in full_cache:
                full_cache[node] = _scatter_full(value, views.values[node], items)
            return full_cache[node]

        def concrete(node: fx.Node) -> Any:
            value = env[node]
            return materialize(node) if isinstance(value, Patched) else value

        for index, step in enumerate(self.steps):
            node = step.node
            kind = step.kind
            if kind == STATIC:
                env[node] = views.values[node]
            elif kind == INPUT:
                rows, cols = geometry.windows[node]
                # one occluder for every position, or one per position (N, C, h, w)
                data = (
                    occluder
                    if occluder.dim() == 4
                    else occluder.unsqueeze(0).expand(count, *occluder.shape)
                )
                env[node] = Patched(
                    data, start_tensor(rows.start), start_tensor(cols.start), self.shapes[node]
                )
            elif kind == LOCAL:
                env[node] = self._run_local(
                    step, env[node.args[0]], node.args[0], views, geometry, start_tensor, items
                )
            elif kind == ELEMENTWISE:
                env[node] = self._run_elementwise(step, env, views, geometry, start_tensor, items)
            elif kind == SHAPE:

                def stand_in(n: fx.Node) -> Any:
                    value = env[n]
                    if isinstance(value, Patched):
                        shape = (count,) + tuple(value.view_shape[1:])
                        return torch.empty(shape, dtype=value.data.dtype, device="meta")
                    return value

                args = fx.node.map_arg(node.args, stand_in)
                kwargs = fx.node.map_arg(node.kwargs, stand_in)
                env[node] = step.call(args, kwargs)
            elif kind == GLOBAL:
                args = fx.node.map_arg(node.args, concrete)
                kwargs = fx.node.map_arg(node.kwargs, concrete)
                env[node] = step.call(args, kwargs)
            else:  # OUTPUT
                return fx.node.map_arg(node.args[0], concrete)
            # Free what no later node reads, to keep memory bounded.
            for used in _flatten_nodes((node.args, node.kwargs)):
                if self._users_after.get(used, -1) <= index:
                    env.pop(used, None)
                    full_cache.pop(used, None)
        raise AssertionError("graph has no output node")  # pragma: no cover

    def _run_local(
        self,
        step: Step,
        source: Patched,
        source_node: fx.Node,
        views: MaterializedViews,
        geometry: PatchGeometry,
        start_tensor,
        items: torch.Tensor,
    ) -> Patched:
        spec = step.local
        row_step, col_step = geometry.local_steps[step.node]
        padded, top, left = views.spatial(source_node, _view_pad_value(spec))
        read_rows = start_tensor(row_step.read.start)
        read_cols = start_tensor(col_step.read.start)
        if geometry.scatter_ok[step.node]:
            context = _read_in_context_scatter(
                padded,
                read_rows,
                read_cols,
                top,
                left,
                row_step.read.length,
                col_step.read.length,
                source,
                items,
            )
        else:
            context = _read_in_context(
                padded,
                read_rows,
                read_cols,
                top,
                left,
                row_step.read.length,
                col_step.read.length,
                source,
                start_tensor(row_step.input.start),
                row_step.input.length,
                start_tensor(col_step.input.start),
                col_step.input.length,
                items,
            )
        output = spec.apply(context.permute(0, 3, 1, 2))  # eq 19, on the whole batch
        out_rows = start_tensor(row_step.output.start)
        out_cols = start_tensor(col_step.output.start)
        if spec.divisor_map is not None:
            factor = _gather_windows(
                spec.divisor_map.unsqueeze(-1),
                out_rows,
                out_cols,
                row_step.output.length,
                col_step.output.length,
            )
            output = output * factor.permute(0, 3, 1, 2)
        return Patched(output, out_rows, out_cols, self.shapes[step.node])

    def _run_elementwise(
        self,
        step: Step,
        env: dict,
        views: MaterializedViews,
        geometry: PatchGeometry,
        start_tensor,
        items,
    ) -> Patched:
        node = step.node
        out_rows_w, out_cols_w = geometry.windows[node]
        out_rows = start_tensor(out_rows_w.start)
        out_cols = start_tensor(out_cols_w.start)
        replacements: dict[fx.Node, Any] = {}
        for arg in step.patched_args:
            value: Patched = env[arg]
            if (node, arg) in geometry.aligned:
                replacements[arg] = value.data
            else:  # merge: bring the input to the bounding box (eq 20)
                source, top, left = views.spatial(arg)
                context = _read_in_context(
                    source,
                    out_rows,
                    out_cols,
                    top,
                    left,
                    out_rows_w.length,
                    out_cols_w.length,
                    value,
                    value.rows,
                    value.data.shape[-2],
                    value.cols,
                    value.data.shape[-1],
                    items,
                )
                replacements[arg] = _to_logical(context, value.view_shape)
        for arg in step.cropped_statics:
            source, top, left = views.spatial(arg)
            context = _gather_windows(
                source, out_rows + top, out_cols + left, out_rows_w.length, out_cols_w.length
            )
            replacements[arg] = _to_logical(context, self.shapes[arg])
        args = fx.node.map_arg(node.args, lambda n: replacements.get(n, env[n]))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: replacements.get(n, env[n]))
        return Patched(step.call(args, kwargs), out_rows, out_cols, self.shapes[node])


# ---------------------------------------------------------------------------------------
# Vectorised gather / scatter kernels (the batched form of Algorithm 1, lines 7-10)
# ---------------------------------------------------------------------------------------


def _view_pad_value(spec: ops.LocalOpSpec) -> float:
    """Padding value of the view a local op reads: its own (0 or -inf) where it reads
    padding, else 0, so ops needing no padding share the plain zero-padded view."""
    return spec.pad_value if any(padding_needed(spec.rows) + padding_needed(spec.cols)) else 0.0


def _same(first: Window, second: Window) -> bool:
    return first.length == second.length and np.array_equal(first.start, second.start)


def _inside(inner: Window, outer: Window) -> bool:
    return bool(np.all(inner.start >= outer.start) and np.all(inner.stop <= outer.stop))


def _spatial_last(data: torch.Tensor) -> torch.Tensor:
    """(N, *mid, h, w) -> (N, h, w, M) view or copy."""
    count, height, width = data.shape[0], data.shape[-2], data.shape[-1]
    return data.reshape(count, -1, height, width).permute(0, 2, 3, 1)


def _to_logical(context: torch.Tensor, view_shape: torch.Size) -> torch.Tensor:
    """(N, h, w, M) -> (N, *mid, h, w) matching the view's middle dimensions."""
    count, height, width = context.shape[:3]
    return context.permute(0, 3, 1, 2).reshape(count, *view_shape[1:-2], height, width)


def _gather_windows(
    source: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, height: int, width: int
) -> torch.Tensor:
    """Slice a (H, W, M) tensor at a per-item window: (N, height, width, M), eq 17."""
    row_index = rows.unsqueeze(1) + torch.arange(height, device=rows.device)
    col_index = cols.unsqueeze(1) + torch.arange(width, device=cols.device)
    return source[row_index[:, :, None], col_index[:, None, :]]


def _read_in_context(
    padded: torch.Tensor,
    read_rows: torch.Tensor,
    read_cols: torch.Tensor,
    top: int,
    left: int,
    height: int,
    width: int,
    source: Patched,
    patch_rows: torch.Tensor,
    patch_height: int,
    patch_cols: torch.Tensor,
    patch_width: int,
    items: torch.Tensor,
) -> torch.Tensor:
    """Read-in context with the update patch superimposed (eqs 17-18), general form.

    ``padded`` is the (H+pad, W+pad, M) view; read windows are in unpadded coordinates.
    Only patch cells inside the given patch window are superimposed (projective-field
    thresholding passes a centre-cropped window, eqs 24-26).
    """
    context = _gather_windows(padded, read_rows + top, read_cols + left, height, width)
    arange_h = torch.arange(height, device=read_rows.device)
    arange_w = torch.arange(width, device=read_cols.device)
    absolute_rows = read_rows.unsqueeze(1) + arange_h  # (N, height)
    absolute_cols = read_cols.unsqueeze(1) + arange_w
    in_rows = (absolute_rows >= patch_rows.unsqueeze(1)) & (
        absolute_rows < (patch_rows + patch_height).unsqueeze(1)
    )
    in_cols = (absolute_cols >= patch_cols.unsqueeze(1)) & (
        absolute_cols < (patch_cols + patch_width).unsqueeze(1)
    )
    # Positions inside the patch data (its window starts at source.rows/cols).
    data_rows = (absolute_rows - source.rows.unsqueeze(1)).clamp(0, source.data.shape[-2] - 1)
    data_cols = (absolute_cols - source.cols.unsqueeze(1)).clamp(0, source.data.shape[-1] - 1)
    patch = _spatial_last(source.data)
    values = patch[items[:, None, None], data_rows[:, :, None], data_cols[:, None, :]]
    inside = (in_rows[:, :, None] & in_cols[:, None, :]).unsqueeze(-1)
    return torch.where(inside, values, context)


def _read_in_context_scatter(
    padded: torch.Tensor,
    read_rows: torch.Tensor,
    read_cols: torch.Tensor,
    top: int,
    left: int,
    height: int,
    width: int,
    source: Patched,
    items: torch.Tensor,
) -> torch.Tensor:
    """Read-in context when every patch lies inside its context (eqs 17-18, fast form).

    Gathers the context from the view, then writes the whole patch at its per-item offset:
    cheaper than the general form because only the patch cells are touched twice.
    """
    context = _gather_windows(padded, read_rows + top, read_cols + left, height, width)
    patch_h, patch_w = source.data.shape[-2:]
    row_index = (source.rows - read_rows).unsqueeze(1) + torch.arange(patch_h, device=items.device)
    col_index = (source.cols - read_cols).unsqueeze(1) + torch.arange(patch_w, device=items.device)
    context[items[:, None, None], row_index[:, :, None], col_index[:, None, :]] = _spatial_last(
        source.data
    )
    return context


def _scatter_full(value: Patched, view: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Materialise a patched batch: copies of the view with each patch written in place."""
    count = value.data.shape[0]
    # Always a fresh copy: ``expand(1, ...).contiguous()`` would return ``view`` itself for
    # a batch of one, and the patch would be written into the cached view (or the
    # caller's image).
    full = view.expand(count, *view.shape[1:]).clone(memory_format=torch.contiguous_format)
    height, width = value.data.shape[-2:]
    row_index = value.rows.unsqueeze(1) + torch.arange(height, device=items.device)
    col_index = value.cols.unsqueeze(1) + torch.arange(width, device=items.device)
    target = _spatial_last(full)  # a view into ``full`` when it is contiguous
    target[items[:, None, None], row_index[:, :, None], col_index[:, None, :]] = _spatial_last(
        value.data
    )
    return full
