"""Model-free maps (chance, centre, Sobel edges, local contrast) on occlusion's grid, and
a randomisation check that can fail: the edge map, which never reads the model, fails
it; a map that goes flat once the weights are re-initialised passes; an undefined map
fails instead of being dropped."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import nn

from krypton.baselines import MODEL_FREE, model_free_maps, randomisation_verdict
from krypton.methods import compare, randomised


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(4, 2),
    ).eval()  # fmt: skip


def _square() -> torch.Tensor:
    image = torch.zeros(1, 32, 32)
    image[:, 12:20, 12:20] = 1.0
    return image


def test_model_free_maps_read_the_picture_on_occlusions_grid():
    image = _square()
    occlusion = compare(_net(), image, patch=4, stride=4, label=1, methods=("occlusion",))
    like = occlusion["occlusion"]
    like = dataclasses.replace(like, importance=like.importance.copy())
    like.importance[0, 0] = np.nan  # a cell occlusion did not compute
    maps = model_free_maps(image, like)
    assert set(maps) == set(MODEL_FREE)
    for found in maps.values():
        assert found.importance.shape == like.importance.shape
        assert np.isnan(found.importance[0, 0])  # not computed stays not computed
    cells = like.axes  # each cell's first pixel: 0, 4, ..., 28
    border = (list(cells[0]).index(8), list(cells[1]).index(12))  # holds the square's edge
    outside = (list(cells[0]).index(28), list(cells[1]).index(28))
    for name in ("edges", "contrast"):
        assert maps[name].importance[border] > maps[name].importance[outside] + 1e-6, name
    centre = maps["centre"].importance
    assert np.nanargmax(centre) in {np.ravel_multi_index((3, 3), centre.shape),
                                    np.ravel_multi_index((4, 4), centre.shape),
                                    np.ravel_multi_index((3, 4), centre.shape),
                                    np.ravel_multi_index((4, 3), centre.shape)}  # fmt: skip


def test_the_edge_map_fails_the_randomisation_check_and_a_flat_map_passes():
    image = _square() + 0.1 * torch.rand(1, 32, 32)
    model = _net()
    trained = compare(model, image, patch=4, stride=4, label=1, methods=("occlusion",))
    edges = model_free_maps(image, trained["occlusion"])["edges"]
    again = compare(randomised(model, seed=3), image, patch=4, stride=4, label=1,
                    methods=("occlusion",))  # fmt: skip
    edges_again = model_free_maps(image, again["occlusion"])["edges"]
    verdict = randomisation_verdict(edges, edges_again)
    assert not verdict["passed"] and verdict["spearman_abs"] > 0.99, (
        verdict
    )  # the row that must fail
    flat = dataclasses.replace(edges, importance=np.zeros_like(edges.importance))
    went_flat = randomisation_verdict(edges, flat)
    assert went_flat["passed"] and went_flat["why"] == "the map went flat"  # counted, not dropped
    undefined = dataclasses.replace(edges, importance=np.full_like(edges.importance, np.nan))
    failed = randomisation_verdict(edges, undefined)
    assert not failed["passed"] and "undefined" in failed["why"]
    chance = model_free_maps(image, trained["occlusion"], seed=1)["random"]
    other = model_free_maps(image, trained["occlusion"], seed=2)["random"]
    assert randomisation_verdict(chance, other)["passed"]  # two draws share nothing
