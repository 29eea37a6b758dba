"""A volume's Parametric Map lies on the source's own grid, in the order a viewer fills:
one frame per source slice with its rows, columns and spacing, a per-frame reference to
that slice, frames ascending along the slice normal, each pixel the drop of the model
voxel (so of the cell) its centre falls in. Tried on CTs at geometries other than the
model's: 40 x 128 x 128 slices 6 mm apart at 1.875 mm, and a clinical 512 x 512 at 0.7 mm.
Before, every map was a 48-frame 48 x 48 block at 5 mm whatever the CT, which OHIF cannot
overlay ("Parametric map have different geometry dimensions"), and its frames ran from
high z to low z, which OHIF drew mirrored head to foot."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.ndimage import zoom
from test_pacs import dciodvfy_errors

import krypton
from demo.pacs import ct_series
from krypton.io.volumes import Volume, _series_affine
from krypton.render.parametric_map import RAS_TO_LPS, drop_values, parametric_map
from krypton.render.volumes import lowest_voxel
from krypton.synthetic.chestct import ChestCTGenerator


@pytest.fixture(scope="module")
def model():
    return krypton.registry.load_model("chestct-demo")


def _ct(shape_zyx: tuple[int, int, int], spacing: tuple[float, float, float]) -> list:
    """The nodule sample (48³ at 5 mm) resampled onto another grid over the same body,
    padded with air where the new grid is larger: a CT series of that geometry."""
    sample = ChestCTGenerator(seed=40).sample(label=1, nodules=1).volume
    covered = [round(48 * 5.0 / s) for s in spacing]
    moved = zoom(sample, [c / 48 for c in covered], order=1)
    hu = np.full(shape_zyx, -1000.0, dtype=np.float32)
    take = [min(a, b) for a, b in zip(shape_zyx, moved.shape, strict=True)]
    hu[: take[0], : take[1], : take[2]] = moved[: take[0], : take[1], : take[2]]
    return ct_series(hu, spacing, "Grid^Test", origin=(-120.0, -120.0, -60.0))


def _explained(model, datasets):
    prepared = model.prepare_volume(_volume_of(datasets))
    heatmap = krypton.explain(
        model, prepared.tensor, patch=16, stride=16, mode="exact", fill=model.gray_fill()
    )
    return prepared, heatmap


def _volume_of(datasets) -> Volume:
    """The series as the series reader makes it (slope and intercept applied)."""
    hu = np.stack([d.pixel_array * float(d.RescaleSlope) + float(d.RescaleIntercept)
                   for d in datasets]).astype(np.float32)  # fmt: skip
    step = float(datasets[1].ImagePositionPatient[2]) - float(datasets[0].ImagePositionPatient[2])
    spacing = (step, *(float(v) for v in datasets[0].PixelSpacing))
    affine = _series_affine(datasets[0], step, spacing[1:])
    return Volume(hu, spacing, "series", affine=affine)


GEOMETRIES = {
    "40x128x128-6mm": ((40, 128, 128), (6.0, 1.875, 1.875)),
    "48x512x512-0.7mm": ((48, 512, 512), (5.0, 0.7, 0.7)),
}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_the_map_lies_on_the_source_grid_in_ascending_order(model, geometry, tmp_path):
    shape, spacing = GEOMETRIES[geometry]
    datasets = _ct(shape, spacing)
    prepared, heatmap = _explained(model, datasets)
    shuffled = datasets[::-1]  # the order a PACS lists them in is no order at all
    created = parametric_map(
        heatmap, tuple(model.input_size), prepared.affine, shuffled, model_name=model.name,
        class_name="NODULE", content_label="KRYPTON_TEST", comments="",
    )  # fmt: skip
    assert int(created.NumberOfFrames) == shape[0]  # OHIF reads no map of fewer frames
    assert (created.Rows, created.Columns) == shape[1:]
    groups = created.PerFrameFunctionalGroupsSequence
    shared = created.SharedFunctionalGroupsSequence[0]
    assert [float(v) for v in shared.PixelMeasuresSequence[0].PixelSpacing] == list(spacing[1:])
    z = [float(g.PlanePositionSequence[0].ImagePositionPatient[2]) for g in groups]
    assert z == sorted(z) and len(set(z)) == len(z)  # ascending along the normal (+z)
    by_uid = {d.SOPInstanceUID: d for d in datasets}
    for group, position in zip(groups, z, strict=True):
        (derivation,) = group.DerivationImageSequence
        (source,) = derivation.SourceImageSequence
        referenced = by_uid[source.ReferencedSOPInstanceUID]  # each frame names its slice
        assert float(referenced.ImagePositionPatient[2]) == position

    pixels = np.asarray(created.pixel_array, dtype=np.float32)
    drops = drop_values(heatmap, tuple(model.input_size))
    # every pixel is one cell's drop (or 0 beyond the block): the values stay exact
    cells = np.unique(np.round(drops, 6))
    assert np.isin(np.round(np.unique(pixels), 6), np.append(cells, 0.0)).all()
    assert abs(float(pixels.max()) - float(drops.max())) <= 1e-6
    # the slices that hold the largest drop are the strongest cell's, within one slice
    strongest = np.array([*lowest_voxel(heatmap), 1.0])
    centre_z = float((RAS_TO_LPS @ prepared.affine @ strongest)[2])
    holding = [position for position, frame in zip(z, pixels, strict=True)
               if frame.max() >= pixels.max() - 1e-6]  # fmt: skip
    assert min(holding) - spacing[0] <= centre_z <= max(holding) + spacing[0]
    assert abs(np.mean(holding) - centre_z) <= 16 * 5.0 / 2 + spacing[0]  # inside the cell
    voi = shared.FrameVOILUTSequence[0]
    assert voi.WindowCenterWidthExplanation == "0 to the largest drop"  # one value
    assert len(created.SeriesDescription) <= 64 and "stride 16" in created.SeriesDescription
    assert dciodvfy_errors(created, tmp_path) == []


def test_a_flagged_run_carries_its_warning_into_the_map(model):
    datasets = _ct((40, 128, 128), (6.0, 1.875, 1.875))
    prepared, heatmap = _explained(model, datasets)
    heatmap.extra["ood"] = {"flagged": True, "warning": "Unlike the training images",
                            "score": 9.1, "threshold": 2.8, "stage": "penultimate"}  # fmt: skip
    created = parametric_map(
        heatmap, tuple(model.input_size), prepared.affine, datasets, model_name=model.name,
        class_name="NODULE", comments=krypton.registry.ood.caveat(heatmap.extra["ood"]),
    )  # fmt: skip
    assert "Unlike the training images (unusualness 9.1" in created.ImageComments


def test_a_long_model_and_class_keep_the_stride_in_the_description():
    from krypton.render.parametric_map import series_description

    described = series_description(
        "approximate", "chest-ct-finetuned-on-our-site-2026-v12", "GROUND_GLASS_OPACITY",
        (8, 16, 16), 4,
    )  # fmt: skip
    assert len(described) <= 64
    assert described.startswith("approximate, chest-ct") and ", GROUND_GLA" in described
    assert described.endswith("patch 8x16x16, stride 4")


def test_a_shipped_model_and_class_are_never_cut_in_the_description():
    """The words "Krypton exact, " and ", class " left 16 characters for the model: the map's
    series read "chestct-slice-d~". The words give way before a name is cut."""
    from krypton.render.parametric_map import series_description

    shipped = (("chestct-slice-demo", (16, 8)), ("chestct-slice-demo", (32, 16)),
               ("chestct-demo", ((4, 16, 16), (2, 8, 8))), ("chestct-demo", (12, 6)))  # fmt: skip
    for mode in ("exact", "naive", "approximate"):
        for model, (patch, stride) in shipped:
            described = series_description(mode, model, "NODULE", patch, stride)
            assert len(described) <= 64 and "~" not in described, described
            assert model in described and "NODULE" in described, described
    assert series_description("exact", "fundus-demo", "EXUDATE", 16, 8) == (
        "Krypton exact, fundus-demo, class EXUDATE, patch 16, stride 8"
    )
