"""Exact = naive on the architectures people fine-tune today (torchvision and timm).

Random weights, a few border and centre positions each, at a reduced input size so the
whole matrix stays within a couple of minutes on two CPU cores. Every logit of every
occluded image is compared, relative to the logits' scale; the kinds assert that the new
op rules keep these nets incremental past the spot where they used to turn global.
"""

import pytest
import timm
import torch
import torchvision
from engine_helpers import assert_incremental_matches

from krypton.engine import NodeKind

TORCHVISION = [
    "resnet18",
    "vgg16",
    "inception_v3",
    "densenet121",
    "mobilenet_v2",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
    "regnet_y_400mf",
    "shufflenet_v2_x1_0",
    "googlenet",
    "squeezenet1_0",
]
TIMM = [
    "resnet50d",
    "efficientnet_b0",
    "convnext_nano",
    "densenet121",
    "regnetx_002",
    "mobilenetv3_large_100",
    "inception_v3",
    "xception41",
    "res2net50_14w_8s",
    "ghostnet_100",
    "hgnetv2_b0",
    "selecsls42b",
    "dla34",
    "cspresnet50",
    "dpn68",
    "repvgg_a0",
    "ese_vovnet19b_dw",
    "rexnet_100",
]
# Share of the MACs that must come before the first global op: these nets used to turn
# global at their first F.batch_norm / permute / split / getitem / pad / view.
MOSTLY_INCREMENTAL = {
    "tv:convnext_tiny",
    "tv:shufflenet_v2_x1_0",
    "timm:resnet50d",
    "timm:convnext_nano",
    "timm:densenet121",
    "timm:regnetx_002",
    "timm:inception_v3",
    "timm:xception41",
    "timm:res2net50_14w_8s",
    "timm:hgnetv2_b0",
    "timm:cspresnet50",
    "timm:dpn68",
    "timm:repvgg_a0",
}


def build(name: str) -> torch.nn.Module:
    source, arch = name.split(":")
    torch.manual_seed(0)
    if source == "tv":
        kwargs = {"num_classes": 10}
        if arch in ("inception_v3", "googlenet"):
            kwargs.update(aux_logits=False, init_weights=True)
        model = getattr(torchvision.models, arch)(weights=None, **kwargs)
    else:
        model = timm.create_model(arch, pretrained=False, num_classes=10)
    model.eval()
    # Variance-preserving weights (some default inits shrink the signal until occlusion
    # moves nothing) and non-trivial batch-norm statistics, so a wrong rule shows.
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                torch.nn.init.kaiming_normal_(module.weight, mode="fan_in")
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 1.5)
                if module.weight is not None:  # some nets zero-initialise the last gamma
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.uniform_(-0.1, 0.1)
    return model


def input_size(name: str) -> int:
    return 139 if "inception" in name else 96


@pytest.mark.parametrize("name", [f"tv:{a}" for a in TORCHVISION] + [f"timm:{a}" for a in TIMM])
def test_exact_equals_naive(name):
    model = build(name)
    size = input_size(name)
    patch = 16
    torch.manual_seed(1)
    image = torch.randn(3, size, size)
    last = size - patch
    positions = [(0, 0), (last // 2, last // 2), (last, last), (0, last), (last - 3, 5)]
    graph = assert_incremental_matches(model, image, patch, positions)
    if name in MOSTLY_INCREMENTAL:
        _, share = graph.first_global()
        assert share > 0.95, f"{name}: only {share:.0%} of the MACs before the first global op"
    kinds = {step.kind for step in graph.steps}
    assert NodeKind.LOCAL in kinds
