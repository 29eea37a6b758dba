"""A clinical CT as the scanner wrote it: the model sees the patient in its own
orientation however the series was stored, a series is read slice by slice within the
decode budget (never as a float volume), a map lies on the source voxels its model voxel
was made from, and a refusal names slices as a viewer shows them.

Before: the volume reached the model as stored (the same phantom read NODULE 0.84 axial,
NORMAL 0.75 feet-first, NORMAL 0.90 coronal); a 512 x 512 series cost 16 bytes a voxel
read whole (84 slices over the 256 MB default); a map voxel midway between two model
voxels took the lower; a missing slice was named by its temporary file."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from scipy.ndimage import zoom
from stored_ways import WAYS, source_to_phantom, stored

import krypton
from demo.pacs import ct_series
from krypton.io import _decoding
from krypton.io.model_grid import plan_grid
from krypton.io.series_intake import read_for_model, streamed_cost
from krypton.io.volumes import ImageLoadError, read_dicom_series
from krypton.render.parametric_map import drops_on_slices
from krypton.synthetic.chestct import ChestCTGenerator

SPACING = 2.5  # mm, every axis: the model's 5 mm is two source voxels


@pytest.fixture(scope="module")
def model():
    return krypton.registry.load_model("chestct-demo")


@pytest.fixture(scope="module")
def phantom() -> np.ndarray:
    """The nodule sample (48³ at 5 mm) at 2.5 mm isotropic, in the model's axes."""
    sample = ChestCTGenerator(seed=40).sample(label=1, nodules=1).volume
    return zoom(sample, 2.0, order=1).astype(np.float32)


def _save(datasets, folder):
    folder.mkdir()
    for number, dataset in enumerate(datasets):  # file names in no slice order
        name = f"{(number * 37) % len(datasets):05d}.dcm"
        dataset.save_as(folder / name, enforce_file_format=True)
    return folder


@pytest.fixture(scope="module")
def explained(model, phantom, tmp_path_factory):
    """Each way's series read as the CLI, batch and the workers read it, explained."""
    found = {}
    for way in WAYS:
        datasets = stored(phantom, SPACING, way)
        folder = _save(datasets, tmp_path_factory.mktemp("ways") / way)
        prepared, geometry = model.read_volume(folder)
        heatmap = krypton.explain(model, prepared.tensor, patch=16, stride=16, mode="exact",
                                  fill=model.gray_fill())  # fmt: skip
        found[way] = (datasets, folder, prepared, geometry, heatmap)
    return found


def test_every_way_a_scanner_stores_the_phantom_gives_one_answer_and_one_map(explained):
    axial = explained["axial"][4]
    for way in WAYS:
        _, _, prepared, _, heatmap = explained[way]
        assert heatmap.label == axial.label, way
        assert abs(heatmap.prob - axial.prob) <= 0.01, way
        assert np.allclose(heatmap.values, axial.values, atol=1e-4), way  # cell for cell
        assert prepared.orientation.endswith("to the model's SPL"), (way, prepared.orientation)
    assert explained["coronal"][2].orientation == "PIL to the model's SPL"  # said as stored
    assert explained["feet-first"][2].orientation == "IPR to the model's SPL"
    assert explained["sagittal"][2].orientation == "RIP to the model's SPL"


def test_each_way_s_map_lies_on_the_same_patient_voxels(model, explained):
    """The drop written back onto each way's own slices, looked up at the phantom voxel
    each source pixel is: the same at every voxel, whichever way it was stored."""
    maps = {}
    for way in ("axial", "feet-first", "coronal", "sagittal"):
        datasets, _, prepared, _, heatmap = explained[way]
        drops = np.asarray(heatmap.prob - np.nan_to_num(heatmap.values), np.float32)
        block = np.repeat(np.repeat(np.repeat(drops, 16, 0), 16, 1), 16, 2)
        pixels = drops_on_slices(block, prepared.affine, datasets)
        placed = np.full((96, 96, 96), np.nan, np.float32)
        for frame, where in zip(pixels, source_to_phantom(datasets, SPACING), strict=True):
            placed[where[..., 0], where[..., 1], where[..., 2]] = frame
        maps[way] = placed
    for way, placed in maps.items():
        assert not np.isnan(placed).any(), way
        assert np.allclose(placed, maps["axial"], atol=1e-4), way


def test_a_tilted_series_says_how_far_off_axis_it_is(model, phantom, tmp_path):
    folder = _save(stored(phantom, SPACING, "tilted", tilt=10.0), tmp_path / "tilted")
    prepared, _ = model.read_volume(folder)
    assert prepared.orientation == "SPL to the model's SPL; 10° off axis, taken to its closest axes"
    assert abs(prepared.off_axis_degrees - 10.0) < 1e-6


def test_the_cli_says_the_turn_and_reads_the_same(explained, capsys):
    from krypton.cli.main import main

    _, folder, _, _, heatmap = explained["coronal"]
    out = folder.parent / "coronal-out"
    assert main(["explain", str(folder), "--model", "chestct-demo", "--patch", "16",
                 "--stride", "16", "--out", str(out)]) == 0  # fmt: skip
    said = capsys.readouterr().out
    assert "orientation PIL to the model's SPL" in said
    assert f"probability {heatmap.prob:.4f}" in said


def test_the_page_streams_a_series_upload_into_the_same_block(model, explained):
    import io
    import zipfile

    from webapp.runs.volumes import prepare_uploaded_volume, read_uploaded_source

    _, folder, prepared, _, _ = explained["sagittal"]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted(folder.iterdir()):
            archive.write(path, path.name)
    uploaded = read_uploaded_source(buffer.getvalue(), "sagittal.zip")
    assert uploaded.volume is None and uploaded.shape == (96, 96, 96)  # no voxels kept
    block, geometry = prepare_uploaded_volume(buffer.getvalue, "sagittal.zip", model, uploaded)
    assert geometry.source.startswith("sagittal.zip")
    assert np.array_equal(block.tensor.numpy(), prepared.tensor.numpy())


def test_a_one_cell_map_lies_exactly_over_the_source_voxels_of_its_model_voxel():
    """Model voxel (20, 21, 22) alone non-zero, written back onto 0.7 mm slices 1.25 mm
    apart (k = 5 / 0.7 and 5 / 1.25 source voxels a model voxel): the pixels it takes are
    exactly those whose centres lie in its extent, ``[(n + c) k - 0.5, (n + c + 1) k -
    0.5)`` in source indices; midway centres do not go to the lower voxel."""
    shape, spacing = (120, 160, 150), (1.25, 0.7, 0.7)
    datasets = ct_series(np.zeros((shape[0], 2, 2), np.float32), spacing, "Cell^Test")
    for dataset in datasets:
        dataset.Rows, dataset.Columns = shape[1:]
    affine = np.diag([-1.0, -1.0, 1.0, 1.0]) @ np.array(
        [[0, 0, 0.7, 0], [0, 0.7, 0, 0], [1.25, 0, 0, 0], [0, 0, 0, 1.0]]
    )
    grid = plan_grid(shape, spacing, affine, (5.0, 5.0, 5.0), (48, 48, 48), "SPL")
    one = np.zeros((48, 48, 48), np.float32)
    one[20, 21, 22] = 1.0
    pixels = drops_on_slices(one, grid.affine, datasets)
    taken = np.argwhere(pixels > 0)
    for axis, n in zip(range(3), (20, 21, 22), strict=True):
        spec = grid.axes[axis]
        low, high = (n + spec.corner) * spec.scale - 0.5, (n + spec.corner + 1) * spec.scale - 0.5
        expected = [i for i in range(shape[axis]) if low <= i < high]
        assert sorted(set(taken[:, axis])) == expected, axis
    assert len(taken) == np.prod([len(set(taken[:, a])) for a in range(3)])  # one block


def test_a_map_voxel_midway_between_two_cells_takes_the_higher_and_no_more(model):
    from krypton.render.volumes import voxel_values

    class Cells:  # two cells of stride 5, patch 8: centres 3.5 and 8.5
        values = np.array([[[1.0, 2.0]]], np.float32)
        axes = (np.array([0]), np.array([0]), np.array([0, 5]))
        patch = 8

    along = voxel_values(Cells, (8, 8, 14))[3, 3]
    assert along[6] == 2.0  # 2.5 from both centres: the higher cell's, not the lower's
    assert np.isnan(along[11]) and along[10] == 2.0  # [6, 11): five voxels, not six
    assert np.isnan(along[0]) and along[1] == 1.0  # [1, 6)


def test_a_missing_slice_is_named_by_instance_number_and_position(phantom, tmp_path):
    datasets = stored(phantom[:12, :32, :32], SPACING, "axial")
    del datasets[4]  # instance 5
    folder = _save(datasets, tmp_path / "gap")
    with pytest.raises(ImageLoadError) as refused:
        read_dicom_series(folder)
    said = str(refused.value)
    assert "between instance 4 (at -142.5 mm) and instance 6 (at -137.5 mm)" in said, said
    assert "about 1 slice missing" in said and ".dcm" not in said


def test_a_512_by_512_by_600_ct_fits_the_default_budget_read_slice_by_slice():
    cost = streamed_cost(600, 512, 512, 16, (48, 48, 48), 512 * 512 * 2 + 4096)
    assert cost <= _decoding.DEFAULT_DECODE_BUDGET_MB * 2**20
    whole_float_volume = 600 * 512 * 512 * 4
    assert cost < whole_float_volume / 5


def test_a_series_larger_than_the_budget_as_floats_is_read_within_it(model, tmp_path, monkeypatch):
    """60 slices of 512 x 512 are 63 MB as floats (and cost 252 MB read whole); with a
    24 MB budget the series is still read, and the reader's peak stays near one slice."""
    rng = np.random.default_rng(3)
    hu = rng.normal(-600, 200, size=(60, 512, 512)).astype(np.float32)
    folder = _save(ct_series(hu, (1.25, 0.7, 0.7), "Big^Series"), tmp_path / "big")
    monkeypatch.setattr(_decoding.DECODE_BUDGET, "limit_bytes", 24 * 2**20)
    with pytest.raises(ImageLoadError, match="decode budget"):
        read_dicom_series(folder)  # the whole float volume: refused
    tracemalloc.start()
    prepared, geometry = read_for_model(folder, model.volume_target())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert geometry.shape == (60, 512, 512) and prepared.tensor.shape == (1, 48, 48, 48)
    assert peak < 24 * 2**20, peak


def test_batch_and_the_workers_read_every_way_as_the_axial_series(model, explained):
    """krypton batch and the Celery workers explain a series through explain_item."""
    from krypton.batch.folder import explain_item

    options = {"patch": 16, "stride": 16, "mode": "exact", "fill": model.gray_fill()}
    axial = explained["axial"][4]
    for way in ("feet-first", "sagittal"):
        row, files = explain_item(explained[way][1], None, model, options, image=way)
        assert not row.error, row.error
        heatmap = row.extra["heatmap"]
        assert heatmap.label == axial.label and abs(heatmap.prob - axial.prob) <= 0.01, way
        assert np.allclose(heatmap.values, axial.values, atol=1e-4), way


def test_every_way_s_report_draws_the_strongest_cell_where_its_map_holds_it(
    model, explained, monkeypatch
):
    """The finding's Structured Report, for each way a scanner stores the phantom
    (feet-first, coronal, sagittal, tilted 10°): its rectangle lies on a source slice
    whose map frame holds the strongest cell's drop at the rectangle's centre, and every
    way reports the same class and drop."""
    import highdicom as hd

    from krypton.pacs import dicomweb, results

    said = set()
    stored_now: list = []
    monkeypatch.setattr(dicomweb, "store", lambda p, found, s: stored_now.extend(found))
    for way in WAYS:
        datasets, _, prepared, _, heatmap = explained[way]
        stored_now.clear()
        source = results.VolumeSource(prepared, datasets)
        settings = {"patch": 16, "stride": 16, "label": heatmap.label}
        results.send_result(None, "1.2", model, heatmap, source, "KRYPTON_TEST", settings)
        (pmap,) = [d for d in stored_now if d.SOPClassUID == results.PARAMETRIC_MAP_STORAGE]
        (report,) = [d for d in stored_now if d.SOPClassUID == "1.2.840.10008.5.1.4.1.1.88.34"]
        parsed = hd.sr.Comprehensive3DSR.from_dataset(report)
        (group,) = parsed.content.get_planar_roi_measurement_groups()
        region = group.roi
        image = region.ContentSequence[0].ReferencedSOPSequence[0].ReferencedSOPInstanceUID
        frame = next(
            number for number, g in enumerate(pmap.PerFrameFunctionalGroupsSequence)
            if g.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID
            == image
        )  # fmt: skip
        corners = np.asarray(region.GraphicData, dtype=np.float64).reshape(-1, 2)[:4]
        column, row = (corners.min(axis=0) + corners.max(axis=0)) / 2
        drop = {m.name.value: m.value for m in group.get_measurements()}["DROP"]
        on_map = np.asarray(pmap.pixel_array, dtype=np.float32)[frame][int(row), int(column)]
        assert on_map == pytest.approx(drop, abs=1e-5), way
        said.add((group.finding_type.meaning, round(float(drop), 2)))
    assert len(said) == 1, said
