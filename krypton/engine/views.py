"""Materialised views: the unoccluded image's tensors that incremental inference reads.

:class:`StreamingInterpreter` runs the captured graph once, the way
``torch/fx/passes/shape_prop.py`` does, and hands every value to a callback when it is
computed and again when its last user has run and it is freed — so views are built while
the tensors stream past and peak memory stays that of ordinary inference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .kernels import canonical

__all__ = ["MaterializedViews", "StreamingInterpreter", "build_views"]


@dataclass
class MaterializedViews:
    """The tensors of the unoccluded image that incremental inference reads (the views).

    Only what some consumer reads is kept, in the layout it reads: spatial-last copies
    (H + pad, W + pad, M), or (D + pad, H + pad, W + pad, M) for a volume, for read-in
    contexts — one per node and padding value, padded
    for its most demanding consumer — and plain tensors where a batch is materialised.
    """

    image_shape: tuple[int, ...]
    values: dict[fx.Node, Any]  # static values and views materialised in full
    padded: dict[tuple[fx.Node, float], tuple[torch.Tensor, tuple[int, ...]]]
    logits: torch.Tensor

    def _tensors(self) -> list[torch.Tensor]:
        tensors = [t for t in self.values.values() if isinstance(t, torch.Tensor)]
        return tensors + [padded for padded, _ in self.padded.values()]

    @property
    def nbytes(self) -> int:
        """Bytes the views hold (each tensor's storage counted once)."""
        storages = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._tensors()
        }
        return int(sum(storages.values()))

    @functools.cached_property
    def storages(self) -> frozenset[int]:
        """Addresses of the storages the views hold: what a run must never overwrite."""
        return frozenset(t.untyped_storage().data_ptr() for t in self._tensors())

    def spatial(
        self, node: fx.Node, pad_value: float = 0.0
    ) -> tuple[torch.Tensor, tuple[int, ...]]:
        """(padded spatial-last view, low padding per spatial axis) of ``node``."""
        return self.padded[(node, pad_value)]


class _ReleasingEnv(dict):
    """The interpreter's value table; deleting a value (its last use) reports it."""

    def __init__(self, on_release: Callable[[fx.Node, Any], None]):
        super().__init__()
        self.on_release = on_release

    def __delitem__(self, node: fx.Node) -> None:
        value = self[node]
        super().__delitem__(node)
        self.on_release(node, value)


class StreamingInterpreter(fx.Interpreter):
    """Batch-1 inference over the graph with a hook on every value and every release.

    Call nodes run through ``calls`` (out-of-place versions: cached tensors must never be
    written), not through the graph's own targets.
    """

    def __init__(
        self,
        module: fx.GraphModule,
        calls: dict[fx.Node, Callable[[tuple, dict], Any] | None],
        on_value: Callable[[fx.Node, Any, dict], None],
        on_release: Callable[[fx.Node, Any], None],
    ):
        super().__init__(module, garbage_collect_values=True)
        self.extra_traceback = False  # errors keep their own message
        self.calls = calls
        self.on_value = on_value
        self.on_release = on_release

    def run_node(self, node: fx.Node) -> Any:
        if node.op in ("call_module", "call_function", "call_method"):
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            value = self.calls[node](args, kwargs)
        else:
            value = super().run_node(node)
        self.env[node] = value  # visible to on_value before run() stores it
        self.on_value(node, value, self.env)
        return value

    def stream(self, image: torch.Tensor) -> Any:
        """Run on one image (C, H, W) or volume (C, D, H, W); every value still held at
        the end is released."""
        env = _ReleasingEnv(self.on_release)
        output = self.run(image.unsqueeze(0), initial_env=env, enable_io_processing=False)
        for node in list(env):
            del env[node]
        return output


def build_views(
    image: torch.Tensor,
    module: fx.GraphModule,
    calls: dict[fx.Node, Callable[[tuple, dict], Any] | None],
    keep_whole: Callable[[fx.Node], bool],
    padding_needs: dict[fx.Node, dict[float, list[tuple[int, int]]]],
    spatial_dims: Callable[[fx.Node], tuple[int, ...]],
    on_value: Callable[[fx.Node, Any, dict], None] | None = None,
) -> MaterializedViews:
    """One streaming inference that keeps exactly the views incremental runs read.

    ``padding_needs`` and ``keep_whole`` are consulted when a value is released, so a
    first pass may fill them in through ``on_value`` (capture classifies as it streams).
    ``padding_needs``: per node and pad value, (low, high) padding per spatial axis.
    """
    kept: dict[fx.Node, Any] = {}
    padded: dict[tuple[fx.Node, float], tuple[torch.Tensor, tuple[int, ...]]] = {}

    def release(node: fx.Node, value: Any) -> None:
        if keep_whole(node):
            kept[node] = value
        needs = padding_needs.get(node)
        if not needs:
            return
        dims = spatial_dims(node)
        rank = len(dims)
        flat = canonical(value, dims)
        flat = flat.reshape(-1, *flat.shape[-rank:])
        for pad_value, pads in needs.items():
            grown = flat
            if any(low or high for low, high in pads):
                widths = [width for pair in reversed(pads) for width in pair]  # last axis first
                grown = F.pad(flat, widths, value=pad_value)
            spatial_last = grown.permute(*range(1, rank + 1), 0).contiguous()
            padded[(node, pad_value)] = (spatial_last, tuple(low for low, _ in pads))

    on_value = on_value or (lambda node, value, env: None)
    logits = StreamingInterpreter(module, calls, on_value, release).stream(image)
    return MaterializedViews(tuple(image.shape), kept, padded, logits)
