"""Volumes in: DICOM series (folder or zip) and NIfTI, checked before decoding, and
resampling to a model's voxel spacing. Series are made from pydicom's own CT slice."""

import zipfile

import nibabel
import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.uid import generate_uid

from bench.hostile_volumes import zipped
from krypton.io import _decoding
from krypton.io._decoding import ImageLoadError
from krypton.io.volumes import (
    Volume,
    read_dicom_series,
    read_multiframe_dicom,
    read_nifti,
    read_volume,
    resample,
)

ORIENTATION = [1.0, 0.0, 0.0, 0.0, 0.8, 0.6]  # rows along x, columns tilted: oblique slices
NORMAL = np.cross(ORIENTATION[:3], ORIENTATION[3:])


def write_series(folder, count=5, step=2.5, uid=None, positions=None, name=None):
    """``count`` slices of pydicom's CT_small, slice k holding k * 100 + its pixel index
    (stored values; the file's rescale slope/intercept turn them into HU), written in a
    shuffled order under names that do not sort by position."""
    template = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    uid = uid or generate_uid()
    rows, cols = template.Rows, template.Columns
    positions = positions if positions is not None else [k * step for k in range(count)]
    order = np.random.default_rng(0).permutation(len(positions))
    folder.mkdir(parents=True, exist_ok=True)
    for written, k in enumerate(order):
        dataset = template.copy()
        dataset.SeriesInstanceUID = uid
        dataset.SOPInstanceUID = generate_uid()
        dataset.ImageOrientationPatient = ORIENTATION
        dataset.ImagePositionPatient = list(np.array([10.0, -5.0, 3.0]) + positions[k] * NORMAL)
        dataset.PixelSpacing = [0.7, 0.9]
        pixels = (np.arange(rows * cols).reshape(rows, cols) % 50 + int(k) * 100).astype(np.int16)
        dataset.PixelData = pixels.tobytes()
        dataset.save_as(folder / f"{name or 'img'}{written:03d}.dcm", enforce_file_format=True)
    (folder / "README.txt").write_text("not a DICOM file: skipped")
    return template


def test_a_series_is_read_in_order_along_the_normal_in_hounsfield_units(tmp_path):
    template = write_series(tmp_path / "series")
    volume = read_dicom_series(tmp_path / "series")
    assert volume.shape == (5, template.Rows, template.Columns)
    assert volume.spacing == pytest.approx((2.5, 0.7, 0.9))
    slope, intercept = float(template.RescaleSlope), float(template.RescaleIntercept)
    for k in range(5):  # slice k holds k * 100 + (index % 50), stored; HU after the LUT
        expected = (k * 100 + np.arange(template.Rows * template.Columns) % 50) * slope
        np.testing.assert_allclose(volume.voxels[k].ravel(), expected + intercept)
    assert volume.modality == "CT" and volume.series_uid


def test_a_zip_of_the_series_reads_the_same(tmp_path):
    write_series(tmp_path / "series")
    archive = tmp_path / "series.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        for path in sorted((tmp_path / "series").iterdir()):
            zipped.write(path, f"scan/{path.name}")
    np.testing.assert_array_equal(
        read_volume(archive).voxels, read_volume(tmp_path / "series").voxels
    )


def test_a_slice_whose_pixel_data_will_not_parse_is_refused_by_name(tmp_path, monkeypatch):
    """Each file is parsed once, pixels included: a file whose header reads but whose
    whole parse fails is a broken slice, refused by name with an ImageLoadError (not
    skipped as a non-DICOM file, nor left to fail later as a raw parser error)."""
    write_series(tmp_path / "series")
    broken = (tmp_path / "series" / "img002.dcm").read_bytes()
    read = pydicom.dcmread

    def failing_on_the_broken_slice(source, *args, **kwargs):
        if not kwargs.get("stop_before_pixels") and source.getvalue() == broken:
            raise ValueError("pixel element runs past the end")
        return read(source, *args, **kwargs)

    monkeypatch.setattr(pydicom, "dcmread", failing_on_the_broken_slice)
    with pytest.raises(ImageLoadError, match=r"img002\.dcm: its pixel data cannot be read"):
        read_dicom_series(tmp_path / "series")


def test_a_slice_shorter_than_its_header_declares_is_refused_by_name(tmp_path):
    """A slice cut 100 bytes short loaded without a word: pydicom pads the missing pixel
    bytes with zeros, so the volume had a black band where the file ended."""
    write_series(tmp_path / "series")
    path = tmp_path / "series" / "img002.dcm"
    dataset = pydicom.dcmread(path)
    dataset.PixelData = dataset.PixelData[:-100]  # the header still declares 128x128x16 bits
    dataset.save_as(path)
    with pytest.raises(ImageLoadError, match=r"img002\.dcm is truncated: .* of the 32,768 bytes"):
        read_dicom_series(tmp_path / "series")


def test_mixed_series_are_refused_naming_each(tmp_path):
    write_series(tmp_path / "mixed", uid="1.2.3.4", name="a")
    write_series(tmp_path / "mixed", count=3, uid="1.2.3.5", name="b")
    with pytest.raises(ImageLoadError, match=r"mixes 2 series: .*1\.2\.3\.4 \(5 files\)"):
        read_dicom_series(tmp_path / "mixed")


@pytest.mark.parametrize(
    "positions, message",
    [
        ([0.0, 2.5, 5.0, 10.0, 12.5], "a gap between"),
        ([0.0, 2.5, 5.0, 5.0, 7.5], "slices closer than the rest"),
    ],
)
def test_gaps_and_duplicates_are_refused(tmp_path, positions, message):
    write_series(tmp_path / "series", positions=positions)
    with pytest.raises(ImageLoadError, match=message):
        read_dicom_series(tmp_path / "series")


def test_a_slice_in_another_orientation_is_refused(tmp_path):
    write_series(tmp_path / "series")
    path = sorted((tmp_path / "series").glob("*.dcm"))[2]
    dataset = pydicom.dcmread(path)
    dataset.ImageOrientationPatient = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    dataset.save_as(path)
    with pytest.raises(ImageLoadError, match="oriented differently"):
        read_dicom_series(tmp_path / "series")


def test_a_series_over_the_decode_budget_is_refused_before_decoding(tmp_path, monkeypatch):
    write_series(tmp_path / "series")
    monkeypatch.setattr(_decoding.DECODE_BUDGET, "limit_bytes", 300_000)  # files fit, decode not
    decoded = []
    monkeypatch.setattr(
        "krypton.io.dicom._decode_frame", lambda *args: decoded.append(args) or None
    )
    with pytest.raises(ImageLoadError, match="5x128x128 16-bit DICOM series.*decode budget"):
        read_dicom_series(tmp_path / "series")
    assert not decoded


def test_a_folder_without_dicom_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ImageLoadError, match="no DICOM files"):
        read_dicom_series(tmp_path)


def test_nifti_is_read_slices_first(tmp_path):
    data = np.random.default_rng(1).random((6, 5, 4)).astype(np.float32)  # (x, y, z)
    image = nibabel.Nifti1Image(data, np.diag([0.5, 0.75, 2.0, 1.0]))
    path = tmp_path / "volume.nii.gz"
    image.to_filename(str(path))
    volume = read_nifti(path)
    assert volume.shape == (4, 5, 6) and volume.spacing == (2.0, 0.75, 0.5)
    np.testing.assert_array_equal(volume.voxels, np.transpose(data, (2, 1, 0)))
    assert read_volume(path).shape == (4, 5, 6)


def test_a_nifti_file_over_the_decode_budget_is_refused(tmp_path, monkeypatch):
    image = nibabel.Nifti1Image(np.zeros((64, 64, 64), dtype=np.int16), np.eye(4))
    path = tmp_path / "big.nii"
    image.to_filename(str(path))
    monkeypatch.setattr(_decoding.DECODE_BUDGET, "limit_bytes", 1_000_000)
    with pytest.raises(ImageLoadError, match="64x64x64 NIfTI volume.*decode budget"):
        read_nifti(path)
    (tmp_path / "broken.nii.gz").write_bytes(b"not a nifti")
    with pytest.raises(ImageLoadError, match="not a NIfTI file"):
        read_nifti(tmp_path / "broken.nii.gz")


def test_resampling_to_a_model_spacing_keeps_the_extent():
    ramp = np.broadcast_to(np.arange(8, dtype=np.float32)[:, None, None], (8, 4, 4)).copy()
    volume = Volume(ramp, (2.0, 1.0, 1.0), "test")
    finer = resample(volume, (1.0, 1.0, 1.0))
    assert finer.shape == (16, 4, 4) and finer.spacing == (1.0, 1.0, 1.0)
    column = finer.voxels[:, 0, 0]
    assert np.all(np.diff(column) >= 0) and column[0] == 0 and column[-1] == 7
    assert resample(volume, (2.0, 1.0, 1.0)) is volume
    with pytest.raises(ValueError, match="three positive distances"):
        resample(volume, (1.0, 0.0, 1.0))


def test_a_series_read_and_resampled_is_explained_exactly(tmp_path):
    """Intake to heatmap: a series at 2.5 x 0.7 x 0.9 mm, resampled to the 2.5 x 2.8 x
    3.6 mm a model was trained on, explained in exact mode with naive's numbers."""
    import torch
    from torch import nn

    import krypton

    write_series(tmp_path / "series")
    volume = resample(read_dicom_series(tmp_path / "series"), (2.5, 2.8, 3.6))
    assert volume.shape == (5, 32, 32)
    voxels = torch.from_numpy((volume.voxels - volume.voxels.mean()) / volume.voxels.std())
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv3d(4, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool3d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    ).eval()
    kwargs = dict(patch=(2, 8, 8), stride=(1, 8, 8))
    exact = krypton.explain(model, voxels[None], mode="exact", strategy="incremental", **kwargs)
    naive = krypton.explain(model, voxels[None], mode="naive", **kwargs)
    assert exact.values.shape == (4, 4, 4)
    np.testing.assert_allclose(exact.values, naive.values, atol=1e-6, rtol=0)


def enhanced_from_series(folder, path, gap=False):
    """The series in ``folder`` converted by highdicom into one Legacy Converted Enhanced
    CT file (per-frame functional groups place each frame), frames in file-name order;
    with ``gap`` the last slice moved one more step out (a missing slice before it)."""
    import highdicom

    slices = [pydicom.dcmread(p) for p in sorted(folder.glob("*.dcm"))]
    converted = highdicom.legacy.LegacyConvertedEnhancedCTImage(
        slices, generate_uid(), 1, generate_uid(), 1
    )
    if gap:
        planes = [f.PlanePositionSequence[0] for f in converted.PerFrameFunctionalGroupsSequence]
        along = [float(np.array(p.ImagePositionPatient, float) @ NORMAL) for p in planes]
        last = planes[int(np.argmax(along))]
        last.ImagePositionPatient = list(np.array(last.ImagePositionPatient, float) + 2.5 * NORMAL)
    converted.save_as(path)
    return path


def test_an_enhanced_multiframe_file_reads_as_its_series_does(tmp_path):
    write_series(tmp_path / "series")
    series = read_dicom_series(tmp_path / "series")
    path = enhanced_from_series(tmp_path / "series", tmp_path / "enhanced.dcm")
    volume = read_volume(path)  # a file that is not NIfTI or a zip: multi-frame DICOM
    assert volume.source.startswith("multi-frame DICOM enhanced.dcm (5 frames)")
    np.testing.assert_allclose(volume.voxels, series.voxels)
    assert volume.spacing == pytest.approx(series.spacing)
    np.testing.assert_allclose(volume.affine, series.affine, atol=1e-6)


def test_a_series_affine_places_voxels_where_the_dicom_header_says(tmp_path):
    write_series(tmp_path / "series")
    volume = read_dicom_series(tmp_path / "series")
    # voxel (slice k, row r, column c): IPP_k + c * 0.9 * row cosine + r * 0.7 * column
    # cosine, in LPS; RAS flips x and y
    k, r, c = 3, 10, 20
    lps = (
        np.array([10.0, -5.0, 3.0]) + k * 2.5 * NORMAL
        + c * 0.9 * np.array(ORIENTATION[:3]) + r * 0.7 * np.array(ORIENTATION[3:])
    )  # fmt: skip
    np.testing.assert_allclose((volume.affine @ [k, r, c, 1])[:3], lps * [-1, -1, 1], atol=1e-9)


def test_multiframe_files_that_are_not_volumes_are_refused(tmp_path, monkeypatch):
    write_series(tmp_path / "series", count=6)
    gap = enhanced_from_series(tmp_path / "series", tmp_path / "gap.dcm", gap=True)
    with pytest.raises(ImageLoadError, match="do not form one evenly spaced volume"):
        read_multiframe_dicom(gap)
    with pytest.raises(ImageLoadError, match="holds one frame"):
        read_multiframe_dicom(get_testdata_file("CT_small.dcm"))
    with pytest.raises(ImageLoadError, match="no per-frame functional groups"):
        read_multiframe_dicom(get_testdata_file("examples_ybr_color.dcm"))
    whole = enhanced_from_series(tmp_path / "series", tmp_path / "whole.dcm")
    # the file (0.2 MB) fits, its 6x128x128 decode (1.6 MB) does not
    monkeypatch.setattr(_decoding.DECODE_BUDGET, "limit_bytes", 1_000_000)
    with pytest.raises(ImageLoadError, match="6x128x128 16-bit multi-frame DICOM.*decode budget"):
        read_multiframe_dicom(whole)


def test_a_zip_bomb_is_refused_before_anything_is_inflated(tmp_path, monkeypatch):
    """A few hundred kilobytes that inflate to 300 MB: refused from the archive's own
    directory, before one entry is read."""
    bomb = tmp_path / "series.zip"
    zeros = b"\0" * (100 * 2**20)
    bomb.write_bytes(zipped({f"slice{i}.dcm": zeros for i in range(3)}))
    assert bomb.stat().st_size < 2 * 2**20
    read = []
    monkeypatch.setattr(zipfile.ZipFile, "read", lambda *args: read.append(args))
    with pytest.raises(ImageLoadError, match="3 files of 300 MB together.*decode budget"):
        read_dicom_series(bomb)
    assert not read


def test_a_zip_that_lies_about_its_sizes_is_refused_as_damaged(tmp_path):
    """An entry declaring 10 bytes that holds 50 MB: zipfile inflates 10 and the CRC
    check says it is damaged — a message, never an unhandled BadZipFile."""
    import struct

    data = bytearray(zipped({"slice0.dcm": b"\0" * 50_000_000}))
    struct.pack_into("<I", data, 22, 10)  # the local header's inflated size
    struct.pack_into("<I", data, data.find(b"PK\x01\x02") + 24, 10)  # the directory's
    path = tmp_path / "liar.zip"
    path.write_bytes(bytes(data))
    with pytest.raises(ImageLoadError, match="slice0.dcm is damaged"):
        read_dicom_series(path)
