"""Vectorised gather/scatter primitives: the batched form of Algorithm 1, lines 7-10.

Every function works on a whole batch of positions at once (one advanced-indexing call,
no loop over items). Tensors have any number of spatial axes (rows and columns of an
image; slices, rows and columns of a volume), and a patched tensor may keep them anywhere
(NCHW, NHWC, NCDHW, ...): ``Patched.spatial_dims`` says where, and these kernels move
them to the end only where they index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Patched",
    "canonical",
    "spatial_last",
    "to_logical",
    "window_index",
    "gather_windows",
    "read_in_context",
    "read_in_context_scatter",
    "gather_remapped",
    "scatter_full",
]

Starts = Sequence[torch.Tensor]  # one (N,) start tensor per spatial axis


@dataclass
class Patched:
    """A batch of tensors equal to a node's view except inside one window per item.

    ``data`` keeps the node's own layout with the batch first: (N, ..., h, ..., w, ...);
    spatial axis ``a`` is at ``spatial_dims[a]`` and its window starts at ``starts[a]``.
    """

    data: torch.Tensor
    starts: tuple[torch.Tensor, ...]  # per spatial axis: (N,) window start per item
    view_shape: tuple[int, ...]  # (1, ...) full shape of the view supplying the other cells
    spatial_dims: tuple[int, ...] | None = None  # default: the last len(starts) dimensions

    def __post_init__(self) -> None:
        self.starts = tuple(self.starts)
        if self.spatial_dims is None:
            ndim, rank = len(self.view_shape), len(self.starts)
            self.spatial_dims = tuple(range(ndim - rank, ndim))

    @property
    def lengths(self) -> tuple[int, ...]:
        """The window's extent along each spatial axis."""
        return tuple(self.data.shape[d] for d in self.spatial_dims or ())


def _last(rank: int) -> tuple[int, ...]:
    return tuple(range(-rank, 0))


def canonical(tensor: torch.Tensor, spatial_dims: Sequence[int]) -> torch.Tensor:
    """A view with the spatial axes moved last: (N, *other, *spatial)."""
    return tensor.movedim(tuple(spatial_dims), _last(len(spatial_dims)))


def spatial_last(data: torch.Tensor, spatial_dims: Sequence[int]) -> torch.Tensor:
    """(N, ..., h, ..., w, ...) -> (N, *spatial, M), M the other dimensions flattened."""
    rank = len(spatial_dims)
    moved = canonical(data, spatial_dims)
    spatial = moved.shape[-rank:]
    flat = moved.reshape(moved.shape[0], -1, *spatial)
    return flat.permute(0, *range(2, rank + 2), 1)


def to_logical(
    context: torch.Tensor, view_shape: Sequence[int], spatial_dims: Sequence[int]
) -> torch.Tensor:
    """(N, *spatial, M) -> the node's own layout, matching the view's other dimensions."""
    rank = len(spatial_dims)
    count, spatial = context.shape[0], context.shape[1 : rank + 1]
    other = [size for dim, size in enumerate(view_shape) if dim != 0 and dim not in spatial_dims]
    moved = context.permute(0, rank + 1, *range(1, rank + 1)).reshape(count, *other, *spatial)
    return moved.movedim(_last(rank), tuple(spatial_dims))


def _ranges(starts: Starts, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Per axis, the (N, length) absolute coordinates of each item's window."""
    return [
        start.unsqueeze(1) + torch.arange(length, device=start.device)
        for start, length in zip(starts, lengths)
    ]


def _broadcast(per_axis: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(N, l_a) per axis -> index tensors that broadcast to (N, l_0, ..., l_k-1)."""
    rank = len(per_axis)
    shaped = []
    for axis, index in enumerate(per_axis):
        shape = [index.shape[0]] + [1] * rank
        shape[axis + 1] = index.shape[1]
        shaped.append(index.view(shape))
    return tuple(shaped)


def window_index(starts: Starts, lengths: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Index tensors selecting each item's window: they broadcast to (N, *lengths)."""
    return _broadcast(_ranges(starts, lengths))


def _items(items: torch.Tensor, rank: int) -> torch.Tensor:
    return items.view(-1, *([1] * rank))


def gather_windows(source: torch.Tensor, starts: Starts, lengths: Sequence[int]) -> torch.Tensor:
    """Slice a (*spatial, M) tensor at a per-item window: (N, *lengths, M), eq 17."""
    return source[window_index(starts, lengths)]


def _overlay(
    context: torch.Tensor,
    absolute: Sequence[torch.Tensor],
    source: Patched,
    patch_starts: Starts,
    patch_lengths: Sequence[int],
    items: torch.Tensor,
) -> torch.Tensor:
    """Where the absolute cell lies in the given patch window, take the patch's value."""
    inside_axes = [
        (cells >= start.unsqueeze(1)) & (cells < (start + length).unsqueeze(1))
        for cells, start, length in zip(absolute, patch_starts, patch_lengths)
    ]
    data_axes = [
        (cells - start.unsqueeze(1)).clamp(0, size - 1)
        for cells, start, size in zip(absolute, source.starts, source.lengths)
    ]
    patch = spatial_last(source.data, source.spatial_dims or ())
    values = patch[(_items(items, len(absolute)), *_broadcast(data_axes))]
    inside = _broadcast(inside_axes)
    mask = inside[0]
    for axis_mask in inside[1:]:
        mask = mask & axis_mask
    return torch.where(mask.unsqueeze(-1), values, context)


def read_in_context(
    padded: torch.Tensor,
    read_starts: Starts,
    offsets: Sequence[int],
    lengths: Sequence[int],
    source: Patched,
    patch_starts: Starts,
    patch_lengths: Sequence[int],
    items: torch.Tensor,
) -> torch.Tensor:
    """Read-in context with the update patch superimposed (eqs 17-18), general form.

    ``padded`` is the (*spatial + padding, M) view, its low padding per axis ``offsets``;
    read windows are in unpadded coordinates. Only patch cells inside the given patch
    window are superimposed (projective-field thresholding passes a centre-cropped window,
    eqs 24-26).
    """
    shifted = [start + offset for start, offset in zip(read_starts, offsets)]
    context = gather_windows(padded, shifted, lengths)
    absolute = _ranges(read_starts, lengths)
    return _overlay(context, absolute, source, patch_starts, patch_lengths, items)


def read_in_context_scatter(
    padded: torch.Tensor,
    read_starts: Starts,
    offsets: Sequence[int],
    lengths: Sequence[int],
    source: Patched,
    items: torch.Tensor,
) -> torch.Tensor:
    """Read-in context when every patch lies inside its context (eqs 17-18, fast form).

    Gathers the context from the view, then writes the whole patch at its per-item offset:
    cheaper than the general form because only the patch cells are touched twice.
    """
    shifted = [start + offset for start, offset in zip(read_starts, offsets)]
    context = gather_windows(padded, shifted, lengths)
    patch = spatial_last(source.data, source.spatial_dims or ())
    rank = len(lengths)
    relative = [start - read for start, read in zip(source.starts, read_starts)]
    index = window_index(relative, patch.shape[1 : rank + 1])
    context[(_items(items, rank), *index)] = patch.to(context.dtype)  # autocast: bf16 into fp32
    return context


def gather_remapped(
    view: torch.Tensor,
    source_cells: Sequence[torch.Tensor],
    source: Patched,
    fill: float,
    items: torch.Tensor,
) -> torch.Tensor:
    """Output cells that copy one input cell each (padding of any mode, cropping).

    ``view``: the (*spatial, M) input view; ``source_cells``: per axis, the (N, l) input
    coordinate each output cell copies, -1 for a cell filled with ``fill``. The incoming
    patch is superimposed where a copied cell lies in it. Returns (N, *l, M).
    """
    clamped = [cells.clamp(min=0) for cells in source_cells]
    context = view[_broadcast(clamped)]
    context = _overlay(context, clamped, source, source.starts, source.lengths, items)
    valid_axes = _broadcast([cells >= 0 for cells in source_cells])
    valid = valid_axes[0]
    for axis_valid in valid_axes[1:]:
        valid = valid & axis_valid
    return torch.where(valid.unsqueeze(-1), context, torch.full_like(context, fill))


def scatter_full(value: Patched, view: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Materialise a patched batch: copies of the view with each patch written in place."""
    count = value.data.shape[0]
    # Always a fresh copy: ``expand(1, ...).contiguous()`` would return ``view`` itself for
    # a batch of one, and the patch would be written into the cached view (or the
    # caller's image).
    full = view.expand(count, *view.shape[1:]).clone(memory_format=torch.contiguous_format)
    dims = value.spatial_dims or ()
    rank = len(dims)
    patch = canonical(value.data, dims)  # (N, *other, *window)
    index = window_index(value.starts, patch.shape[-rank:])
    target = canonical(full, dims)  # a view into ``full``, any layout
    # Advanced indices around the other dimensions put (N, *window) first, then the others.
    where: tuple[Any, ...] = (_items(items, rank), Ellipsis, *index)
    target[where] = patch.movedim(_last(rank), tuple(range(1, rank + 1))).to(target.dtype)
    return full
