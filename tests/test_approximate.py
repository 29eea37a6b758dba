"""Approximate mode: thresholding, drill-down, τ tuning and the runtime estimator."""

import json
import math
import warnings

import numpy as np
import pytest
import torch
import torchvision
from engine_helpers import same_cells

import krypton
from krypton.approximate import drilldown
from krypton.approximate.tuning import TauTuning, heatmap_ssim
from krypton.calibration import calibrate, save_calibration
from krypton.estimator import NotCalibratedError, estimate_seconds, planned_positions
from krypton.registry import load_model, register_model
from krypton.tune import tune_tau


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None, num_classes=5).eval()


@pytest.fixture(scope="module")
def image():
    torch.manual_seed(1)
    return torch.randn(3, 64, 64)


def test_tau_one_without_drill_down_is_exact(model, image):
    exact = krypton.explain(model, image, patch=8, stride=4, strategy="incremental")
    approx = krypton.explain(
        model, image, patch=8, stride=4, mode="approximate", tau=1.0, r_drill_down=1.0
    )
    same_cells(approx.values, exact.values)
    assert approx.extra["tau"] == 1.0 and approx.flops_spent == exact.flops_spent


def test_thresholding_spends_fewer_flops_and_stays_close(model, image):
    exact = krypton.explain(model, image, patch=8, stride=4)
    approx = krypton.explain(
        model, image, patch=8, stride=4, mode="approximate", tau=0.5, r_drill_down=1.0
    )
    assert approx.flops_spent < exact.flops_spent
    assert approx.values.shape == exact.values.shape
    assert np.abs(approx.values - exact.values).max() < 0.5


def test_drill_down_shape_and_exact_cells(model, image):
    exact = krypton.explain(model, image, patch=8, stride=2)
    approx = krypton.explain(
        model, image, patch=8, stride=2, mode="approximate", tau=1.0, r_drill_down=0.25, s1=6
    )
    assert approx.values.shape == exact.values.shape
    assert list(approx.xs) == list(exact.xs) and list(approx.ys) == list(exact.ys)
    assert not np.isnan(approx.values).any()
    extra = approx.extra
    # grid 0, 2, …, 56; stage one 0, 6, …, 54 and the last position 56: 11 per axis
    assert extra["s1"] == 6 and extra["stage_one_positions"] == 11 * 11
    assert (
        approx.positions_evaluated
        == extra["stage_one_positions"] + extra["stage_two_positions"]
        < exact.positions_evaluated
    )
    # with tau = 1 every computed cell is exact: stage-one positions and drilled cells
    on_stage_one = np.zeros(len(exact.ys), dtype=bool)
    on_stage_one[::3] = on_stage_one[-1] = True
    grid = on_stage_one[:, None] & on_stage_one[None, :]
    np.testing.assert_allclose(approx.values[grid], exact.values[grid], atol=1e-5)
    equal = np.isclose(approx.values, exact.values, atol=1e-5)
    assert equal.sum() >= grid.sum() + extra["stage_two_positions"]
    # the drilled area holds the largest stage-one drops
    stage_one = exact.values[grid].reshape(11, 11)
    worst = np.unravel_index(np.argmin(stage_one), stage_one.shape)
    assert np.allclose(
        approx.values[worst[0] * 3 : worst[0] * 3 + 3, worst[1] * 3 : worst[1] * 3 + 3],
        exact.values[worst[0] * 3 : worst[0] * 3 + 3, worst[1] * 3 : worst[1] * 3 + 3],
        atol=1e-5,
    )


def test_drill_down_from_target_speedup(model, image):
    approx = krypton.explain(
        model,
        image,
        patch=8,
        stride=2,
        mode="approximate",
        tau=1.0,
        r_drill_down=0.1,
        target_speedup=5,
    )
    expected_s1 = 2 * round(math.sqrt(5 / (1 - 0.1 * 5)))  # eq 29, a multiple of S2 = 2
    assert approx.extra["s1"] == expected_s1
    assert approx.extra["theoretical_drill_down_speedup"] == pytest.approx(
        expected_s1**2 / (4 + 0.1 * expected_s1**2)
    )


def test_equations_28_to_30():
    assert drilldown.drill_down_speedup(16, 4, 0.25) == pytest.approx(256 / (16 + 64))  # 28
    s1 = drilldown.stage_one_stride(3, 0.25, 4)  # eq 29
    assert drilldown.drill_down_speedup(s1, 4, 0.25) == pytest.approx(3)
    assert drilldown.max_drill_down_speedup(224, 4, 0.25) == pytest.approx(
        min(224**2 / (16 + 0.25 * 224**2), 4)
    )  # eq 30
    with pytest.raises(ValueError, match="largest achievable drill-down speedup is below 3.99"):
        drilldown.check_drill_down(4.5, 0.25, 4, 224)
    assert drilldown.check_drill_down(3, 0.25, 4, 224) == 4 * round(s1 / 4)


def test_block_selection_and_interpolation():
    stage = np.array([[0.9, 0.1], [0.5, 0.8]])
    assert drilldown.selected_blocks(stage, 0.25).tolist() == [[False, True], [False, False]]
    assert drilldown.selected_blocks(stage, 0.5).sum() == 2
    values = drilldown.interpolate_to_grid(
        (np.array([0, 4]), np.array([0, 4])), stage, (np.array([0, 2, 4, 6]), np.array([0, 2]))
    )
    assert values[0, 0] == pytest.approx(0.9) and values[1, 0] == pytest.approx(0.7)
    assert values[3, 0] == pytest.approx(0.5)  # beyond the last row: nearest edge
    single = drilldown.interpolate_to_grid(
        (np.array([0]), np.array([0, 4])),
        np.array([[1.0, 3.0]]),
        (np.array([0, 2]), np.array([0, 2, 4])),
    )
    assert single.tolist() == [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tau": 0}, "tau must be in"),
        ({"tau": 1.5}, "tau must be in"),
        ({"tau": 1.0, "r_drill_down": 0}, "r_drill_down must be in"),
        ({"tau": 1.0, "r_drill_down": 1.2}, "r_drill_down must be in"),
        ({"tau": 1.0, "target_speedup": 1}, "target_speedup must be greater than 1"),
        ({"tau": 1.0, "target_speedup": 4.5}, "largest achievable"),
        ({"target_ssim": 0}, "target_ssim must be in"),
        ({"target_ssim": 1.1}, "target_ssim must be in"),
        ({"target_ssim": 0.9}, "tuned SSIM"),
        ({"tau": 0.5, "target_ssim": 0.9}, "not both"),
        ({"tau": 1.0, "s1": 2}, "must be larger than the stride"),
    ],
)
def test_bad_approximate_parameters(image, kwargs, message):
    class Counting(torch.nn.Module):
        calls = 0

        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 2, 3)

        def forward(self, x):
            Counting.calls += 1
            return self.conv(x).mean((2, 3))

    with pytest.raises(ValueError, match=message):
        krypton.explain(Counting().eval(), image, patch=8, stride=4, mode="approximate", **kwargs)
    assert Counting.calls == 0


def test_untuned_model_warns_and_uses_tau_one(model, image):
    with pytest.warns(UserWarning, match="no tuned tau"):
        heatmap = krypton.explain(
            model, image, patch=8, stride=8, mode="approximate", r_drill_down=1.0
        )
    assert heatmap.extra["tau"] == 1.0


def test_chosen_tau_falls_with_target():
    tuning = TauTuning((-1.2, 2.6, -0.4))  # a concave curve like the paper's Fig 9a
    taus = [tuning.tau_for(t) for t in (0.99, 0.95, 0.9, 0.8, 0.7)]
    assert taus == sorted(taus, reverse=True) and taus[0] > taus[-1]
    assert tuning.tau_for(1.0) == 1.0
    for target, tau in zip((0.99, 0.95, 0.9, 0.8, 0.7), taus):
        assert tuning.predicted_ssim(tau) >= target
    # a convex fit (like fundus-demo's) rises again at low tau: never jump down there
    convex = TauTuning((1.523, -1.665, 1.162))
    assert convex.tau_for(0.9) == pytest.approx(0.91)
    assert convex.predicted_ssim(0.3) > 0.72 > convex.predicted_ssim(0.55)
    assert convex.tau_for(0.72) > 0.55  # lowest-meeting-tau alone would give 0.3
    lowered = [convex.tau_for(t) for t in (0.95, 0.9, 0.85, 0.8, 0.75)]
    assert lowered == sorted(lowered, reverse=True)


def test_heatmap_ssim():
    rng = np.random.default_rng(0)
    heatmap = rng.uniform(0.4, 0.6, (12, 12))
    assert heatmap_ssim(heatmap, heatmap, 0.5) == pytest.approx(1.0)
    assert heatmap_ssim(heatmap, heatmap[::-1], 0.5) < 0.5


def test_tuning_and_calibration_round_trip(tmp_path, model, image):
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    registry = tmp_path / "registry"
    loaded = register_model(
        "tiny",
        tmp_path / "weights.pt",
        list("abcde"),
        architecture="resnet18",
        input_size=(64, 64),
        directory=registry,
    )
    images = [torch.randn(3, 64, 64) for _ in range(4)]
    record = tune_tau(
        loaded.module,
        images[:3],
        patch=16,
        stride=8,
        taus=(1.0, 0.7, 0.4),
        held_out=images[3:],
        log=lambda line: None,
    )
    path = registry / "tiny.json"
    entry = json.loads(path.read_text())
    entry["tuning"] = record
    path.write_text(json.dumps(entry))
    assert record["mean_ssim_by_tau"]["1.0"] == 1.0
    assert record["held_out"]["images"] == 1

    reloaded = load_model("tiny", registry)
    assert reloaded.tuning.chosen_tau == record["chosen"]["tau"]
    assert record["chosen"]["tau"] >= record["chosen"]["quality_floor"]
    assert record["chosen"]["tau"] >= record["chosen"]["curve_tau"]
    assert set(record["localisation_by_tau"]) == {"1.0", "0.7", "0.4"}
    assert record["localisation_by_tau"]["1.0"]["minimum_kept"] == 1.0
    heatmap = krypton.explain(
        reloaded, image, patch=16, stride=8, mode="approximate", target_ssim=0.9, r_drill_down=1.0
    )
    assert heatmap.extra["tau"] == record["chosen"]["tau"]
    assert heatmap.extra["tau_source"] == "tuned for SSIM 0.9 and localisation"
    default = krypton.explain(reloaded, image, patch=16, stride=8, mode="approximate")
    assert default.extra["tau"] == record["chosen"]["tau"]
    # an explainer built from the registry model uses its tuning too (one built from the
    # bare module cannot know it: it warns and runs τ 1.0, which a benchmark once hid)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        direct = krypton.OcclusionExplainer(reloaded).explain(
            image, patch=16, stride=8, mode="approximate"
        )
    assert direct.extra["tau"] == record["chosen"]["tau"]
    with pytest.warns(UserWarning, match="no tuned tau"):
        bare = krypton.OcclusionExplainer(reloaded.module).explain(
            image, patch=16, stride=8, mode="approximate"
        )
    assert bare.extra["tau"] == 1.0

    calibration = calibrate(reloaded.module, "tiny", (64, 64), patches=(16,), log=lambda line: None)
    save_calibration(path, calibration)
    for mode in ("naive", "exact", "approximate"):
        seconds = estimate_seconds("tiny", patch=16, stride=4, mode=mode, directory=registry)
        assert 0 < seconds < 60
    more = estimate_seconds("tiny", patch=16, stride=2, mode="exact", directory=registry)
    assert more > estimate_seconds("tiny", patch=16, stride=8, mode="exact", directory=registry)
    with pytest.raises(NotCalibratedError, match="krypton calibrate --model tiny"):
        estimate_seconds("tiny", patch=8, stride=4, directory=registry)
    # a patch size added later (as fundus-demo's 12 was) keeps the fits already stored
    at_16 = estimate_seconds("tiny", patch=16, stride=4, directory=registry)
    added = calibrate(reloaded.module, "tiny", (64, 64), patches=(8,), log=lambda line: None)
    as_returned = json.dumps(added, sort_keys=True)
    save_calibration(path, added, keep_other_patches=True)
    assert json.dumps(added, sort_keys=True) == as_returned  # the caller's record untouched
    assert estimate_seconds("tiny", patch=8, stride=4, directory=registry) > 0
    assert estimate_seconds("tiny", patch=16, stride=4, directory=registry) == at_16
    fits = json.loads(path.read_text())["calibration"]["models"]
    assert list(fits) == ["8", "16"] and fits["16"]["exact"]["date"] == calibration["date"]
    stored = json.loads(path.read_text())["calibration"]
    assert stored["held_out_patches"] == [8]  # the summary error is the new run's alone
    save_calibration(path, added)  # a plain calibration replaces every patch size
    with pytest.raises(NotCalibratedError):
        estimate_seconds("tiny", patch=16, stride=4, directory=registry)


def test_planned_positions_match_runs(model, image):
    heatmap = krypton.explain(
        model,
        image,
        patch=8,
        stride=2,
        mode="approximate",
        tau=1.0,
        r_drill_down=0.25,
        target_speedup=3,
    )
    stage_one, stage_two = planned_positions((64, 64), 8, 2, None, "approximate", 0.25, 3)
    assert stage_one == heatmap.extra["stage_one_positions"]
    assert abs(stage_two - heatmap.extra["stage_two_positions"]) <= 0.35 * stage_two
    assert planned_positions((64, 64), 8, 4) == (15 * 15, 0)


def test_refine_by_variation_drills_a_lesion_between_stage_one_samples():
    """A drop that stage one only grazes — one sample at 0.6 beside samples at 1.0 — while
    broad but shallow drops fill the lowest-probability budget: the paper's rule never
    refines the grazed cell, drop+variation does, at the same number of cells."""
    stage_one = np.ones((6, 6))
    stage_one[0, :] = 0.55  # a broad, shallow drop along the top edge
    stage_one[1, :] = 0.58
    stage_one[2, :] = 0.8
    stage_one[4, 3] = 0.6  # a lesion between samples: a partial drop beside none
    budget = 0.25
    by_drop = drilldown.selected_blocks(stage_one, budget, "drop")
    by_quality = drilldown.selected_blocks(stage_one, budget, "drop+variation")
    assert by_drop.sum() == by_quality.sum() == 9
    assert not by_drop[4, 3] and by_quality[4, 3]
    assert drilldown.local_variation(stage_one)[4, 3] == pytest.approx(0.4)
    with pytest.raises(ValueError, match="refine_by must be one of"):
        drilldown.selected_blocks(stage_one, budget, "largest")


def test_refine_by_is_recorded_and_validated(model, image):
    heatmap = krypton.explain(
        model, image, patch=8, stride=4, mode="approximate", tau=1.0, refine_by="drop"
    )
    assert heatmap.extra["refine_by"] == "drop"
    with pytest.raises(ValueError, match="refine_by must be one of"):
        krypton.explain(model, image, mode="approximate", tau=1.0, refine_by="nope")


class _BrightestPixel(torch.nn.Module):
    """Two classes; class 0's logit is the image's largest value (class 1's is 1), so it
    drops only while the patch covers the one bright pixel."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 1, 1, bias=False)
        torch.nn.init.constant_(self.conv.weight, 1.0)

    def forward(self, x):
        peak = torch.amax(self.conv(x), dim=(1, 2, 3))
        return torch.stack([peak, torch.ones_like(peak)], dim=1)


def test_drill_down_samples_the_last_row_and_column():
    """The only drop is at the bottom-right border: on a 64-px image, patch 8, stride 2 the
    grid ends at 56, which S1 = 6 never reaches (0, 6, …, 54). Stage one used to extrapolate
    row and column 54 over it, so the heatmap showed no drop at all; now the last position
    is always a stage-one sample and the drop is there, exactly."""
    image = torch.zeros(3, 64, 64)
    image[:, 62, 62] = 5.0  # covered only by patches at y, x in 55..62: the grid's 56
    model = _BrightestPixel().eval()
    exact = krypton.explain(model, image, patch=8, stride=2, label=0)
    approx = krypton.explain(
        model, image, patch=8, stride=2, mode="approximate", label=0, tau=1.0, s1=6
    )
    assert exact.values[-1, -1] < 0.5 < exact.values[:-1, :-1].min()
    np.testing.assert_allclose(approx.values, exact.values, atol=1e-6)
    assert drilldown.stage_one_axis(np.arange(0, 57, 2), 6).tolist()[-3:] == [48, 54, 56]
    blocks = drilldown.block_of(np.array([52, 54, 55, 56]), np.array([0, 54, 56]))
    assert blocks.tolist() == [0, 1, 1, 2]  # the last position is a block of its own
