"""Patch propagation geometry: where an occlusion patch's update lands in each tensor.

Pure integer arithmetic over numpy arrays, vectorised over all patch positions at once;
no torch, no tensors. Coordinates are per spatial axis; a 2-D window is two 1-D windows.

Equation numbers refer to Nakandala et al., "Incremental and Approximate Inference for
Faster Occlusion-based Deep CNN Explanations" (SIGMOD 2019).

Every window has one *length* shared by all positions (the paper's uniform patch sizes,
needed for batching) and a per-position *start* array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "AxisOp",
    "Window",
    "LocalStep",
    "local_step",
    "tight_output_length",
    "project_centre",
    "bounding_window",
    "padding_needed",
    "ceil_div",
]


def ceil_div(numerator: np.ndarray | int, denominator: int) -> np.ndarray | int:
    """Integer ceiling division that is correct for negative numerators."""
    return -((-numerator) // denominator)


@dataclass(frozen=True)
class AxisOp:
    """One spatial axis of a local-context operator (convolution or pooling).

    ``pad_before`` is the implicit padding on the low side; ``in_size``/``out_size`` are the
    full input and output extents along this axis (out_size taken from the real tensor, so
    ceil_mode pooling needs no special formula here).
    """

    kernel: int
    stride: int
    dilation: int
    pad_before: int
    in_size: int
    out_size: int

    @property
    def extent(self) -> int:
        """Span of input cells one output reads (kernel size with dilation gaps)."""
        return self.dilation * (self.kernel - 1) + 1


@dataclass(frozen=True)
class Window:
    """Per-position start coordinates and one uniform length along one axis."""

    start: np.ndarray
    length: int

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"window length must be >= 1, got {self.length}")

    @property
    def stop(self) -> np.ndarray:
        return self.start + self.length

    def take(self, index: np.ndarray | slice) -> Window:
        """The same window restricted to a subset of positions."""
        return Window(self.start[index], self.length)


@dataclass(frozen=True)
class LocalStep:
    """Geometry of one local-context operator for all positions along one axis.

    ``input``: the part of the input update patch that is propagated (equal to the incoming
    patch in exact mode; centre-cropped by projective-field thresholding, eqs 24-26).
    ``read``: the read-in context, in input coordinates (may start below 0 in the padding).
    ``output``: the output update patch.
    """

    input: Window
    read: Window
    output: Window
    centre: np.ndarray | None = None  # where the patch's centre lands in the output


def project_centre(op: AxisOp, centre: np.ndarray) -> np.ndarray:
    """The output coordinate whose receptive field is centred on input ``centre``
    (inverse of eq 15 for the middle of a kernel), kept inside the output."""
    projected = (centre + op.pad_before - (op.extent - 1) / 2) / op.stride
    return np.clip(projected, 0, op.out_size - 1)


def tight_output_length(op: AxisOp, in_start: np.ndarray, in_len: int) -> int:
    """Uniform output patch length for exactly these positions: the most output cells
    whose window touches a position's input patch.

    Eq 14's ceil((W_in + W_K - 1) / S) holds for the input patch at any offset to the
    stride; for a given offset one output fewer can suffice (a 2x2/2 pool of a 20-cell
    patch starting on an even cell changes 10 cells, eq 14 says 11), and positions on a
    grid whose step is a multiple of the stride all share one offset. Never more than
    eq 14.
    """
    bound = min(int(ceil_div(in_len + op.extent - 1, op.stride)), op.out_size)
    if in_start.size == 0:
        return bound
    first = np.maximum(ceil_div(op.pad_before + in_start - op.extent + 1, op.stride), 0)  # eq 13
    last = np.minimum((op.pad_before + in_start + in_len - 1) // op.stride, op.out_size - 1)
    return max(1, min(int(np.max(last - first + 1)), bound))


def local_step(
    op: AxisOp,
    incoming: Window,
    tau: float = 1.0,
    centre: np.ndarray | None = None,
    tight: bool = True,
) -> LocalStep:
    """Propagate an input update patch through a convolution/pooling axis.

    Exact mode (tau=1): eqs 13-16 with the border clamp of eq 31; with ``tight`` the
    uniform length is the least that covers these positions' changed outputs
    (:func:`tight_output_length`) rather than eq 14's bound for any offset, which the
    paper's per-query limit counts (``tight=False``). With tau < 1 the output patch is
    truncated to round(tau * out_size) and the input patch cropped to match
    (projective-field thresholding, eqs 21-27, always on eq 14 and 21 as tuned).

    ``centre`` (per position, input coordinates) is where the occluding patch's centre
    lies in this tensor. The crop of eq 25 keeps the cells around it, inside the incoming
    window. Without it the crop is centred on the incoming window, which near a border has
    been shifted by the clamp of eq 31 away from the patch: the crop then keeps cells the
    patch barely changed and drops the ones it changed most (a lesion under the patch
    vanished from approximate heatmaps in a band along the borders).
    """
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    extent, stride = op.extent, op.stride
    in_start, in_len = incoming.start, incoming.length

    # eq 14 / eq 21: uniform output patch length (an upper bound for every position).
    out_len = min(int(ceil_div(in_len + extent - 1, stride)), op.out_size)
    if tight and tau == 1.0:
        out_len = tight_output_length(op, in_start, in_len)

    if tau < 1.0:
        # A single changed input cell already reaches ceil(extent / stride) outputs, so no
        # centre crop can honour a smaller limit (eq 24 would give a width below 1).
        limit = max(int(round(tau * op.out_size)), int(ceil_div(extent, stride)))
        if out_len > limit:  # eq 22
            out_len = limit  # eq 23
            new_in_len = out_len * stride - extent + 1  # eq 24 (>= 1 by the floor above)
            if centre is None:
                in_start = in_start + (in_len - new_in_len) // 2  # eq 25: centre crop
            else:  # eq 25 around the patch's own centre, inside the incoming window
                wanted = np.floor(centre - (new_in_len - 1) / 2).astype(np.int64)
                in_start = np.clip(wanted, in_start, in_start + in_len - new_in_len)
            in_len = new_in_len  # eq 26

    # eq 13 / eq 27: first output whose window touches the (possibly cropped) input patch.
    out_start = np.maximum(ceil_div(op.pad_before + in_start - extent + 1, stride), 0)
    # eq 31: keep the uniform-length patch inside the output tensor.
    out_start = np.minimum(out_start, op.out_size - out_len)

    read_start = out_start * stride - op.pad_before  # eq 15
    read_len = extent + (out_len - 1) * stride  # eq 16
    return LocalStep(
        input=Window(in_start, in_len),
        read=Window(read_start, read_len),
        output=Window(out_start, out_len),
        centre=None if centre is None else project_centre(op, centre),
    )


def bounding_window(windows: list[Window], size: int) -> Window:
    """Bounding box of several update patches on the same tensor (eq 20).

    The uniform length is the largest per-position union; starts are clamped so the window
    stays inside ``[0, size)`` (the same clamp as eq 31).
    """
    if not windows:
        raise ValueError("bounding_window needs at least one window")
    low = np.minimum.reduce([w.start for w in windows])
    high = np.maximum.reduce([w.stop for w in windows])
    length = int(np.max(high - low)) if low.size else max(w.length for w in windows)
    length = min(length, size)
    return Window(np.minimum(low, size - length), length)


def padding_needed(op: AxisOp) -> tuple[int, int]:
    """Padding (low, high) so that every read-in context of ``op`` lies inside the padded input.

    The high side can exceed the operator's own padding for ceil_mode pooling, whose last
    window may hang past the padded input.
    """
    last_read_stop = (op.out_size - 1) * op.stride - op.pad_before + op.extent
    return op.pad_before, max(0, last_read_stop - op.in_size)
