"""Shared check: incremental logits equal full re-inference for given positions."""

import numpy as np
import torch

from krypton.engine import IncrementalGraph, scatter_full
from krypton.engine.kernels import Patched


def occluded_batch(image: torch.Tensor, occluder: torch.Tensor, ys, xs) -> torch.Tensor:
    """Full occluded images (eq 5), built independently of the engine's run path."""
    count = len(ys)
    return scatter_full(
        Patched(
            occluder.expand(count, *occluder.shape),
            torch.as_tensor(np.asarray(ys)),
            torch.as_tensor(np.asarray(xs)),
            (1, *image.shape),
        ),
        image.unsqueeze(0),
        torch.arange(count),
    )


def assert_incremental_matches(
    model, image, patch, positions, fill=0.5, tau=1.0, relative=2e-5
) -> IncrementalGraph:
    """Every logit of every occluded image, incremental vs full, relative to their scale;
    the occlusion must move the logits, or the comparison would prove nothing."""
    ys = np.array([p[0] for p in positions])
    xs = np.array([p[1] for p in positions])
    occluder = torch.full((image.shape[0], patch, patch), float(fill))
    with torch.inference_mode():
        graph = IncrementalGraph(model, image)
        views = graph.materialize(image)
        geometry = graph.geometry(ys, xs, patch, patch, tau)
        incremental = graph.run_batch(views, geometry, slice(0, len(ys)), occluder)
        full = model(occluded_batch(image, occluder, ys, xs))
    scale = float(full.abs().max())
    assert float((full - views.logits).abs().max()) > 1e-5 * scale, "occlusion changed nothing"
    torch.testing.assert_close(incremental, full, rtol=0, atol=relative * scale + 1e-6)
    return graph
