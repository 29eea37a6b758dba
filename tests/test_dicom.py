"""DICOM intake on files pydicom ships: modality LUT and windowing checked against
pydicom's own apply_modality_lut / apply_voi_lut, MONOCHROME1, frames, colour, compressed
syntaxes, bad files — and no identifying tag in anything Krypton reports."""

import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.pixels import apply_modality_lut, apply_voi_lut

import krypton
from krypton.dicom import WINDOW_PRESETS, is_dicom, load_dicom, parse_window
from krypton.imaging import ImageLoadError, load_image
from test_cli import run_cli

CT = get_testdata_file("CT_small.dcm")
MR = get_testdata_file("MR_small.dcm")


def gray(picture):
    array = np.asarray(picture)
    assert (array[..., 0] == array[..., 1]).all() and (array[..., 1] == array[..., 2]).all()
    return array[..., 0].astype(np.float64)


def pydicom_windowed(dataset, values):
    """pydicom's windowing of modality-LUT values, scaled from its output range to 0-255."""
    windowed = apply_voi_lut(values, dataset, prefer_lut=False)
    bits = dataset.BitsStored
    low, high = (
        (0, 2**bits - 1)
        if dataset.PixelRepresentation == 0
        else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    )
    if "RescaleSlope" in dataset:
        low = low * float(dataset.RescaleSlope) + float(dataset.RescaleIntercept)
        high = high * float(dataset.RescaleSlope) + float(dataset.RescaleIntercept)
    return np.round((windowed - low) / (high - low) * 255)


def test_mr_window_from_the_file_matches_pydicom():
    dataset = pydicom.dcmread(MR)
    values = apply_modality_lut(dataset.pixel_array, dataset)
    loaded = load_dicom(MR)
    assert loaded.window_source == "file" and loaded.window == (600.0, 1600.0)
    np.testing.assert_allclose(gray(loaded.picture), pydicom_windowed(dataset, values), atol=1)
    assert loaded.pixel_spacing == (0.3125, 0.3125)


@pytest.mark.parametrize("preset", sorted(WINDOW_PRESETS))
def test_ct_signed_16_bit_with_presets_matches_pydicom(preset):
    dataset = pydicom.dcmread(CT)
    assert dataset.PixelRepresentation == 1 and "RescaleIntercept" in dataset
    values = apply_modality_lut(dataset.pixel_array, dataset)  # Hounsfield units
    centre, width = WINDOW_PRESETS[preset]
    dataset.WindowCenter, dataset.WindowWidth = centre, width
    loaded = load_dicom(CT, window=preset)
    assert loaded.window == (centre, width) and loaded.window_source == f"preset {preset}"
    np.testing.assert_allclose(gray(loaded.picture), pydicom_windowed(dataset, values), atol=1)


def test_monochrome1_is_inverted(tmp_path):
    dataset = pydicom.dcmread(MR)
    dataset.PhotometricInterpretation = "MONOCHROME1"
    path = tmp_path / "mono1.dcm"
    dataset.save_as(path)
    normal, inverted = gray(load_dicom(MR).picture), gray(load_dicom(path).picture)
    np.testing.assert_allclose(inverted, 255 - normal, atol=1)


def test_frames_colour_and_compressed():
    dose = load_dicom(get_testdata_file("rtdose.dcm"))
    assert dose.frames == 15 and dose.frame == 7  # the middle frame by default
    assert load_dicom(get_testdata_file("rtdose.dcm"), frame=0).frame == 0
    with pytest.raises(ImageLoadError, match="has 15 frames"):
        load_dicom(get_testdata_file("rtdose.dcm"), frame=15)
    rle = load_dicom(get_testdata_file("MR_small_RLE.dcm"))  # RLE: pydicom's own decoder
    np.testing.assert_array_equal(np.asarray(rle.picture), np.asarray(load_dicom(MR).picture))
    colour = load_dicom(get_testdata_file("SC_rgb_rle.dcm"))
    assert colour.window_source == "colour" and np.asarray(colour.picture).std(axis=2).max() > 0
    palette = load_dicom(get_testdata_file("examples_palette.dcm"))  # PALETTE COLOR
    assert palette.window_source == "colour" and np.asarray(palette.picture).std(axis=2).max() > 0
    big_endian = load_dicom(get_testdata_file("MR_small_bigendian.dcm"))
    np.testing.assert_array_equal(
        np.asarray(big_endian.picture), np.asarray(load_dicom(MR).picture)
    )


@pytest.mark.parametrize(
    "name, message",
    [
        ("rtplan.dcm", "has no pixel data"),
        ("MR_truncated.dcm", "may be truncated or corrupt"),
        ("MR_small_jpeg_ls_lossless.dcm", "JPEG-LS Lossless"),
    ],
)
def test_bad_dicom_files_get_clear_messages(name, message):
    with pytest.raises(ImageLoadError, match=message):
        load_image(get_testdata_file(name))


def test_windows_are_parsed_and_checked():
    assert parse_window("Lung") == "lung" and parse_window("40,400") == (40.0, 400.0)
    with pytest.raises(ValueError, match="lung, mediastinum, bone, brain"):
        parse_window("liver")
    with pytest.raises(ValueError, match="at least 1"):
        parse_window("40,0")
    assert is_dicom(CT) and not is_dicom(b"\x89PNG" + bytes(200))


def test_load_image_and_explain_a_ct_slice_without_identifying_tags(tmp_path):
    dataset = pydicom.dcmread(CT)
    dataset.PatientName = "Doe^Jane"
    dataset.PatientID = "ID-12345"
    path = tmp_path / "slice"  # no extension: recognised by its DICM marker
    dataset.save_as(path)
    picture = load_image(path, window="mediastinum")
    assert picture.size == (128, 128) and picture.mode == "RGB"
    assert "Doe" not in str(load_dicom(path).info) and "ID-12345" not in str(load_dicom(path).info)
    loaded = krypton.load_model("fundus-demo")
    heatmap = krypton.explain(loaded, loaded.preprocess(picture), patch=16, stride=16)
    assert heatmap.values.shape == (8, 8)
    out = tmp_path / "h.png"
    result = run_cli("explain", str(path), "--window", "lung", "--stride", "16", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.exists()
    everything = result.stdout + result.stderr
    assert "Doe" not in everything and "ID-12345" not in everything
    bad = run_cli("explain", str(path), "--window", "liver", "--out", str(out))
    assert bad.returncode == 2 and "window must be one of" in bad.stderr


def test_a_dicom_file_dropped_on_the_page_is_decoded_with_its_own_window():
    import base64

    from webapp.helpers import decode_upload

    data = open(MR, "rb").read()
    contents = "data:application/dicom;base64," + base64.b64encode(data).decode()
    picture = decode_upload(contents, "scan.dcm", 25 * 2**20)
    np.testing.assert_array_equal(np.asarray(picture), np.asarray(load_dicom(MR).picture))
