"""Every index a run's batches read, compiled once per plan (Algorithm 1, lines 7-10).

For a geometry (the call's positions), a batch size and a device, :func:`compile_batches`
works out in numpy, for all the batches at once, where each layer reads its context
(eqs 15-16), where the update patch lands in it (eqs 17-18), which cells a merge or a copy
op takes from the patch (eq 20), and where a patch lands in the full tensor at the first
global op. The arrays cross to the device in one transfer per dtype and are cut into
per-batch views there. A batch step then only indexes: no loop over positions, no tensor
built from Python data, no host round trip (``.item()``, ``nonzero``) after compilation.

Index forms, all broadcasting to the shape they select:

* ``gather``: per spatial axis, into a spatial-last view (*spatial + padding, M), giving
  (N, *window, M);
* ``place``: one index per dimension of a tensor in its own layout (N, ..., h, ..., w,
  ...), the batch item first, that writes a patch of that layout into it as it is;
* ``values`` / ``inside``: for a context the patch only partly covers, which patch cell
  each context cell would take, and whether it takes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from .classify import PATCHED_KINDS, NodeKind, Step, first_input, flatten_nodes
from .geometry import Window, padding_needed
from .ops import LocalOpSpec
from .plan import PatchGeometry
from .program import Program

__all__ = ["Read", "NodeIndex", "BatchIndex", "compile_batches", "view_pad_value"]

# A tensor on the run's device; in a template (before the transfer) the _Token for it.
Slot = Any
Index = tuple[Slot, ...]


@dataclass
class Read:
    """How one batch reads a window of a view with its update patch superimposed."""

    gather: Index  # per spatial axis, into the spatial-last view: (N, *window, M)
    place: Index | None = None  # scatter form: (item, *cells) of the spatial-last patch
    values: Index | None = None  # overlay form: (item, *cells) into the spatial-last patch
    inside: Slot | None = None  # overlay form: (N, *window, 1) cells the patch gives
    valid: Slot | None = None  # copy ops: (N, *window, 1) cells copied, not filled


@dataclass
class NodeIndex:
    """One node's indices for one batch (only the fields its kind reads are set)."""

    read: Read | None = None  # local and copy ops: the read-in context
    divisor: Slot | None = None  # average pools: (N, 1, *out) divisor factors
    args: dict[fx.Node, Read] = field(default_factory=dict)  # merges: unaligned inputs
    statics: dict[fx.Node, Index] = field(default_factory=dict)  # full-extent statics
    full: Index | None = None  # where the patch lands in the full tensor (global ops)


@dataclass
class BatchIndex:
    """Everything one batch of positions indexes, on the run's device."""

    count: int
    nodes: dict[fx.Node, NodeIndex]


class _Token:
    """A numpy array awaiting its device tensor (per position, or shared by batches)."""

    __slots__ = ("array", "per_position", "number")

    def __init__(self, array: np.ndarray, per_position: bool, number: int):
        self.array, self.per_position, self.number = array, per_position, number


class _Arrays:
    """Collects the plan's arrays (identical ones once) and moves them to the device."""

    def __init__(self) -> None:
        self.tokens: list[_Token] = []
        self._seen: dict[tuple, _Token] = {}

    def add(self, array: np.ndarray, per_position: bool = True) -> _Token:
        key = (array.dtype.str, array.shape, per_position, array.tobytes())
        token = self._seen.get(key)
        if token is None:
            token = _Token(np.ascontiguousarray(array), per_position, len(self.tokens))
            self.tokens.append(token)
            self._seen[key] = token
        return token

    def to_device(
        self, device: torch.device, float_dtype: torch.dtype, batch_sizes: list[int]
    ) -> list[list[torch.Tensor]]:
        """Per token, one tensor per batch: one host-to-device copy per dtype, then views."""
        tensors: list[list[torch.Tensor]] = [[] for _ in self.tokens]
        groups: dict[str, list[_Token]] = {}
        for token in self.tokens:  # by dtype kind: "i" indices, "b" masks, "f" factors
            groups.setdefault(str(token.array.dtype.kind), []).append(token)
        for kind, tokens in groups.items():
            flat = np.concatenate([token.array.ravel() for token in tokens])
            buffer = torch.from_numpy(flat)
            target = float_dtype if kind == "f" else buffer.dtype
            if device.type != "cpu" or target != buffer.dtype:
                buffer = buffer.to(device=device, dtype=target)
            pieces = torch.split(buffer, [token.array.size for token in tokens])
            for token, piece in zip(tokens, pieces):
                shaped = piece.view(token.array.shape)
                if token.per_position:
                    tensors[token.number] = list(torch.split(shaped, batch_sizes))
                else:
                    tensors[token.number] = [shaped] * len(batch_sizes)
        return tensors


def _cells(window: Window) -> np.ndarray:
    """(P, length): every position's cells along one axis."""
    return window.start[:, None] + np.arange(window.length)


def _axis_shape(count: int, length: int, at: int, ndim: int) -> tuple[int, ...]:
    shape = [count] + [1] * (ndim - 1)
    shape[at] = length
    return tuple(shape)


def _gather(cells: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per axis (P, L_a) -> arrays broadcasting to (P, *L) (a spatial-last gather)."""
    rank = len(cells)
    return [
        c.reshape(_axis_shape(len(c), c.shape[1], a + 1, rank + 1)) for a, c in enumerate(cells)
    ]


def _every_axis(per_axis: Sequence[np.ndarray]) -> np.ndarray:
    """Per axis (P, L_a) booleans -> (P, *L, 1): true where they are true on every axis."""
    joint = np.ones((len(per_axis[0]), *(flags.shape[1] for flags in per_axis)), dtype=bool)
    for shaped in _gather(per_axis):
        joint &= shaped
    return joint[..., None]


def view_pad_value(spec: LocalOpSpec) -> float:
    """Padding value of the view a local op reads: its own (0 or -inf) where it reads
    padding, else 0, so ops needing no padding share the plain zero-padded view."""
    reads_padding = any(any(padding_needed(axis)) for axis in spec.axes)
    return spec.pad_value if reads_padding else 0.0


Offsets = Callable[[fx.Node, float], tuple[int, ...]]


class _Compiler:
    """One geometry's per-node index templates, tokens standing for the tensors."""

    def __init__(self, graph: Program, geometry: PatchGeometry, offsets: Offsets, sub: slice):
        self.graph, self.geometry, self.offsets, self.sub = graph, geometry, offsets, sub
        self.arrays = _Arrays()
        self.items = np.empty(0, dtype=np.int64)  # (P,) each position's place in its batch
        self.kinds = {step.node: step.kind for step in graph.steps}
        self.float_dtype = torch.float32

    def windows(self, node: fx.Node) -> tuple[Window, ...]:
        return tuple(window.take(self.sub) for window in self.geometry.windows[node])

    def _item_index(self, ndim: int) -> _Token:
        return self.arrays.add(self.items.reshape((-1,) + (1,) * (ndim - 1)))

    def gather(self, cells: Sequence[np.ndarray], offsets: Sequence[int]) -> Index:
        """A spatial-last gather of these cells (unpadded coordinates) from a view whose
        low padding per axis is ``offsets``."""
        shifted = [axis_cells + offset for axis_cells, offset in zip(cells, offsets)]
        return tuple(self.arrays.add(array) for array in _gather(shifted))

    def place(
        self, cells: Sequence[np.ndarray], shape: Sequence[int], dims: Sequence[int]
    ) -> Index:
        """Write a patch of layout ``shape`` (batch first, spatial axes at ``dims`` with
        ``cells`` per axis) into a tensor of that layout, as it is."""
        ndim, count = len(shape), len(self.items)
        index: list[Any] = []
        for dim in range(ndim):
            if dim == 0:
                index.append(self._item_index(ndim))
            elif dim in dims:
                axis_cells = cells[list(dims).index(dim)]
                shaped = axis_cells.reshape(_axis_shape(count, axis_cells.shape[1], dim, ndim))
                index.append(self.arrays.add(shaped))
            else:
                other = np.arange(shape[dim]).reshape(_axis_shape(1, shape[dim], dim, ndim))
                index.append(self.arrays.add(other, per_position=False))
        return tuple(index)

    def place_rows(self, patch: Sequence[Window], context: Sequence[np.ndarray]) -> Index:
        """Write a spatial-last patch (N, *patch, M) into a spatial-last context (N,
        *context, M) whose cells per axis are ``context``: whole rows of M values, which
        a CPU copies as blocks (an index per channel too cost 9x the time)."""
        relative = [_cells(window) - cells[:, :1] for window, cells in zip(patch, context)]
        item = self._item_index(len(context) + 1)
        return (item, *(self.arrays.add(array) for array in _gather(relative)))

    def overlay(
        self, absolute: Sequence[np.ndarray], patch: Sequence[Window], own: Sequence[Window]
    ) -> tuple[Index, Any]:
        """(values, inside) of the general read-in form (eqs 17-18): the patch cell each
        context cell at ``absolute`` would take (clamped into the patch, whose window is
        ``own``), and whether it lies in the ``patch`` window (a crop of ``own`` under
        projective-field thresholding, eqs 24-26)."""
        hits, data = [], []
        for cells, window, source in zip(absolute, patch, own):
            start = window.start[:, None]
            hits.append((cells >= start) & (cells < start + window.length))
            data.append(np.clip(cells - source.start[:, None], 0, source.length - 1))
        item = self._item_index(len(absolute) + 1)
        values = (item, *(self.arrays.add(array) for array in _gather(data)))
        return values, self.arrays.add(_every_axis(hits))

    def node(self, step: Step) -> NodeIndex | None:
        """The template of one step's indices (None where it indexes nothing)."""
        if step.kind == NodeKind.LOCAL and step.node not in self.geometry.whole:
            return self.local(step)
        if step.kind == NodeKind.REMAP:
            return self.remap(step)
        if step.kind == NodeKind.POINTWISE and step.pick is None and step.patch_call is None:
            return self.pointwise(step)
        return None

    def local(self, step: Step) -> NodeIndex:
        node, spec = step.node, step.local
        source = first_input(node)
        axis_steps = self.geometry.local_steps[node]
        read = [axis.read.take(self.sub) for axis in axis_steps]
        cells = [_cells(window) for window in read]
        own_padding = self.geometry.implicit_padding.get(node)
        if own_padding is not None:  # whole axes: read unpadded, the convolution pads them
            cells = [c[:, pad : c.shape[1] - pad] for c, pad in zip(cells, own_padding)]
        gather = self.gather(cells, self.offsets(source, view_pad_value(spec)))
        incoming = self.windows(source)
        if self.geometry.scatter_ok[node]:  # eq 18 by scatter: the patch inside its context
            context = Read(gather, place=self.place_rows(incoming, cells))
        else:
            patch = [axis.input.take(self.sub) for axis in axis_steps]
            values, inside = self.overlay(cells, patch, incoming)
            context = Read(gather, values=values, inside=inside)
        divisor = None
        if spec.divisor_map is not None:
            factors = spec.divisor_map.detach().cpu().double().numpy()
            out = [_cells(axis.output.take(self.sub)) for axis in axis_steps]
            picked = factors[tuple(_gather(out))]
            divisor = self.arrays.add(picked[:, None])
            self.float_dtype = spec.divisor_map.dtype
        return NodeIndex(read=context, divisor=divisor)

    def remap(self, step: Step) -> NodeIndex:
        """A copy op (padding of any mode, cropping): each output cell's source cell,
        the patch superimposed where that cell lies in it, the fill elsewhere."""
        source = first_input(step.node)
        incoming = self.windows(source)
        copied = [
            np.asarray(index_map)[_cells(window)]
            for index_map, window in zip(step.remap.maps, self.windows(step.node))
        ]
        clamped = [np.maximum(cells, 0) for cells in copied]
        gather = self.gather(clamped, self.offsets(source, 0.0))
        values, inside = self.overlay(clamped, incoming, incoming)
        valid = None
        if any(np.any(cells < 0) for cells in copied):
            valid = self.arrays.add(_every_axis([cells >= 0 for cells in copied]))
        return NodeIndex(read=Read(gather, values=values, inside=inside, valid=valid))

    def pointwise(self, step: Step) -> NodeIndex:
        """A merge's inputs not already on its window (eq 20), and full-extent statics
        cropped to it."""
        node = step.node
        out = self.windows(node)
        box = [_cells(window) for window in out]
        args: dict[fx.Node, Any] = {}
        for arg in step.patched_args:
            if (node, arg) in self.geometry.aligned:
                continue
            gather = self.gather(box, self.offsets(arg, 0.0))
            own = self.windows(arg)
            if (node, arg) in self.geometry.contained:  # scatter the patch into the box
                args[arg] = Read(gather, place=self.place_rows(own, box))
            else:  # bring the input to the bounding box
                values, inside = self.overlay(box, own, own)
                args[arg] = Read(gather, values=values, inside=inside)
        statics = {arg: self.gather(box, self.offsets(arg, 0.0)) for arg in step.cropped_statics}
        return NodeIndex(args=args, statics=statics)

    def materialised(self, node: fx.Node) -> Index:
        """Where ``node``'s patch lands in its full tensor (a global op reads it whole)."""
        shape = (len(self.items), *self.graph.shapes[node][1:])
        cells = [_cells(window) for window in self.windows(node)]
        return self.place(cells, shape, self.graph.dims_of(node))

    def templates(self) -> dict[fx.Node, NodeIndex]:
        """Every node's template, in execution order."""
        found: dict[fx.Node, NodeIndex] = {}
        for step in self.graph.steps:
            template = self.node(step)
            if template is not None:
                found[step.node] = template
            if step.kind in (NodeKind.GLOBAL, NodeKind.OUTPUT):
                for arg in flatten_nodes((step.node.args, step.node.kwargs)):
                    whole = self.kinds.get(arg) in PATCHED_KINDS and arg in self.graph.shapes
                    if whole and arg in self.geometry.windows:
                        found.setdefault(arg, NodeIndex()).full = self.materialised(arg)
        return found


def _resolve(value: Any, tensors: list[list[torch.Tensor]], batch: int) -> Any:
    """A template with each token replaced by its tensor for one batch."""
    if isinstance(value, _Token):
        return tensors[value.number][batch]
    if isinstance(value, tuple):
        return tuple(_resolve(item, tensors, batch) for item in value)
    if isinstance(value, dict):
        return {key: _resolve(item, tensors, batch) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {
            f.name: _resolve(getattr(value, f.name), tensors, batch)
            for f in dataclasses.fields(value)
        }
        return dataclasses.replace(value, **changes)
    return value


def compile_batches(
    graph: Program,
    geometry: PatchGeometry,
    offsets: Offsets,
    first: slice,
    device: torch.device,
) -> dict[int, BatchIndex]:
    """The indices of batches ``first``, the next one of the same length, and so on to
    the last position (shorter at the end), keyed by each batch's first position.

    Compiled once: numpy over all those positions, one transfer per dtype, then
    per-batch views on ``device``."""
    start, stop, _ = first.indices(geometry.positions)
    length = max(1, stop - start)
    count = geometry.positions - start
    sizes = [length] * (count // length) + ([count % length] if count % length else [])
    compiler = _Compiler(graph, geometry, offsets, slice(start, geometry.positions))
    compiler.items = np.arange(count, dtype=np.int64) % length
    templates = compiler.templates()
    tensors = compiler.arrays.to_device(device, compiler.float_dtype, sizes)
    return {
        start + number * length: BatchIndex(
            size, {node: _resolve(t, tensors, number) for node, t in templates.items()}
        )
        for number, size in enumerate(sizes)
    }
