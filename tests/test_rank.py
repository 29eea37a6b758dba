"""The library where rank is a number (MONAI's way): one grid for any rank, a region as
(low, high) per axis in tensor order beside the public flat forms, one explain path for
images and volumes (a rectangular image patch as a volume's box), one ``prepare``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import same_cells
from PIL import Image
from torch import nn

import krypton
from krypton.explainer import grid, grid_positions


def small_net(rank: int) -> nn.Module:
    conv = nn.Conv2d if rank == 2 else nn.Conv3d
    pool = nn.AdaptiveAvgPool2d if rank == 2 else nn.AdaptiveAvgPool3d
    torch.manual_seed(0)
    return nn.Sequential(
        conv(2, 4, 3, padding=1), nn.ReLU(), conv(4, 4, 3, stride=2, padding=1), nn.ReLU(),
        pool(1), nn.Flatten(), nn.Linear(4, 3),
    ).eval()  # fmt: skip


def test_one_grid_for_any_rank_in_tensor_order():
    """Two grid functions (an image's (ys, xs) from (x0, y0, x1, y1), a volume's from
    (z0, y0, x0, z1, y1, x1)) become one: per axis c0, c0 + stride, ... while the patch
    fits, for rank 1, 2, 3 or 4, the region as (low, high) or the old flat forms."""
    ys, xs = grid((20, 24), 4, (2, 3))
    assert ys.tolist() == list(range(0, 17, 2)) and xs.tolist() == list(range(0, 21, 3))
    # an image's public region (x0, y0, x1, y1) is (low, high) = ((y0, x0), (y1, x1))
    flat, paired = grid((20, 24), 4, 2, (4, 2, 20, 18)), grid((20, 24), 4, 2, ((2, 4), (18, 20)))
    assert [a.tolist() for a in flat] == [a.tolist() for a in paired]
    old = grid_positions((20, 24), 4, 2, (4, 2, 20, 18))
    assert [a.tolist() for a in flat] == [a.tolist() for a in old]
    assert [a.tolist() for a in paired] == [list(range(2, 15, 2)), list(range(4, 17, 2))]
    # a volume's flat region is already in tensor order
    zs, ys, xs = grid((10, 12, 14), (2, 3, 4), 3, (1, 2, 3, 9, 12, 14))
    assert (zs.tolist(), ys.tolist(), xs.tolist()) == ([1, 4, 7], [2, 5, 8], [3, 6, 9])
    assert [a.tolist() for a in grid((10, 12, 14), (2, 3, 4), 3, ((1, 2, 3), (9, 12, 14)))] == [
        zs.tolist(),
        ys.tolist(),
        xs.tolist(),
    ]
    # rank is a number: a signal and a 4-D input take the same rule
    assert [a.tolist() for a in grid((10,), 3, 2)] == [[0, 2, 4, 6]]
    assert [len(a) for a in grid((6, 6, 6, 6), 2, 2)] == [3, 3, 3, 3]


@pytest.mark.parametrize(
    "sizes, patch, region, message",
    [
        ((32, 32), 40, None, "patch 40 is larger than the image (32x32 pixels)"),
        ((32, 32), 16, (0, 0, 10, 10), "patch 16 is larger than the region (10x10 pixels)"),
        ((32, 32), 4, (0, 0, 40, 20), "outside the 32x32 image or empty"),
        ((8, 9, 10), 4, ((0, 0, 0), (8, 9, 11)), "outside the 8x9x10 volume or empty"),
        ((8, 9, 10), (4, 4), None, "patch must be one integer or 3"),
        ((8, 9, 10), 4, (1, 2, 3), "a volume's region must be (z0, y0, x0, z1, y1, x1)"),
    ],
)
def test_the_grid_says_what_to_change(sizes, patch, region, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        grid(sizes, patch, 2, region)


def test_an_image_takes_a_rectangular_patch_and_a_region_per_axis_as_a_volume_does():
    """The image path forked from the volume's on ``image.dim() == 4``: an image's patch
    had to be one int and its region the flat (x0, y0, x1, y1). One path now: a
    (height, width) patch and stride, exact equal to naive, drawn over its own area; a
    region as (low, high) gives the flat form's heatmap."""
    from krypton.render.overlay import overlay

    model, image = small_net(2), torch.rand(2, 20, 24)
    naive = krypton.explain(model, image, patch=(4, 6), stride=(2, 3), mode="naive")
    exact = krypton.explain(model, image, patch=(4, 6), stride=(2, 3), mode="exact")
    assert naive.values.shape == (9, 7) and naive.patch == (4, 6) and naive.stride == (2, 3)
    np.testing.assert_allclose(exact.values, naive.values, atol=1e-6)
    flat = krypton.explain(model, image, patch=4, stride=2, mode="exact", region=(4, 2, 20, 18))
    paired = krypton.explain(model, image, patch=4, stride=2, mode="exact",
                             region=((2, 4), (18, 20)))  # fmt: skip
    same_cells(flat.values, paired.values)
    assert flat.ys.tolist() == list(range(2, 15, 2)) and flat.xs.tolist() == list(range(4, 17, 2))
    # listed positions: an image's are (x, y) as always, a volume's (z, y, x)
    listed = krypton.explain(model, image, patch=4, positions=[(4, 2)], mode="exact")
    assert listed.position_values() == [(4, 2, pytest.approx(float(flat.values[0, 0])))]
    picture = Image.new("RGB", (24, 20))
    drawn = np.asarray(overlay(picture, naive.values, naive.xs, naive.ys, naive.patch, naive.prob))
    # the cells tile x 3 - 1.5 + 3 * 7 wide from x = 1.5: nothing drawn left of it
    assert drawn[:, :1].sum() == 0 and drawn[:, 2:22].sum() > 0


def test_a_volume_and_an_image_are_refused_alike_outside_their_input():
    model, volume = small_net(3), torch.rand(2, 8, 9, 10)
    with pytest.raises(ValueError, match=r"position \(z=6, y=0, x=0\) puts the 4x4x4 cube"):
        krypton.explain(model, volume, patch=4, positions=[(6, 0, 0)])
    with pytest.raises(ValueError, match=r"position \(x=30, y=0\) puts the 4-pixel patch"):
        krypton.explain(small_net(2), torch.rand(2, 32, 32), patch=4, positions=[(30, 0)])
    heatmap = krypton.explain(model, volume, patch=4, stride=(2, 3, 3), mode="exact",
                              region=((0, 0, 0), (8, 9, 10)))  # fmt: skip
    assert heatmap.values.shape == (3, 2, 3)


def test_one_prepare_takes_a_picture_or_a_volume_by_the_models_rank():
    from krypton.io.volumes import Volume

    image_model = krypton.load_model("fundus-demo")
    picture = Image.new("RGB", (300, 200), (120, 60, 30))
    torch.testing.assert_close(image_model.prepare(picture), image_model.preprocess(picture))
    volume_model = krypton.load_model("chestct-demo")
    rng = np.random.default_rng(0)
    volume = Volume(rng.normal(-700, 50, (40, 64, 64)).astype(np.float32), (5.0, 5.0, 5.0), "made")
    torch.testing.assert_close(
        volume_model.prepare(volume), volume_model.prepare_volume(volume).tensor
    )
    with pytest.raises(ValueError, match="3-D model; it explains volumes, not images"):
        volume_model.prepare(picture)
    with pytest.raises(ValueError, match="2-D model; it explains images, not volumes"):
        image_model.prepare(volume)
    with pytest.raises(TypeError, match="a PIL image or a krypton.io.volumes.Volume"):
        image_model.prepare(np.zeros((3, 4, 4)))


def test_approximate_mode_reads_a_region_given_per_axis():
    """Drill-down's stage-one stride is set by the region's width (eq 30); it read the
    flat form only and broke on (low, high)."""
    model, image = small_net(2), torch.rand(2, 40, 40)
    options = dict(patch=4, stride=2, mode="approximate", tau=1.0, target_speedup=1.5)
    flat = krypton.explain(model, image, region=(8, 4, 40, 36), **options)
    paired = krypton.explain(model, image, region=((4, 8), (36, 40)), **options)
    assert flat.extra["s1"] == paired.extra["s1"]
    same_cells(flat.values, paired.values)


def test_the_settings_are_one_record_held_once():
    """krypton.explain and OcclusionExplainer.explain wrote the same 21 keyword arguments
    out twice, with their defaults, and forwarded them one by one. Both take one
    ExplainSettings now, or its fields as keywords; their signatures are built from it,
    so help() and inspect still show every setting with its default."""
    import inspect

    from krypton import ExplainSettings, OcclusionExplainer

    fields = list(ExplainSettings.__dataclass_fields__)
    assert len(fields) == 21  # threads: the caller's, else the host's share
    for function in (krypton.explain, OcclusionExplainer.explain):
        parameters = inspect.signature(function).parameters
        for name in fields:
            assert parameters[name].default == getattr(ExplainSettings(), name), name
    model, image = small_net(2), torch.rand(2, 16, 16)
    settings = ExplainSettings(patch=4, stride=4, mode="naive")
    record = krypton.explain(model, image, settings)
    keywords = krypton.explain(model, image, patch=4, stride=4, mode="naive")
    same_cells(record.values, keywords.values)
    # a keyword changes the record it is given; the record itself is left as it was
    exact = OcclusionExplainer(model).explain(image, settings, mode="exact")
    assert exact.mode == "exact" and settings.mode == "naive"
    np.testing.assert_allclose(exact.values, record.values, atol=1e-6)
    with pytest.raises(TypeError, match="unexpected keyword argument.*stirde"):
        krypton.explain(model, image, stirde=4)
    with pytest.raises(TypeError, match="must be an ExplainSettings, got 8"):
        krypton.explain(model, image, 8)


def test_one_prediction_of_an_image_or_a_volume_gives_the_probabilities_and_the_ood_verdict():
    """The app asked the explainer three times for what one prediction is (views, the
    OOD check, and for a volume a forward pass of its own); ``predict`` is that one
    call, for either rank, and its views serve the run that follows."""
    image_model = krypton.load_model("fundus-demo")
    explainer = krypton.OcclusionExplainer(image_model)
    picture = image_model.prepare(Image.new("RGB", (300, 200), (120, 60, 30)))
    found = explainer.predict(picture)
    with torch.inference_mode():
        logits = image_model.module(picture.unsqueeze(0))
    np.testing.assert_allclose(found.probabilities, torch.softmax(logits[0], 0).numpy(), atol=1e-5)
    assert found.capture_error is None and found.ood == explainer.ood_report(picture)
    assert explainer.predict(picture, ood=False).ood is None
    graph, views = explainer.views_for(picture)
    heatmap = explainer.explain(picture, patch=64, stride=64, mode="exact")
    assert explainer.views_for(picture)[1] is views  # the prediction's views, reused
    np.testing.assert_allclose(heatmap.base_probs, found.probabilities, atol=1e-6)

    volume_model = krypton.load_model("chestct-demo")
    from krypton.io.volumes import Volume

    rng = np.random.default_rng(0)
    volume = Volume(rng.normal(-700, 50, (40, 64, 64)).astype(np.float32), (5.0, 5.0, 5.0), "made")
    tensor = volume_model.prepare(volume)
    plain = krypton.OcclusionExplainer(volume_model)
    seen = plain.predict(tensor, views=False)
    assert not plain._views  # one plain forward pass: nothing materialised
    with torch.inference_mode():
        logits = volume_model.module(tensor.unsqueeze(0))
    np.testing.assert_allclose(seen.probabilities, torch.softmax(logits[0], 0).numpy(), atol=1e-5)


def test_a_model_torch_fx_cannot_capture_is_predicted_plainly_and_says_why():
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 2, 3)

        def forward(self, x):
            y = self.conv(x).mean((2, 3))
            if y.sum() > 1e9:  # data-dependent control flow: fx cannot trace it
                return -y
            return y

    torch.manual_seed(0)
    model = Branchy().eval()
    found = krypton.OcclusionExplainer(model).predict(torch.randn(3, 8, 8))
    assert found.capture_error and found.probabilities.shape == (2,)
    assert found.ood is None  # no reference set: nothing to say
