"""Shared check: incremental logits equal full re-inference for given positions."""

import copy

import numpy as np
import torch

from krypton.engine import IncrementalGraph, scatter_full
from krypton.engine.kernels import Patched


def occluded_batch(image: torch.Tensor, occluder: torch.Tensor, *starts) -> torch.Tensor:
    """Full occluded images or volumes (eq 5), built independently of the engine's run
    path: ``starts`` holds one coordinate list per spatial axis (ys, xs or zs, ys, xs)."""
    count = len(starts[0])
    return scatter_full(
        Patched(
            occluder.expand(count, *occluder.shape),
            tuple(torch.as_tensor(np.asarray(start)) for start in starts),
            (1, *image.shape),
        ),
        image.unsqueeze(0),
        torch.arange(count),
    )


def assert_incremental_matches(
    model, image, patch, positions, fill=0.5, tau=1.0, relative=2e-5
) -> IncrementalGraph:
    """Every logit of every occluded image, incremental vs full, within ``relative`` of
    their scale — or, for a network whose float32 logits are ill-conditioned (random
    GhostNet weights: full inference itself is 2e-4 of the scale off its float64 value on
    one thread), within three times full inference's own rounding error, measured against
    float64. The occlusion must move the logits by more than that error, or the
    comparison would prove nothing."""
    rank = image.dim() - 1  # 2 for an image, 3 for a volume
    starts = tuple(np.array([p[axis] for p in positions]) for axis in range(rank))
    extent = tuple(patch) if isinstance(patch, (tuple, list)) else (patch,) * rank
    occluder = torch.full((image.shape[0], *extent), float(fill))
    with torch.inference_mode():
        graph = IncrementalGraph(model, image)
        views = graph.materialize(image)
        geometry = graph.geometry(starts, extent, tau)
        incremental = graph.run_batch(views, geometry, slice(0, len(positions)), occluder)
        batch = occluded_batch(image, occluder, *starts)
        full = model(batch)
        truth = copy.deepcopy(model).double()(batch.double())
    scale = float(full.abs().max())
    rounding = float((full.double() - truth).abs().max())  # full inference's own error
    moved = float((full - views.logits).abs().max())
    assert moved > max(1e-5 * scale, 10 * rounding), "occlusion changed nothing (or too little)"
    tolerance = max(relative * scale, 3 * rounding) + 1e-6
    torch.testing.assert_close(incremental, full, rtol=0, atol=tolerance)
    return graph


# Two runs of the same cells agree to this: each run takes the torch threads the load at its
# start gives it (krypton.host.share_host), and on a busy host two runs of one computation
# differed in the 7th digit (2.4e-7), the reduction order of another thread count.
SAME_CELLS = 1e-6


def same_cells(first: np.ndarray, second: np.ndarray) -> None:
    """Two heatmaps of the same computation: equal up to SAME_CELLS."""
    np.testing.assert_allclose(first, second, rtol=0, atol=SAME_CELLS)
