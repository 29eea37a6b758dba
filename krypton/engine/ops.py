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
    """A convolution or pooling operator with its geometry and a padding-free kernel."""

    kind: str  # "conv", "max_pool", "avg_pool"
    rows: AxisOp
    cols: AxisOp
    pad_value: float  # value of the implicit padding: 0 for conv/avg, -inf for max
    apply: Callable[[torch.Tensor], torch.Tensor]  # runs the op on a padded context, padding 0
    divisor_map: torch.Tensor | None = None  # avg pool: (Ho, Wo) factor when not uniform
    conv_macs_per_output: int = 0  # Cin/groups * kh * kw for convs (eq 9), 0 otherwise


def _pair(value: Any) -> tuple[int, int]:
    if isinstance(value, (tuple, list)):
        if len(value) == 1:
            return int(value[0]), int(value[0])
        return int(value[0]), int(value[1])
    return int(value), int(value)


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
    nn.Dropout2d,
    nn.Dropout1d,
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
    F.dropout2d,
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
_TRAINING_FLAG_FUNCTIONS = {F.dropout, F.dropout2d}
if _stochastic_depth is not None:
    _TRAINING_FLAG_FUNCTIONS.add(_stochastic_depth)


def _max_pool2d_signature(
    input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False
):  # pragma: no cover
    """Stand-in with F.max_pool2d's documented signature (the real one hides it)."""


def _avg_pool2d_signature(
    input,
    kernel_size,
    stride=None,
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):  # pragma: no cover
    """Stand-in with F.avg_pool2d's documented signature (a builtin without one)."""


def _conv2d_signature(
    input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1
):  # pragma: no cover
    """Stand-in with F.conv2d's documented signature (a builtin without one)."""


_SIGNATURE_STAND_INS: dict[Any, Callable] = {
    F.max_pool2d: _max_pool2d_signature,
    torch.max_pool2d: _max_pool2d_signature,
    F.avg_pool2d: _avg_pool2d_signature,
    F.conv2d: _conv2d_signature,
    torch.conv2d: _conv2d_signature,
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


def _conv_spec(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    in_hw: tuple[int, int],
    out_hw: tuple[int, int],
) -> LocalOpSpec:
    """A zero-padded 2-D convolution, module or functional (F.conv2d)."""
    kh, kw = weight.shape[-2:]
    sh, sw = _pair(stride)
    dh, dw = _pair(dilation)
    if isinstance(padding, str):
        if padding == "valid":
            ph = pw = 0
        else:  # "same": PyTorch puts the odd cell of padding on the high side
            ph, pw = (dh * (kh - 1)) // 2, (dw * (kw - 1)) // 2
    else:
        ph, pw = _pair(padding)

    def apply(context: torch.Tensor) -> torch.Tensor:
        return F.conv2d(context, weight, bias, (sh, sw), 0, (dh, dw), groups)

    return LocalOpSpec(
        kind="conv",
        rows=AxisOp(kh, sh, dh, ph, in_hw[0], out_hw[0]),
        cols=AxisOp(kw, sw, dw, pw, in_hw[1], out_hw[1]),
        pad_value=0.0,
        apply=apply,
        conv_macs_per_output=int(weight.shape[1]) * kh * kw,
    )


def _conv_module_spec(
    conv: nn.Conv2d, in_hw: tuple[int, int], out_hw: tuple[int, int]
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
        in_hw,
        out_hw,
    )


def _max_pool_spec(
    kernel, stride, padding, dilation, return_indices, in_hw, out_hw
) -> LocalOpSpec | None:
    if return_indices:
        return None
    kh, kw = _pair(kernel)
    sh, sw = _pair(stride if stride not in (None, [], ()) else kernel)
    ph, pw = _pair(padding)
    dh, dw = _pair(dilation)

    def apply(context: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(context, (kh, kw), (sh, sw), 0, (dh, dw))

    return LocalOpSpec(
        kind="max_pool",
        rows=AxisOp(kh, sh, dh, ph, in_hw[0], out_hw[0]),
        cols=AxisOp(kw, sw, dw, pw, in_hw[1], out_hw[1]),
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
    in_hw,
    out_hw,
    dtype,
    device,
) -> LocalOpSpec:
    kh, kw = _pair(kernel)
    sh, sw = _pair(stride if stride not in (None, [], ()) else kernel)
    ph, pw = _pair(padding)
    rows = AxisOp(kh, sh, 1, ph, in_hw[0], out_hw[0])
    cols = AxisOp(kw, sw, 1, pw, in_hw[1], out_hw[1])

    # The padding-free kernel sums each window; the divisor PyTorch uses depends on the
    # window's position (count_include_pad, ceil_mode overhang, divisor_override). Measure
    # it once on a tensor of ones: factor = avg(ones) / windowsum(ones inside input).
    top, bottom = padding_needed(rows)
    left, right = padding_needed(cols)
    ones = torch.ones((1, 1) + tuple(in_hw), dtype=dtype, device=device)
    averaged = F.avg_pool2d(
        ones, (kh, kw), (sh, sw), (ph, pw), ceil_mode, count_include_pad, divisor_override
    )
    summed = F.avg_pool2d(
        F.pad(ones, (left, right, top, bottom)), (kh, kw), (sh, sw), 0, divisor_override=1
    )
    factor = (averaged / summed)[0, 0]
    uniform = torch.allclose(factor, torch.full_like(factor, 1.0 / (kh * kw)), rtol=0, atol=0)

    if uniform:

        def apply(context: torch.Tensor) -> torch.Tensor:
            return F.avg_pool2d(context, (kh, kw), (sh, sw), 0)

        divisor_map = None
    else:

        def apply(context: torch.Tensor) -> torch.Tensor:
            return F.avg_pool2d(context, (kh, kw), (sh, sw), 0, divisor_override=1)

        divisor_map = factor

    return LocalOpSpec(
        kind="avg_pool", rows=rows, cols=cols, pad_value=0.0, apply=apply, divisor_map=divisor_map
    )


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
) -> LocalOpSpec | None:
    """Describe a convolution/pooling node, or return None if it is not one we can do."""
    if len(in_shape) != 4 or len(out_shape) != 4:
        return None
    in_hw, out_hw = (in_shape[2], in_shape[3]), (out_shape[2], out_shape[3])
    if node_op == "call_module":
        if type(module) is nn.Conv2d:
            return _conv_module_spec(module, in_hw, out_hw)
        if type(module) is nn.MaxPool2d:
            return _max_pool_spec(
                module.kernel_size,
                module.stride,
                module.padding,
                module.dilation,
                module.return_indices,
                in_hw,
                out_hw,
            )
        if type(module) is nn.AvgPool2d:
            return _avg_pool_spec(
                module.kernel_size,
                module.stride,
                module.padding,
                module.ceil_mode,
                module.count_include_pad,
                module.divisor_override,
                in_hw,
                out_hw,
                dtype,
                device,
            )
        return None
    if node_op == "call_function" and target in (F.conv2d, torch.conv2d):
        bound = bind_arguments(target, args, kwargs)
        if bound is None or not isinstance(bound.arguments["weight"], torch.Tensor):
            return None
        a = bound.arguments
        if a["weight"].dim() != 4:
            return None
        return _conv_spec(
            a["weight"],
            a["bias"],
            a["stride"],
            a["padding"],
            a["dilation"],
            a["groups"],
            in_hw,
            out_hw,
        )
    if node_op == "call_function" and target in (F.max_pool2d, F.avg_pool2d, torch.max_pool2d):
        bound = bind_arguments(target, args, kwargs)
        if bound is None:
            return None
        a = bound.arguments
        if target in (F.max_pool2d, torch.max_pool2d):
            return _max_pool_spec(
                a["kernel_size"],
                a["stride"],
                a["padding"],
                a["dilation"],
                a.get("return_indices", False),
                in_hw,
                out_hw,
            )
        return _avg_pool_spec(
            a["kernel_size"],
            a["stride"],
            a["padding"],
            a["ceil_mode"],
            a["count_include_pad"],
            a["divisor_override"],
            in_hw,
            out_hw,
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

    ``row_map[o]`` is the input row output row ``o`` copies, -1 where it is ``fill``; the
    same for columns. Constant, reflect, replicate and circular padding, and negative
    padding (cropping), are all of this form, and their update windows follow from the
    maps (:func:`krypton.engine.plan.remap_window`), not from a formula per mode.
    """

    row_map: np.ndarray
    col_map: np.ndarray
    fill: float


_PAD_MODULES = {
    nn.ZeroPad2d: "constant",
    nn.ConstantPad2d: "constant",
    nn.ReflectionPad2d: "reflect",
    nn.ReplicationPad2d: "replicate",
}
if hasattr(nn, "CircularPad2d"):
    _PAD_MODULES[nn.CircularPad2d] = "circular"


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
) -> RemapSpec | None:
    """Describe F.pad / nn.*Pad2d on the two spatial (last) dimensions, or None."""
    if len(in_shape) < 3 or len(out_shape) != len(in_shape):
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
    if len(pad) == 2:
        pad = pad + (0, 0)
    if len(pad) != 4 or mode not in ("constant", "reflect", "replicate", "circular"):
        return None  # padding a non-spatial dimension
    left, right, top, bottom = pad
    row_map = _axis_map(int(in_shape[-2]), top, bottom, mode)
    col_map = _axis_map(int(in_shape[-1]), left, right, mode)
    if row_map is None or col_map is None:
        return None
    if (len(row_map), len(col_map)) != (out_shape[-2], out_shape[-1]):
        return None
    return RemapSpec(row_map, col_map, value)
