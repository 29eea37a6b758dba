"""DICOM intake on files pydicom ships: modality LUT and windowing checked against
pydicom's own apply_modality_lut / apply_voi_lut, MONOCHROME1, frames, colour, compressed
syntaxes, bad files — and no identifying tag in anything Krypton reports."""

import io
import json

import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.pixels import apply_modality_lut, apply_voi_lut

import krypton
from krypton.io.dicom import (
    IDENTIFYING_KEYWORDS,
    WINDOW_PRESETS,
    decodable_transfer_syntaxes,
    is_dicom,
    load_dicom,
    parse_window,
)
from krypton.io.images import ImageLoadError, load_image
from krypton.render.dicom_capture import heatmap_capture, secondary_capture
from webapp import exports

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
        ("MR_truncated.dcm", "is truncated: its pixel data holds"),
    ],
)
def test_bad_dicom_files_get_clear_messages(name, message):
    with pytest.raises(ImageLoadError, match=message):
        load_image(get_testdata_file(name))


def test_an_image_shorter_than_its_header_declares_is_refused(tmp_path):
    """An uncompressed image cut short read as a picture with a black band (pydicom pads
    the missing bytes)."""
    dataset = pydicom.dcmread(MR)
    dataset.PixelData = dataset.PixelData[:-100]  # the header still declares 64x64x16 bits
    path = tmp_path / "short.dcm"
    dataset.save_as(path)
    with pytest.raises(ImageLoadError, match="short.dcm is truncated: its pixel data holds"):
        load_image(path)


@pytest.mark.parametrize(
    "name",
    [
        "MR_small_jpeg_ls_lossless.dcm",  # JPEG-LS (pylibjpeg-libjpeg / pyjpegls)
        "MR_small_jp2klossless.dcm",  # JPEG 2000 (pylibjpeg-openjpeg)
        "MR_small_RLE.dcm",  # RLE
    ],
)
def test_compressed_syntaxes_decode_to_the_uncompressed_pixels(name):
    np.testing.assert_array_equal(
        np.asarray(load_dicom(get_testdata_file(name)).picture), np.asarray(load_dicom(MR).picture)
    )


def test_jpeg_baseline_and_extended_decode():
    assert load_dicom(get_testdata_file("SC_rgb_jpeg.dcm")).window_source == "colour"
    nm = load_dicom(get_testdata_file("JPGExtended.dcm"))
    assert nm.picture.size == (256, 1024) and np.asarray(nm.picture).std() > 0


def test_a_syntax_without_decoder_names_what_can_be_read(tmp_path):
    from pydicom.encaps import encapsulate
    from pydicom.uid import MPEG2MPML

    dataset = pydicom.dcmread(MR)
    dataset.PixelData = encapsulate([dataset.PixelData])
    dataset.file_meta.TransferSyntaxUID = MPEG2MPML
    path = tmp_path / "video.dcm"
    dataset.save_as(path, enforce_file_format=True)
    with pytest.raises(ImageLoadError, match="MPEG2 Main Profile") as caught:
        load_image(path)
    assert "JPEG 2000" in str(caught.value) and "JPEG-LS Lossless" in str(caught.value)
    names = decodable_transfer_syntaxes()
    assert "RLE Lossless" in names and "JPEG Baseline (Process 1)" in names
    assert not any(name.startswith("MPEG") for name in names)


def test_windows_are_parsed_and_checked():
    assert parse_window("Lung") == "lung" and parse_window("40,400") == (40.0, 400.0)
    with pytest.raises(ValueError, match="lung, mediastinum, bone, brain"):
        parse_window("liver")
    with pytest.raises(ValueError, match="at least 1"):
        parse_window("40,0")
    assert is_dicom(CT) and not is_dicom(b"\x89PNG" + bytes(200))


def test_load_image_and_explain_a_ct_slice_without_identifying_tags(tmp_path, cli_here):
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
    assert heatmap.values.shape == (14, 14)
    out = tmp_path / "h.png"
    result = cli_here("explain", str(path), "--window", "lung", "--stride", "16", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.exists()
    everything = result.stdout + result.stderr
    assert "Doe" not in everything and "ID-12345" not in everything
    bad = cli_here("explain", str(path), "--window", "liver", "--out", str(out))
    assert bad.returncode == 2 and "window must be one of" in bad.stderr


def test_a_dicom_file_dropped_on_the_page_is_decoded_with_its_own_window():
    from webapp.helpers import decode_upload

    picture = decode_upload(open(MR, "rb").read(), "scan.dcm")
    np.testing.assert_array_equal(np.asarray(picture), np.asarray(load_dicom(MR).picture))


def identified(tmp_path, name="CT_small.dcm"):
    """A copy of a shipped file carrying a (made-up) patient identity."""
    dataset = pydicom.dcmread(get_testdata_file(name))
    dataset.PatientName, dataset.PatientID = "Doe^Jane", "ID-12345"
    dataset.PatientBirthDate, dataset.AccessionNumber = "19700101", "ACC-999"
    path = tmp_path / f"identified-{name}"
    dataset.save_as(path)
    return dataset, path


def test_secondary_capture_references_the_source_and_keeps_identity_out(tmp_path):
    source, path = identified(tmp_path)
    picture = load_dicom(path, window="lung").picture
    capture = pydicom.dcmread(io.BytesIO(secondary_capture(path, picture, comments="c")))
    assert capture.SOPClassUID == pydicom.uid.SecondaryCaptureImageStorage
    assert capture.StudyInstanceUID == source.StudyInstanceUID
    assert capture.SeriesInstanceUID != source.SeriesInstanceUID  # a new, derived series
    assert capture.SourceImageSequence[0].ReferencedSOPInstanceUID == source.SOPInstanceUID
    assert capture.SourceImageSequence[0].ReferencedSOPClassUID == source.SOPClassUID
    series = capture.ReferencedSeriesSequence[0]
    assert series.SeriesInstanceUID == source.SeriesInstanceUID
    assert series.ReferencedInstanceSequence[0].ReferencedSOPInstanceUID == source.SOPInstanceUID
    np.testing.assert_array_equal(capture.pixel_array, np.asarray(picture))
    assert [float(v) for v in capture.PixelSpacing] == [float(v) for v in source.PixelSpacing]
    for keyword in IDENTIFYING_KEYWORDS:
        assert not capture.get(keyword), keyword
    with_identity = pydicom.dcmread(
        io.BytesIO(secondary_capture(path, picture, include_identity=True))
    )
    assert str(with_identity.PatientName) == "Doe^Jane" and with_identity.PatientID == "ID-12345"
    assert with_identity.AccessionNumber == "ACC-999"


def test_heatmap_capture_of_a_multi_frame_file_names_its_frame(tmp_path):
    dose = get_testdata_file("rtdose.dcm")
    values = np.linspace(0.2, 0.9, 4, dtype=np.float32).reshape(2, 2)
    data = heatmap_capture(
        dose,
        values=values,
        xs=[0, 4],
        ys=[0, 4],
        patch=4,
        stride=4,
        prob=0.9,
        input_size=(8, 8),
        label_name="A",
        mode="exact",
        model_name="m",
        frame=3,
    )
    capture = pydicom.dcmread(io.BytesIO(data))
    assert capture.SourceImageSequence[0].ReferencedFrameNumber == 4  # 1-based in DICOM
    assert capture.Rows == 10 and capture.Columns == 10  # the file's own resolution
    assert "frame 3" in capture.DerivationDescription
    assert "relative scale" in capture.ImageComments


def test_no_identifying_tag_in_any_app_export_or_log_line(tmp_path, caplog):
    """A DICOM image through the page's path: load, run, every export, the log."""
    import logging

    from webapp import helpers, runs
    from webapp.services import Services

    caplog.set_level(logging.DEBUG)
    _, path = identified(tmp_path)
    data = path.read_bytes()
    services = Services(tmp_path / "cache")
    source = services.images.put_source(data, "s")
    loaded, record = helpers.dicom_view(data, source, "lung", None, path.name)
    key = services.images.put(loaded.picture)
    request = runs.RunRequest(
        key=key,
        name=helpers.dicom_name(record),
        model="fundus-demo",
        patch=16,
        stride=16,
        mode="exact",
        fill_rgb=(0.5, 0.5, 0.5),
        dicom=record,
    )
    result = runs.execute(services, "s", request, lambda *a: None)
    files = {
        "png": exports.export_png(services.images.get(key), result),
        "npy": exports.export_npy(result),
        "npz": exports.export_all_classes(result),
        "csv": exports.export_csv(result).encode(),
        "json": runs.export_json(result).encode(),
        "dicom": exports.export_dicom(services.images.source(source, "s"), result),
    }
    names = [exports.export_stem(result)] + [p.name for p in (tmp_path / "cache").rglob("*")]
    for secret in ("Doe", "Jane", "ID-12345", "19700101", "ACC-999"):
        for kind, content in files.items():
            assert secret.encode() not in content, (secret, kind)
        assert not any(secret in name for name in names)
        assert all(secret not in r.getMessage() for r in caplog.records)
    assert json.loads(files["json"])["dicom"]["window"] == [-600.0, 1500.0]
    assert json.loads(files["json"])["dicom"]["window_source"] == "preset lung"


def test_cli_explain_writes_a_secondary_capture_without_identity(tmp_path, cli_here):
    source, path = identified(tmp_path)
    out = tmp_path / "h.png"
    result = cli_here("explain", str(path), "--window", "lung", "--stride", "16", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "C -600 / W 1500 (preset lung)" in result.stdout
    capture = pydicom.dcmread(out.with_suffix(".dcm"))
    assert capture.StudyInstanceUID == source.StudyInstanceUID and not capture.PatientID
    assert "W 1500" in capture.ImageComments
    named = cli_here("explain", str(path), "--stride", "16", "--out", str(out), "--dicom-identity")
    assert named.returncode == 0, named.stderr
    assert pydicom.dcmread(out.with_suffix(".dcm")).PatientID == "ID-12345"


@pytest.mark.parametrize("model", ["chestct-slice-demo", "fundus-demo"])
def test_an_mr_slice_says_no_model_is_made_for_it(tmp_path, model):
    """No shipped model is made for MR: an MR file kept whichever model was chosen last
    (the CT slice model after a CT, the fundus model after a photograph), without a word.
    The DICOM panel now says which model explains it and that none is made for MR."""
    from pathlib import Path

    from webapp.panels.image import ImagePanel
    from webapp.services import Services

    panel = ImagePanel(Services(tmp_path / "cache"))
    data = Path(get_testdata_file("MR_small.dcm")).read_bytes()
    image_data = panel.dicom_image_data(data, "MR (DICOM)", "tab-1")
    assert ImagePanel.model_for("file", image_data, model) is None  # kept, and said
    _, text, *_ = panel.show_dicom(image_data, model, 16)
    assert f"No model here is made for MR images: {model} (made for " in text, text
    ct = panel.dicom_image_data(Path(get_testdata_file("CT_small.dcm")).read_bytes(), "CT", "t")
    ImagePanel.model_for("file", ct, "chestct-slice-demo")
    assert "No model here" not in panel.show_dicom(ct, "chestct-slice-demo", 16)[1]
