"""krypton.captum.Occlusion is Captum's class: what Captum's own occlusion tests check
(argument errors, 1-D and 0-d features, tuples of inputs, integer inputs, extra forward
arguments, baselines per input, strides per input, progress text, futures), the call
patterns of tutorials and public code, and the model's training mode — each with the
engine, not Captum's own forwards, producing the numbers wherever the inputs allow."""

import copy
import io
import re
import warnings
from contextlib import redirect_stderr

import pytest
import torch
import torchvision
from captum.attr import Attribution, NoiseTunnel
from captum.attr import Occlusion as CaptumOcclusion
from torch import nn

import krypton.captum as krypton_captum
import krypton.engine.graph
from krypton.captum import Occlusion
from krypton.dropins.shared import ENGINE_BATCH, explainer_for

torch.manual_seed(0)


class Features(nn.Module):
    """(N, 3) features -> (N, 2): linear layers with a ReLU, like Captum's test MLPs."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.second = nn.Linear(4, 2)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


class Pair(nn.Module):
    """Two inputs and an optional extra argument: relu(x1 - 1 - relu(x2)) * scale."""

    def forward(self, x1, x2, scale=1):
        return torch.relu(x1 - 1 - torch.relu(x2)) * scale


class SmallConv(nn.Module):
    """(N, 1, 4, 4) and an optional second image added in: conv, relu, linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(8, 4)

    def forward(self, x, x2=None):
        if x2 is not None:
            x = x + x2
        return self.fc(torch.relu(self.conv(x)).flatten(1))


FEATURES = Features().eval()
CONV = SmallConv().eval()
RESNET = torchvision.models.resnet18(num_classes=5).eval()
IMAGES = torch.randn(2, 3, 32, 36)


def both(model, inputs, **arguments):
    """(Captum's result, krypton's result, the drop-in) for one call."""
    expected = CaptumOcclusion(model).attribute(inputs, **arguments)
    occlusion = Occlusion(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "batched" notes
        got = occlusion.attribute(inputs, **arguments)
    return expected, got, occlusion


def same(expected, got) -> None:
    if isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected)
        for theirs, mine in zip(expected, got):
            same(theirs, mine)
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# -- the class -------------------------------------------------------------------------
def test_it_is_captums_class_with_its_methods():
    occlusion = Occlusion(CONV)
    assert isinstance(occlusion, CaptumOcclusion) and isinstance(occlusion, Attribution)
    assert occlusion.get_name() == "Occlusion"
    assert occlusion.has_convergence_delta() is False
    assert occlusion.multiplies_by_inputs is True
    with pytest.raises(NotImplementedError):
        occlusion.attribute_future()


def test_noise_tunnel_wraps_it_and_equals_captums():
    arguments = dict(
        nt_type="smoothgrad", nt_samples=3, stdevs=0.1, target=1,
        sliding_window_shapes=(3, 12, 12), strides=(3, 8, 8),
    )  # fmt: skip
    torch.manual_seed(3)
    expected = NoiseTunnel(CaptumOcclusion(RESNET)).attribute(IMAGES[:1], **arguments)
    torch.manual_seed(3)
    tunnel = NoiseTunnel(Occlusion(RESNET))
    got = tunnel.attribute(IMAGES[:1], **arguments)
    assert tunnel.attribution_method.last_engine == "krypton"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# -- Captum's argument checks, unchanged --------------------------------------------------
@pytest.mark.parametrize(
    "inputs, arguments",
    [
        ("one", dict(sliding_window_shapes=((1, 2),))),  # too few window dims
        ("two", dict(sliding_window_shapes=((1, 1, 2), (1, 1, 1, 2)))),  # too many
        ("two", dict(sliding_window_shapes=((1, 1, 2),) * 3)),  # too many windows
        ("one", dict(sliding_window_shapes=(1, 2, 2), strides=(1, 2))),  # too few strides
        ("two", dict(sliding_window_shapes=((1, 1, 2), (1, 2, 2)), strides=((1, 1, 2),) * 3)),
        ("one", dict(sliding_window_shapes=((1, 1, 2),), strides=2)),  # stride > window
        ("one", dict(sliding_window_shapes=(1, 5, 2))),  # window > input
        ("one", dict(sliding_window_shapes=(1, 2, 2), perturbations_per_eval=0)),
    ],
)
def test_argument_errors_are_captums(inputs, arguments):
    image = torch.arange(16, dtype=torch.float).view(1, 1, 4, 4)
    given = image if inputs == "one" else (image, image)
    with pytest.raises(AssertionError):
        CaptumOcclusion(CONV).attribute(given, target=0, **arguments)
    with pytest.raises(AssertionError):
        Occlusion(CONV).attribute(given, target=0, **arguments)


def test_a_wrong_length_target_raises_what_captum_raises():
    arguments = dict(sliding_window_shapes=(3, 8, 8), strides=(3, 8, 8), target=[0, 1, 2])
    with pytest.raises(Exception) as theirs:
        CaptumOcclusion(RESNET).attribute(IMAGES, **arguments)
    with pytest.raises(Exception) as mine:
        Occlusion(RESNET).attribute(IMAGES, **arguments)
    assert type(mine.value) is type(theirs.value)


# -- the forms Captum's own tests pass, computed by the engine ------------------------
FORMS = {
    "1-D features, each batch size": (
        FEATURES,
        torch.tensor([[20.0, 50.0, 30.0]], requires_grad=True),
        dict(sliding_window_shapes=(1,), target=0),
    ),
    "1-D features, window 2, baseline per feature": (
        FEATURES,
        torch.tensor([[20.0, 50.0, 30.0], [2.0, 10.0, 3.0]]),
        dict(sliding_window_shapes=(2,), baselines=torch.tensor([10.0, 10.0, 10.0]), target=1),
    ),
    "1-D features, stride 2": (
        FEATURES,
        torch.tensor([[20.0, 50.0, 30.0]]),
        dict(sliding_window_shapes=(2,), strides=2, target=0),
    ),
    "two integer inputs": (
        Pair(),
        (torch.tensor([[-10], [3]]), torch.tensor([[-5], [1]])),
        dict(sliding_window_shapes=((1,), (1,)), target=0),
    ),
    "two 0-d feature inputs, no target": (
        Pair(),
        (torch.tensor([-10.0, 3.0]), torch.tensor([-5.0, 1.0])),
        dict(sliding_window_shapes=((), ())),
    ),
    "extra forward arguments": (
        Pair(),
        (torch.tensor([[4.0], [3.0]]), torch.tensor([[-5.0], [1.0]])),
        dict(sliding_window_shapes=((1,), (1,)), additional_forward_args=(3,), target=0),
    ),
    "baselines per input": (
        Pair(),
        (torch.tensor([[4.0, 7.0], [3.0, 1.0]]), torch.tensor([[-5.0, 2.0], [1.0, 0.5]])),
        dict(
            sliding_window_shapes=((1,), (2,)),
            baselines=(torch.tensor([[1.0, 4.0], [3.0, 6.0]]), 3.0),
            strides=(1, 2),
            target=1,
        ),
    ),
    "two images, windows and strides per input": (
        CONV,
        (torch.arange(16.0).view(1, 1, 4, 4), torch.ones(1, 1, 4, 4)),
        dict(
            sliding_window_shapes=((1, 2, 3), (1, 1, 2)),
            strides=((1, 2, 1), (1, 1, 2)),
            target=0,
        ),
    ),
    "two images of different shapes": (
        CONV,
        (torch.arange(16.0).view(1, 1, 4, 4), torch.ones(1, 1, 4, 1)),
        dict(
            sliding_window_shapes=((1, 2, 4), (1, 2, 1)), strides=((1, 2, 1), (1, 1, 1)), target=0
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(FORMS))
@pytest.mark.parametrize("per_eval", [1, 2, 3])
def test_captums_test_forms_are_computed_by_the_engine(name, per_eval):
    model, inputs, arguments = FORMS[name]
    expected, got, occlusion = both(model, inputs, perturbations_per_eval=per_eval, **arguments)
    same(expected, got)
    assert occlusion.last_engine == "krypton"


def final_bar(call) -> str:
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        call()
    return re.findall(r"Occlusion attribution: +\d+%\|[^|]*\| *\d+/\d+", stderr.getvalue())[-1]


def test_progress_has_captums_text_and_follows_the_engine(monkeypatch):
    """Captum's own bar, text and counts (Captum 0.9 counts an image's elements, not its
    windows, as the total: the drop-in's bar ends where Captum's does), with the engine's
    work inside it a chunk at a time, not computed first and replayed."""
    chunks = []
    real = krypton_captum._Session._compute

    def counted(session, first):
        chunks.append(first)
        return real(session, first)

    monkeypatch.setattr(krypton_captum._Session, "_compute", counted)
    arguments = dict(sliding_window_shapes=(3, 8, 8), strides=(3, 4, 4), target=1)
    image = torch.randn(1, 3, 64, 64)
    theirs = final_bar(
        lambda: CaptumOcclusion(RESNET).attribute(image, show_progress=True, **arguments)
    )
    occlusion = Occlusion(RESNET)
    mine = final_bar(lambda: occlusion.attribute(image, show_progress=True, **arguments))
    assert mine.split("|")[-1] == theirs.split("|")[-1] == " 226/12289"
    assert occlusion.last_strategy == "incremental"
    assert len(chunks) == -(-225 // ENGINE_BATCH) == 2  # one engine batch each
    features = torch.tensor([[20.0, 50.0, 30.0]])
    for per_eval in (1, 2, 3):
        bar = final_bar(
            lambda: Occlusion(FEATURES).attribute(  # noqa: B023
                features, sliding_window_shapes=(1,), target=0, show_progress=True,
                perturbations_per_eval=per_eval,  # noqa: B023
            )
        )  # fmt: skip
        assert bar.startswith("Occlusion attribution: 100%")


# -- tutorial and public-code patterns ---------------------------------------------------
class Scores(nn.Module):
    """One score per example: (N,) with no class dimension."""

    def forward(self, x):
        return RESNET(x)[:, 2]


class Summed(nn.Module):
    """One number per batch (an aggregate): Captum's 'agg' forward."""

    def forward(self, x):
        return RESNET(x)[:, 1].sum()


class Spatial(nn.Module):
    """(N, 2, h, w) outputs: a target is a tuple of indices."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 5, stride=4)

    def forward(self, x):
        return self.conv(x)


PATTERNS = {
    "tutorial: int target, (3, 15, 15) window, stride 8": (
        RESNET,
        IMAGES[:1],
        dict(target=3, sliding_window_shapes=(3, 15, 15), strides=(3, 8, 8)),
    ),
    "list of targets": (
        RESNET,
        IMAGES,
        dict(target=[4, 0], sliding_window_shapes=(3, 8, 8), strides=6),
    ),
    "tensor of targets": (
        RESNET,
        IMAGES,
        dict(target=torch.tensor([1, 2]), sliding_window_shapes=(3, 8, 8), strides=6),
    ),
    "one-element tensor target": (
        RESNET,
        IMAGES,
        dict(target=torch.tensor(1), sliding_window_shapes=(3, 8, 8), strides=6),
    ),
    "1-tuple target": (
        RESNET,
        IMAGES,
        dict(target=(2,), sliding_window_shapes=(3, 8, 8), strides=6),
    ),
    "list of 1-tuples": (
        RESNET,
        IMAGES,
        dict(target=[(1,), (3,)], sliding_window_shapes=(3, 8, 8), strides=6),
    ),
    "no target, one score per example": (
        Scores().eval(),
        IMAGES,
        dict(sliding_window_shapes=(3, 8, 8), strides=6),
    ),
    "no target, five outputs": (RESNET, IMAGES, dict(sliding_window_shapes=(3, 8, 8), strides=6)),
    "a tuple target on (N, 2, h, w) outputs": (
        Spatial().eval(),
        IMAGES,
        dict(target=(1, 2, 3), sliding_window_shapes=(3, 8, 8), strides=6),
    ),
    "window of one channel": (
        RESNET,
        IMAGES,
        dict(target=1, sliding_window_shapes=(1, 8, 8), strides=(1, 8, 8)),
    ),
    "window as a 1-tuple of tuples": (
        RESNET,
        IMAGES,
        dict(target=1, sliding_window_shapes=((3, 8, 8),), strides=((3, 6, 6),)),
    ),
    "a 1-tuple of inputs": (
        RESNET,
        (IMAGES,),
        dict(target=1, sliding_window_shapes=((3, 8, 8),), strides=6),
    ),
    "scalar baseline": (
        RESNET,
        IMAGES,
        dict(target=1, sliding_window_shapes=(3, 8, 8), strides=6, baselines=0.3),
    ),
    "integer baseline": (
        RESNET,
        IMAGES,
        dict(target=1, sliding_window_shapes=(3, 8, 8), strides=6, baselines=1),
    ),
    "per-channel baseline": (
        RESNET,
        IMAGES,
        dict(
            target=1,
            sliding_window_shapes=(3, 8, 8),
            strides=6,
            baselines=torch.tensor([0.4, 0.5, 0.6]).view(3, 1, 1),
        ),
    ),
    "baseline image per example": (
        RESNET,
        IMAGES,
        dict(target=1, sliding_window_shapes=(3, 8, 8), strides=6, baselines=IMAGES.flip(-1)),
    ),
    "baseline as a 1-tuple": (
        RESNET,
        IMAGES,
        dict(target=1, sliding_window_shapes=(3, 8, 8), strides=6, baselines=(0.2,)),
    ),
    "window the size of the image": (
        RESNET,
        IMAGES,
        dict(target=1, sliding_window_shapes=(3, 32, 36)),
    ),
    "large perturbations_per_eval": (
        RESNET,
        IMAGES,
        dict(target=1, sliding_window_shapes=(3, 8, 8), strides=6, perturbations_per_eval=64),
    ),
    "float64 model and input": (
        copy.deepcopy(RESNET).double(),
        IMAGES.double(),
        dict(target=1, sliding_window_shapes=(3, 8, 8), strides=8),
    ),
    "volume batch": (
        nn.Sequential(nn.Conv3d(1, 3, 3), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten()).eval(),
        torch.randn(2, 1, 10, 12, 12),
        dict(target=1, sliding_window_shapes=(1, 4, 4, 4), strides=(1, 3, 4, 4)),
    ),
    "one number per batch, perturbations_per_eval 1": (
        Summed().eval(),
        IMAGES,
        dict(sliding_window_shapes=(3, 8, 8), strides=8),
    ),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_call_patterns_give_captums_numbers(name):
    model, inputs, arguments = PATTERNS[name]
    expected, got, occlusion = both(model, inputs, **arguments)
    same(expected, got)
    if "per batch" in name:  # Captum's own forwards: the engine cannot split a sum
        assert occlusion.last_engine == "captum"
    else:
        assert occlusion.last_engine == "krypton"


def test_a_float64_input_for_a_float32_model_fails_as_in_captum():
    arguments = dict(target=1, sliding_window_shapes=(3, 8, 8), strides=8)
    with pytest.raises(RuntimeError) as theirs:
        CaptumOcclusion(RESNET).attribute(IMAGES.double(), **arguments)
    with pytest.raises(RuntimeError) as mine, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        Occlusion(RESNET).attribute(IMAGES.double(), **arguments)
    assert re.sub(r"\s+", " ", str(mine.value)) == re.sub(r"\s+", " ", str(theirs.value))


# -- training mode -----------------------------------------------------------------------
def test_a_training_model_without_dropout_or_batch_norm_runs_on_the_engine_and_stays_training():
    model = torchvision.models.resnet18(num_classes=5, norm_layer=nn.Identity)
    model.train()
    arguments = dict(target=1, sliding_window_shapes=(3, 8, 8), strides=6)
    expected, got, occlusion = both(model, IMAGES, **arguments)
    same(expected, got)
    assert occlusion.last_engine == "krypton"
    assert occlusion.last_strategy in ("incremental", "naive")
    assert all(module.training for module in model.modules())


def test_a_training_model_with_batch_norm_and_dropout_is_captums_and_stays_training():
    """Batch norm in training normalises by the batch and dropout is random: eval mode
    would change the numbers, so Captum's own forwards run them, in training mode."""
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.0),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    )  # fmt: skip
    model.train()
    theirs, mine = copy.deepcopy(model), copy.deepcopy(model)
    arguments = dict(target=1, sliding_window_shapes=(3, 8, 8), strides=8)
    expected = CaptumOcclusion(theirs).attribute(IMAGES, **arguments)
    occlusion = Occlusion(mine)
    with pytest.warns(UserWarning, match="training mode"):
        got = occlusion.attribute(IMAGES, **arguments)
    assert occlusion.last_engine == "captum"
    torch.testing.assert_close(got, expected)
    assert all(module.training for module in mine.modules())
    torch.testing.assert_close(mine[1].running_mean, theirs[1].running_mean)


def test_the_mode_is_restored_when_the_call_fails():
    model = torchvision.models.resnet18(num_classes=5, norm_layer=nn.Identity).train()
    with pytest.raises(AssertionError):
        Occlusion(model).attribute(IMAGES, target=1, sliding_window_shapes=(3, 99, 8))
    assert all(module.training for module in model.modules())


# -- one capture per model -----------------------------------------------------------------
def test_a_fresh_instance_per_call_reuses_the_capture(monkeypatch):
    arguments = dict(target=1, sliding_window_shapes=(3, 8, 8), strides=8)
    model = torchvision.models.resnet18(num_classes=5).eval()
    first = Occlusion(model).attribute(IMAGES[:1], **arguments)
    explainer = explainer_for(model)

    def no_capture(*args, **kwargs):
        raise AssertionError("captured again")

    monkeypatch.setattr(krypton.engine.graph.fx, "symbolic_trace", no_capture)
    again = Occlusion(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(again.attribute(IMAGES[:1], **arguments), first)
    assert explainer_for(model) is explainer and again.last_engine == "krypton"
    model.fc.bias.data += 1  # new weights: captured again (and here refused)
    with pytest.warns(UserWarning, match="captured again"):
        Occlusion(model).attribute(IMAGES[:1], **arguments)


@pytest.mark.cuda
def test_a_cuda_model_and_image_run_on_the_card():
    """Skipped without a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = copy.deepcopy(RESNET).to("cuda")
    images = IMAGES.to("cuda")
    arguments = dict(target=1, sliding_window_shapes=(3, 8, 8), strides=6)
    # Captum's own run in full fp32: by default cuDNN convolves in TF32 on a card (an
    # H200 put Captum 4e-4 off), while the drop-in's runs hold fp32 (TF32 off)
    matmul = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            expected, got, occlusion = both(model, images, **arguments)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
    assert occlusion.last_engine == "krypton" and got.device.type == "cuda"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
