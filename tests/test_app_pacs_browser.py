"""A radiologist's path from her PACS in a real Chromium: Debian's Orthanc with its DICOMweb
plugin holds a chest CT; the page searches it, opens the series in the volume panel (or
one slice in the image panel, for a 2-D model), runs exact and sends the result back.
A QIDO search then finds the Parametric Map in the same study, and highdicom reads its
values back equal to the page's heatmap, on the source's frame of reference."""

import json
from pathlib import Path

import numpy as np
import pytest
from test_app_dicom_browser import downloaded
from test_pacs import PASSWORD, USER, dciodvfy_errors, orthanc  # noqa: F401

from demo.pacs import ct_series
from krypton.pacs import dicomweb
from krypton.render.parametric_map import RAS_TO_LPS, drop_values
from krypton.synthetic.chestct import ChestCTGenerator

pytestmark = pytest.mark.browser
PARAMETRIC_MAP = "1.2.840.10008.5.1.4.1.1.30"
REPORT = "1.2.840.10008.5.1.4.1.1.88.34"  # the finding, a Comprehensive 3D SR


@pytest.fixture
def pacs_app(orthanc, monkeypatch, tmp_path):  # noqa: F811
    """The app as an operator starts it beside her PACS: KRYPTON_DICOMWEB_URL and its
    sign-in in the environment."""
    monkeypatch.setenv("KRYPTON_DICOMWEB_URL", orthanc)
    monkeypatch.setenv("KRYPTON_DICOMWEB_USER", USER)
    monkeypatch.setenv("KRYPTON_DICOMWEB_PASSWORD", PASSWORD)
    from app import create_app

    return create_app(tmp_path / "cache")


@pytest.fixture
def chest_study(orthanc):  # noqa: F811
    """A held-out generated chest CT (one nodule) stored as a CT series at chestct-demo's
    5 mm: (study, series, its datasets)."""
    volume = ChestCTGenerator(seed=40).sample(label=1, nodules=1).volume
    datasets = ct_series(volume, (5.0, 5.0, 5.0), "Browser^Test", origin=(-120.0, -120.0, -60.0))
    for dataset in datasets:
        dataset.PatientID = "KRYPTON-BROWSER"
    pacs = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD))
    dicomweb.store(pacs, datasets, datasets[0].StudyInstanceUID)
    return datasets[0].StudyInstanceUID, datasets[0].SeriesInstanceUID, datasets


def test_search_open_run_and_send_a_series_from_the_pacs(
    dash_duo,
    pacs_app,
    chest_study,
    orthanc,  # noqa: F811
    tmp_path,
    caplog,
):
    study, series, datasets = chest_study
    dash_duo.start_server(pacs_app)
    dash_duo.wait_for_element(".pacs-search summary", timeout=20).click()
    dash_duo.find_element("#pacs-patient").send_keys("KRYPTON-BROWSER")
    dash_duo.find_element("#pacs-search").click()
    dash_duo.wait_for_contains_text("#pacs-message", "1 study found", timeout=30)
    dash_duo.wait_for_contains_text("#pacs-study", "Browser^Test", timeout=30)
    dash_duo.wait_for_contains_text("#pacs-series", "CT chest CT sample (48 images)", timeout=30)
    dash_duo.wait_for_element("#pacs-open:not([disabled])", timeout=30).click()
    dash_duo.wait_for_contains_text("#volume-info", "48x48x48 voxels at 5x5x5 mm", timeout=60)
    assert dash_duo.find_element("#volume-info").text.startswith("PACS CT chest CT sample")
    assert dash_duo.find_element("#volume-pacs-send").get_attribute("disabled")  # nothing to send

    dash_duo.find_element("#volume-stride").clear()
    dash_duo.find_element("#volume-stride").send_keys("8")
    dash_duo.wait_for_contains_text("#volume-estimate", "positions", timeout=30)
    dash_duo.wait_for_element("#volume-run:not([disabled])", timeout=30).click()
    dash_duo.wait_for_contains_text("#volume-summary", "positions computed", timeout=180)
    dash_duo.find_element(".volume-panel button[id*='json']").click()
    exported = downloaded(dash_duo, ".json").read_text()
    shown = json.loads(exported)

    dash_duo.wait_for_element("#volume-pacs-send:not([disabled])", timeout=30).click()
    dash_duo.wait_for_contains_text("#volume-pacs-sent", "Sent to the PACS", timeout=60)
    assert "a Structured Report of the finding" in dash_duo.find_element("#volume-pacs-sent").text
    dash_duo.find_element("#volume-pacs-send").click()  # again: the study has it, nothing is stored
    dash_duo.wait_for_contains_text("#volume-pacs-sent", "Already in the PACS", timeout=60)

    client = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD)).client
    (report,) = client.search_for_instances(study, search_filters={"SOPClassUID": REPORT})
    (found,) = client.search_for_instances(study, search_filters={"SOPClassUID": PARAMETRIC_MAP})
    stored = client.retrieve_instance(
        study, found["0020000E"]["Value"][0], found["00080018"]["Value"][0]
    )
    import highdicom as hd

    parametric_map = hd.pm.ParametricMap.from_dataset(stored)
    assert parametric_map.FrameOfReferenceUID == datasets[0].FrameOfReferenceUID
    assert parametric_map.StudyInstanceUID == study
    referenced = parametric_map.ReferencedSeriesSequence[0].SeriesInstanceUID
    assert referenced == series

    from webapp.runs import result_heatmap

    heatmap = result_heatmap({**shown, "values": np.array(shown["values"], dtype=float)})
    expected = drop_values(heatmap, tuple(shown["input_size"]))
    # the map's voxels, placed by its own geometry, on the page's block in the patient frame
    block = hd.Volume(
        expected, RAS_TO_LPS @ np.asarray(shown["affine"]), "PATIENT",
        datasets[0].FrameOfReferenceUID,
    )  # fmt: skip
    placed = parametric_map.get_volume().match_geometry(block)
    np.testing.assert_allclose(placed.array, expected, atol=1e-6)
    assert dciodvfy_errors(stored, tmp_path) == []
    # the sign-in never reached the page, an export or a log line
    assert PASSWORD not in dash_duo.driver.page_source
    assert PASSWORD not in exported and USER not in exported
    assert PASSWORD not in caplog.text


def test_open_run_and_send_one_image_of_a_series_for_a_2d_model(
    dash_duo,
    pacs_app,
    orthanc,  # noqa: F811
    tmp_path,
):
    """One slice of a CT series in the image panel: the page's default model (fundus-demo,
    made for photographs) gives way to the CT slice model, and says so; the map stored
    over the source slice's own pixels holds the page's drops."""
    import highdicom as hd
    from test_app_browser import choose, wait_for_result

    from krypton.render.parametric_map import drop_values
    from webapp.runs import result_heatmap

    volume = ChestCTGenerator(seed=41).sample(label=1, nodules=1).volume
    datasets = ct_series(volume, (5.0, 5.0, 5.0), "Slice^Test", origin=(-120.0, -120.0, -60.0))
    for dataset in datasets:
        dataset.PatientID = "KRYPTON-SLICE"
    study = datasets[0].StudyInstanceUID
    client = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD))
    dicomweb.store(client, datasets, study)
    source = next(d for d in datasets if int(d.InstanceNumber) == 24)

    dash_duo.start_server(pacs_app)
    dash_duo.wait_for_element(".pacs-search summary", timeout=20).click()
    dash_duo.find_element("#pacs-patient").send_keys("KRYPTON-SLICE")
    dash_duo.find_element("#pacs-search").click()
    dash_duo.wait_for_contains_text("#pacs-series", "CT chest CT sample (48 images)", timeout=30)
    dash_duo.wait_for_element("#pacs-open-image:not([disabled])", timeout=30).click()
    dash_duo.wait_for_contains_text("#message", "48 images: name one", timeout=60)
    dash_duo.find_element("#pacs-image-number").send_keys("24")
    dash_duo.find_element("#pacs-open-image").click()
    dash_duo.wait_for_contains_text("#dicom-info", "48x48 px", timeout=60)
    switched = "model changed to chestct-slice-demo"
    dash_duo.wait_for_contains_text("#dicom-info", switched, timeout=60)
    dash_duo.wait_for_contains_text("#top5", "NODULE", timeout=60)
    assert dash_duo.find_element("#pacs-send").get_attribute("disabled")

    choose(dash_duo, "stride", "16")
    dash_duo.wait_for_element("#run:not([disabled])", timeout=30).click()
    wait_for_result(dash_duo)
    dash_duo.find_element("#result-panel-body button[id*='json']").click()
    shown = json.loads(downloaded(dash_duo, ".json").read_text())
    dash_duo.find_element("#result-panel-body button[id*='npy']").click()
    values = np.load(downloaded(dash_duo, ".npy"))

    dash_duo.wait_for_element("#pacs-send:not([disabled])", timeout=30).click()
    sent = "Sent to the PACS: a Parametric"
    dash_duo.wait_for_contains_text("#pacs-sent", sent, timeout=60)
    assert "a Structured Report of the finding" in dash_duo.find_element("#pacs-sent").text
    # README's picture of the flow: the search, the slice, its heatmap and what was sent
    # (out/ is ignored by git; copy it to docs/pacs.png)
    dash_duo.driver.execute_script("window.scrollTo(0, 0)")
    dash_duo.driver.save_screenshot(str(Path(__file__).parents[1] / "out" / "pacs.png"))
    dash_duo.find_element("#pacs-send").click()  # again: nothing new is stored
    dash_duo.wait_for_contains_text("#pacs-sent", "Already in the PACS", timeout=60)

    (found,) = client.client.search_for_instances(
        study, search_filters={"SOPClassUID": PARAMETRIC_MAP}
    )
    stored = client.client.retrieve_instance(
        study, found["0020000E"]["Value"][0], found["00080018"]["Value"][0]
    )
    parametric_map = hd.pm.ParametricMap.from_dataset(stored)
    assert parametric_map.FrameOfReferenceUID == source.FrameOfReferenceUID
    referenced = parametric_map.ReferencedSeriesSequence[0].ReferencedInstanceSequence[0]
    assert referenced.ReferencedSOPInstanceUID == source.SOPInstanceUID
    assert (stored.Rows, stored.Columns) == (source.Rows, source.Columns)
    heatmap = result_heatmap({**shown, "values": values, "base_probs": [shown["prob"]]})
    drops = drop_values(heatmap, tuple(shown["input_size"]))
    picks = [
        np.minimum(((np.arange(n) + 0.5) * size / n).astype(int), size - 1)
        for n, size in zip((source.Rows, source.Columns), shown["input_size"])
    ]  # each source pixel takes the model-input pixel it was resized to
    np.testing.assert_allclose(stored.pixel_array, drops[np.ix_(*picks)], atol=1e-6)
    assert dciodvfy_errors(stored, tmp_path) == []
