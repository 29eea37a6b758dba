"""A flagged image's out-of-distribution warning travels with every export of its result:
the PNG (drawn above the title and in its "Warning" text chunk), the JSON, the DICOM
Secondary Capture's Image Comments, and the CLI's and batch's PNG. The page said "not
meaningful" while the PNG title said "NORMAL (p = 0.720)" and the DICOM said nothing."""

from __future__ import annotations

import io
import json
import zipfile

import pydicom
import pytest
from PIL import Image
from pydicom.data import get_testdata_file
from test_volume_cli import hu_volume, volume_model, write_series  # noqa: F401

import krypton
from krypton.batch.folder import heatmap_files
from krypton.registry.ood import caveat
from webapp import exports

FLAGGED = {
    "score": 12.3,
    "threshold": 4.1,
    "flagged": True,
    "warning": "this image does not look like fundus-demo's training images; its "
    "prediction and heatmap are not meaningful",
    "stage": "layer3",
}


def test_the_caveat_names_the_warning_and_its_numbers():
    text = caveat(FLAGGED)
    assert "not meaningful" in text and "12.3" in text and "4.1" in text
    assert caveat(dict(FLAGGED, flagged=False)) == "" and caveat(None) == ""


@pytest.fixture(scope="module")
def dicom_result(tmp_path_factory):
    """A real run of the page's path over a CT slice, then marked as flagged."""
    from webapp import helpers, runs
    from webapp.services import Services

    folder = tmp_path_factory.mktemp("export")
    services = Services(folder / "cache")
    data = open(get_testdata_file("CT_small.dcm"), "rb").read()
    source = services.images.put_source(data, "s")
    loaded, record = helpers.dicom_view(data, source, None, None, "ct.dcm")
    key = services.images.put(loaded.picture)
    request = runs.RunRequest(
        key=key, name="CT", model="fundus-demo", patch=32, stride=32,
        mode="exact", fill_rgb=(0.5, 0.5, 0.5), region=(0, 0, 64, 64), dicom=record,
    )  # fmt: skip
    result = runs.execute(services, "s", request, lambda *a: None)
    result["ood"] = FLAGGED
    return services, result, data


def test_app_exports_of_a_flagged_image_carry_the_warning(dicom_result):
    from webapp import runs

    services, result, data = dicom_result
    png = exports.export_png(services.images.get(result["source_key"]), result)
    assert "not meaningful" in Image.open(io.BytesIO(png)).info["Warning"]
    summary = json.loads(runs.export_json(result))
    assert summary["warnings"] and "not meaningful" in summary["warnings"][0]
    capture = pydicom.dcmread(io.BytesIO(exports.export_dicom(data, result)))
    assert capture.ImageComments.startswith("WARNING: this image does not look like")


def test_app_exports_of_an_unflagged_image_say_nothing_extra(dicom_result):
    from webapp import runs

    services, result, data = dicom_result
    clean = dict(result, ood=dict(FLAGGED, flagged=False))
    png = exports.export_png(services.images.get(clean["source_key"]), clean)
    assert "Warning" not in Image.open(io.BytesIO(png)).info
    assert json.loads(runs.export_json(clean))["warnings"] == []
    capture = pydicom.dcmread(io.BytesIO(exports.export_dicom(data, clean)))
    assert not capture.ImageComments.startswith("WARNING")


def test_cli_and_batch_pictures_carry_the_warning():
    from krypton.registry import load_model

    model = load_model("fundus-demo")
    picture = Image.new("RGB", (224, 224), (120, 60, 40))
    heatmap = krypton.explain(
        model, model.preprocess(picture), patch=32, stride=32, region=(0, 0, 64, 64)
    )
    heatmap.extra["ood"] = FLAGGED
    png = heatmap_files(picture, heatmap, model)[".png"]
    assert "not meaningful" in Image.open(io.BytesIO(png)).info["Warning"]


def test_csv_npz_and_npy_downloads_carry_the_warning_too(dicom_result, tmp_path):
    """README promised the warning "in every download", and the CSV and .npy had none:
    the CSV now opens with a comment line, the .npz holds it under "warning", and the
    .npy — one array, nothing else — gets a STEM.warning.txt beside it (CLI, batch) or a
    file name that says so (the page). The comment line is what pandas skips with
    ``read_csv(..., comment="#")``."""
    import csv

    import numpy as np

    from krypton.registry import load_model
    from krypton.render.exports import WARNING_KEY, WARNING_SUFFIX

    services, result, data = dicom_result
    text = exports.export_csv(result)
    assert text.startswith("# warning: this image does not look like")
    rows = list(csv.reader(line for line in text.splitlines() if not line.startswith("#")))
    assert rows[0] == ["x", "y", "probability"] and len(rows) == 5  # 2 x 2 positions
    with np.load(io.BytesIO(exports.export_all_classes(result))) as archive:
        assert "not meaningful" in str(archive[WARNING_KEY])
    clean = dict(result, ood=dict(FLAGGED, flagged=False))
    assert exports.export_csv(clean).startswith("x,y,probability")
    with np.load(io.BytesIO(exports.export_all_classes(clean))) as archive:
        assert WARNING_KEY not in archive.files

    model = load_model("fundus-demo")
    picture = Image.new("RGB", (224, 224), (120, 60, 40))
    heatmap = krypton.explain(
        model, model.preprocess(picture), patch=32, stride=32, region=(0, 0, 64, 64)
    )
    heatmap.extra["ood"] = FLAGGED
    files = heatmap_files(picture, heatmap, model)
    assert "not meaningful" in files[WARNING_SUFFIX].decode()
    with np.load(io.BytesIO(files[".npz"])) as archive:
        assert "not meaningful" in str(archive[WARNING_KEY])
    heatmap.extra["ood"] = dict(FLAGGED, flagged=False)
    assert WARNING_SUFFIX not in heatmap_files(picture, heatmap, model)


def test_the_cli_writes_the_warning_beside_a_flagged_photographs_npy(cli_here, tmp_path):
    """A photograph is not a fundus image: the fundus model's check flags it."""
    out = tmp_path / "coffee.png"
    result = cli_here("explain", "assets/samples/coffee.png", "--stride", "32", "--out", str(out))
    assert result.returncode == 0, result.stderr
    sidecar = tmp_path / "coffee.warning.txt"
    assert sidecar.exists() and "does not look like" in sidecar.read_text()
    assert (tmp_path / "coffee.npy").exists()


def test_the_image_panel_says_the_warning_once_on_screen(dicom_result):
    """The image panel's top 5 carries the warning beside the picture; its result summary
    repeated it (2-3 warnings on one screen). The page summary leaves it to the top 5; the
    volume panel, whose summary is the one place its page says it, and every export, keep
    it."""
    from webapp.panels.image import ImagePanel
    from webapp.panels.volume import VolumePanel

    services, result, _ = dicom_result
    image_summary = str(ImagePanel(services, None).summary(result))
    assert "p = " in image_summary and "not meaningful" not in image_summary
    assert "not meaningful" in str(VolumePanel(services, None).summary(result))


def _caveat_of(dataset) -> str:
    """An image's Image Comments; a Structured Report's out-of-distribution evaluation,
    in the same words ("WARNING: <caveat>. ")."""
    if "ImageComments" in dataset:
        return str(dataset.ImageComments)
    from krypton.render.structured_report import ood_words

    return ood_words(dataset)


def test_every_dicom_the_project_writes_says_the_caveat_in_one_wording(
    dicom_result,
    volume_model,  # noqa: F811
    hu_volume,  # noqa: F811
    tmp_path,
    monkeypatch,
):
    """Every DICOM Krypton writes for a flagged input (the app's image and volume
    downloads, the library's Send of an image and of a volume: Parametric Maps and
    Secondary Captures, and the Structured Report's report-level evaluation; the CLI
    writes through the app image's heatmap_capture) opens its Image Comments with one
    sentence, "WARNING: <caveat>." Before: the volume
    download said "WARNING: Warning: ...", the library's Send the caveat alone and the
    image capture a third form."""
    from krypton.io.volumes import read_dicom_series
    from krypton.pacs import dicomweb, results
    from webapp import runs

    stored: list = []
    monkeypatch.setattr(dicomweb, "store", lambda pacs, datasets, study: stored.extend(datasets))
    expected = f"WARNING: {caveat(FLAGGED)}. "
    written = {}  # what wrote it: its comments

    services, result, data = dicom_result
    written["app image download"] = pydicom.dcmread(
        io.BytesIO(exports.export_dicom(data, result))
    ).ImageComments
    heatmap = runs.result_heatmap(result)
    heatmap.extra["ood"] = FLAGGED
    image_model = krypton.load_model("fundus-demo")
    settings = {"patch": 32, "stride": 32, "label": heatmap.label}
    results.send_result(
        None, "1.2", image_model, heatmap, results.ImageSource(data), "KRYPTON_TEST", settings
    )
    for dataset in stored:
        written[f"image send, {dataset.SOPClassUID.name}"] = _caveat_of(dataset)
    stored.clear()

    folder = tmp_path / "series"
    write_series(folder, hu_volume)
    volume = read_dicom_series(folder)
    headers = [pydicom.dcmread(path) for path in sorted(folder.iterdir())]
    prepared = volume_model.prepare_volume(volume)
    heatmap = krypton.explain(volume_model, prepared.tensor, patch=16, stride=16, mode="exact",
                              fill=volume_model.gray_fill())  # fmt: skip
    heatmap.extra["ood"] = FLAGGED
    source = results.VolumeSource(prepared, headers)
    settings = {"patch": 16, "stride": 16, "label": heatmap.label}
    results.send_result(None, "1.2", volume_model, heatmap, source, "KRYPTON_TEST", settings)
    for dataset in stored:
        written[f"volume send, {dataset.SOPClassUID.name}"] = _caveat_of(dataset)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted(folder.iterdir()):
            archive.write(path, path.name)
    key = services.images.put_source(buffer.getvalue(), "s")
    asked = runs.RunRequest(key=key, name="series.zip", model="ct-test", patch=16, stride=16,
                            mode="exact", rank=3)  # fmt: skip
    record = runs.execute(services, "s", asked, lambda *a: None)
    record["ood"] = FLAGGED
    from webapp.runs import volumes

    shown = services.prepared_volume(key, "s", "ct-test")
    exported = volumes.export_dicom_series(record, buffer.getvalue(), shown)
    with zipfile.ZipFile(io.BytesIO(exported)) as archive:
        first = archive.namelist()[0]
        written["app volume download"] = pydicom.dcmread(
            io.BytesIO(archive.read(first))
        ).ImageComments

    assert sorted(written) == [
        "app image download", "app volume download",
        "image send, Comprehensive 3D SR Storage", "image send, Parametric Map Storage",
        "image send, Secondary Capture Image Storage",
        "volume send, Comprehensive 3D SR Storage", "volume send, Parametric Map Storage",
        "volume send, Secondary Capture Image Storage",
    ]  # fmt: skip
    for writer, comments in written.items():
        assert str(comments).startswith(expected.strip()), (writer, str(comments)[:160])
        assert "Warning:" not in str(comments), (writer, str(comments)[:160])
