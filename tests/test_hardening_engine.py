"""Engine hardening: nothing writes into the caller's image or a cached view; changed weights,
settings or modes never reuse stale views; training-mode submodules are refused."""

import hashlib

import numpy as np
import pytest
import torch
from torch import nn

import krypton

torch.manual_seed(0)


def small_cnn() -> nn.Module:
    """Conv, batch norm, residual merge, pooling and a head: every view kind is used."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
            self.pool = nn.MaxPool2d(2)
            self.conv3 = nn.Conv2d(8, 8, 3, stride=2, padding=1)
            self.head = nn.Linear(8, 5)

        def forward(self, x):
            x = torch.relu(self.bn(self.conv1(x)))
            x = x + torch.relu(self.conv2(x))
            x = self.conv3(self.pool(x))
            return self.head(x.mean(dim=(2, 3)))

    model = Net()
    with torch.no_grad():  # non-trivial statistics so eps and running stats matter
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.01, 0.05)
    return model.eval()


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha1(tensor.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def view_digests(explainer: krypton.OcclusionExplainer) -> dict:
    found = {}
    for frozen, (_, views) in explainer._views.items():
        found[(frozen, "logits")] = digest(views.logits)
        for node, value in views.values.items():
            if isinstance(value, torch.Tensor):
                found[(frozen, "value", node.name)] = digest(value)
        for (node, pad), (tensor, _) in views.padded.items():
            found[(frozen, "padded", node.name, pad)] = digest(tensor)
    return found


def test_one_position_naive_leaves_the_callers_image_alone():
    model = small_cnn()
    image = torch.randn(3, 64, 64)
    before = image.clone()
    krypton.explain(model, image, mode="naive", patch=16, positions=[(40, 40)])
    assert torch.equal(image, before)


def test_one_position_exact_does_not_corrupt_the_cached_views():
    model = small_cnn()
    image = torch.randn(3, 64, 64)
    explainer = krypton.OcclusionExplainer(model)
    naive = explainer.explain(image, mode="naive", patch=8, stride=8)
    for _ in range(2):  # the second call reads views the first one would have corrupted
        explainer.explain(
            image, mode="exact", patch=8, positions=[(24, 24)], strategy="incremental"
        )
        exact = explainer.explain(image, mode="exact", patch=8, stride=8, strategy="incremental")
        np.testing.assert_allclose(exact.values, naive.values, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_no_call_writes_into_the_image_or_a_cached_view(seed):
    """Random explain calls of every mode, batch size and position count (1 included):
    the caller's image and every cached view keep their bytes."""
    rng = np.random.default_rng(seed)
    model = small_cnn()
    image = torch.randn(3, 48, 48)
    image_digest = digest(image)
    explainer = krypton.OcclusionExplainer(model)
    explainer.views_for(image.clone())
    for _ in range(4):
        views_before = view_digests(explainer)
        mode = str(rng.choice(["naive", "exact", "approximate"]))
        count = int(rng.choice([1, 2, 3, 5, 17]))
        batch = int(rng.choice([1, 2, 4, 16]))
        positions = [(int(x), int(y)) for x, y in rng.integers(0, 48 - 8 + 1, size=(count, 2))]
        kwargs = {"tau": 0.8} if mode == "approximate" else {}
        if mode == "exact":
            kwargs = {"strategy": "incremental"}
        heatmap = explainer.explain(
            image, mode=mode, patch=8, positions=positions, batch_size=batch, **kwargs
        )
        assert np.isfinite(heatmap.values[~np.isnan(heatmap.values)]).all()
        assert digest(image) == image_digest
        after = view_digests(explainer)
        assert {k: v for k, v in after.items() if k in views_before} == views_before
    grid = explainer.explain(
        image,
        mode="approximate",
        patch=8,
        stride=4,
        tau=0.8,
        r_drill_down=0.3,
        target_speedup=2.0,
        batch_size=1,
    )
    assert grid.extra["stage_one_positions"] > 0
    assert digest(image) == image_digest


def test_grid_with_a_last_batch_of_one_matches_naive():
    model = small_cnn()
    image = torch.randn(3, 40, 40)
    # 7 x 7 = 49 positions = 3 batches of 16 and one of 1
    exact = krypton.explain(model, image, patch=16, stride=4, batch_size=16, strategy="incremental")
    again = krypton.explain(model, image, patch=16, stride=4, batch_size=16, strategy="incremental")
    naive = krypton.explain(model, image, patch=16, stride=4, mode="naive")
    assert exact.values.size == 49
    np.testing.assert_allclose(exact.values, naive.values, atol=1e-5)
    np.testing.assert_allclose(again.values, naive.values, atol=1e-5)


def edit_data_copy(model):
    with torch.no_grad():
        model.conv1.weight.data.copy_(torch.randn_like(model.conv1.weight))


def edit_eps(model):
    model.bn.eps = 10.0


def edit_running_var_data(model):
    model.bn.running_var.data.mul_(3.0)


def edit_replaced_layer(model):
    model.conv2 = nn.Conv2d(8, 8, 3, padding=1).eval()


def edit_stride(model):
    model.pool.stride = 1


@pytest.mark.parametrize(
    "edit", [edit_data_copy, edit_eps, edit_running_var_data, edit_replaced_layer, edit_stride]
)
def test_changed_weights_and_settings_invalidate_cached_views(edit):
    model = small_cnn()
    image = torch.randn(3, 48, 48)
    explainer = krypton.OcclusionExplainer(model)
    explainer.explain(image, patch=16, stride=8)  # caches graph and views
    edit(model)
    exact = explainer.explain(image, patch=16, stride=8)
    naive = explainer.explain(image, patch=16, stride=8, mode="naive")
    np.testing.assert_allclose(exact.values, naive.values, atol=1e-5)
    assert exact.prob == pytest.approx(naive.prob, abs=1e-6)


@pytest.mark.parametrize("submodule", ["dropout", "bn"])
def test_a_submodule_in_training_mode_is_refused(submodule):
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.Dropout(0.5),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    ).eval()
    image = torch.randn(3, 32, 32)
    krypton.explain(model, image, patch=8, stride=8)  # fine in eval mode
    index = 2 if submodule == "dropout" else 1
    model[index].train()
    for mode in ("naive", "exact", "approximate"):
        with pytest.raises(ValueError, match=rf"training mode \({index}\).*model.eval\(\)"):
            krypton.explain(model, image, patch=8, stride=8, mode=mode, tau=1.0)


def test_batch_size_is_capped_by_the_memory_budget(monkeypatch):
    from krypton.explainer import capped_batch_size

    model = small_cnn()
    image = torch.randn(3, 48, 48)
    monkeypatch.setenv("KRYPTON_MEMORY_BUDGET_MB", "1")
    with torch.inference_mode():  # exact mode holds its views beside its batches
        views = krypton.OcclusionExplainer(model).views_for(image)[1].nbytes
    assert 0 < views < 2**19
    for mode, reserved in (("naive", 0), ("exact", views)):
        heatmap = krypton.explain(model, image, patch=16, stride=8, mode=mode, batch_size=100_000)
        assert heatmap.extra["batch_size_capped_from"] == 100_000
        # largest activation: 8 x 48 x 48 floats; four of them live per image
        assert heatmap.extra["batch_size"] == (2**20 - reserved) // (4 * 8 * 48 * 48 * 4)
    assert capped_batch_size(16, 10) == 16
    assert capped_batch_size(16, 2**40) == 1
