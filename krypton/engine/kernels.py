"""Patched batches and their layouts: what run.py's steps hand each other.

The incremental steps index through indices compiled once per run (:mod:`.indices`);
what is left here builds naive inference's occluded batches (:func:`scatter_full`) and
moves spatial axes where an index expects them, for a whole batch of positions at once.
Tensors have any number of spatial axes (rows and columns of an image; slices, rows and
columns of a volume), and a patched tensor may keep them anywhere (NCHW, NHWC, NCDHW,
...): ``Patched.spatial_dims`` says where.
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
    # per spatial axis: (N,) window start per item, where a scatter reads them (naive's
    # occluded batches); incremental steps leave it empty, their indices are compiled
    starts: tuple[torch.Tensor, ...]
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
    if data.dim() == rank + 2 and tuple(spatial_dims) == tuple(range(2, rank + 2)):
        return data.permute(0, *range(2, rank + 2), 1)  # (N, C, *spatial): one view
    moved = canonical(data, spatial_dims)
    spatial = moved.shape[-rank:]
    flat = moved.reshape(moved.shape[0], -1, *spatial)
    return flat.permute(0, *range(2, rank + 2), 1)


def to_logical(
    context: torch.Tensor, view_shape: Sequence[int], spatial_dims: Sequence[int]
) -> torch.Tensor:
    """(N, *spatial, M) -> the node's own layout, matching the view's other dimensions."""
    rank = len(spatial_dims)
    if len(view_shape) == rank + 2 and tuple(spatial_dims) == tuple(range(2, rank + 2)):
        return context.permute(0, rank + 1, *range(1, rank + 1))  # (N, C, *spatial): one view
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
