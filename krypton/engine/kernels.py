"""Vectorised gather/scatter primitives: the batched form of Algorithm 1, lines 7-10.

Every function works on a whole batch of positions at once (one advanced-indexing call,
no loop over items). A patched tensor may keep its spatial dimensions anywhere (NCHW,
NHWC, ...): ``Patched.spatial_dims`` says where rows and columns are, and these kernels
move them to the end only where they index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "Patched",
    "canonical",
    "spatial_last",
    "to_logical",
    "gather_windows",
    "read_in_context",
    "read_in_context_scatter",
    "gather_remapped",
    "scatter_full",
]


@dataclass
class Patched:
    """A batch of tensors equal to a node's view except inside one window per item.

    ``data`` keeps the node's own layout with the batch first: (N, ..., h, ..., w, ...),
    rows at ``spatial_dims[0]`` and columns at ``spatial_dims[1]``.
    """

    data: torch.Tensor
    rows: torch.Tensor  # (N,) window start row per item
    cols: torch.Tensor  # (N,) window start column per item
    view_shape: tuple[int, ...]  # (1, ...) full shape of the view supplying the other cells
    spatial_dims: tuple[int, int] | None = None  # default: the last two dimensions

    def __post_init__(self) -> None:
        if self.spatial_dims is None:
            ndim = len(self.view_shape)
            self.spatial_dims = (ndim - 2, ndim - 1)


def canonical(tensor: torch.Tensor, spatial_dims: tuple[int, int]) -> torch.Tensor:
    """A view with rows and columns moved last: (N, *other, H, W)."""
    return tensor.movedim(spatial_dims, (-2, -1))


def spatial_last(data: torch.Tensor, spatial_dims: tuple[int, int]) -> torch.Tensor:
    """(N, ..., h, ..., w, ...) -> (N, h, w, M), M the other dimensions flattened."""
    moved = canonical(data, spatial_dims)
    count, height, width = moved.shape[0], moved.shape[-2], moved.shape[-1]
    return moved.reshape(count, -1, height, width).permute(0, 2, 3, 1)


def to_logical(
    context: torch.Tensor, view_shape: tuple[int, ...], spatial_dims: tuple[int, int]
) -> torch.Tensor:
    """(N, h, w, M) -> the node's own layout, matching the view's other dimensions."""
    count, height, width = context.shape[:3]
    other = [size for dim, size in enumerate(view_shape) if dim != 0 and dim not in spatial_dims]
    moved = context.permute(0, 3, 1, 2).reshape(count, *other, height, width)
    return moved.movedim((-2, -1), spatial_dims)


def gather_windows(
    source: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, height: int, width: int
) -> torch.Tensor:
    """Slice a (H, W, M) tensor at a per-item window: (N, height, width, M), eq 17."""
    row_index = rows.unsqueeze(1) + torch.arange(height, device=rows.device)
    col_index = cols.unsqueeze(1) + torch.arange(width, device=cols.device)
    return source[row_index[:, :, None], col_index[:, None, :]]


def _overlay(
    context: torch.Tensor,
    absolute_rows: torch.Tensor,
    absolute_cols: torch.Tensor,
    source: Patched,
    patch_rows: torch.Tensor,
    patch_height: int,
    patch_cols: torch.Tensor,
    patch_width: int,
    items: torch.Tensor,
) -> torch.Tensor:
    """Where the absolute cell lies in the given patch window, take the patch's value."""
    in_rows = (absolute_rows >= patch_rows.unsqueeze(1)) & (
        absolute_rows < (patch_rows + patch_height).unsqueeze(1)
    )
    in_cols = (absolute_cols >= patch_cols.unsqueeze(1)) & (
        absolute_cols < (patch_cols + patch_width).unsqueeze(1)
    )
    data_height, data_width = (source.data.shape[d] for d in source.spatial_dims)
    data_rows = (absolute_rows - source.rows.unsqueeze(1)).clamp(0, data_height - 1)
    data_cols = (absolute_cols - source.cols.unsqueeze(1)).clamp(0, data_width - 1)
    patch = spatial_last(source.data, source.spatial_dims)
    values = patch[items[:, None, None], data_rows[:, :, None], data_cols[:, None, :]]
    inside = (in_rows[:, :, None] & in_cols[:, None, :]).unsqueeze(-1)
    return torch.where(inside, values, context)


def read_in_context(
    padded: torch.Tensor,
    read_rows: torch.Tensor,
    read_cols: torch.Tensor,
    top: int,
    left: int,
    height: int,
    width: int,
    source: Patched,
    patch_rows: torch.Tensor,
    patch_height: int,
    patch_cols: torch.Tensor,
    patch_width: int,
    items: torch.Tensor,
) -> torch.Tensor:
    """Read-in context with the update patch superimposed (eqs 17-18), general form.

    ``padded`` is the (H+pad, W+pad, M) view; read windows are in unpadded coordinates.
    Only patch cells inside the given patch window are superimposed (projective-field
    thresholding passes a centre-cropped window, eqs 24-26).
    """
    context = gather_windows(padded, read_rows + top, read_cols + left, height, width)
    absolute_rows = read_rows.unsqueeze(1) + torch.arange(height, device=read_rows.device)
    absolute_cols = read_cols.unsqueeze(1) + torch.arange(width, device=read_cols.device)
    return _overlay(
        context,
        absolute_rows,
        absolute_cols,
        source,
        patch_rows,
        patch_height,
        patch_cols,
        patch_width,
        items,
    )


def read_in_context_scatter(
    padded: torch.Tensor,
    read_rows: torch.Tensor,
    read_cols: torch.Tensor,
    top: int,
    left: int,
    height: int,
    width: int,
    source: Patched,
    items: torch.Tensor,
) -> torch.Tensor:
    """Read-in context when every patch lies inside its context (eqs 17-18, fast form).

    Gathers the context from the view, then writes the whole patch at its per-item offset:
    cheaper than the general form because only the patch cells are touched twice.
    """
    context = gather_windows(padded, read_rows + top, read_cols + left, height, width)
    patch = spatial_last(source.data, source.spatial_dims)
    patch_h, patch_w = patch.shape[1:3]
    row_index = (source.rows - read_rows).unsqueeze(1) + torch.arange(patch_h, device=items.device)
    col_index = (source.cols - read_cols).unsqueeze(1) + torch.arange(patch_w, device=items.device)
    context[items[:, None, None], row_index[:, :, None], col_index[:, None, :]] = patch
    return context


def gather_remapped(
    view: torch.Tensor,
    source_rows: torch.Tensor,
    source_cols: torch.Tensor,
    source: Patched,
    fill: float,
    items: torch.Tensor,
) -> torch.Tensor:
    """Output cells that copy one input cell each (padding of any mode, cropping).

    ``view``: the (H, W, M) input view; ``source_rows`` (N, h) and ``source_cols`` (N, w):
    the input cell each output cell copies, -1 for a cell filled with ``fill``. The
    incoming patch is superimposed where a copied cell lies in it. Returns (N, h, w, M).
    """
    rows = source_rows.clamp(min=0)
    cols = source_cols.clamp(min=0)
    context = view[rows[:, :, None], cols[:, None, :]]
    patch_height, patch_width = (source.data.shape[d] for d in source.spatial_dims)
    context = _overlay(
        context, rows, cols, source, source.rows, patch_height, source.cols, patch_width, items
    )
    valid = ((source_rows >= 0)[:, :, None] & (source_cols >= 0)[:, None, :]).unsqueeze(-1)
    return torch.where(valid, context, torch.full_like(context, fill))


def scatter_full(value: Patched, view: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
    """Materialise a patched batch: copies of the view with each patch written in place."""
    count = value.data.shape[0]
    # Always a fresh copy: ``expand(1, ...).contiguous()`` would return ``view`` itself for
    # a batch of one, and the patch would be written into the cached view (or the
    # caller's image).
    full = view.expand(count, *view.shape[1:]).clone(memory_format=torch.contiguous_format)
    dims = value.spatial_dims
    patch = canonical(value.data, dims)  # (N, *other, h, w)
    height, width = patch.shape[-2:]
    row_index = value.rows.unsqueeze(1) + torch.arange(height, device=items.device)
    col_index = value.cols.unsqueeze(1) + torch.arange(width, device=items.device)
    target = canonical(full, dims)  # a view into ``full``, any layout
    # Advanced indices around the other dimensions put (N, h, w) first, then the others.
    target[items[:, None, None], ..., row_index[:, :, None], col_index[:, None, :]] = patch.movedim(
        (-2, -1), (1, 2)
    )
    return full
