"""Batched incremental execution (Algorithm 1, one vectorised step per layer).

For a slice of positions, every node runs once for the whole batch: local ops on read-in
contexts (eqs 17-19), copy ops through their index maps, pointwise ops on the update
patches (bounding boxes for merges, eq 20), and global ops on the full tensors scattered
together at the first of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.fx as fx

from .classify import NodeKind, Step, first_input, flatten_nodes
from .clock import DeviceClock
from .indices import BatchIndex, NodeIndex, Read, compile_batches, view_pad_value
from .kernels import Patched, spatial_last, to_logical
from .plan import PatchGeometry
from .program import Program
from .views import MaterializedViews

__all__ = ["run_batch", "view_pad_value", "batch_index"]


@dataclass
class _Batch:
    """What every node of one batch reads: the graph, the values so far, the views, the
    batch's compiled indices and the materialised tensors."""

    graph: Program
    env: dict
    views: MaterializedViews
    geometry: PatchGeometry
    indices: BatchIndex
    full_cache: dict
    occluder: torch.Tensor
    index: int = 0  # the step running now

    def of(self, node: fx.Node) -> NodeIndex:
        return self.indices.nodes[node]

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


def batch_index(
    graph: Program, views: MaterializedViews, geometry: PatchGeometry, batch: slice, device
) -> BatchIndex:
    """The compiled indices of positions ``batch`` (:mod:`.indices`): compiled on the
    first batch of a run for it and every later batch of its length, then looked up. A
    run whose batches are cut into shards (:mod:`krypton.schedule`) keeps both layouts,
    each compiled once."""
    start, stop, _ = batch.indices(geometry.positions)
    layouts = geometry.compiled.setdefault(str(device), {})  # batch length -> first -> index
    for layout in list(layouts.values()):
        known = layout.get(start)
        if known is not None and known.count == stop - start:
            return known
    fresh = compile_batches(
        graph,
        geometry,
        lambda node, pad: views.spatial(node, pad)[1],
        slice(start, stop),
        torch.device(device),
    )
    layouts.setdefault(stop - start, {}).update(fresh)
    return fresh[start]


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
    indices = batch_index(graph, views, geometry, batch, device)
    count = indices.count
    env: dict[fx.Node, Any] = {}
    full_cache: dict[fx.Node, torch.Tensor] = {}
    state = _Batch(graph, env, views, geometry, indices, full_cache, occluder)

    def concrete(node: fx.Node) -> Any:
        value = env[node]
        if not isinstance(value, Patched):
            return value
        if node not in full_cache:
            full_cache[node] = _materialise(value, views.values[node], state.of(node))
        return full_cache[node]

    for index, step in enumerate(graph.steps):
        node = step.node
        kind = step.kind
        state.index = index
        began = clock.now() if clock is not None else 0.0
        if kind in (NodeKind.STATIC, NodeKind.FROZEN):
            env[node] = views.values[node]
        elif kind == NodeKind.INPUT:
            # one occluder for every position, or one per position (N, C, *patch)
            data = (
                occluder
                if occluder.dim() == len(graph.dims_of(node)) + 2
                else occluder.expand(count, *occluder.shape)
            )
            env[node] = Patched(data, (), graph.shapes[node], graph.dims_of(node))
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


def _same_dtype(patch: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The patch in the target's dtype (autocast: bf16 written into fp32), no op if equal."""
    return patch if patch.dtype == target.dtype else patch.to(target.dtype)


def _materialise(value: Patched, view: torch.Tensor, index: NodeIndex) -> torch.Tensor:
    """A patched batch in full: copies of the view with each patch written in place.

    Always a fresh tensor (``repeat``): the patch must never land in the cached view."""
    full = view.repeat(value.data.shape[0], *([1] * (view.dim() - 1)))
    assert index.full is not None
    full.index_put_(index.full, _same_dtype(value.data, full))
    return full


def _read_in(view: torch.Tensor, read: Read, source: Patched) -> torch.Tensor:
    """The spatial-last context (N, *window, M) gathered from ``view`` with the update
    patch superimposed (eqs 17-18): written in as whole rows where the patch lies inside
    the context, else taken cell by cell where it covers the context."""
    context = view[read.gather]
    patch = _same_dtype(spatial_last(source.data, source.spatial_dims or ()), context)
    if read.place is not None:
        context.index_put_(read.place, patch)
        return context
    assert read.values is not None and read.inside is not None
    return torch.where(read.inside, patch[read.values], context)


def _run_local(batch: _Batch, step: Step) -> Patched:
    graph, env, views, geometry = batch.graph, batch.env, batch.views, batch.geometry
    spec = step.local
    source_node = first_input(step.node)
    source: Patched = env[source_node]
    if step.node in geometry.whole:  # the patch is the whole tensor: as in full inference
        args = fx.node.map_arg(step.node.args, lambda n: _plain(env[n]))
        kwargs = fx.node.map_arg(step.node.kwargs, lambda n: _plain(env[n]))
        output = step.call(args, kwargs)
        return Patched(output, (), graph.shapes[step.node], graph.dims_of(step.node))
    index = batch.of(step.node)
    read = index.read
    assert read is not None
    padded, _ = views.spatial(source_node, view_pad_value(spec))
    context = _read_in(padded, read, source)  # (N, *context, M), eqs 17-18
    rank = context.dim() - 2
    channels_first = context.permute(0, rank + 1, *range(1, rank + 1))
    own_padding = geometry.implicit_padding.get(step.node)
    output = (  # eq 19, on the whole batch
        spec.apply(channels_first)
        if own_padding is None
        else spec.apply(channels_first, own_padding)
    )
    if index.divisor is not None:
        output = output * index.divisor
    return Patched(output, (), graph.shapes[step.node], graph.dims_of(step.node))


def _plain(value: Any) -> Any:
    """A patch's data where the patch is the whole tensor; other values as they are."""
    return value.data if isinstance(value, Patched) else value


def _run_remap(batch: _Batch, step: Step) -> Patched:
    graph, env, views = batch.graph, batch.env, batch.views
    source_node = first_input(step.node)
    read = batch.of(step.node).read
    assert read is not None
    view, _ = views.spatial(source_node)
    context = _read_in(view, read, env[source_node])
    if read.valid is not None:
        context = torch.where(read.valid, context, step.remap.fill)
    shape = graph.shapes[step.node]
    dims = graph.dims_of(step.node)
    return Patched(to_logical(context, shape, dims), (), shape, dims)


def _run_pointwise(batch: _Batch, step: Step) -> Any:
    graph, env, views, geometry = batch.graph, batch.env, batch.views, batch.geometry
    node = step.node
    shape = graph.shapes.get(node)
    if step.pick is not None:  # one piece of a split
        return env[step.patched_args[0]][step.pick]
    if step.patch_call is not None:  # layout op on a single, aligned patch
        data = step.patch_call(env[step.patched_args[0]].data)
        return Patched(data, (), shape, graph.dims_of(node))
    index = batch.of(node)
    replacements: dict[fx.Node, Any] = {}
    for arg in step.patched_args:
        value: Patched = env[arg]
        if (node, arg) in geometry.aligned:
            replacements[arg] = value.data
            continue
        source, _ = views.spatial(arg)  # a merge: the input brought to its box (eq 20)
        context = _read_in(source, index.args[arg], value)
        replacements[arg] = to_logical(context, value.view_shape, value.spatial_dims or ())
    for arg in step.cropped_statics:
        source, _ = views.spatial(arg)
        context = source[index.statics[arg]]
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
            Patched(piece, (), piece_shape, graph.dims_of(node))
            for piece, piece_shape in zip(output, step.element_shapes)
        )
    return Patched(output, (), shape, graph.dims_of(node))
