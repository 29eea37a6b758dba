"""Volumes: the engine's exact incremental inference on (C, D, H, W) inputs.

The same engine as for images, with one more spatial axis: every occluded volume's logits
equal full 3-D re-inference within 1e-5 of their scale, on real 3-D architectures with
random weights and on a network built to exercise every 3-D op rule.
"""

import monai.networks.nets as monai_nets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from engine_helpers import assert_incremental_matches
from torch import nn

import krypton
from krypton.engine import IncrementalGraph, NodeKind


def _seeded(build):
    def make():
        torch.manual_seed(0)
        return build().eval()

    return make


# name -> (model, input (C, D, H, W), patch (an int is a cube), positions (z, y, x))
ARCHITECTURES = {
    "r3d_18": (
        _seeded(torchvision.models.video.r3d_18),
        (3, 8, 56, 56),
        (4, 16, 16),
        [(0, 0, 0), (2, 20, 20), (4, 40, 40), (3, 7, 33)],
    ),
    "mc3_18": (
        _seeded(torchvision.models.video.mc3_18),
        (3, 8, 56, 56),
        (4, 16, 16),
        [(0, 0, 0), (2, 20, 20), (4, 40, 40)],
    ),
    "r2plus1d_18": (
        _seeded(torchvision.models.video.r2plus1d_18),
        (3, 8, 48, 48),
        (4, 12, 12),
        [(0, 0, 0), (2, 18, 18), (4, 36, 36)],
    ),
    "monai_densenet121": (
        _seeded(lambda: monai_nets.DenseNet121(spatial_dims=3, in_channels=1, out_channels=2)),
        (1, 32, 32, 32),
        8,
        [(0, 0, 0), (12, 12, 12), (24, 24, 24)],
    ),
    "monai_resnet10": (
        _seeded(lambda: monai_nets.resnet10(spatial_dims=3, n_input_channels=1, num_classes=2)),
        (1, 48, 48, 48),
        12,
        [(0, 0, 0), (18, 18, 18), (36, 36, 36), (5, 30, 11)],
    ),
    "monai_resnet18": (
        _seeded(lambda: monai_nets.resnet18(spatial_dims=3, n_input_channels=1, num_classes=2)),
        (1, 32, 32, 32),
        8,
        [(0, 0, 0), (12, 12, 12), (24, 24, 24)],
    ),
    "monai_seresnet50": (
        _seeded(lambda: monai_nets.SEResNet50(spatial_dims=3, in_channels=1, num_classes=2)),
        (1, 32, 32, 32),
        8,
        [(0, 0, 0), (12, 12, 12), (24, 24, 24)],
    ),
    "monai_unet_encoder_classifier": (
        _seeded(
            lambda: monai_nets.Classifier(
                in_shape=(1, 32, 32, 32),
                classes=2,
                channels=(8, 16, 32),
                strides=(2, 2, 2),
                norm="batch",
            )
        ),
        (1, 32, 32, 32),
        8,
        [(0, 0, 0), (12, 12, 12), (24, 24, 24), (3, 17, 9)],
    ),
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_exact_equals_naive_on_3d_architectures(name):
    build, shape, patch, positions = ARCHITECTURES[name]
    torch.manual_seed(1)
    volume = torch.rand(shape)
    graph = assert_incremental_matches(build(), volume, patch, positions, relative=1e-5)
    assert graph.rank == 3
    local = [s for s in graph.steps if s.kind == NodeKind.LOCAL]
    assert local and all(len(s.local.axes) == 3 for s in local)


class EveryRule3d(nn.Module):
    """One of each 3-D op the engine windows: strided, dilated, grouped and functional
    convolutions; max and average pools with padding and ceil mode; padding of three
    modes, one padding only the last two axes; a residual merge, a channel concatenation and
    a channels-last layer norm + linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(2, 8, (3, 5, 5), stride=(1, 2, 2), padding=(1, 2, 2))
        self.norm = nn.BatchNorm3d(8)
        self.pool = nn.MaxPool3d(3, stride=2, padding=1, ceil_mode=True)
        self.dilated = nn.Conv3d(8, 8, 3, padding=2, dilation=2, groups=4)
        self.pad = nn.ReplicationPad3d((1, 0, 1, 0, 0, 1))
        self.branch = nn.Conv3d(8, 8, 2)
        self.smooth = nn.Conv3d(8, 8, 3)
        self.average = nn.AvgPool3d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        self.weight = nn.Parameter(torch.randn(16, 16, 1, 3, 3) * 0.2)
        self.layer_norm = nn.LayerNorm(16)
        self.linear = nn.Linear(16, 12)
        self.head = nn.Linear(12, 5)

    def forward(self, x):
        x = F.relu(self.norm(self.stem(x)))
        x = self.pool(x)
        x = x + F.relu(self.dilated(x))
        branch = self.branch(self.pad(x))
        branch = self.smooth(F.pad(branch, (1, 1, 1, 1, 1, 1), mode="reflect"))
        x = torch.cat([x, branch], dim=1)
        x = self.average(x)
        x = F.conv3d(F.pad(x, (1, 1, 1, 1, 0, 0), mode="circular"), self.weight)
        x = x.permute(0, 2, 3, 4, 1)
        x = self.linear(self.layer_norm(x)).permute(0, 4, 1, 2, 3)
        return self.head(F.adaptive_avg_pool3d(x, 1).flatten(1))


def test_every_3d_op_rule_is_exact_and_incremental():
    torch.manual_seed(2)
    model = EveryRule3d().eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 2.0)
    volume = torch.rand(2, 20, 28, 26)
    positions = [(0, 0, 0), (7, 10, 9), (14, 22, 20), (3, 0, 20), (14, 5, 0)]
    graph = assert_incremental_matches(model, volume, (6, 6, 6), positions, fill=0.9)
    kinds = {s.node.name: s.kind for s in graph.steps}
    assert graph.first_global()[0] == "adaptive_avg_pool3d"
    for name in ("stem", "pool", "dilated", "branch", "smooth", "average", "conv3d"):
        assert kinds[name] == NodeKind.LOCAL, name
    assert kinds["pad"] == kinds["pad_1"] == kinds["pad_2"] == NodeKind.REMAP
    assert kinds["layer_norm"] == NodeKind.POINTWISE


def test_a_patch_per_axis_and_a_cube_propagate_per_axis():
    """A (depth, height, width) patch is windowed per axis: a 1-slice patch of a 3x1x1
    convolution reaches 3 slices, while its rows and columns stay the patch's own."""
    model = nn.Sequential(nn.Conv3d(1, 1, (3, 1, 1), padding=(1, 0, 0))).eval()
    volume = torch.rand(1, 10, 12, 12)
    with torch.inference_mode():
        graph = IncrementalGraph(model, volume)
        geometry = graph.geometry((np.array([4]), np.array([2]), np.array([3])), (1, 5, 6))
    conv = next(s for s in graph.steps if s.kind == NodeKind.LOCAL).node
    depth, rows, cols = geometry.windows[conv]
    assert (depth.length, rows.length, cols.length) == (3, 5, 6)
    assert (int(depth.start[0]), int(rows.start[0]), int(cols.start[0])) == (3, 2, 3)
    assert geometry.cells(conv) == 3 * 5 * 6


def test_convolutions_whose_context_spans_the_map_pad_it_themselves():
    """r3d_18's update patch spans all 8 frames after two layers and the whole map in the
    last stages. An explicitly padded context made oneDNN multiply the padding too (2/3
    of a 3-deep kernel's taps on a 1-slice map): 2.3x the time of the full inference's
    own convolution. Where a context spans a whole axis it is now read unpadded there and
    the convolution pads it; where the patch is the whole tensor the layer runs as in full
    inference. The values stay exact."""
    build, shape, patch, positions = ARCHITECTURES["r3d_18"]
    torch.manual_seed(1)
    graph = assert_incremental_matches(build(), torch.rand(shape), patch, positions, relative=1e-5)
    starts = tuple(np.array([p[axis] for p in positions]) for axis in range(3))
    geometry = graph.geometry(starts, patch)
    local = [s for s in graph.steps if s.kind == NodeKind.LOCAL]
    last_stage = [s.node for s in local if graph.shapes[s.node][2:] == (1, 4, 4)]
    assert len(last_stage) == 5 and all(node in geometry.whole for node in last_stage)
    layer1 = [s.node for s in local if graph.shapes[s.node][2:] == (8, 28, 28)][1:3]
    assert all(geometry.implicit_padding.get(node) == (1, 0, 0) for node in layer1)  # frames
    stem = local[0].node
    assert stem not in geometry.implicit_padding and stem not in geometry.whole


def test_geometry_needs_one_start_array_and_one_extent_per_axis():
    model = nn.Sequential(nn.Conv3d(1, 2, 3)).eval()
    with torch.inference_mode():
        graph = IncrementalGraph(model, torch.rand(1, 8, 8, 8))
    with pytest.raises(ValueError, match="3 spatial axes"):
        graph.geometry((np.array([0]), np.array([0])), (4, 4))


def test_static_analysis_of_a_volume():
    """`krypton analyze` for a 3-D input shape: the conv-FLOP limit of a centred cube
    (eqs 9-14 per axis), with per-layer 3-D patches."""
    model, _, _, _ = ARCHITECTURES["monai_resnet10"]
    report = krypton.analyze(model(), (1, 48, 48, 48), 12)
    assert report.input_shape == (1, 48, 48, 48)
    assert all(len(layer.output_patch) == 3 for layer in report.layers)
    assert 3.0 < report.speedup < 4.5  # 3.67x
    assert "x" in report.table().splitlines()[1].split()[3]
    video = krypton.theoretical_speedup(
        torchvision.models.video.r3d_18().eval(), (3, 8, 56, 56), (4, 16, 16)
    )
    assert 1.5 < video < 2.0  # 1.70x: time kernels of 3 cover 8 frames after two layers
    with pytest.raises(ValueError, match="larger than"):
        krypton.analyze(model(), (1, 48, 48, 48), (12, 12, 64))
    with pytest.raises(ValueError, match="3 positive integers"):
        krypton.analyze(model(), (1, 48, 48, 48), (12, 12))


# ---------------------------------------------------------------------------------------
# krypton.explain on volumes
# ---------------------------------------------------------------------------------------


class SmallVolumeNet(nn.Module):
    """A small 3-D classifier: strided convolutions, batch norm, a residual merge."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.stem = nn.Conv3d(1, 8, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm3d(8)
        self.body = nn.Conv3d(8, 8, 3, padding=1)
        self.down = nn.Conv3d(8, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.norm(self.stem(x)))
        x = x + F.relu(self.body(x))
        x = F.relu(self.down(x))
        return self.head(x.mean(dim=(2, 3, 4)))


@pytest.fixture(scope="module")
def small_volume_net():
    torch.manual_seed(3)
    return SmallVolumeNet().eval()


def test_explain_a_volume_exact_equals_naive(small_volume_net):
    torch.manual_seed(4)
    volume = torch.rand(1, 20, 24, 28)
    region = (2, 0, 4, 18, 24, 28)
    kwargs = dict(patch=(4, 6, 8), stride=(4, 6, 5), region=region, fill=0.5)
    naive = krypton.explain(small_volume_net, volume, mode="naive", **kwargs)
    exact = krypton.explain(
        small_volume_net, volume, mode="exact", strategy="incremental", **kwargs
    )
    assert exact.is_volume and exact.values.ndim == 3
    np.testing.assert_array_equal(exact.zs, [2, 6, 10, 14])
    np.testing.assert_array_equal(exact.ys, [0, 6, 12, 18])
    np.testing.assert_array_equal(exact.xs, [4, 9, 14, 19])
    assert exact.values.shape == (4, 4, 4) == naive.values.shape
    assert exact.patch == (4, 6, 8) and exact.stride == (4, 6, 5)
    assert exact.positions_evaluated == 64
    np.testing.assert_allclose(exact.values, naive.values, atol=1e-5, rtol=0)
    assert naive.values.max() - naive.values.min() > 1e-4  # the occlusion moved something
    assert naive.macs_naive > 0 and exact.macs_spent < exact.macs_naive
    other = exact.for_label((exact.label + 1) % 3)
    np.testing.assert_allclose(other.values, naive.for_label(other.label).values, atol=1e-5, rtol=0)
    # one value of the heatmap, checked against a hand-built occluded volume
    occluded = volume.clone()
    occluded[:, 6:10, 12:18, 9:17] = 0.5
    with torch.inference_mode():
        probability = torch.softmax(small_volume_net(occluded.unsqueeze(0)), dim=1)
    assert abs(float(probability[0, exact.label]) - float(exact.values[1, 2, 1])) < 1e-5


def test_explain_a_volume_with_a_cube_and_the_explainer_object(small_volume_net):
    volume = torch.rand(1, 16, 16, 16)
    explainer = krypton.OcclusionExplainer(small_volume_net)
    heatmap = explainer.explain(volume, patch=8, stride=4, mode="exact")
    assert heatmap.values.shape == (3, 3, 3) and heatmap.patch == 8 and heatmap.stride == 4
    assert heatmap.extra["plan"]  # what ran and why, as for images
    again = explainer.explain(volume, patch=8, stride=4, mode="naive")
    np.testing.assert_allclose(heatmap.values, again.values, atol=1e-5, rtol=0)


def test_a_volume_explains_listed_positions_as_its_grid_does(small_volume_net):
    """Volumes take positions as images do — (z, y, x) first voxels, as their regions —
    so an app computes any set of cells (coarse to fine, the unknown ones) in one call."""
    volume = torch.rand(1, 16, 16, 16)
    explainer = krypton.OcclusionExplainer(small_volume_net)
    grid = explainer.explain(volume, patch=8, stride=4, mode="exact")
    listed = [(8, 0, 4), (0, 8, 8), (4, 4, 0), (8, 0, 4)]  # a duplicate costs nothing
    for mode in ("exact", "naive"):
        some = explainer.explain(volume, patch=8, mode=mode, positions=listed)
        assert some.positions_evaluated == 3
        assert some.zs.tolist() == [0, 4, 8] and some.xs.tolist() == [0, 4, 8]
        for z, y, x in listed:
            k, i, j = (
                int(np.searchsorted(a, v)) for a, v in ((some.zs, z), (some.ys, y), (some.xs, x))
            )
            assert some.values[k, i, j] == pytest.approx(
                grid.values[z // 4, y // 4, x // 4], abs=1e-5
            )
        assert np.isnan(some.values).sum() == some.values.size - 3  # the rest not computed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="approximate", tau=1.0, stride=(4, 4, 2)), "drill-down needs one stride"),
        (dict(positions=[(0, 0)]), r"list of \(z, y, x\) triples"),
        (dict(positions=[(0, 0, 14)]), r"position \(z=0, y=0, x=14\) puts the 4x4x4 cube outside"),
        (dict(region=(0, 0, 8, 8)), r"\(z0, y0, x0, z1, y1, x1\)"),
        (dict(region=(0, 0, 0, 8, 8, 40)), "outside the 16x16x16 volume"),
        (dict(patch=(4, 4)), "one integer or 3"),
        (dict(patch=(4, 4, 20)), "larger than the volume"),
        (dict(stride=0), "stride must be positive"),
    ],
)
def test_bad_volume_requests_are_refused_before_any_work(small_volume_net, kwargs, message):
    volume = torch.rand(1, 16, 16, 16)
    with pytest.raises(ValueError, match=message):
        krypton.explain(small_volume_net, volume, **{"patch": 4, "stride": 4, **kwargs})


def test_an_image_of_five_dimensions_is_refused(small_volume_net):
    with pytest.raises(ValueError, match=r"\(C, D, H, W\) for a volume"):
        krypton.explain(small_volume_net, torch.rand(1, 1, 8, 8, 8))


# ---------------------------------------------------------------------------------------
# The memory budget
# ---------------------------------------------------------------------------------------


def test_a_volume_run_stays_inside_the_memory_budget():
    """Measured, in a fresh process: MONAI resnet10 on 48^3, 64 positions, batch 64 asked
    for. Exact mode's views (51 MB) and each occluded volume's live activations (4 x 27
    MB) leave room for a batch of 3 in 400 MB; with no budget the same run took its
    batch of 64 and peaked 330 MB above the process's memory after one inference (126 MB
    at the budget)."""
    mode = "exact"  # the mode with views beside its batches; naive is accounted the same
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("volume_peak.py")
    env = dict(os.environ, KRYPTON_MEMORY_BUDGET_MB="400")
    done = subprocess.run(
        [sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["positions"] == 64 and result["batch_size"] == 3
    assert result["extra_peak"] <= 400 * 2**20, result
    assert (result["views_mb"] > 40) == (mode == "exact")


def test_a_volume_run_that_cannot_fit_its_budget_is_refused(small_volume_net, monkeypatch):
    """An image's run always gets a batch of one; a volume's run whose views and one
    occluded volume exceed the budget is refused, saying what it needs."""
    from krypton._fingerprint import MemoryBudgetError

    monkeypatch.setenv("KRYPTON_MEMORY_BUDGET_MB", "1")  # the smallest budget allowed
    volume = torch.rand(1, 64, 64, 64)  # 1 MB of voxels: one occluded copy is over it
    for mode in ("exact", "naive"):
        with pytest.raises(MemoryBudgetError, match="over the memory budget of 1 MB"):
            krypton.explain(small_volume_net, volume, patch=8, stride=8, mode=mode)


# -- approximate mode on volumes ----------------------------------------------------------


def test_approximate_at_tau_1_without_drill_down_is_exact_on_a_volume(small_volume_net):
    torch.manual_seed(5)
    volume = torch.rand(1, 16, 16, 16)
    kwargs = dict(patch=4, stride=4, fill=0.5)
    exact = krypton.explain(small_volume_net, volume, **kwargs)
    approximate = krypton.explain(
        small_volume_net, volume, mode="approximate", tau=1.0, r_drill_down=1.0, **kwargs
    )
    np.testing.assert_allclose(approximate.values, exact.values, atol=1e-5, rtol=0)
    # projective-field thresholding per axis: fewer MACs, the same grid
    thresholded = krypton.explain(
        small_volume_net, volume, mode="approximate", tau=0.5, r_drill_down=1.0, **kwargs
    )
    assert thresholded.values.shape == exact.values.shape
    assert thresholded.macs_spent < exact.macs_spent
    assert np.abs(thresholded.values - exact.values).max() < 0.2


def test_drill_down_over_a_volume_refines_where_it_matters(small_volume_net):
    torch.manual_seed(6)
    volume = torch.rand(1, 24, 24, 24)
    kwargs = dict(patch=4, stride=2, fill=0.5)
    exact = krypton.explain(small_volume_net, volume, **kwargs)
    partial_pictures = []
    drilled = krypton.explain(
        small_volume_net, volume, mode="approximate", tau=1.0, r_drill_down=0.1, s1=6,
        partial=lambda values: partial_pictures.append(values.shape), **kwargs,
    )  # fmt: skip
    assert drilled.values.shape == exact.values.shape == (11, 11, 11)
    extra = drilled.extra
    assert extra["s1"] == 6 and extra["s2"] == 2
    # stage one: 0, 6, 12, 18 and the last position 20 on each axis
    assert extra["stage_one_positions"] == 5**3
    assert drilled.positions_evaluated == 5**3 + extra["stage_two_positions"] < 11**3
    # eq 28 on a volume's grid: positions fall with the cube of the stride
    assert extra["theoretical_drill_down_speedup"] == pytest.approx(6**3 / (2**3 + 0.1 * 6**3))
    on_stage_one = np.ix_(*(np.isin(axis, [0, 6, 12, 18, 20]) for axis in (drilled.zs,) * 3))
    np.testing.assert_allclose(drilled.values[on_stage_one], exact.values[on_stage_one], atol=1e-5)
    # refined cells are computed, not interpolated: they match exact too; among them
    # every cell of the block whose stage-one value is lowest ("drop")
    matches = np.isclose(drilled.values, exact.values, atol=1e-5)
    assert matches.sum() >= drilled.positions_evaluated
    stage_axis = np.array([0, 6, 12, 18, 20])
    stage_one = exact.values[np.ix_(*(np.isin(drilled.zs, stage_axis),) * 3)]
    lowest_block = np.unravel_index(np.argmin(stage_one), stage_one.shape)
    block = np.searchsorted(stage_axis, drilled.zs, side="right") - 1
    assert matches[np.ix_(*(block == b for b in lowest_block))].all()
    assert partial_pictures and all(shape == (11, 11, 11) for shape in partial_pictures)


def test_tau_is_tuned_over_volumes_as_over_images(small_volume_net):
    from krypton.tune import tune_tau

    torch.manual_seed(7)
    volumes = [torch.rand(1, 16, 16, 16) for _ in range(3)]
    record = tune_tau(
        small_volume_net, volumes[:2], patch=4, stride=2, fill=0.5, taus=(1.0, 0.8, 0.6),
        held_out=volumes[2:], log=lambda line: None,
    )  # fmt: skip
    assert record["sample_images"] == 2 and 0.6 <= record["chosen"]["tau"] <= 1.0
    assert record["mean_ssim_by_tau"]["1.0"] == pytest.approx(1.0)  # tau 1 is exact
    assert record["held_out"]["images"] == 1


def test_the_time_limit_scales_each_layer_by_the_share_a_centred_mask_changes():
    """bench.dropin's time limit: a net whose every layer is a 1x1x1 convolution changes
    only the mask's cells, so the limit nears volume / mask cells and nothing changes in
    full; a global mean and what follows it count in full."""
    from bench.dropin import time_limit

    torch.manual_seed(0)
    pointwise = nn.Sequential(
        nn.Conv3d(1, 32, 1), nn.ReLU(), nn.Conv3d(32, 32, 1), nn.AdaptiveAvgPool3d(1),
        nn.Flatten(), nn.Linear(32, 2),
    ).eval()  # fmt: skip
    limit, in_full = time_limit(pointwise, torch.randn(1, 1, 16, 16, 16), 8, batch=4)
    assert 2.0 < limit <= 8.0 and in_full < 0.5
    spreading = nn.Sequential(
        nn.Conv3d(1, 8, 9, padding=4), nn.Conv3d(8, 8, 9, padding=4), nn.AdaptiveAvgPool3d(1),
        nn.Flatten(), nn.Linear(8, 2),
    ).eval()  # fmt: skip
    limit, in_full = time_limit(spreading, torch.randn(1, 1, 16, 16, 16), 8, batch=4)
    assert limit < 1.3 and in_full > 0.5  # the second convolution's window is the whole map
