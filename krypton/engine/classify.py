"""What each traced op does to the spatial dimensions (paper §2.2, thesis §7.2).

Every torch.fx node that depends on the image gets a :class:`NodeKind`:

* ``LOCAL``: convolution / pooling, module or functional: recomputed on a read-in context
  (eqs 13-19);
* ``REMAP``: every output cell copies one input cell (padding of any mode, cropping);
* ``POINTWISE``: the op treats every spatial cell alike and independently (activations,
  eval-mode batch norm in every spelling, layer norm / linear over a channels-last
  channel dimension, per-channel arithmetic, layer scale), merges of update patches
  (eq 20), and layout ops that move only non-spatial dimensions or the spatial ones
  together (permute NCHW <-> NHWC, channel split/chunk/getitem/narrow/cat, channel
  shuffle reshapes, unsqueeze): all run on the update patch only;
* ``GLOBAL``: everything else, including anything not understood. Slower, never wrong.

The pointwise rules are the table :data:`POINTWISE_RULES`, keyed by function, method name
or module type. A rule receives an :class:`OpCall` (the node with its concrete values,
recorded on the unoccluded image) and returns a :class:`Pointwise` (where the spatial axes
are in the output, and how static inputs broadcast) or None for "global". To teach Krypton
a new op, add one entry.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from . import ops

__all__ = [
    "NodeKind",
    "Step",
    "OpCall",
    "Pointwise",
    "POINTWISE_RULES",
    "classify_dependent",
    "flatten_nodes",
]


class NodeKind(str, enum.Enum):
    """How a node is executed for a batch of occluded images."""

    STATIC = "static"  # does not depend on the image: the same for every occluded copy
    INPUT = "input"  # the occluded image itself
    LOCAL = "local"  # convolution / pooling: read-in context, eqs 13-19
    REMAP = "remap"  # copies of input cells (padding, cropping)
    POINTWISE = "pointwise"  # per-cell op, merge (eq 20) or layout op on update patches
    GLOBAL = "global"  # full materialisation, normal inference
    FROZEN = "frozen"  # a global-context gate kept at its unoccluded value (approximate)
    SHAPE = "shape"  # python value (size/shape/dim) of an image-dependent tensor
    OUTPUT = "output"


PATCHED_KINDS = frozenset({NodeKind.INPUT, NodeKind.LOCAL, NodeKind.REMAP, NodeKind.POINTWISE})


@dataclass
class Step:
    """One traced node with its kind and what executing it needs."""

    node: fx.Node
    kind: NodeKind
    call: Callable[..., Any] | None = None  # evaluates the node given concrete args/kwargs
    # the op as the model wrote it, overwriting its one tensor input (ReLU(inplace=True),
    # .relu_()): run_batch uses it when that input's patch is fresh and read by no one else
    in_place_call: Callable[..., Any] | None = None
    local: ops.LocalOpSpec | None = None
    remap: ops.RemapSpec | None = None
    patched_args: tuple[fx.Node, ...] = ()  # image-dependent tensor inputs
    cropped_statics: tuple[fx.Node, ...] = ()  # static inputs with full spatial extent
    macs_full: int = 0  # conv/linear multiply-accumulates for one image (eq 9)
    spatial_dims: tuple[int, ...] | None = None  # where the spatial axes are in the output
    patch_call: Callable[[torch.Tensor], Any] | None = None  # layout ops: run on the patch
    pick: int | None = None  # getitem of a split's tuple of patches
    element_shapes: tuple[tuple[int, ...], ...] = ()  # split: each piece's full shape
    reason: str = ""  # why a node is global


@dataclass
class OpCall:
    """A dependent node with the concrete values seen on the unoccluded image."""

    node: fx.Node
    module: nn.Module | None
    args: tuple
    kwargs: dict
    value: Any
    patched: list[fx.Node]  # dependent tensor inputs (update patches at run time)
    shapes: dict[fx.Node, tuple[int, ...]]
    dims: dict[fx.Node, tuple[int, ...]]  # spatial dims of each patched input

    @property
    def source(self) -> fx.Node:
        return self.patched[0]

    @property
    def source_dims(self) -> tuple[int, ...]:
        return self.dims[self.patched[0]]

    @property
    def ndim(self) -> int:
        return self.value.dim()

    def arg(self, position: int, name: str, default: Any = None) -> Any:
        """Argument by position (after the tensor) or keyword."""
        if len(self.args) > position:
            return self.args[position]
        return self.kwargs.get(name, default)


@dataclass(frozen=True)
class Pointwise:
    """A rule's verdict: where the spatial axes are in the output, how statics are read."""

    spatial_dims: tuple[int, ...]
    # "broadcast": static tensor inputs broadcast against the output (per-channel or
    # full-extent, the latter cropped to the window); "parameters": they are the op's
    # own parameters (batch norm statistics, layer-norm/linear weights), never spatial.
    statics: str = "broadcast"
    patch_call: Callable[[torch.Tensor], Any] | None = None
    element_shapes: tuple[tuple[int, ...], ...] = ()


Rule = Callable[[OpCall], "Pointwise | None"]


def first_input(node: fx.Node) -> fx.Node:
    """The node a local, remapping or elementwise op reads its tensor from."""
    source = node.args[0]
    if not isinstance(source, fx.Node):
        raise TypeError(f"{node.name} reads {source!r}, not another node's tensor")
    return source


def flatten_nodes(value: Any) -> list[fx.Node]:
    """Every fx.Node inside a (nested) argument structure."""
    found: list[fx.Node] = []

    def collect(node: fx.Node) -> fx.Node:
        found.append(node)
        return node

    fx.node.map_arg(value, collect)
    return found


def _normalise(dim: Any, ndim: int) -> int | None:
    if isinstance(dim, bool) or not isinstance(dim, int):
        return None
    dim = dim + ndim if dim < 0 else dim
    return dim if 0 <= dim < ndim else None


def _is_channel_dim(dim: Any, ndim: int, spatial: tuple[int, ...]) -> bool:
    """True if ``dim`` is neither the batch nor a spatial dimension."""
    dim = _normalise(dim, ndim)
    return dim is not None and dim != 0 and dim not in spatial


# ---------------------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------------------


def same_layout(call: OpCall) -> Pointwise | None:
    """Per-cell op or merge: every patched input has the output's shape and layout."""
    dims = call.source_dims
    for node in call.patched:
        if call.shapes[node] != tuple(call.value.shape) or call.dims[node] != dims:
            return None
    return Pointwise(dims)


def _parameters(rule: Callable[[OpCall], bool]) -> Rule:
    """A per-cell op whose static inputs are its own parameters (never spatial)."""

    def check(call: OpCall) -> Pointwise | None:
        verdict = same_layout(call)
        if verdict is None or len(call.patched) != 1 or not rule(call):
            return None
        return Pointwise(verdict.spatial_dims, statics="parameters")

    return check


def _channel_one(call: OpCall) -> bool:
    return 1 not in call.source_dims


def _batch_norm_function(call: OpCall) -> bool:
    """F.batch_norm(x, running_mean, running_var, weight, bias, training, ...) in eval."""
    training = call.arg(5, "training", False)
    return training is False and call.arg(1, "running_mean") is not None and _channel_one(call)


def _batch_norm_builtin(call: OpCall) -> bool:
    """torch.batch_norm(x, weight, bias, running_mean, running_var, training, ...)."""
    return (
        len(call.args) > 5
        and call.args[5] is False
        and call.args[3] is not None
        and _channel_one(call)
    )


def _batch_norm_module(call: OpCall) -> bool:
    module = call.module
    return not module.training and module.running_mean is not None and _channel_one(call)


def _last_dims_free(count: int) -> Callable[[OpCall], bool]:
    def check(call: OpCall) -> bool:
        return max(call.source_dims) < call.ndim - count

    return check


def _layer_norm_function(call: OpCall) -> bool:
    shape = call.arg(1, "normalized_shape")
    count = len(shape) if isinstance(shape, (tuple, list, torch.Size)) else 1
    return _last_dims_free(count)(call)


def _layer_norm_module(call: OpCall) -> bool:
    return _last_dims_free(len(cast(nn.LayerNorm, call.module).normalized_shape))(call)


def _linear_output(call: OpCall) -> Pointwise | None:
    """F.linear / nn.Linear over the last dimension: per cell when that is not spatial."""
    if len(call.patched) != 1 or max(call.source_dims) >= call.ndim - 1:
        return None
    shape_in, shape_out = call.shapes[call.source], tuple(call.value.shape)
    if shape_in[:-1] != shape_out[:-1]:
        return None
    return Pointwise(call.source_dims, statics="parameters")


def _permutation(call: OpCall, order: list[int]) -> Pointwise | None:
    ndim = call.ndim
    order = [_normalise(d, ndim) for d in order]
    if None in order or sorted(order) != list(range(ndim)) or order[0] != 0:
        return None
    return Pointwise(tuple(order.index(dim) for dim in call.source_dims))


def permute(call: OpCall) -> Pointwise | None:
    """x.permute(0, 2, 3, 1) and torch.permute(x, dims): the spatial axes move with it."""
    if len(call.patched) != 1:
        return None
    rest = list(call.args[1:])
    order = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
    if not rest:
        order = call.kwargs.get("dims", [])
    return _permutation(call, list(order))


def transpose(call: OpCall) -> Pointwise | None:
    """x.transpose(a, b): swaps two dimensions (channel-shuffle groups, NCHW <-> NHWC)."""
    if len(call.patched) != 1:
        return None
    a, b = _normalise(call.arg(1, "dim0"), call.ndim), _normalise(call.arg(2, "dim1"), call.ndim)
    if a is None or b is None:
        return None
    order = list(range(call.ndim))
    order[a], order[b] = order[b], order[a]
    return _permutation(call, order)


def reshape_channels(call: OpCall) -> Pointwise | None:
    """view / reshape / flatten that regroup channel dimensions only.

    With the spatial axes the last dimensions before and after, and of the same sizes, a
    row-major reshape keeps every cell's coordinates: channel shuffle's
    (N, C, H, W) -> (N, g, C/g, H, W) and back. On the patch it runs with the patch's
    own batch and window sizes.
    """
    if len(call.patched) != 1:
        return None
    shape_in, shape_out = call.shapes[call.source], tuple(call.value.shape)
    rank = len(call.source_dims)
    if call.source_dims != _last_dims(len(shape_in), rank) or len(shape_out) < rank + 1:
        return None
    if shape_out[-rank:] != shape_in[-rank:] or shape_out[0] != shape_in[0]:
        return None
    middle = shape_out[1:-rank]

    def on_patch(data: torch.Tensor) -> torch.Tensor:
        return data.reshape(data.shape[0], *middle, *data.shape[-rank:])

    return Pointwise(_last_dims(len(shape_out), rank), patch_call=on_patch)


def _split_like(dim_position: int, dim_default: int) -> Rule:
    """split / chunk / tensor_split along a channel dimension: a tuple of patches."""

    def check(call: OpCall) -> Pointwise | None:
        if len(call.patched) != 1 or not isinstance(call.value, (tuple, list)):
            return None
        ndim = len(call.shapes[call.source])
        dim = call.arg(dim_position, "dim", dim_default)
        if not _is_channel_dim(dim, ndim, call.source_dims):
            return None
        if not all(isinstance(piece, torch.Tensor) for piece in call.value):
            return None
        users = list(call.node.users)
        if not users or not all(
            u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int)
            for u in users
        ):
            return None  # only picking single pieces keeps them patches
        return Pointwise(
            call.source_dims,
            element_shapes=tuple(tuple(piece.shape) for piece in call.value),
        )

    return check


def getitem(call: OpCall) -> Pointwise | None:
    """Indexing that keeps the batch and every spatial dimension whole."""
    if len(call.patched) != 1 or not isinstance(call.args[0], torch.Tensor):
        return None
    index = call.args[1]
    index = index if isinstance(index, tuple) else (index,)
    ndim_in = call.args[0].dim()
    used = sum(1 for entry in index if entry is not None and entry is not Ellipsis)
    expanded: list[Any] = []
    for entry in index:
        if entry is Ellipsis:
            expanded.extend([slice(None)] * (ndim_in - used))
        else:
            expanded.append(entry)
    spatial = call.source_dims
    in_dim = out_dim = 0
    mapping: dict[int, int] = {}
    for entry in expanded:
        if entry is None:
            out_dim += 1
            continue
        if isinstance(entry, bool) or not isinstance(entry, (int, slice)):
            return None  # tensor (advanced) indices
        if in_dim == 0 or in_dim in spatial:
            if entry != slice(None):
                return None  # touches the batch or a spatial dimension
        if isinstance(entry, slice):
            mapping[in_dim] = out_dim
            out_dim += 1
        in_dim += 1
    if in_dim > ndim_in:
        return None
    for dim in range(in_dim, ndim_in):
        mapping[dim] = out_dim + dim - in_dim
    if 0 not in mapping or mapping[0] != 0:
        return None
    return Pointwise(tuple(mapping[dim] for dim in spatial))


def narrow(call: OpCall) -> Pointwise | None:
    """x.narrow(dim, start, length) along a channel dimension."""
    if len(call.patched) != 1 or not _is_channel_dim(
        call.arg(1, "dim"), call.ndim, call.source_dims
    ):
        return None
    return Pointwise(call.source_dims)


def cat(call: OpCall) -> Pointwise | None:
    """Concatenation along a channel dimension (DenseNet, Inception, GhostNet)."""
    dims = call.source_dims
    ndim = call.ndim
    if not _is_channel_dim(call.arg(1, "dim", 0), ndim, dims):
        return None
    for node in call.patched:
        shape = call.shapes[node]
        if call.dims[node] != dims or len(shape) != ndim:
            return None
    return Pointwise(dims)


def unsqueeze(call: OpCall) -> Pointwise | None:
    """A new dimension after the batch: the spatial axes shift past it."""
    if len(call.patched) != 1:
        return None
    dim = _normalise(call.arg(1, "dim"), call.ndim)
    if dim is None or dim == 0:
        return None
    return Pointwise(tuple(d + (d >= dim) for d in call.source_dims))


POINTWISE_RULES: dict[Any, Rule] = {
    # functions
    **dict.fromkeys(ops.ELEMENTWISE_FUNCTIONS, same_layout),
    F.batch_norm: _parameters(_batch_norm_function),
    torch.batch_norm: _parameters(_batch_norm_builtin),
    F.layer_norm: _parameters(_layer_norm_function),
    torch.layer_norm: _parameters(_layer_norm_function),
    F.linear: _linear_output,
    torch.permute: permute,
    torch.transpose: transpose,
    torch.swapaxes: transpose,
    torch.reshape: reshape_channels,
    torch.flatten: reshape_channels,  # only channel-only flattening is per cell
    torch.split: _split_like(2, 0),
    torch.chunk: _split_like(2, 0),
    torch.tensor_split: _split_like(2, 0),
    torch.narrow: narrow,
    torch.cat: cat,
    torch.concat: cat,
    torch.unsqueeze: unsqueeze,
    operator.getitem: getitem,
    # methods (by name; in-place spellings run out of place)
    **dict.fromkeys(ops.ELEMENTWISE_METHODS, same_layout),
    "permute": permute,
    "transpose": transpose,
    "swapaxes": transpose,
    "view": reshape_channels,
    "reshape": reshape_channels,
    "flatten": reshape_channels,
    "split": _split_like(2, 0),
    "chunk": _split_like(2, 0),
    "tensor_split": _split_like(2, 0),
    "narrow": narrow,
    "unsqueeze": unsqueeze,
    # modules (by type; subclasses are traced through, so exact types suffice)
    **dict.fromkeys(ops.ELEMENTWISE_MODULES, same_layout),
    nn.BatchNorm1d: _parameters(_batch_norm_module),
    nn.BatchNorm2d: _parameters(_batch_norm_module),
    nn.BatchNorm3d: _parameters(_batch_norm_module),
    nn.LayerNorm: _parameters(_layer_norm_module),
    nn.Linear: _linear_output,
    nn.Flatten: reshape_channels,
}

# Dropout-like functions are per cell only when not training.
for _function in ops._TRAINING_FLAG_FUNCTIONS:

    def _dropout(call: OpCall, _function=_function) -> Pointwise | None:
        if not ops.is_elementwise_function(_function, call.args, call.kwargs):
            return None
        return same_layout(call)

    POINTWISE_RULES[_function] = _dropout


def rule_for(node: fx.Node, module: nn.Module | None) -> Rule | None:
    """The pointwise rule of a node, or None (then the node is global unless local)."""
    if node.op == "call_module":
        return POINTWISE_RULES.get(type(module))
    if node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.endswith("__"):
            name = name[:-1]  # in-place spelling, run out of place
        return POINTWISE_RULES.get(name)
    if node.op == "call_function":
        try:
            return POINTWISE_RULES.get(node.target)
        except TypeError:  # unhashable target
            return None
    return None


# ---------------------------------------------------------------------------------------
# Classification of one dependent node
# ---------------------------------------------------------------------------------------

_SHAPE_METHODS = {"size", "dim", "ndimension"}
_SHAPE_ATTRIBUTES = {"shape", "ndim", "dtype"}


@dataclass
class Classifier:
    """Classifies dependent nodes in graph order, remembering kinds and layouts."""

    module: fx.GraphModule
    kinds: dict[fx.Node, NodeKind] = field(default_factory=dict)
    dims: dict[fx.Node, tuple[int, ...]] = field(default_factory=dict)
    shapes: dict[fx.Node, tuple[int, ...]] = field(default_factory=dict)

    def classify(self, node: fx.Node, values: dict[fx.Node, Any], dtype, device) -> Step:
        step = classify_dependent(self, node, values, dtype, device)
        self.kinds[node] = step.kind
        if step.spatial_dims is not None:
            self.dims[node] = step.spatial_dims
        return step


def _global(node: fx.Node, reason: str) -> Step:
    return Step(node, NodeKind.GLOBAL, reason=reason)


def classify_dependent(
    classifier: Classifier, node: fx.Node, values: dict[fx.Node, Any], dtype, device
) -> Step:
    """Kind of a node that depends on the image, from its inputs' kinds and the values."""
    kinds, shapes = classifier.kinds, classifier.shapes
    value = values[node]
    inputs = flatten_nodes((node.args, node.kwargs))
    dependent = [i for i in inputs if kinds.get(i, NodeKind.STATIC) != NodeKind.STATIC]
    module = classifier.module.get_submodule(str(node.target)) if node.op == "call_module" else None

    if not isinstance(value, (torch.Tensor, tuple, list)) or (
        isinstance(value, (tuple, list)) and not any(isinstance(v, torch.Tensor) for v in value)
    ):
        is_shape_query = (node.op == "call_method" and node.target in _SHAPE_METHODS) or (
            node.op == "call_function"
            and node.target is getattr
            and len(node.args) > 1
            and node.args[1] in _SHAPE_ATTRIBUTES
        )
        if is_shape_query or all(kinds[i] == NodeKind.SHAPE for i in dependent):
            return Step(node, NodeKind.SHAPE)
        return _global(node, "a python value computed from the image")

    # getitem of a split's tuple of patches
    if (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and isinstance(values.get(node.args[0]), (tuple, list))
    ):
        source = node.args[0]
        if kinds.get(source) == NodeKind.POINTWISE and isinstance(node.args[1], int):
            return Step(
                node,
                NodeKind.POINTWISE,
                patched_args=(source,),
                spatial_dims=classifier.dims[source],
                pick=node.args[1],
            )
        return _global(node, "an element of a value that is not a patch")

    patched = [i for i in dependent if kinds[i] in PATCHED_KINDS]
    others = [i for i in dependent if kinds[i] not in PATCHED_KINDS]
    if any(kinds[i] != NodeKind.SHAPE for i in others):
        return _global(node, "reads a globally computed value")
    if not patched:
        return _global(node, "no update patch among its inputs")
    if isinstance(value, torch.Tensor) and (value.dim() < 3 or value.shape[0] != 1):
        return _global(node, f"output of shape {tuple(value.shape)} has no spatial extent")

    args = fx.node.map_arg(node.args, lambda n: values[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: values[n])
    first = node.args[0] if node.args else None
    if isinstance(first, fx.Node) and patched == [first] and isinstance(value, torch.Tensor):
        in_shape = shapes[first]
        rank = len(classifier.dims[first])
        if classifier.dims[first] == _last_dims(len(in_shape), rank):
            spec = ops.local_op_spec(
                node.op,
                node.target,
                module,
                args,
                kwargs,
                torch.Size(in_shape),
                value.shape,
                dtype,
                device,
                rank,
            )
            if spec is not None:
                return Step(
                    node, NodeKind.LOCAL, local=spec, spatial_dims=_last_dims(rank + 2, rank)
                )
            remap = ops.pad_spec(
                node.op, node.target, module, args, kwargs, torch.Size(in_shape), value.shape, rank
            )
            if remap is not None:
                return Step(
                    node, NodeKind.REMAP, remap=remap, spatial_dims=_last_dims(value.dim(), rank)
                )
        if module is not None and type(module) in ops.LOCAL_MODULE_TYPES:
            return _global(node, f"{type(module).__name__} with settings Krypton cannot window")

    rule = rule_for(node, module)
    if rule is None:
        return _global(node, "not a known per-cell, local or layout op")
    call = OpCall(node, module, args, kwargs, value, patched, shapes, classifier.dims)
    verdict = rule(call)
    if verdict is None:
        return _global(node, "used in a way that mixes spatial cells")
    if isinstance(value, torch.Tensor):
        sizes = tuple(value.shape[d] for d in verdict.spatial_dims)
        source_shape = shapes[call.source]
        if sizes != tuple(source_shape[d] for d in call.source_dims):
            return _global(node, "changes the spatial size")
    cropped: list[fx.Node] = []
    if verdict.statics == "broadcast" and isinstance(value, torch.Tensor):
        for i in inputs:
            if i in dependent or not isinstance(values.get(i), torch.Tensor):
                continue
            kind = _static_broadcast(values[i], value, verdict.spatial_dims)
            if kind is None:
                return _global(node, "a static input covers the image in an unsupported layout")
            if kind == "cropped":
                cropped.append(i)
    return Step(
        node,
        NodeKind.POINTWISE,
        patched_args=tuple(dict.fromkeys(patched)),
        cropped_statics=tuple(cropped),
        spatial_dims=verdict.spatial_dims,
        patch_call=verdict.patch_call,
        element_shapes=verdict.element_shapes,
    )


def _last_dims(ndim: int, rank: int) -> tuple[int, ...]:
    """The last ``rank`` dimensions of an ``ndim``-dimensional tensor."""
    return tuple(range(ndim - rank, ndim))


def _static_broadcast(static: torch.Tensor, output: torch.Tensor, dims: tuple[int, ...]):
    """'broadcast' (no spatial extent), 'cropped' (full extent, cut to the window), None."""
    ndim = output.dim()
    if static.dim() > ndim:
        return None
    aligned = (1,) * (ndim - static.dim()) + tuple(static.shape)
    if aligned[0] != 1:
        return None
    extent = tuple(aligned[d] for d in dims)
    if all(size == 1 for size in extent):
        return "broadcast"
    full = tuple(output.shape[d] for d in dims)
    spatial_last = dims == _last_dims(ndim, len(dims))
    if extent == full and static.dim() == ndim and spatial_last:
        return "cropped"
    return None
