"""Paired tests between methods on the same inputs (krypton.paired) and the deletion
metric that shares neither occlusion's fill nor its grid (krypton.methods)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from krypton.methods import MethodMap, blur_deletion_curve, deletion_curve
from krypton.paired import holm, mcnemar, paired_difference


def test_mcnemar_counts_the_discordant_inputs_and_gives_the_exact_binomial_p():
    first = [True] * 8 + [False] * 2 + [True] * 5 + [False] * 5
    second = [False] * 8 + [True] * 2 + [True] * 5 + [False] * 5
    found = mcnemar(first, second)
    assert (found["only_first"], found["only_second"], found["n"]) == (8, 2, 20)
    # P(X <= 2 or X >= 8) for X ~ Bin(10, 1/2) = 2 * (1 + 10 + 45) / 1024
    assert found["p"] == pytest.approx(112 / 1024)
    assert mcnemar([True, False], [True, False])["p"] == 1.0  # nothing tells them apart
    with pytest.raises(ValueError, match="same inputs"):
        mcnemar([True], [True, False])


def test_the_paired_bootstrap_finds_a_shift_that_unpaired_intervals_would_hide():
    rng = np.random.default_rng(1)
    base = rng.uniform(0.0, 1.0, 60)  # inputs vary far more than the methods differ
    first, second = base + 0.02 + rng.normal(0, 0.005, 60), base
    found = paired_difference(first, second, seed=3)
    assert found["low"] > 0 and found["low"] < 0.02 < found["high"]
    assert found["mean"] == pytest.approx(np.mean(first - second))
    same = paired_difference(base, base)
    assert same["mean"] == 0 and math.isnan(same["low"])  # no spread, no interval


def test_holm_multiplies_by_the_hypotheses_left_and_keeps_the_order():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == [1.0, 1.0]
    assert holm([]) == []


class _BrightRight(nn.Module):
    """Class 1's logit is the right half's mean intensity: the evidence is on the right."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        right = x[:, :, :, x.shape[-1] // 2 :].mean(dim=(1, 2, 3))
        return torch.stack([torch.zeros_like(right), 20 * right], 1)


def _map(importance: np.ndarray, patch: int, stride: int) -> MethodMap:
    axes = tuple(np.arange(n) * stride for n in importance.shape)
    return MethodMap("test", importance, axes, (patch, patch), 1, 1.0, 0.0, "")


def test_blur_deletion_rewards_a_map_that_finds_the_evidence_and_ignores_the_fill():
    torch.manual_seed(0)
    image = torch.rand(1, 32, 32) * 0.2
    image[:, 10:22, 18:30] = 1.0  # a bright patch on the right: a blur spreads it away
    model = _BrightRight().eval()
    cells = np.zeros((7, 7))
    cells[2:5, 4:7] = 1.0  # a map on the bright patch (patch 8, stride 4)
    good, bad = _map(cells, 8, 4), _map(1.0 - cells, 8, 4)
    _, good_curve, good_area = blur_deletion_curve(model, image, good)
    _, _, bad_area = blur_deletion_curve(model, image, bad)
    assert good_area < bad_area and good_curve[0] > good_curve[-1]
    _, _, good_in = blur_deletion_curve(model, image, good, insertion=True)
    _, _, bad_in = blur_deletion_curve(model, image, bad, insertion=True)
    assert good_in > bad_in
    shares, curve, _ = blur_deletion_curve(model, image, good, steps=9, block=5)
    assert len(shares) == len(curve) == 10 and curve[0] > curve[-1]
    # the fill-based curve is unchanged by the refactor: all hidden is the fill's picture
    _, fill_curve, _ = deletion_curve(model, image, good, fill=0.0)
    with torch.no_grad():
        assert fill_curve[-1] == pytest.approx(
            float(torch.softmax(model(torch.zeros(1, 1, 32, 32)), 1)[0, 1]), abs=1e-6
        )
