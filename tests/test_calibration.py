"""The runtime calibration for inputs of any rank, and of the Compare view's gradient
step: a fresh host's first volume run and first Compare run are estimated, not left
blank until one has been logged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_volume_cli import volume_model  # noqa: F401
from torch import nn

import krypton
from krypton import calibration
from krypton.calibration import calibrate, save_calibration, time_gradient_step
from krypton.estimator import (
    calibrated_step,
    estimate_for_counts,
    fit_seconds,
    load_factor,
    planned_positions,
)
from krypton.registry.entries import find_entry


def tiny_volume_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 4, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 2),
    ).eval()  # fmt: skip


def test_a_volume_model_is_calibrated_over_regions_of_its_own_rank():
    """calibrate() took (H, W) and three channels only: a volume model could not be
    calibrated, so its first runs on a host had no estimate."""
    record = calibrate(
        tiny_volume_model(), "tiny-3d", (16, 16, 16), channels=1, patches=(4,),
        modes=("exact", "naive"), log=lambda line: None,
    )  # fmt: skip
    assert record["image_size"] == [16, 16, 16]
    for mode in ("exact", "naive"):
        fit = record["models"]["4"][mode]
        assert fit["coefficients"][0] > 0 and fit["intercept"] >= 0
        assert fit["fit_runs"] >= 2 and fit["held_out_runs"] >= 1


def test_planned_positions_of_a_volume_are_the_positions_a_run_evaluates():
    model, volume = tiny_volume_model(), torch.randn(1, 16, 16, 16)
    region = (0, 2, 0, 12, 16, 16)  # (z0, y0, x0, z1, y1, x1)
    exact = krypton.explain(model, volume, patch=4, stride=2, region=region)
    assert planned_positions((16, 16, 16), 4, 2, region) == (exact.positions_evaluated, 0)
    drilled = krypton.explain(
        model, volume, patch=4, stride=2, mode="approximate", tau=1.0, r_drill_down=0.25,
        target_speedup=3,
    )  # fmt: skip
    stage_one, stage_two = planned_positions((16, 16, 16), 4, 2, None, "approximate", 0.25, 3)
    assert stage_one == drilled.extra["stage_one_positions"]
    assert abs(stage_two - drilled.extra["stage_two_positions"]) <= 0.35 * stage_two


def test_one_slow_large_run_does_not_set_the_fixed_term_of_small_runs():
    """The volume model's first calibration fitted naive's runs unweighted: one disturbed
    run of 1,331 positions gave a 2.8 s fixed term to runs that take 0.05-0.5 s (82%
    held-out error). Errors weighed as a share of each run's time keep small runs right."""
    positions = np.array([[1], [8], [27], [64], [125], [343], [1331]], dtype=float)
    seconds = positions[:, 0] * 0.018
    seconds[-1] *= 1.6  # the disturbed large run
    relative = fit_seconds(positions, seconds, relative=True)
    assert relative.predict([[8]])[0] == pytest.approx(8 * 0.018, rel=0.25)
    plain = fit_seconds(positions, seconds)
    assert plain.predict([[8]])[0] > 1.4 * 8 * 0.018  # the unweighted fit misses them


def test_the_gradient_step_is_timed_per_class_and_estimated_before_any_is_logged(
    tmp_path, krypton_home
):
    step = time_gradient_step(tiny_volume_model(), (16, 16, 16), 1, 4, [0, 1], inputs=1)
    assert len(step["seconds_per_class"]) == 2 and min(step["seconds_per_class"]) > 0
    registry = tmp_path / "registry"
    registry.mkdir()
    path = registry / "tiny-3d.json"
    _, entry = find_entry("chestct-demo")  # a volume model's entry, without a calibration
    entry = {key: value for key, value in entry.items() if key != "calibration"}
    path.write_text(json.dumps(dict(entry, name="tiny-3d")))
    assert calibrated_step("tiny-3d", 2, 0.0, registry) is None  # nothing calibrated
    record = {"date": "2026-11-27", "models": {}, "gradient_step": step}
    save_calibration(path, record)
    found = calibrated_step("tiny-3d", 2, 0.0, registry)
    timed = np.array(step["seconds_per_class"]) * 2 / load_factor(0.0, threads=step["threads"])
    assert found is not None and found.low <= timed.min() <= timed.max() <= found.high
    assert found.seconds == pytest.approx(float(np.median(timed)))
    busy = calibrated_step("tiny-3d", 2, 2.0, registry)
    assert busy.seconds > found.seconds  # two cores busy: the step takes longer
    # a later calibration of other patches keeps the step's timing
    save_calibration(path, {"date": "2026-11-28", "models": {}}, keep_other_patches=True)
    assert calibrated_step("tiny-3d", 2, 0.0, registry) == found


def test_krypton_calibrate_takes_a_volume_model(cli_here, volume_model, monkeypatch):  # noqa: F811
    """`krypton calibrate --model` of a volume model fits its patch and stores it where
    the panel's estimate reads it: a fresh host's first volume run is estimated."""
    from webapp.runs import volumes

    monkeypatch.setattr(calibration, "FRACTIONS", (0.5, 0.75, 1.0))  # three small grids
    monkeypatch.setattr(calibration, "STRIDES", (16,))
    before = volumes.volume_estimate("ct-test", (48, 48, 48), 8, 8, "exact", None)
    assert "no time estimate yet" in before
    done = cli_here("calibrate", "--model", "ct-test", "--patches", "8", "--step-classes", "0")
    assert done.returncode == 0, done.stderr
    after = volumes.volume_estimate("ct-test", (48, 48, 48), 8, 8, "exact", None)
    assert "estimated" in after and "calibration (" in after
    found = estimate_for_counts("ct-test", "naive", 8, (27, 0), load=0.0)
    assert found.seconds > 0
