"""``IncrementalGraph``: a model captured once with torch.fx, ready for batched
incremental inference at one input shape (paper §3, Algorithm 1; thesis §7.2).

Capture traces the model, then one streaming inference on the first image classifies
every node (:mod:`.classify`) and materialises that image's views (:mod:`.views`).
:meth:`IncrementalGraph.geometry` propagates patches (:mod:`.plan`) and
:meth:`IncrementalGraph.run_batch` executes a batch of positions (:mod:`.run`).
"""

from __future__ import annotations

import collections
import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch
import torch.fx as fx
from torch import nn

from . import ops
from .capture_lock import CAPTURE_LOCK
from .classify import PATCHED_KINDS, Classifier, NodeKind, Step, first_input, flatten_nodes
from .clock import DeviceClock
from .geometry import padding_needed
from .plan import ExecutionPlan, PatchGeometry, propagate, static_plan
from .run import batch_index, run_batch, view_pad_value
from .views import MaterializedViews, build_views

__all__ = ["IncrementalGraph", "UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model cannot be run incrementally (it could not be captured as a graph)."""


def _out_of_place_name(method: str) -> str:
    """'add_' -> 'add': the engine never lets an operation overwrite its input."""
    return method[:-1] if method.endswith("_") and not method.endswith("__") else method


def writes_first_input(module: nn.Module, node: fx.Node) -> bool:
    """Whether ``node`` overwrites its first argument in place, as the model wrote it
    (``ReLU(inplace=True)``, ``F.relu(x, inplace=True)``, ``x.relu_()``)."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_module":
        return getattr(module.get_submodule(str(node.target)), "inplace", False) is True
    if node.op == "call_function":
        return ops.writes_in_place(cast(Callable[..., Any], node.target), node.args, node.kwargs)
    return node.op == "call_method" and _out_of_place_name(str(node.target)) != node.target


# grids whose geometry (and compiled indices) a graph keeps: the latest call's, and the
# one before it (a timed call after its warm-up; the forced and planned runs of a bench)
GEOMETRIES_KEPT = 2

_VIEW_METHODS = frozenset(
    "view view_as reshape reshape_as flatten unflatten squeeze unsqueeze transpose permute "
    "narrow expand expand_as unfold select chunk split t movedim as_strided contiguous "
    "detach".split()
)
_VIEW_FUNCTIONS = (
    operator.getitem, torch.flatten, torch.reshape, torch.transpose, torch.permute,
    torch.squeeze, torch.unsqueeze, torch.narrow, torch.chunk, torch.split, torch.select,
    torch.movedim, torch.t, torch.detach,
)  # fmt: skip


def _may_be_view(node: fx.Node) -> bool:
    """Whether ``node``'s value may share storage with its first argument."""
    if node.op == "call_method":
        return str(node.target) in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_FUNCTIONS


def follow_in_place_writes(module: fx.GraphModule) -> None:
    """Make the ops that read a tensor after an in-place write read the write's result.

    The engine runs every op out of place (cached views must never change), so where a
    model reads ``y`` again after ``z = relu_(y)``, eager PyTorch sees the overwritten
    values and the captured graph the old ones: exact mode gave another heatmap than
    naive. Later readers of ``y`` now read ``z``, which holds what eager ``y`` holds. A
    write through a view of a tensor read later cannot be followed that way, and is
    refused rather than run differently."""
    nodes = list(module.graph.nodes)
    order = {node: index for index, node in enumerate(nodes)}
    for node in nodes:
        if not writes_first_input(module, node):
            continue
        written = cast(fx.Node, node.args[0])
        for user in [u for u in written.users if order[u] > order[node]]:
            user.replace_input_with(written, node)
        base = written
        while _may_be_view(base) and isinstance(base.args[0], fx.Node):
            base = base.args[0]
            if any(order[u] > order[node] for u in base.users):
                raise UnsupportedModelError(
                    f"node '{node.name}' writes a view of '{base.name}' in place, and a "
                    f"later operation reads '{base.name}'; exact and approximate modes "
                    f"cannot follow that write — use mode='naive' for this model"
                )
    module.recompile()


def gate_roots(graph: fx.Graph, input_node: fx.Node) -> dict[fx.Node, set[fx.Node]]:
    """Nodes that start a global-context gate, each with the tensors it gates.

    A gate root R feeds a branch that rejoins one of R's own ancestors A (squeeze-
    excitation's ``x * sigmoid(fc(mean(x)))``, ECA, CBAM's channel attention: A is x). A
    classifier head's pooling only flows to the output, and the halves of an avg+max
    pooling head rejoin each other, not an ancestor: neither is a gate.
    """
    nodes = list(graph.nodes)
    depends: set[fx.Node] = {input_node}
    for node in nodes:
        if any(i in depends for i in flatten_nodes((node.args, node.kwargs))):
            depends.add(node)
    ancestors: dict[fx.Node, set[fx.Node]] = {}

    def ancestors_of(node: fx.Node) -> set[fx.Node]:
        if node not in ancestors:
            found: set[fx.Node] = set()
            frontier = flatten_nodes((node.args, node.kwargs))
            while frontier:
                parent = frontier.pop()
                if parent not in found:
                    found.add(parent)
                    frontier.extend(flatten_nodes((parent.args, parent.kwargs)))
            ancestors[node] = found
        return ancestors[node]

    roots: dict[fx.Node, set[fx.Node]] = {}
    for node in nodes:
        if node not in depends or node is input_node or node.op == "output":
            continue
        downstream: set[fx.Node] = set()
        frontier = list(node.users)
        while frontier:
            user = frontier.pop()
            if user in downstream or user.op == "output":
                continue
            downstream.add(user)
            frontier.extend(user.users)
        partners = {
            arg
            for user in downstream
            for arg in flatten_nodes((user.args, user.kwargs))
            if arg in depends and arg is not node and arg not in downstream
        }
        if partners:
            gated = partners & ancestors_of(node)
            if gated:
                roots[node] = gated
    return roots


class IncrementalGraph:
    """A captured model ready for batched incremental inference at one input shape.

    ``freeze_gates`` (approximate mode only): global-context gates keep the values they
    have on the unoccluded image, so inference stays incremental past them. A gate is a
    global op with no spatial extent left (a (1, C, 1, 1) or (1, C) vector) that starts a
    branch rejoining the image's tensors (:func:`gate_roots`); the patch contributes
    about patch² / (H·W) of its input, so freezing it is an approximation, measured like
    τ's.
    """

    def __init__(self, model: nn.Module, image: torch.Tensor, freeze_gates: bool = False):
        try:
            with CAPTURE_LOCK.exclusive():  # symbolic_trace patches nn.Module process-wide
                self.module = fx.symbolic_trace(model)
        except Exception as exc:  # torch.fx raises many kinds of errors on dynamic code
            raise UnsupportedModelError(
                f"could not capture {type(model).__name__} as a torch.fx graph "
                f"({type(exc).__name__}: {exc}); exact and approximate modes need a traceable "
                f"model — use mode='naive' for this one"
            ) from exc
        follow_in_place_writes(self.module)
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
        self.rank = image.dim() - 1  # spatial axes: 2 for an image, 3 for a volume
        if self.rank not in (2, 3):
            raise ValueError(
                f"expected an image (C, H, W) or a volume (C, D, H, W), got {self.image_shape}"
            )
        self.freeze_gates = freeze_gates
        self.frozen: list[str] = []  # names of the gates kept at their unoccluded values
        # the latest grids' geometries, with the indices their runs compiled (see geometry);
        # two runs on one model (two tabs) read and trim it at once: behind its own lock
        self._geometries: collections.OrderedDict[tuple, PatchGeometry] = collections.OrderedDict()
        self._geometries_lock = threading.Lock()
        self.last_use = self._last_uses()
        self._calls = {n: self._call_for(n) for n in self.nodes}
        self.steps: list[Step] = []
        self.shapes: dict[fx.Node, tuple[int, ...]] = {}
        self._classifier = Classifier(self.module, shapes=self.shapes)
        # (node -> pad value -> (low, high) per spatial axis) and nodes kept whole
        self._padding_needs: dict[fx.Node, dict[float, list[tuple[int, int]]]] = {}
        self._kept_in_full: set[fx.Node] = set()
        depends: set[fx.Node] = set()
        dtype, device = image.dtype, image.device

        def classify(node: fx.Node, value: Any, values: dict[fx.Node, Any]) -> None:
            if isinstance(value, torch.Tensor):
                self.shapes[node] = tuple(value.shape)
            step = self._classify_node(node, values, depends, dtype, device)
            self.steps.append(step)
            self._note_requirements(step)

        # One streaming pass classifies every node and materialises the first image's
        # views: a node's value is released (and its views built) only after all its
        # consumers have been classified, so its requirements are known by then.
        self._first_image = image
        self._first_views: MaterializedViews | None = self._stream(image, classify)

    # ---------------------------------------------------------------------------------
    # Capture and classification
    # ---------------------------------------------------------------------------------
    @functools.cached_property
    def gate_candidates(self) -> dict[fx.Node, set[fx.Node]]:
        """Gate roots of the graph (:func:`gate_roots`), found when first asked: only
        approximate mode with frozen gates needs them, not every capture."""
        return gate_roots(self.module.graph, self.input_node)

    @property
    def kinds(self) -> dict[fx.Node, NodeKind]:
        return self._classifier.kinds

    def dims_of(self, node: fx.Node) -> tuple[int, ...]:
        """Where the spatial axes are in ``node``'s tensor (the last ones by default)."""
        dims = self._classifier.dims.get(node)
        if dims is None:
            ndim = len(self.shapes[node])
            dims = tuple(range(ndim - self.rank, ndim))
        return dims

    def _last_uses(self) -> dict[fx.Node, int]:
        last: dict[fx.Node, int] = {}
        for index, node in enumerate(self.nodes):
            for used in flatten_nodes((node.args, node.kwargs)):
                last[used] = index
        return last

    def _call_for(self, node: fx.Node, as_written: bool = False) -> Callable[..., Any] | None:
        """A callable evaluating ``node`` out of place (cached views must never change),
        or ``as_written``: in place where the model wrote it so."""
        if node.op == "call_module":
            module = self.module.get_submodule(str(node.target))
            if not as_written:
                module = ops.out_of_place_module(module)
            return lambda args, kwargs: module(*args, **kwargs)
        if node.op == "call_function":
            target = cast(Callable[..., Any], node.target)
            if as_written or not ops.writes_in_place(target, node.args, node.kwargs):
                # Decided once here: binding the signature on every call cost 14% of a
                # DenseNet run. ``inplace`` is a literal in the graph, never a value.
                return lambda args, kwargs: target(*args, **kwargs)

            def call_function(args, kwargs):
                args, kwargs = ops.out_of_place_call(target, args, kwargs)
                return target(*args, **kwargs)

            return call_function
        if node.op == "call_method":
            name = str(node.target)
            if not as_written:
                name = _out_of_place_name(name)  # later readers: follow_in_place_writes
            return lambda args, kwargs: getattr(args[0], name)(*args[1:], **kwargs)
        return None

    def _in_place_call_for(self, step: Step) -> Callable[..., Any] | None:
        """The op as written, where it overwrites its only tensor input in place and is
        run per cell on a patch (an activation such as ReLU(inplace=True)); else None."""
        node = step.node
        if (
            step.kind != NodeKind.POINTWISE
            or step.patch_call is not None
            or step.pick is not None
            or step.cropped_statics
            or len(flatten_nodes((node.args, node.kwargs))) != 1
            or not node.args
            or node.args[0] not in step.patched_args
        ):
            return None
        if not writes_first_input(self.module, node):
            return None
        return self._call_for(node, as_written=True)

    def _classify_node(
        self,
        node: fx.Node,
        values: dict[fx.Node, Any],
        depends: set,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Step:
        """Kind of one node, from its inputs' kinds and the live values."""
        inputs = flatten_nodes((node.args, node.kwargs))
        kinds = self._classifier.kinds
        if node is self.input_node:
            depends.add(node)
            ndim = len(self.shapes[node])
            step = Step(node, NodeKind.INPUT, spatial_dims=tuple(range(ndim - self.rank, ndim)))
        elif node.op == "output":
            step = Step(node, NodeKind.OUTPUT)
        elif not any(i in depends for i in inputs):
            step = Step(node, NodeKind.STATIC)
        else:
            step = self._classifier.classify(node, values, dtype, device)
            if step.kind == NodeKind.GLOBAL and self._freezes(node, values[node]):
                step = Step(node, NodeKind.FROZEN, reason="gate kept at its unoccluded value")
                self.frozen.append(node.name)
                kinds[node] = step.kind  # not in ``depends``: its users see a constant
                return step
            depends.add(node)
            step.call = self._calls[node]
            step.in_place_call = self._in_place_call_for(step)
            step.macs_full = self._macs(node, values)
            return step
        kinds[node] = step.kind
        if step.spatial_dims is not None:
            self._classifier.dims[node] = step.spatial_dims
        return step

    def _freezes(self, node: fx.Node, value: Any) -> bool:
        """Whether this global node is a gate to keep at its unoccluded value."""
        if not self.freeze_gates or node not in self.gate_candidates:
            return False
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[0] != 1:
            return False
        spatial = value.shape[2:] if value.dim() >= 3 else ()
        if any(size != 1 for size in spatial):
            return False  # not a channel vector: it still has spatial extent
        # it gates a tensor that does have spatial extent (known: an ancestor)
        return any(
            len(self.shapes.get(partner, ())) >= 3 and int(np.prod(self.shapes[partner][2:])) > 1
            for partner in self.gate_candidates[node]
        )

    def _macs(self, node: fx.Node, values: dict[fx.Node, Any]) -> int:
        """Conv and linear multiply-accumulates of one image at this node (eq 9)."""
        out = values[node]
        if not isinstance(out, torch.Tensor):
            return 0
        weight = None
        if node.op == "call_module":
            module = self.module.get_submodule(str(node.target))
            if isinstance(module, (nn.Conv2d, nn.Conv3d, nn.Linear)):
                weight = module.weight
        elif node.op == "call_function" and node.target in (
            *ops.CONV_FUNCTIONS[2],
            *ops.CONV_FUNCTIONS[3],
            torch.nn.functional.linear,
        ):
            candidate = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            weight = values.get(candidate) if isinstance(candidate, fx.Node) else None
        if not isinstance(weight, torch.Tensor):
            return 0
        if weight.dim() in (4, 5):  # conv: Cin/groups * prod(kernel) per output value
            return int(weight[0].numel()) * out[0].numel()
        if weight.dim() == 2:  # linear: in_features per output value
            return int(weight.shape[1]) * out[0].numel()
        return 0

    def _note_requirements(self, step: Step) -> None:
        """Record which views ``step`` reads, and how: padding per (input, pad value) for
        read-in contexts; whole tensors where a batch is materialised for a global op.

        A conv output read only by its batch norm, say, needs no view at all: the batch
        norm runs on the patch alone.
        """

        none = [(0, 0)] * self.rank

        def need(node: fx.Node, pad_value: float, pads: list[tuple[int, int]]) -> None:
            current = self._padding_needs.setdefault(node, {}).setdefault(pad_value, list(none))
            for axis, (low, high) in enumerate(pads):
                current[axis] = (max(current[axis][0], low), max(current[axis][1], high))

        if step.kind == NodeKind.LOCAL:
            pads = [padding_needed(axis) for axis in step.local.axes]
            need(first_input(step.node), view_pad_value(step.local), pads)
        elif step.kind == NodeKind.REMAP:
            need(first_input(step.node), 0.0, none)
        elif step.kind == NodeKind.POINTWISE and step.pick is None:
            if len(step.patched_args) > 1:  # merges may read inputs in a bounding box
                for arg in step.patched_args:
                    need(arg, 0.0, none)
            for arg in step.cropped_statics:
                need(arg, 0.0, none)
        elif step.kind in (NodeKind.GLOBAL, NodeKind.OUTPUT):
            for arg in flatten_nodes((step.node.args, step.node.kwargs)):
                if self.kinds.get(arg) in PATCHED_KINDS:
                    self._kept_in_full.add(arg)  # materialised in full for a global op

    # ---------------------------------------------------------------------------------
    # Views
    # ---------------------------------------------------------------------------------
    def _keep_whole(self, node: fx.Node) -> bool:
        return self.kinds.get(node) in (NodeKind.STATIC, NodeKind.SHAPE, NodeKind.FROZEN) or (
            node in self._kept_in_full
        )

    def _stream(
        self, image: torch.Tensor, on_value: Callable[[fx.Node, Any, dict], None] | None = None
    ) -> MaterializedViews:
        with CAPTURE_LOCK.shared():
            return build_views(
                image,
                self.module,
                self._calls,
                self._keep_whole,
                self._padding_needs,
                self.dims_of,
                on_value,
            )

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

    # ---------------------------------------------------------------------------------
    # Geometry, plan, execution
    # ---------------------------------------------------------------------------------
    @property
    def output_shape(self) -> tuple[int, ...]:
        """Shape of what the model returns for one image (e.g. (1, classes))."""
        output = next(node for node in self.nodes if node.op == "output")
        value = output.args[0]
        if not isinstance(value, fx.Node) or value not in self.shapes:
            raise UnsupportedModelError("the model does not return one tensor")
        return self.shapes[value]

    def geometry(
        self,
        starts: Sequence[np.ndarray],
        patch: Sequence[int],
        tau: float = 1.0,
        tight: bool = True,
    ) -> PatchGeometry:
        """Propagate the occlusion patch at every position through the graph (vectorised).

        ``starts``: one array per spatial axis, (ys, xs) for an image or (zs, ys, xs) for
        a volume; ``patch``: its extent per axis. ``tight=False`` gives eq 14's lengths,
        the paper's per-query count.

        The latest GEOMETRIES_KEPT geometries are kept, with the indices their runs
        compiled (:mod:`.indices`, about 0.1 s for ResNet18's 2,809 positions on a CPU
        core — a third of a whole naive run on one H200): a timed call after a warm-up,
        a re-run, or the next image on the same grid compiles nothing."""
        if len(starts) != self.rank or len(patch) != self.rank:
            raise ValueError(
                f"this graph has {self.rank} spatial axes: give {self.rank} start arrays and "
                f"{self.rank} patch extents, got {len(starts)} and {len(patch)}"
            )
        arrays = [np.ascontiguousarray(axis) for axis in starts]
        key = (
            tuple((a.dtype.str, a.shape, a.tobytes()) for a in arrays),
            tuple(int(p) for p in patch),
            float(tau),
            tight,
        )
        with self._geometries_lock:
            known = self._geometries.get(key)
            if known is not None:
                self._geometries.move_to_end(key)
                return known
        geometry = propagate(self.steps, self.shapes, starts, patch, tau, tight)
        with self._geometries_lock:  # a run beside this one may have kept the same grid
            geometry = self._geometries.setdefault(key, geometry)
            self._geometries.move_to_end(key)
            while len(self._geometries) > GEOMETRIES_KEPT:
                self._geometries.popitem(last=False)
        return geometry

    def forget_geometries(self) -> None:
        """Drop the kept geometries and the indices compiled for them."""
        with self._geometries_lock:
            self._geometries.clear()

    def macs_per_position(self, geometry: PatchGeometry) -> tuple[int, int]:
        """(incremental, full) conv+linear MACs for one occluded image (eqs 9-12)."""
        return geometry.macs_per_position(self.steps, self.shapes)

    def first_global_step(self) -> tuple[Step | None, int, int]:
        """(first image-dependent global step or None, MACs before it, all MACs)."""
        total = sum(step.macs_full for step in self.steps)
        before = 0
        for step in self.steps:
            if step.kind == NodeKind.GLOBAL:
                return step, before, total
            before += step.macs_full
        return None, total, total

    def first_global(self) -> tuple[str | None, float]:
        """(name of the first image-dependent global op, share of MACs before it)."""
        step, before, total = self.first_global_step()
        if step is None:
            return None, 1.0
        return step.node.name, (before / total if total else 0.0)

    def plan(self, geometry: PatchGeometry) -> ExecutionPlan:
        """Static plan for these positions: incremental, or naive when it cannot gain."""
        return static_plan(self, geometry)

    def prepare_batch(
        self, views: MaterializedViews, geometry: PatchGeometry, batch: slice, device
    ) -> None:
        """Compile the indices of positions ``batch`` now, in this thread (a batch cut
        into shards for worker threads: they then only read them)."""
        batch_index(self, views, geometry, batch, device)

    def run_batch(
        self,
        views: MaterializedViews,
        geometry: PatchGeometry,
        batch: slice,
        occluder: torch.Tensor,
        timings: dict[str, float] | None = None,
        clock: DeviceClock | None = None,
    ) -> torch.Tensor:
        """Logits of the occluded images for positions ``batch`` (Algorithm 1 per layer).

        ``occluder``: (C, *patch) pixels superimposed on the image (eq 5), or
        (count, C, *patch): each position's own pixels. ``timings``: seconds
        per node name, added to (a per-layer profile), read from ``clock`` (default the
        occluder's device's).
        """
        with CAPTURE_LOCK.shared():
            return run_batch(self, views, geometry, batch, occluder, timings, clock)
