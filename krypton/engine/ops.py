"""Classification of traced operations by spatial locality (paper §2.2, thesis §7.2).

Each torch.fx node that depends on the image falls in one of three classes:

* local spatial context (convolution, max/avg pooling): recomputed on a read-in context;
* element-wise or merge (activations, eval-mode batch norm, dropout, scalar arithmetic,
  element-wise add/mul of spatial tensors, channel concatenation, channel indexing):
  applied to the update patch only (merges use the bounding box of eq 20);
* global (everything else, including anything not understood): inputs are materialised in
  full and the op runs normally. Treating an unknown op as global is slower, never wrong.
"""

from __future__ import annotations

import copy
import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .geometry import AxisOp, padding_needed

try:  # torchvision's stochastic depth is traced as a leaf function
    from torchvision.ops import stochastic_depth as _stochastic_depth
except Exception:  # pragma: no cover - torchvision is a hard requirement, but stay importable
    _stochastic_depth = None


@dataclass(frozen=True)
class LocalOpSpec:
    """A convolution or pooling operator with its geometry and a padding-free kernel.

    ``axes`` holds one :class:`AxisOp` per spatial axis, in tensor order: (rows, columns)
    for an image, (slices, rows, columns) for a volume."""

    kind: str  # "conv", "max_pool", "avg_pool"
    axes: tuple[AxisOp, ...]
    pad_value: float  # value of the implicit padding: 0 for conv/avg, -inf for max
    # runs the op on a context padded by the caller; a convolution may be asked to pad
    # some axes itself (``padding`` per axis: see PatchGeometry.implicit_padding)
    apply: Callable[..., torch.Tensor]
    divisor_map: torch.Tensor | None = None  # avg pool: (*out spatial) factor if not uniform
    conv_macs_per_output: int = 0  # Cin/groups * prod(kernel) for convs (eq 9), 0 otherwise


def _tuple(value: Any, rank: int) -> tuple[int, ...]:
    """An int or a per-axis sequence (a single entry repeats) as ``rank`` ints."""
    if isinstance(value, (tuple, list)):
        if len(value) == 1:
            return (int(value[0]),) * rank
        if len(value) != rank:
            raise ValueError(f"expected {rank} values per axis, got {value!r}")
        return tuple(int(v) for v in value)
    return (int(value),) * rank


# ---------------------------------------------------------------------------------------
# Element-wise operators
# ---------------------------------------------------------------------------------------

ELEMENTWISE_MODULES: tuple[type, ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.PReLU,
)

ELEMENTWISE_FUNCTIONS: set[Any] = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.neg,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.neg,
    torch.relu,
    F.relu,
    F.relu6,
    F.leaky_relu,
    F.elu,
    F.selu,
    F.celu,
    F.gelu,
    F.silu,
    F.mish,
    F.hardswish,
    F.hardsigmoid,
    F.hardtanh,
    torch.sigmoid,
    F.sigmoid,
    torch.tanh,
    F.tanh,
    F.softplus,
    torch.clamp,
    torch.clip,
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    F.dropout3d,
}
if _stochastic_depth is not None:
    ELEMENTWISE_FUNCTIONS.add(_stochastic_depth)

ELEMENTWISE_METHODS: set[str] = {
    "relu",
    "sigmoid",
    "tanh",
    "add",
    "sub",
    "mul",
    "div",
    "neg",
    "clamp",
    "clip",
    "contiguous",
    "clone",
}

# Functions whose "training" argument must be False for them to be element-wise.
_TRAINING_FLAG_FUNCTIONS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d}
if _stochastic_depth is not None:
    _TRAINING_FLAG_FUNCTIONS.add(_stochastic_depth)


def _max_pool_signature(
    input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False
):  # pragma: no cover
    """Stand-in with F.max_pool2d/3d's documented signature (the real ones hide it)."""


def _avg_pool_signature(
    input,
    kernel_size,
    stride=None,
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):  # pragma: no cover
    """Stand-in with F.avg_pool2d/3d's documented signature (builtins without one)."""


def _conv_signature(
    input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1
):  # pragma: no cover
    """Stand-in with F.conv2d/3d's documented signature (builtins without one)."""


# Per number of spatial axes: the convolution and pooling kernels of that rank.
CONV_FUNCTIONS = {2: (F.conv2d, torch.conv2d), 3: (F.conv3d, torch.conv3d)}
MAX_POOL_FUNCTIONS = {2: (F.max_pool2d, torch.max_pool2d), 3: (F.max_pool3d, torch.max_pool3d)}
AVG_POOL_FUNCTIONS = {2: (F.avg_pool2d,), 3: (F.avg_pool3d,)}
_CONV = {2: F.conv2d, 3: F.conv3d}
_CHANNELS_LAST = {2: torch.channels_last, 3: torch.channels_last_3d}
_MAX_POOL = {2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {2: F.avg_pool2d, 3: F.avg_pool3d}
_CONV_MODULES: dict[type, int] = {nn.Conv2d: 2, nn.Conv3d: 3}
_MAX_POOL_MODULES: dict[type, int] = {nn.MaxPool2d: 2, nn.MaxPool3d: 3}
_AVG_POOL_MODULES: dict[type, int] = {nn.AvgPool2d: 2, nn.AvgPool3d: 3}
LOCAL_MODULE_TYPES = (*_CONV_MODULES, *_MAX_POOL_MODULES, *_AVG_POOL_MODULES)

_SIGNATURE_STAND_INS: dict[Any, Callable] = {
    **{f: _conv_signature for fs in CONV_FUNCTIONS.values() for f in fs},
    **{f: _max_pool_signature for fs in MAX_POOL_FUNCTIONS.values() for f in fs},
    **{f: _avg_pool_signature for fs in AVG_POOL_FUNCTIONS.values() for f in fs},
}


def bind_arguments(target: Callable, args: tuple, kwargs: dict) -> inspect.BoundArguments | None:
    """Bind a call's arguments to the target's signature (None for builtins without one)."""
    try:
        signature = inspect.signature(_SIGNATURE_STAND_INS.get(target, target))
    except (TypeError, ValueError):
        return None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound


def is_elementwise_module(module: nn.Module) -> bool:
    """Element-wise in eval mode: activations, dropout, identity, eval batch norm."""
    if isinstance(module, ELEMENTWISE_MODULES):
        return True  # (PReLU's per-channel slope is still independent per spatial cell)
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        # In eval mode with running statistics, batch norm is a per-channel affine map.
        return (not module.training) and module.running_mean is not None
    return False


def is_elementwise_function(target: Any, args: tuple, kwargs: dict) -> bool:
    """Element-wise call_function targets (dropout-like ones only when not training)."""
    if target not in ELEMENTWISE_FUNCTIONS:
        return False
    if target in _TRAINING_FLAG_FUNCTIONS:
        bound = bind_arguments(target, args, kwargs)
        return bound is not None and bound.arguments.get("training") is False
    return True


def out_of_place_module(module: nn.Module) -> nn.Module:
    """A shallow copy of an element-wise module with ``inplace`` turned off.

    Cached tensors must never be overwritten, so in-place activations are run out of place.
    """
    if getattr(module, "inplace", False):
        module = copy.copy(module)
        module.inplace = False  # type: ignore[assignment]  # the flag, not a submodule
    return module


def writes_in_place(target: Callable, args: tuple, kwargs: dict) -> bool:
    """True if this call asks to overwrite its input (``inplace=True``)."""
    bound = bind_arguments(target, args, kwargs)
    return bound is not None and bool(bound.arguments.get("inplace", False))


def out_of_place_call(target: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Rewrite a functional call so that it does not modify its input (inplace=False)."""
    bound = bind_arguments(target, args, kwargs)
    if bound is None or "inplace" not in bound.arguments or not bound.arguments["inplace"]:
        return args, kwargs
    bound.arguments["inplace"] = False
    return tuple(bound.args), dict(bound.kwargs)


# ---------------------------------------------------------------------------------------
# Local spatial context operators
# ---------------------------------------------------------------------------------------


def _axes(
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    padding: tuple[int, ...],
    in_sizes: tuple[int, ...],
    out_sizes: tuple[int, ...],
) -> tuple[AxisOp, ...]:
    return tuple(
        AxisOp(k, s, d, p, i, o)
        for k, s, d, p, i, o in zip(kernel, stride, dilation, padding, in_sizes, out_sizes)
    )


def _conv_spec(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    in_sizes: tuple[int, ...],
    out_sizes: tuple[int, ...],
) -> LocalOpSpec:
    """A zero-padded 2-D or 3-D convolution, module or functional (F.conv2d/3d)."""
    rank = weight.dim() - 2
    kernel = tuple(int(k) for k in weight.shape[2:])
    strides, dilations = _tuple(stride, rank), _tuple(dilation, rank)
    if isinstance(padding, str):
        if padding == "valid":
            pads = (0,) * rank
        else:  # "same": PyTorch puts the odd cell of padding on the high side
            pads = tuple((d * (k - 1)) // 2 for d, k in zip(dilations, kernel))
    else:
        pads = _tuple(padding, rank)
    convolve = _CONV[rank]
    layout = _CHANNELS_LAST[rank]
    in_layout: dict[str, torch.Tensor] = {}  # the weight in the contexts' layout, made once

    def apply(context: torch.Tensor, padding: tuple[int, ...] | int = 0) -> torch.Tensor:
        # Read-in contexts are channels-last (gathered spatial-last); a weight in the
        # other layout was converted on every call (4% of a ResNet18 run on a CPU).
        used = weight
        if context.is_contiguous(memory_format=layout) and not weight.is_contiguous(
            memory_format=layout
        ):
            used = in_layout.get("weight")
            if used is None:
                used = in_layout["weight"] = weight.contiguous(memory_format=layout)
        return convolve(context, used, bias, strides, padding, dilations, groups)

    return LocalOpSpec(
        kind="conv",
        axes=_axes(kernel, strides, dilations, pads, in_sizes, out_sizes),
        pad_value=0.0,
        apply=apply,
        conv_macs_per_output=int(weight.shape[1]) * int(np.prod(kernel)),
    )


def _conv_module_spec(
    conv: nn.Conv2d | nn.Conv3d, in_sizes: tuple[int, ...], out_sizes: tuple[int, ...]
) -> LocalOpSpec | None:
    if conv.padding_mode != "zeros":
        return None  # reflect/replicate/circular padding reads beyond the zero border model
    return _conv_spec(
        conv.weight,
        conv.bias,
        conv.stride,
        conv.padding,
        conv.dilation,
        conv.groups,
        in_sizes,
        out_sizes,
    )


def _max_pool_spec(
    kernel, stride, padding, dilation, return_indices, in_sizes, out_sizes
) -> LocalOpSpec | None:
    if return_indices:
        return None
    rank = len(in_sizes)
    kernels = _tuple(kernel, rank)
    strides = _tuple(stride if stride not in (None, [], ()) else kernel, rank)
    dilations = _tuple(dilation, rank)
    pool = _MAX_POOL[rank]

    def apply(context: torch.Tensor) -> torch.Tensor:
        return pool(context, kernels, strides, 0, dilations)

    return LocalOpSpec(
        kind="max_pool",
        axes=_axes(kernels, strides, dilations, _tuple(padding, rank), in_sizes, out_sizes),
        pad_value=float("-inf"),
        apply=apply,
    )


def _avg_pool_spec(
    kernel,
    stride,
    padding,
    ceil_mode,
    count_include_pad,
    divisor_override,
    in_sizes,
    out_sizes,
    dtype,
    device,
) -> LocalOpSpec:
    rank = len(in_sizes)
    kernels = _tuple(kernel, rank)
    strides = _tuple(stride if stride not in (None, [], ()) else kernel, rank)
    pads = _tuple(padding, rank)
    axes = _axes(kernels, strides, (1,) * rank, pads, in_sizes, out_sizes)
    pool = _AVG_POOL[rank]

    # The padding-free kernel sums each window; the divisor PyTorch uses depends on the
    # window's position (count_include_pad, ceil_mode overhang, divisor_override). Measure
    # it once on a tensor of ones: factor = avg(ones) / windowsum(ones inside input).
    grow: list[int] = []
    for axis in reversed(axes):  # F.pad lists the last axis first
        grow.extend(padding_needed(axis))
    ones = torch.ones((1, 1) + tuple(in_sizes), dtype=dtype, device=device)
    averaged = pool(ones, kernels, strides, pads, ceil_mode, count_include_pad, divisor_override)
    summed = pool(F.pad(ones, grow), kernels, strides, 0, divisor_override=1)
    factor = (averaged / summed)[0, 0]
    volume = int(np.prod(kernels))
    uniform = torch.allclose(factor, torch.full_like(factor, 1.0 / volume), rtol=0, atol=0)

    if uniform:

        def apply(context: torch.Tensor) -> torch.Tensor:
            return pool(context, kernels, strides, 0)

        divisor_map = None
    else:

        def apply(context: torch.Tensor) -> torch.Tensor:
            return pool(context, kernels, strides, 0, divisor_override=1)

        divisor_map = factor

    return LocalOpSpec(
        kind="avg_pool", axes=axes, pad_value=0.0, apply=apply, divisor_map=divisor_map
    )


def _function_rank(target: Any, table: dict[int, tuple]) -> int | None:
    return next((rank for rank, functions in table.items() if target in functions), None)


def local_op_spec(
    node_op: str,
    target: Any,
    module: nn.Module | None,
    args: tuple,
    kwargs: dict,
    in_shape: torch.Size,
    out_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
) -> LocalOpSpec | None:
    """Describe a convolution/pooling node with ``rank`` spatial axes (2-D on
    (N, C, H, W), 3-D on (N, C, D, H, W)), or return None if it is not one we can do."""
    if rank not in _CONV or len(in_shape) != rank + 2 or len(out_shape) != len(in_shape):
        return None
    in_sizes, out_sizes = tuple(in_shape[2:]), tuple(out_shape[2:])
    if node_op == "call_module":
        kind = type(module)
        if _CONV_MODULES.get(kind) == rank:
            return _conv_module_spec(cast(Any, module), in_sizes, out_sizes)
        if _MAX_POOL_MODULES.get(kind) == rank:
            pool = cast(Any, module)
            return _max_pool_spec(
                pool.kernel_size,
                pool.stride,
                pool.padding,
                pool.dilation,
                pool.return_indices,
                in_sizes,
                out_sizes,
            )
        if _AVG_POOL_MODULES.get(kind) == rank:
            pool = cast(Any, module)
            return _avg_pool_spec(
                pool.kernel_size,
                pool.stride,
                pool.padding,
                pool.ceil_mode,
                pool.count_include_pad,
                pool.divisor_override,
                in_sizes,
                out_sizes,
                dtype,
                device,
            )
        return None
    if node_op != "call_function":
        return None
    if _function_rank(target, CONV_FUNCTIONS) == rank:
        bound = bind_arguments(target, args, kwargs)
        if bound is None or not isinstance(bound.arguments["weight"], torch.Tensor):
            return None
        a = bound.arguments
        if a["weight"].dim() != rank + 2:
            return None
        return _conv_spec(
            a["weight"],
            a["bias"],
            a["stride"],
            a["padding"],
            a["dilation"],
            a["groups"],
            in_sizes,
            out_sizes,
        )
    max_rank = _function_rank(target, MAX_POOL_FUNCTIONS)
    if max_rank == rank or _function_rank(target, AVG_POOL_FUNCTIONS) == rank:
        bound = bind_arguments(target, args, kwargs)
        if bound is None:
            return None
        a = bound.arguments
        if max_rank == rank:
            return _max_pool_spec(
                a["kernel_size"],
                a["stride"],
                a["padding"],
                a["dilation"],
                a.get("return_indices", False),
                in_sizes,
                out_sizes,
            )
        return _avg_pool_spec(
            a["kernel_size"],
            a["stride"],
            a["padding"],
            a["ceil_mode"],
            a["count_include_pad"],
            a["divisor_override"],
            in_sizes,
            out_sizes,
            dtype,
            device,
        )
    return None


def linear_macs(module: nn.Module) -> int:
    """Multiply-accumulates of a fully connected layer for one image."""
    if isinstance(module, nn.Linear):
        return module.in_features * module.out_features
    return 0


# ---------------------------------------------------------------------------------------
# Copy operators: padding of every mode, cropping
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemapSpec:
    """An op whose every output cell copies one input cell (or is a constant).

    ``maps[a][o]`` is the input coordinate that output coordinate ``o`` copies along
    spatial axis ``a``, -1 where it is ``fill``. Constant, reflect, replicate and circular
    padding, and negative padding (cropping), are all of this form, and their update
    windows follow from the maps (:func:`krypton.engine.plan.remap_window`), not from a
    formula per mode.
    """

    maps: tuple[np.ndarray, ...]
    fill: float


_PAD_MODULES = {
    nn.ZeroPad2d: "constant",
    nn.ConstantPad2d: "constant",
    nn.ReflectionPad2d: "reflect",
    nn.ReplicationPad2d: "replicate",
    nn.ZeroPad3d: "constant",
    nn.ConstantPad3d: "constant",
    nn.ReflectionPad3d: "reflect",
    nn.ReplicationPad3d: "replicate",
}
for _name in ("CircularPad2d", "CircularPad3d"):
    if hasattr(nn, _name):
        _PAD_MODULES[getattr(nn, _name)] = "circular"


def _pad_signature(input, pad, mode="constant", value=None):  # pragma: no cover
    """Stand-in with F.pad's documented signature."""


def _axis_map(size: int, low: int, high: int, mode: str) -> np.ndarray | None:
    """Which input index each output index copies along one axis (-1: the fill value),
    found by running F.pad itself on the indices, so every mode's rule is PyTorch's own."""
    index = torch.arange(size, dtype=torch.float64).view(1, 1, size)
    try:
        if mode == "constant":
            mapped = F.pad(index, (low, high), mode="constant", value=-1.0)
        else:
            mapped = F.pad(index, (low, high), mode=mode)
    except (RuntimeError, ValueError, NotImplementedError):
        return None
    return mapped.view(-1).to(torch.int64).numpy()


def pad_spec(
    node_op: str,
    target: Any,
    module: nn.Module | None,
    args: tuple,
    kwargs: dict,
    in_shape: torch.Size,
    out_shape: torch.Size,
    rank: int,
) -> RemapSpec | None:
    """Describe F.pad / nn.*Pad2d / nn.*Pad3d on the ``rank`` spatial (last) dimensions,
    or None (padding the channels, say)."""
    ndim = len(in_shape)
    if ndim < rank + 1 or len(out_shape) != ndim:
        return None
    if node_op == "call_module" and type(module) in _PAD_MODULES:
        pad = tuple(int(p) for p in cast(Any, module).padding)
        mode = _PAD_MODULES[type(module)]
        value = float(getattr(module, "value", 0.0))
    elif node_op == "call_function" and target in (F.pad, torch.nn.functional.pad):
        try:
            bound = inspect.signature(_pad_signature).bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        a = bound.arguments
        if not isinstance(a["pad"], (tuple, list)) or not all(isinstance(p, int) for p in a["pad"]):
            return None
        pad = tuple(a["pad"])
        mode = a["mode"]
        value = 0.0 if a["value"] is None else float(a["value"])
    else:
        return None
    if len(pad) % 2 or len(pad) // 2 > rank or mode not in _MODES:
        return None  # padding a non-spatial dimension
    maps = []
    for axis in range(rank):
        from_last = rank - 1 - axis  # F.pad lists the last axis first
        low, high = pad[2 * from_last : 2 * from_last + 2] if 2 * from_last < len(pad) else (0, 0)
        dim = ndim - rank + axis
        index_map = _axis_map(int(in_shape[dim]), low, high, mode)
        if index_map is None or len(index_map) != out_shape[dim]:
            return None
        maps.append(index_map)
    return RemapSpec(tuple(maps), value)


_MODES = ("constant", "reflect", "replicate", "circular")
