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
    with pytest.warns(UserWarning, match="MONAI.s own code runs it"):
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


# -- what MONAI's own tests check, with the engine computing ------------------------------
def test_it_is_monais_class():
    sensitivity = OcclusionSensitivity(MODEL)
    assert isinstance(sensitivity, monai_visualize.OcclusionSensitivity)
    assert OcclusionSensitivity.crop_meshgrid is monai_visualize.OcclusionSensitivity.crop_meshgrid


def dense_2d(channels: int = 1):
    from monai.networks.nets import DenseNet121

    torch.manual_seed(0)
    return DenseNet121(spatial_dims=2, in_channels=channels, out_channels=4).eval()


@pytest.mark.parametrize("mode", ["gaussian", "mean_patch", "mean_img"])
def test_image_shapes_classes_and_box_as_monai(mode):
    model = dense_2d()
    image = torch.rand(1, 1, 48, 64)
    sensitivity = OcclusionSensitivity(model, mode=mode, verbose=False)
    got, most_probable = sensitivity(image, b_box=[2, 40, 1, 62])
    expected, _ = monai_visualize.OcclusionSensitivity(model, mode=mode, verbose=False)(
        image, b_box=[2, 40, 1, 62]
    )
    assert sensitivity.last_engine == "krypton"
    assert got.shape == (1, 4, 38, 61) and most_probable.shape == (1, 1, 38, 61)
    assert most_probable.dtype == torch.int64 and 0 <= int(most_probable.min())
    assert int(most_probable.max()) < 4
    torch.testing.assert_close(got.as_tensor(), expected.as_tensor(), rtol=1e-5, atol=1e-5)


def test_volumes_with_boxes_and_two_channel_images_as_monai():
    from monai.networks.nets import DenseNet

    torch.manual_seed(0)
    model = DenseNet(
        spatial_dims=3, in_channels=1, out_channels=3, init_features=2, growth_rate=2,
        block_config=(6,),
    ).eval()  # fmt: skip
    cases = [
        (model, dict(n_batch=10, mask_size=(16, 15, 14)), torch.rand(1, 1, 64, 32, 16),
         [2, 43, -1, -1, -1, -1], (1, 3, 41, 32, 16)),
        (model, dict(n_batch=10), torch.rand(1, 1, 6, 7, 8), [1, 3, -1, -1, -1, -1],
         (1, 3, 2, 7, 8)),
        (dense_2d(2), {}, torch.rand(1, 2, 48, 64), None, (1, 4, 48, 64)),
    ]  # fmt: skip
    for net, settings, x, box, shape in cases:
        sensitivity = OcclusionSensitivity(net, verbose=False, **settings)
        got, most_probable = sensitivity(x, b_box=box)
        expected, _ = monai_visualize.OcclusionSensitivity(net, verbose=False, **settings)(
            x, b_box=box
        )
        assert sensitivity.last_engine == "krypton"
        assert got.shape == shape and most_probable.shape == (1, 1, *shape[2:])
        torch.testing.assert_close(got.as_tensor(), expected.as_tensor(), rtol=1e-5, atol=1e-5)


def test_extra_forward_arguments_go_to_monai():
    from monai.networks.nets import DenseNet121

    class Adjoint(DenseNet121):
        def __call__(self, x, adjoint_info):
            if adjoint_info != 42:
                raise ValueError
            return super().__call__(x)

    torch.manual_seed(0)
    model = Adjoint(spatial_dims=2, in_channels=1, out_channels=4).eval()
    sensitivity = OcclusionSensitivity(model, verbose=False)
    with pytest.warns(UserWarning, match="extra forward arguments"):
        got, _ = sensitivity(torch.rand(1, 1, 48, 64), b_box=[2, 40, 1, 62], adjoint_info=42)
    assert got.shape == (1, 4, 38, 61) and sensitivity.last_engine == "monai"


@pytest.mark.parametrize(
    "settings, x, error",
    [
        ({"n_batch": 10, "mask_size": 200}, torch.rand(1, 1, 48, 64), ValueError),
        ({"n_batch": 10, "mask_size": 100}, torch.rand(2, 1, 48, 64), ValueError),
        ({"mode": "test"}, torch.rand(1, 1, 48, 64), NotImplementedError),
    ],
)
def test_refusals_are_monais(settings, x, error):
    with pytest.raises(error):
        OcclusionSensitivity(dense_2d(), **settings)(x)


def test_a_float64_image_for_a_float32_model_fails_as_in_monai():
    """The drop-in once converted the image to the model's dtype where MONAI raises."""
    image = IMAGE.double()
    with pytest.raises(RuntimeError) as theirs:
        monai_visualize.OcclusionSensitivity(MODEL, verbose=False)(image)
    sensitivity = OcclusionSensitivity(MODEL, verbose=False)
    with pytest.raises(RuntimeError) as mine, pytest.warns(UserWarning, match="dtype"):
        sensitivity(image)
    assert str(mine.value) == str(theirs.value)


def test_progress_follows_the_engine_and_a_fresh_instance_reuses_the_capture(monkeypatch):
    """MONAI's own bar runs while the engine computes a chunk at a time (not a replay of
    work done before it), and a new instance per call does not capture again."""
    import krypton.engine.graph
    import krypton.monai as krypton_monai

    chunks = []
    real = krypton_monai._Windows._compute

    def counted(windows, begin, end):
        chunks.append((begin, end))
        return real(windows, begin, end)

    monkeypatch.setattr(krypton_monai._Windows, "_compute", counted)
    model = torchvision.models.resnet18(num_classes=4).eval()
    image = torch.randn(1, 3, 96, 96)
    settings = dict(mask_size=8, overlap=0.5)  # MONAI's n_batch: the engine batches
    expected, _ = monai_visualize.OcclusionSensitivity(model, verbose=False, **settings)(image)
    sensitivity = OcclusionSensitivity(model, verbose=True, **settings)
    got, _ = sensitivity(image)
    torch.testing.assert_close(got.as_tensor(), expected.as_tensor(), rtol=1e-5, atol=1e-5)
    assert len(chunks) == 5 and chunks[0] == (0, 128)  # 529 windows, one engine batch each

    def no_capture(*args, **kwargs):
        raise AssertionError("captured again")

    monkeypatch.setattr(krypton.engine.graph.fx, "symbolic_trace", no_capture)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="krypton")  # no "MONAI's own code runs it"
        again, _ = OcclusionSensitivity(model, verbose=False, **settings)(image)
    torch.testing.assert_close(again, got)


# -- call patterns of MONAI's tutorials and public code --------------------------------------
PATTERNS = {
    "defaults": ({}, {}),
    "mask as a tuple": ({"mask_size": (12, 16)}, {}),
    "no overlap": ({"overlap": 0.0}, {}),
    "high overlap": ({"overlap": 0.75, "mask_size": 20}, {}),
    "n_batch 1": ({"n_batch": 1, "mask_size": 20}, {}),
    "n_batch larger than the windows": ({"n_batch": 500, "mask_size": 24}, {}),
    "constant 0": ({"mode": 0.0}, {}),
    "constant 1": ({"mode": 1.0}, {}),
    "mean_img": ({"mode": "mean_img"}, {}),
    "mean_patch": ({"mode": "mean_patch", "mask_size": 20}, {}),
    "no activation": ({"activate": False}, {}),
    "callable activation": ({"activate": lambda out: out.sigmoid()}, {}),
    "box on both axes": ({}, {"b_box": [10, 30, 5, 45]}),
    "box with -1 (whole axis)": ({}, {"b_box": [-1, -1, 20, 40]}),
    "box smaller than the mask": ({"mask_size": 8}, {"b_box": [20, 24, 20, 24]}),
    "mask the image's size": ({"mask_size": (48, 56)}, {}),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_call_patterns_give_monais_numbers_on_the_engine(name):
    settings, call = PATTERNS[name]
    settings = dict(settings, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # MONAI's own indexing warnings
        expected, expected_class = monai_visualize.OcclusionSensitivity(MODEL, **settings)(
            IMAGE, **call
        )
        sensitivity = OcclusionSensitivity(MODEL, **settings)
        got, got_class = sensitivity(IMAGE, **call)
    assert sensitivity.last_engine == "krypton"
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got.as_tensor(), expected.as_tensor(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got_class, expected_class)
