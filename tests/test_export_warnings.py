"""A flagged image's out-of-distribution warning travels with every export of its result:
the PNG (drawn above the title and in its "Warning" text chunk), the JSON, the DICOM
Secondary Capture's Image Comments, and the CLI's and batch's PNG. The page said "not
meaningful" while the PNG title said "NORMAL (p = 0.720)" and the DICOM said nothing."""

from __future__ import annotations

import io
import json

import pydicom
import pytest
from PIL import Image
from pydicom.data import get_testdata_file

import krypton
from krypton.batch.folder import heatmap_files
from krypton.registry.ood import caveat

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
        image_key=key, image_name="CT", model="fundus-demo", patch=32, stride=32,
        mode="exact", fill_rgb=(0.5, 0.5, 0.5), region=(0, 0, 64, 64), dicom=record,
    )  # fmt: skip
    result = runs.execute(services, "s", request, lambda *a: None)
    result["ood"] = FLAGGED
    return services, result, data


def test_app_exports_of_a_flagged_image_carry_the_warning(dicom_result):
    from webapp import helpers, runs

    services, result, data = dicom_result
    png = helpers.export_png(services.images.get(result["image_key"]), result)
    assert "not meaningful" in Image.open(io.BytesIO(png)).info["Warning"]
    summary = json.loads(runs.export_summary(result))
    assert summary["warnings"] and "not meaningful" in summary["warnings"][0]
    capture = pydicom.dcmread(io.BytesIO(helpers.export_dicom(data, result)))
    assert capture.ImageComments.startswith("WARNING: this image does not look like")


def test_app_exports_of_an_unflagged_image_say_nothing_extra(dicom_result):
    from webapp import helpers, runs

    services, result, data = dicom_result
    clean = dict(result, ood=dict(FLAGGED, flagged=False))
    png = helpers.export_png(services.images.get(clean["image_key"]), clean)
    assert "Warning" not in Image.open(io.BytesIO(png)).info
    assert json.loads(runs.export_summary(clean))["warnings"] == []
    capture = pydicom.dcmread(io.BytesIO(helpers.export_dicom(data, clean)))
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
