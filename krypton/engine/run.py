"""Batched incremental execution (Algorithm 1, one vectorised step per layer).

For a slice of positions, every node runs once for the whole batch: local ops on read-in
contexts (eqs 17-19), copy ops through their index maps, pointwise ops on the update
patches (bounding boxes for merges, eq 20), and global ops on the full tensors scattered
together at the first of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.fx as fx

from . import ops
from .classify import NodeKind, Step, first_input, flatten_nodes
from .clock import DeviceClock
from .geometry import padding_needed
from .kernels import (
    Patched,
    gather_remapped,
    gather_windows,
    read_in_context,
    read_in_context_scatter,
    scatter_full,
    to_logical,
)
from .plan import PatchGeometry
from .program import Program
from .views import MaterializedViews

__all__ = ["run_batch", "view_pad_value"]

StartTensor = Callable[[np.ndarray], torch.Tensor]


@dataclass
class _Batch:
    """What every node of one batch reads: the graph, the values so far, the views, the
    windows, per-position start tensors and the item index."""

    graph: Program
    env: dict
    views: MaterializedViews
    geometry: PatchGeometry
    start_tensor: StartTensor
    items: torch.Tensor
    full_cache: dict
    occluder: torch.Tensor
    index: int = 0  # the step running now

    def may_overwrite(self, node: fx.Node) -> bool:
        """Whether ``node``'s patch may be overwritten by the step running now: no later
        step reads it, and its storage is neither a view's, the occluder's, nor shared
        with any other value still held (a layout op's output is a view of its input)."""
        if self.graph.last_use.get(node, -1) != self.index:
            return False
        storage = self.env[node].data.untyped_storage().data_ptr()
        if storage in self.views.storages or storage == _storage(self.occluder):
            return False
        held = [value for other, value in self.env.items() if other is not node]
        held += list(self.full_cache.values())
        return all(storage != pointer for pointer in _storages(held))


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _storages(values: list) -> list[int]:
    """Storage addresses of the tensors in these values (patches, tuples, tensors)."""
    pointers = []
    for value in values:
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, Patched):
                item = item.data
            if isinstance(item, torch.Tensor):
                pointers.append(_storage(item))
    return pointers


def view_pad_value(spec: ops.LocalOpSpec) -> float:
    """Padding value of the view a local op reads: its own (0 or -inf) where it reads
    padding, else 0, so ops needing no padding share the plain zero-padded view."""
    reads_padding = any(any(padding_needed(axis)) for axis in spec.axes)
    return spec.pad_value if reads_padding else 0.0


def run_batch(
    graph: Program,
    views: MaterializedViews,
    geometry: PatchGeometry,
    batch: slice,
    occluder: torch.Tensor,
    timings: dict[str, float] | None = None,
    clock: DeviceClock | None = None,
) -> Any:
    """The model's output for the occluded images at positions ``batch``.

    ``occluder``: (C, *patch) pixels superimposed on the image (eq 5), or
    (count, C, *patch): each position's own pixels. ``timings``: when given,
    each node's seconds are added under its name (the per-layer profile, bench.profile),
    read from ``clock`` (the device's; it waits for a card's queued kernels).
    """
    device = occluder.device
    if timings is not None and clock is None:
        clock = DeviceClock(device)
    elif timings is None:
        clock = None
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
    state = _Batch(graph, env, views, geometry, start_tensor, items, full_cache, occluder)

    def concrete(node: fx.Node) -> Any:
        value = env[node]
        if not isinstance(value, Patched):
            return value
        if node not in full_cache:
            full_cache[node] = scatter_full(value, views.values[node], items)
        return full_cache[node]

    for index, step in enumerate(graph.steps):
        node = step.node
        kind = step.kind
        state.index = index
        began = clock.now() if clock is not None else 0.0
        if kind in (NodeKind.STATIC, NodeKind.FROZEN):
            env[node] = views.values[node]
        elif kind == NodeKind.INPUT:
            windows = geometry.windows[node]
            # one occluder for every position, or one per position (N, C, *patch)
            data = (
                occluder
                if occluder.dim() == len(windows) + 2
                else occluder.unsqueeze(0).expand(count, *occluder.shape)
            )
            first_cells = tuple(start_tensor(window.start) for window in windows)
            env[node] = Patched(data, first_cells, graph.shapes[node])
        elif kind == NodeKind.LOCAL:
            env[node] = _run_local(state, step)
        elif kind == NodeKind.REMAP:
            env[node] = _run_remap(state, step)
        elif kind == NodeKind.POINTWISE:
            env[node] = _run_pointwise(state, step)
        elif kind == NodeKind.SHAPE:

            def stand_in(n: fx.Node) -> Any:
                value = env[n]
                if isinstance(value, Patched):
                    shape = (count,) + tuple(value.view_shape[1:])
                    return torch.empty(shape, dtype=value.data.dtype, device="meta")
                return value

            args = fx.node.map_arg(node.args, stand_in)
            kwargs = fx.node.map_arg(node.kwargs, stand_in)
            env[node] = step.call(args, kwargs)
        elif kind == NodeKind.GLOBAL:
            args = fx.node.map_arg(node.args, concrete)
            kwargs = fx.node.map_arg(node.kwargs, concrete)
            env[node] = step.call(args, kwargs)
        else:  # OUTPUT
            return fx.node.map_arg(node.args[0], concrete)
        if timings is not None:
            timings[node.name] = timings.get(node.name, 0.0) + clock.now() - began
        # Free what no later node reads, to keep memory bounded.
        for used in flatten_nodes((node.args, node.kwargs)):
            if graph.last_use.get(used, -1) <= index:
                env.pop(used, None)
                full_cache.pop(used, None)
    raise AssertionError("graph has no output node")  # pragma: no cover


def _starts(batch: _Batch, windows) -> tuple[torch.Tensor, ...]:
    """Per spatial axis, the batch's window starts as tensors."""
    return tuple(batch.start_tensor(window.start) for window in windows)


def _run_local(batch: _Batch, step: Step) -> Patched:
    graph, env, views, geometry = batch.graph, batch.env, batch.views, batch.geometry
    spec = step.local
    source_node = first_input(step.node)
    source: Patched = env[source_node]
    if step.node in geometry.whole:  # the patch is the whole tensor: as in full inference
        args = fx.node.map_arg(step.node.args, lambda n: _plain(env[n]))
        kwargs = fx.node.map_arg(step.node.kwargs, lambda n: _plain(env[n]))
        output = step.call(args, kwargs)
        return Patched(output, source.starts, graph.shapes[step.node])
    axis_steps = geometry.local_steps[step.node]
    padded, offsets = views.spatial(source_node, view_pad_value(spec))
    read_starts = _starts(batch, [a.read for a in axis_steps])
    read_lengths = [a.read.length for a in axis_steps]
    own_padding = geometry.implicit_padding.get(step.node)
    if own_padding is not None:  # whole axes: read unpadded, the convolution pads them
        read_starts = tuple(start + pad for start, pad in zip(read_starts, own_padding))
        read_lengths = [length - 2 * pad for length, pad in zip(read_lengths, own_padding)]
    if geometry.scatter_ok[step.node]:
        context = read_in_context_scatter(
            padded, read_starts, offsets, read_lengths, source, batch.items
        )
    else:
        context = read_in_context(
            padded,
            read_starts,
            offsets,
            read_lengths,
            source,
            _starts(batch, [a.input for a in axis_steps]),
            [a.input.length for a in axis_steps],
            batch.items,
        )
    rank = len(axis_steps)
    channels_first = (0, rank + 1, *range(1, rank + 1))
    context = context.permute(channels_first)
    output = (  # eq 19, on the whole batch
        spec.apply(context) if own_padding is None else spec.apply(context, own_padding)
    )
    out_starts = _starts(batch, [a.output for a in axis_steps])
    if spec.divisor_map is not None:
        out_lengths = [a.output.length for a in axis_steps]
        factor = gather_windows(spec.divisor_map.unsqueeze(-1), out_starts, out_lengths)
        output = output * factor.permute(channels_first)
    return Patched(output, out_starts, graph.shapes[step.node])


def _plain(value: Any) -> Any:
    """A patch's data where the patch is the whole tensor; other values as they are."""
    return value.data if isinstance(value, Patched) else value


def _run_remap(batch: _Batch, step: Step) -> Patched:
    graph, env, views, geometry = batch.graph, batch.env, batch.views, batch.geometry
    source_node = first_input(step.node)
    source: Patched = env[source_node]
    view, _ = views.spatial(source_node)
    windows = geometry.windows[step.node]
    out_starts = _starts(batch, windows)
    device = batch.items.device
    source_cells = [
        index_map[start.unsqueeze(1) + torch.arange(window.length, device=device)]
        for index_map, start, window in zip(
            graph.remap_maps(step.node, device), out_starts, windows
        )
    ]
    context = gather_remapped(view, source_cells, source, step.remap.fill, batch.items)
    shape = graph.shapes[step.node]
    return Patched(
        to_logical(context, shape, step.spatial_dims), out_starts, shape, step.spatial_dims
    )


def _run_pointwise(batch: _Batch, step: Step) -> Any:
    graph, env, views, geometry = batch.graph, batch.env, batch.views, batch.geometry
    items = batch.items
    node = step.node
    shape = graph.shapes.get(node)
    if step.pick is not None:  # one piece of a split
        return env[step.patched_args[0]][step.pick]
    windows = geometry.windows[node]
    out_starts = _starts(batch, windows)
    out_lengths = [window.length for window in windows]
    if step.patch_call is not None:  # layout op on a single, aligned patch
        data = step.patch_call(env[step.patched_args[0]].data)
        return Patched(data, out_starts, shape, step.spatial_dims)
    replacements: dict[fx.Node, Any] = {}
    for arg in step.patched_args:
        value: Patched = env[arg]
        if (node, arg) in geometry.aligned:
            replacements[arg] = value.data
            continue
        source, offsets = views.spatial(arg)
        if (node, arg) in geometry.contained:  # merge, input inside the bounding box
            context = read_in_context_scatter(
                source, out_starts, offsets, out_lengths, value, items
            )
        else:  # merge: bring the input to the bounding box (eq 20)
            context = read_in_context(
                source,
                out_starts,
                offsets,
                out_lengths,
                value,
                value.starts,
                value.lengths,
                items,
            )
        replacements[arg] = to_logical(context, value.view_shape, value.spatial_dims or ())
    for arg in step.cropped_statics:
        source, offsets = views.spatial(arg)
        shifted = [start + offset for start, offset in zip(out_starts, offsets)]
        context = gather_windows(source, shifted, out_lengths)
        replacements[arg] = to_logical(context, graph.shapes[arg], graph.dims_of(arg))
    args = fx.node.map_arg(node.args, lambda n: replacements.get(n, env[n]))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: replacements.get(n, env[n]))
    call = step.call
    if step.in_place_call is not None:
        written = cast(fx.Node, node.args[0])  # the op's only tensor input (graph.py)
        if (node, written) in geometry.aligned and batch.may_overwrite(written):
            call = step.in_place_call  # same values, without a new tensor
    output = call(args, kwargs)
    if isinstance(output, (tuple, list)):  # a split: one patch per piece
        return tuple(
            Patched(piece, out_starts, piece_shape, step.spatial_dims)
            for piece, piece_shape in zip(output, step.element_shapes)
        )
    return Patched(output, out_starts, shape, step.spatial_dims)
