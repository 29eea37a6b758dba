"""The drop-ins hear their callers: a count of windows per forward set below the
engine's batch (to fit a card's memory) is the most the engine puts in one forward
(both drop-ins used at least 128 whatever perturbations_per_eval or n_batch said), and a
MONAI subclass that overrides ``predictor`` is run by MONAI's code, with a warning (the
drop-in bypassed it silently)."""

import pytest
import torch
from torch import nn

from krypton.explainer import OcclusionExplainer

monai_visualize = pytest.importorskip("monai.visualize")
from krypton.captum import Occlusion  # noqa: E402
from krypton.monai import OcclusionSensitivity  # noqa: E402


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    ).eval()  # fmt: skip


@pytest.fixture
def batches(monkeypatch) -> list[int]:
    """The batch size of every engine call the drop-ins make."""
    seen: list[int] = []
    original = OcclusionExplainer.occluded_outputs

    def recorded(self, *args, **kwargs):
        seen.append(int(kwargs.get("batch_size") or 0))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OcclusionExplainer, "occluded_outputs", recorded)
    return seen


def test_monai_n_batch_below_the_engines_batch_caps_each_forward(batches):
    model, x = small_net(), torch.rand(1, 1, 48, 48)
    expected = monai_visualize.OcclusionSensitivity(model, mask_size=8, n_batch=4, verbose=False)(x)
    found = OcclusionSensitivity(model, mask_size=8, n_batch=4, verbose=False)(x)
    torch.testing.assert_close(found[0], expected[0], atol=1e-5, rtol=0)
    assert batches and max(batches) <= 4
    batches.clear()
    OcclusionSensitivity(model, mask_size=8, verbose=False)(x)  # MONAI's default: the engine's
    assert max(batches) == 128


def test_captum_perturbations_per_eval_caps_each_forward(batches):
    model, x = small_net(), torch.rand(1, 1, 48, 48)
    arguments = dict(sliding_window_shapes=(1, 8, 8), strides=2, target=0)
    found = Occlusion(model).attribute(x, perturbations_per_eval=4, **arguments)
    from captum.attr import Occlusion as CaptumOcclusion

    torch.testing.assert_close(
        found, CaptumOcclusion(model).attribute(x, **arguments), atol=1e-5, rtol=0
    )
    assert batches and max(batches) <= 4
    batches.clear()
    Occlusion(model).attribute(x, **arguments)  # Captum's default of 1: the engine's batch
    assert max(batches) == 128


def test_a_subclass_with_its_own_predictor_is_run_by_monai():
    """What MONAI does with the override (MONAI 1.6's __call__ names its own class's
    predictor) is what the drop-in's subclass gets: MONAI's code runs it, with a warning."""

    def counting(calls):
        def predictor(*args, **kwargs):
            calls.append(1)
            return monai_visualize.OcclusionSensitivity.predictor(*args, **kwargs)

        return staticmethod(predictor)

    ours, theirs = [], []
    Ours = type("Ours", (OcclusionSensitivity,), {"predictor": counting(ours)})
    Theirs = type(
        "Theirs", (monai_visualize.OcclusionSensitivity,), {"predictor": counting(theirs)}
    )
    model, x = small_net(), torch.rand(1, 1, 32, 32)
    with pytest.warns(UserWarning, match="overrides MONAI's predictor"):
        found = Ours(model, mask_size=8, verbose=False)(x)
    expected = Theirs(model, mask_size=8, verbose=False)(x)
    torch.testing.assert_close(found[0], expected[0], atol=1e-6, rtol=0)
    assert len(ours) == len(theirs)  # the override called exactly as MONAI calls it
