"""krypton.monai.OcclusionSensitivity against MONAI's own: same call, same numbers."""

import copy
import warnings

import pytest
import torch
import torchvision
from torch import nn

monai_visualize = pytest.importorskip("monai.visualize")
from krypton.monai import OcclusionSensitivity  # noqa: E402

torch.manual_seed(0)
MODEL = torchvision.models.resnet18(num_classes=4).eval()
IMAGE = torch.randn(1, 3, 48, 56)


@pytest.mark.parametrize(
    "settings, call",
    [
        ({}, {}),  # MONAI's defaults: gaussian, mask 16, overlap 0.6
        ({"mode": "mean_patch", "overlap": 0.25}, {}),
        ({"mode": "mean_img", "mask_size": (10, 14), "overlap": 0.5}, {}),
        ({"mode": 0.5, "mask_size": 12, "overlap": 0.5, "n_batch": 5}, {"b_box": [4, 40, 2, 50]}),
        ({"activate": False, "overlap": 0.0}, {"b_box": [-1, -1, 10, 40]}),
    ],
)
def test_agrees_with_monai(settings, call):
    settings = dict(settings, verbose=False)
    expected, expected_class = monai_visualize.OcclusionSensitivity(MODEL, **settings)(
        IMAGE, **call
    )
    sensitivity = OcclusionSensitivity(MODEL, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # MONAI's own indexing warnings
        got, got_class = sensitivity(IMAGE, **call)
    assert sensitivity.last_engine == "krypton"
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-5 * max(1.0, float(expected.abs().max()))
    assert torch.equal(got_class, expected_class)


def test_untraceable_models_go_to_monai():
    class Dynamic(nn.Module):
        def forward(self, x):
            return MODEL(x) if x.sum() > -1e9 else -MODEL(x)

    sensitivity = OcclusionSensitivity(Dynamic().eval(), mask_size=16, verbose=False)
    with pytest.warns(UserWarning, match="using MONAI's own"):
        got, _ = sensitivity(IMAGE)
    assert sensitivity.last_engine == "monai"
    expected, _ = monai_visualize.OcclusionSensitivity(Dynamic().eval(), verbose=False)(IMAGE)
    torch.testing.assert_close(got, expected)


class VolumeNet(nn.Module):
    """A small 3-D classifier: the engine windows its convolutions and pool."""

    def __init__(self, channels: int = 1):
        super().__init__()
        self.stem = nn.Conv3d(channels, 6, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm3d(6)
        self.pool = nn.MaxPool3d(2)
        self.body = nn.Conv3d(6, 8, 3, padding=1)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = self.pool(torch.relu(self.norm(self.stem(x))))
        return self.head(torch.relu(self.body(x)).mean(dim=(2, 3, 4)))


torch.manual_seed(1)
VOLUME_MODEL = VolumeNet().eval()
VOLUME = torch.randn(1, 1, 16, 20, 18)


@pytest.mark.parametrize(
    "settings, call",
    [
        ({"mask_size": 8}, {}),  # gaussian at MONAI's default overlap 0.6
        ({"mode": "mean_patch", "mask_size": 6, "overlap": 0.25}, {}),
        ({"mode": "mean_img", "mask_size": (4, 8, 6), "overlap": 0.5}, {}),
        (
            {"mode": 0.5, "mask_size": 6, "overlap": 0.5, "n_batch": 5},
            {"b_box": [2, 14, 0, 16, 3, 17]},
        ),
        ({"activate": False, "mask_size": 8, "overlap": 0.0}, {}),
    ],
)
def test_volumes_agree_with_monai_computed_by_krypton(settings, call):
    """3-D calls ran through MONAI's own class (a warning said so); they are computed
    incrementally now, with MONAI's numbers."""
    settings = dict(settings, verbose=False)
    expected, expected_class = monai_visualize.OcclusionSensitivity(VOLUME_MODEL, **settings)(
        VOLUME, **call
    )
    sensitivity = OcclusionSensitivity(VOLUME_MODEL, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "using MONAI's own" any more
        warnings.filterwarnings("ignore", message=".*non-tuple sequence.*")  # MONAI's own
        got, got_class = sensitivity(VOLUME, **call)
    assert sensitivity.last_engine == "krypton"
    assert got.shape == expected.shape
    assert (got - expected).abs().max() <= 1e-5 * max(1.0, float(expected.abs().max()))
    assert torch.equal(got_class, expected_class)


def test_a_model_in_training_mode_is_left_in_training_mode():
    """The drop-in once left a training model in eval mode (OcclusionExplainer(module.eval()))
    where MONAI restores it: a training loop that called it went on with BatchNorm frozen and
    dropout off. It runs in eval mode, as MONAI does, and gives MONAI's numbers."""
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.5),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )  # fmt: skip
    model.train()
    settings = dict(mask_size=12, overlap=0.25, verbose=False)
    expected, _ = monai_visualize.OcclusionSensitivity(model, **settings)(IMAGE)
    assert model.training
    sensitivity = OcclusionSensitivity(model, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got, _ = sensitivity(IMAGE)
        assert model.training and all(m.training for m in model.modules())
        again, _ = sensitivity(IMAGE)  # the kept capture, still in eval for the computation
    assert sensitivity.last_engine == "krypton" and model.training
    assert (got - expected).abs().max() <= 1e-5 and torch.equal(got, again)


@pytest.mark.cuda
def test_a_cuda_model_and_volume_run_on_the_card():
    """The drop-in crashed on a CUDA model ("Expected all tensors to be on the same
    device"): its first pass built its windows' outputs on the CPU whatever the input's
    device. Skipped without a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = copy.deepcopy(VOLUME_MODEL).to("cuda")
    volume = torch.randn(1, 1, 24, 24, 24, device="cuda")
    settings = dict(mask_size=8, overlap=0.5, verbose=False)
    expected, _ = monai_visualize.OcclusionSensitivity(model, **settings)(volume)
    sensitivity = OcclusionSensitivity(model, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got, _ = sensitivity(volume)
    assert sensitivity.last_engine == "krypton" and got.device.type == "cuda"
    assert (got - expected).abs().max() <= 1e-4 * max(1.0, float(expected.abs().max()))
