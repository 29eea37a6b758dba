"""Static analysis (eqs 9-12) and its per-layer report."""

import pytest
import torch
import torchvision
from torch import nn

import krypton


@pytest.fixture(scope="module")
def vgg16():
    return torchvision.models.vgg16(weights=None).eval()


def test_vgg16_theoretical_speedup_matches_paper(vgg16):
    report = krypton.analyze(vgg16, (3, 224, 224), 16)
    # 13 convs and 5 pools; Q = 15.3 GMACs (paper §3.1: "Q = 15 GFLOPs")
    assert sum(layer.op == "conv" for layer in report.layers) == 13
    assert sum(layer.op == "max_pool" for layer in report.layers) == 5
    assert 15.2e9 < report.macs_full < 15.5e9
    assert 6.7 < report.speedup < 6.9
    first = report.layers[0]
    assert first.output_patch == (18, 18)  # 16 + 3 - 1 (eq 14)
    assert report.layers[-1].output_patch == (7, 7)  # grown to the whole last tensor
    assert "theoretical speedup" in report.table()


def test_speedup_falls_with_patch_size_and_rises_as_tau_falls(vgg16):
    small = krypton.theoretical_speedup(vgg16, (3, 224, 224), 8)
    large = krypton.theoretical_speedup(vgg16, (3, 224, 224), 32)
    assert small > krypton.theoretical_speedup(vgg16, (3, 224, 224), 16) > large
    assert krypton.theoretical_speedup(
        vgg16, (3, 224, 224), 16, tau=0.5
    ) > krypton.theoretical_speedup(vgg16, (3, 224, 224), 16, tau=1.0)


@pytest.mark.parametrize(
    "name, size, low, high", [("resnet18", 224, 2.1, 2.3), ("inception_v3", 299, 1.7, 1.9)]
)
def test_other_models(name, size, low, high):
    kwargs = {"aux_logits": False, "init_weights": False} if name == "inception_v3" else {}
    model = torchvision.models.get_model(name, weights=None, **kwargs).eval()
    assert low < krypton.theoretical_speedup(model, (3, size, size), 16) < high


def test_a_global_first_layer_gives_no_speedup():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"),
        nn.Conv2d(4, 4, 3),
        nn.Flatten(),
        nn.LazyLinear(2),
    )
    model(torch.zeros(1, 3, 16, 16))
    report = krypton.analyze(model.eval(), (3, 16, 16), 4)
    assert report.speedup == pytest.approx(1.0)
    assert report.layers[0].op == "conv (global)"


def test_bad_analysis_arguments(vgg16):
    with pytest.raises(ValueError, match="larger than"):
        krypton.analyze(vgg16, (3, 32, 32), 64)
    with pytest.raises(ValueError, match="tau"):
        krypton.analyze(vgg16, (3, 224, 224), 16, tau=0)
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        krypton.analyze(vgg16, (224, 224), 16)


def test_analysis_names_the_first_global_op_and_the_flops_before_it():
    """Why exact mode gains little on squeeze-excitation nets: the first gate is global."""
    efficient = krypton.analyze(torchvision.models.efficientnet_b0().eval(), (3, 224, 224), 16)
    assert efficient.first_global.startswith("features_1_0_block_1_avgpool")
    assert efficient.share_before_first_global < 0.05
    vgg = krypton.analyze(torchvision.models.vgg16().eval(), (3, 224, 224), 16)
    assert vgg.share_before_first_global > 0.8
    assert "first global op:" in vgg.table()
