"""Naive mode equals Captum's Occlusion where both compute the same thing.

With stride equal to the patch size every pixel lies under exactly one window, so Captum's
attribution at that pixel is prob - occluded prob for that window.
"""

import numpy as np
import pytest
import torch
import torchvision
from captum.attr import Occlusion

import krypton


@pytest.mark.parametrize("fill", [0.0, (0.3, -0.2, 1.0)])
def test_naive_matches_captum_occlusion(fill):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).eval()
    image = torch.randn(3, 64, 80)
    patch = 16
    heatmap = krypton.explain(model, image, patch=patch, stride=patch, mode="naive", fill=fill)

    baselines = (
        torch.as_tensor(fill, dtype=torch.float32).view(-1, 1, 1)
        if isinstance(fill, tuple)
        else fill
    )
    occlusion = Occlusion(lambda x: torch.softmax(model(x), dim=1))
    with torch.no_grad():
        attribution = occlusion.attribute(
            image.unsqueeze(0),
            sliding_window_shapes=(3, patch, patch),
            strides=(3, patch, patch),
            baselines=baselines,
            target=heatmap.label,
            perturbations_per_eval=8,
        )[0, 0]
    expected = heatmap.prob - attribution[heatmap.ys][:, heatmap.xs].numpy()
    assert heatmap.values.shape == (4, 5)
    np.testing.assert_allclose(heatmap.values, expected, atol=1e-5)
    # and exact agrees with both
    exact = krypton.explain(
        model, image, patch=patch, stride=patch, mode="exact", fill=fill, strategy="incremental"
    )
    np.testing.assert_allclose(exact.values, expected, atol=1e-4)
