"""Every bad input raises a clear error naming the problem, before any inference."""

import numpy as np
import pytest
import torch
from torch import nn

import krypton


class CountingNet(nn.Module):
    """Tiny classifier that counts how often it runs, to prove no work was done."""

    def __init__(self, classes=4, output="logits"):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4, classes)
        self.output = output
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        x = torch.relu(self.conv(x))
        if self.output == "spatial":
            return x
        return self.fc(x.mean((2, 3)))


@pytest.fixture
def model():
    return CountingNet().eval()


@pytest.fixture
def image():
    return torch.randn(3, 32, 32)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"patch": 40}, "patch 40 is larger than the image"),
        ({"patch": 0}, "patch must be positive"),
        ({"stride": 0}, "stride must be positive"),
        ({"stride": -2}, "stride must be positive"),
        ({"region": (0, 0, 40, 20)}, "outside the 32x32 image"),
        ({"region": (10, 10, 5, 20)}, "outside the 32x32 image or empty"),
        ({"region": (0, 0, 10, 10), "patch": 16}, "larger than the region"),
        ({"positions": []}, "positions is empty"),
        ({"positions": [(30, 0)]}, "outside the 32x32 image"),
        ({"positions": [(1, 2, 3)]}, "(x, y) pairs"),
        ({"positions": [(0, 0)], "region": (0, 0, 20, 20)}, "either region or positions"),
        ({"label": 4}, "label 4 is out of range: the model has 4 classes"),
        ({"label": -1}, "label -1 is out of range"),
        ({"mode": "fast"}, "mode must be one of"),
        ({"fill": (0.0, 1.0)}, "fill has 2 values but the image has 3 channels"),
        ({"batch_size": 0}, "batch_size must be positive"),
    ],
)
@pytest.mark.parametrize("mode", ["naive", "exact"])
def test_bad_arguments(model, image, kwargs, message, mode):
    kwargs = {"mode": mode, **kwargs}
    with pytest.raises(
        (ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        krypton.explain(model, image, **kwargs)
    # at most the single unoccluded inference ran (label checks need the class count)
    assert model.calls <= 1


def test_bad_image(model):
    with pytest.raises(ValueError, match="shape"):
        krypton.explain(model, torch.randn(32, 32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        krypton.explain(model, np.zeros((3, 32, 32)))
    with pytest.raises(ValueError, match="NaN"):
        krypton.explain(model, torch.full((3, 32, 32), float("nan")))
    assert model.calls == 0


def test_training_mode_is_refused(image):
    with pytest.raises(ValueError, match="training mode"):
        krypton.explain(CountingNet().train(), image)


@pytest.mark.parametrize("mode", ["naive", "exact"])
def test_output_not_logits(image, mode):
    with pytest.raises(ValueError, match=r"logits of shape \(N, classes\)"):
        krypton.explain(CountingNet(output="spatial").eval(), image, mode=mode)


def test_untraceable_model_has_clear_error(image):
    class Dynamic(CountingNet):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow cannot be captured
                return super().forward(x)
            return super().forward(-x)

    model = Dynamic().eval()
    with pytest.raises(krypton.UnsupportedModelError, match="mode='naive'"):
        krypton.explain(model, image)
    assert krypton.explain(model, image, mode="naive", patch=16, stride=16).values.shape == (2, 2)


def test_progress_can_stop_the_run(model, image):
    seen = []

    def progress(done, total):
        seen.append((done, total))
        if done >= 8:
            raise KeyboardInterrupt("user pressed cancel")

    with pytest.raises(KeyboardInterrupt):
        krypton.explain(model, image, patch=4, stride=4, batch_size=4, progress=progress)
    # after each batch; a batch schedule measured meanwhile repeats the count between its
    # runs (krypton.schedule), so whether one was measured depends on the host's load
    assert list(dict.fromkeys(seen)) in ([(4, 64), (8, 64)], [(0, 64), (4, 64), (8, 64)])
    # the engine is left in a clean state: the next run works and matches naive
    exact = krypton.explain(model, image, patch=4, stride=4, batch_size=4)
    naive = krypton.explain(model, image, patch=4, stride=4, batch_size=4, mode="naive")
    np.testing.assert_allclose(exact.values, naive.values, atol=1e-5)


@pytest.mark.parametrize("mode", ["exact", "naive"])
def test_stop_run_from_progress_returns_every_position_computed_so_far(model, image, mode):
    """krypton.StopRun ends a one-pass run with what it computed: each value counted by
    progress, NaN elsewhere, equal to the whole run's there. Before, any exception from
    progress lost the call's values, so a caller that counted 32 kept 16."""
    whole = krypton.explain(model, image, patch=4, stride=4, batch_size=4, mode=mode)

    def progress(done, total):
        if done >= 12:
            raise krypton.StopRun("cancelled at 12")

    stopped = krypton.explain(
        model, image, patch=4, stride=4, batch_size=4, mode=mode, progress=progress
    )
    computed = np.isfinite(stopped.values)
    assert computed.sum() == 12 == stopped.positions_evaluated
    assert stopped.extra["stopped"] == {"computed": 12, "of": 64, "why": "cancelled at 12"}
    np.testing.assert_allclose(stopped.values[computed], whole.values[computed], atol=1e-5)
    assert stopped.class_values is not None
    assert np.isfinite(stopped.class_values).all(axis=-1).sum() == 12


def test_device_mismatch_is_refused(model, image):
    with pytest.raises(ValueError, match="move the model"):
        krypton.explain(model, image, device="meta")
