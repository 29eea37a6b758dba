"""Frozen gates: approximate mode keeps squeeze-excitation gates at their unoccluded
values, so it stays incremental past them; the error that costs is bounded and shown."""

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from engine_helpers import same_cells
from torch import nn

import krypton
from krypton.approximate.tuning import heatmap_ssim, localisation
from krypton.engine import IncrementalGraph, NodeKind


class SENet(nn.Module):
    """Stem, a squeeze-excitation block, more convs and a pooled head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.reduce = nn.Conv2d(8, 2, 1)
        self.expand = nn.Conv2d(2, 8, 1)
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.stem(x))
        gate = torch.sigmoid(self.expand(F.relu(self.reduce(x.mean((2, 3), keepdim=True)))))
        x = self.body(x * gate)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SENet().eval()


def test_gates_are_found_and_the_head_is_not_one(model):
    with torch.inference_mode():
        graph = IncrementalGraph(model, torch.randn(3, 32, 32), freeze_gates=True)
    kinds = {step.node.name: step.kind for step in graph.steps}
    assert graph.frozen == ["mean"]
    assert kinds["mean"] == NodeKind.FROZEN
    assert kinds["reduce"] == kinds["expand"] == kinds["sigmoid"] == NodeKind.STATIC
    assert kinds["mul"] == NodeKind.POINTWISE  # x * gate: a per-channel constant now
    assert kinds["adaptive_avg_pool2d"] == NodeKind.GLOBAL  # the head is not a gate
    assert graph.first_global()[1] > 0.95


def test_unfrozen_approximate_at_tau_one_is_exact(model):
    image = torch.randn(3, 32, 32)
    exact = krypton.explain(model, image, patch=6, stride=3, strategy="incremental")
    approximate = krypton.explain(
        model,
        image,
        patch=6,
        stride=3,
        mode="approximate",
        tau=1.0,
        r_drill_down=1.0,
        freeze_gates=False,
    )
    same_cells(approximate.values, exact.values)
    assert approximate.extra["frozen_gates"] == []


def test_frozen_gates_error_is_bounded(model):
    torch.manual_seed(3)
    image = torch.randn(3, 32, 32)
    image[:, 10:16, 20:26] += 4.0  # some evidence
    exact = krypton.explain(model, image, patch=6, stride=2)
    frozen = krypton.explain(
        model, image, patch=6, stride=2, mode="approximate", tau=1.0, r_drill_down=1.0
    )
    assert frozen.extra["frozen_gates"] == ["mean"]
    # a 6x6 patch is 3.5% of the gate's input: the frozen gate moves probabilities a little
    assert np.nanmax(np.abs(frozen.values - exact.values)) < 0.05
    assert heatmap_ssim(exact.values, frozen.values, exact.prob) > 0.8
    assert localisation(exact.values, frozen.values).minimum_kept
    assert frozen.macs_spent < exact.macs_spent


def test_efficientnet_stays_incremental_with_frozen_gates():
    torch.manual_seed(0)
    net = timm.create_model("efficientnet_b0", pretrained=False, num_classes=4).eval()
    image = torch.randn(3, 96, 96)
    with torch.inference_mode():
        plain = IncrementalGraph(net, image)
        frozen = IncrementalGraph(net, image, freeze_gates=True)
    assert plain.first_global()[1] < 0.1
    assert len(frozen.frozen) == 16  # one gate per MBConv block
    assert frozen.first_global()[1] > 0.95


def test_tuning_scores_approximate_mode_with_its_gates_frozen(model):
    from krypton.tune import tune_tau

    torch.manual_seed(4)
    images = [torch.randn(3, 32, 32) for _ in range(2)]
    record = tune_tau(model, images, patch=6, stride=4, taus=(1.0, 0.8), log=lambda line: None)
    assert record["frozen_gates"] == 1
    # τ 1 is measured, not assumed exact: the frozen gate moves the heatmap a little
    assert record["mean_ssim_by_tau"]["1.0"] < 1.0
    assert record["localisation_by_tau"]["1.0"]["lowest_overlap"] <= 1.0


def test_an_avg_plus_max_pooling_head_is_no_gate():
    """timm's 'avgmax' pooling adds two pooled vectors: each rejoins the other, not an
    ancestor, so freezing either would silently change the prediction."""

    class AvgMaxHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            x = F.relu(self.conv(x))
            pooled = 0.5 * (x.mean((2, 3)) + x.amax((2, 3)))
            return self.fc(pooled)

    model = AvgMaxHead().eval()
    image = torch.randn(3, 16, 16)
    with torch.inference_mode():
        graph = IncrementalGraph(model, image, freeze_gates=True)
    assert graph.frozen == []
    exact = krypton.explain(model, image, patch=4, stride=4, strategy="incremental")
    approximate = krypton.explain(
        model, image, patch=4, stride=4, mode="approximate", tau=1.0, r_drill_down=1.0
    )
    same_cells(approximate.values, exact.values)
