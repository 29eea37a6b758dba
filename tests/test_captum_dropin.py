"""krypton.captum.Occlusion against Captum's own Occlusion: same call, same numbers."""

import warnings

import pytest
import timm
import torch
import torchvision
from captum.attr import Occlusion as CaptumOcclusion
from torch import nn

from krypton.captum import Occlusion

torch.manual_seed(0)
MODELS = {
    "resnet18": torchvision.models.resnet18(num_classes=5).eval(),
    "mobilenet_v2": torchvision.models.mobilenet_v2(num_classes=5).eval(),
    "timm_resnet18": timm.create_model("resnet18", pretrained=False, num_classes=5).eval(),
}
IMAGES = torch.randn(2, 3, 37, 42)  # strides below do not divide these sides


def agree(model, inputs, **arguments):
    expected = CaptumOcclusion(model).attribute(inputs, **arguments)
    occlusion = Occlusion(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback on these configurations
        got = occlusion.attribute(inputs, **arguments)
    assert occlusion.last_engine == "krypton"
    assert occlusion.last_strategy in ("incremental", "naive")  # as static analysis says
    with torch.no_grad():
        scale = model(inputs).abs().max()
    assert got.shape == inputs.shape
    assert (got - expected).abs().max() <= 1e-5 * scale


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    "arguments",
    [
        dict(sliding_window_shapes=(3, 8, 8), strides=(3, 4, 4), target=1),
        dict(sliding_window_shapes=(3, 10, 7), strides=(3, 6, 5), target=[0, 4]),
        dict(
            sliding_window_shapes=(1, 8, 8),
            strides=(1, 5, 5),
            baselines=0.5,
            target=torch.tensor([3, 1]),
        ),
        dict(
            sliding_window_shapes=(2, 9, 9),
            strides=(1, 7, 4),
            target=(2,),
            baselines=torch.tensor([0.1, -0.2, 0.3]).view(3, 1, 1),
        ),
        dict(
            sliding_window_shapes=(3, 8, 8),
            strides=8,
            target=4,
            perturbations_per_eval=7,
            baselines=IMAGES.flip(-1),
        ),  # a baseline image: the occluder varies by position
    ],
)
def test_agrees_with_captum(name, arguments):
    agree(MODELS[name], IMAGES, **arguments)


def test_one_example_and_default_stride():
    agree(
        MODELS["resnet18"],
        IMAGES[:1],
        sliding_window_shapes=(3, 12, 12),
        target=0,
        baselines=torch.randn(1, 3, 37, 42),
        strides=(3, 3, 3),
    )


def test_what_the_engine_cannot_capture_is_batched_with_one_warning():
    """Extra forward arguments, uncapturable control flow and plain callables: the engine
    evaluates the occluded inputs Captum builds, batched, and says so once."""

    class Scaled(nn.Module):  # two inputs: additional_forward_args
        def __init__(self):
            super().__init__()
            self.net = MODELS["resnet18"]

        def forward(self, x, factor):
            return self.net(x) * factor

    class Dynamic(nn.Module):  # data-dependent control flow: not capturable
        def __init__(self):
            super().__init__()
            self.net = MODELS["resnet18"]

        def forward(self, x):
            return self.net(x) if x.sum() > -1e9 else -self.net(x)

    inputs = IMAGES[:2]
    arguments = dict(sliding_window_shapes=(3, 12, 12), strides=(3, 10, 10), target=1)
    for model, extra, said in (
        (Scaled().eval(), {"additional_forward_args": (2.0,)}, "additional_forward_args"),
        (Dynamic().eval(), {}, "cannot take this model"),
        (lambda x: MODELS["resnet18"](x), {}, "not an nn.Module"),
    ):
        occlusion = Occlusion(model)
        with pytest.warns(UserWarning, match=said):
            got = occlusion.attribute(inputs, **arguments, **extra)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once per reason
            occlusion.attribute(inputs, **arguments, **extra)
        assert (occlusion.last_engine, occlusion.last_strategy) == ("krypton", "batched")
        expected = CaptumOcclusion(model).attribute(inputs, **arguments, **extra)
        torch.testing.assert_close(got, expected)

    class Sum(nn.Module):  # a tuple of inputs: the forward takes two
        def forward(self, first, second):
            return MODELS["resnet18"](first + second)

    pair = (IMAGES[:1], IMAGES[:1] * 2)
    arguments = dict(
        sliding_window_shapes=((3, 12, 12), (3, 12, 12)),
        target=0,
        strides=((3, 10, 10), (3, 10, 10)),
    )
    occlusion = Occlusion(Sum().eval())
    with pytest.warns(UserWarning, match="a tuple of tensors"):
        got = occlusion.attribute(pair, **arguments)
    assert occlusion.last_engine == "krypton" and isinstance(got, tuple) and len(got) == 2
    expected = CaptumOcclusion(Sum().eval()).attribute(pair, **arguments)
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(mine, theirs)


def test_a_sequence_input_is_batched():
    """3-D inputs (N, C, L): not images, so the engine evaluates them whole, batched."""
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.AdaptiveAvgPool1d(1), nn.Flatten()).eval()
    signal = torch.randn(3, 2, 20)
    arguments = dict(sliding_window_shapes=(2, 5), strides=(2, 3), target=1)
    occlusion = Occlusion(model)
    with pytest.warns(UserWarning, match="not an image"):
        got = occlusion.attribute(signal, **arguments)
    assert (occlusion.last_engine, occlusion.last_strategy) == ("krypton", "batched")
    torch.testing.assert_close(got, CaptumOcclusion(model).attribute(signal, **arguments))
