"""A radiologist's path from her PACS in a real Chromium: Debian's Orthanc with its DICOMweb
plugin holds a chest CT; the volume panel searches it, opens the series, runs exact and
sends the result back. A QIDO search then finds the Parametric Map in the same study,
and highdicom reads its values back equal to the page's heatmap, on the source's frame
of reference."""

import json
from pathlib import Path

import numpy as np
import pytest
from test_app_dicom_browser import downloaded
from test_pacs import PASSWORD, USER, dciodvfy_errors, orthanc  # noqa: F401

from demo.pacs import ct_series
from krypton.chestct import ChestCTGenerator
from krypton.io import dicomweb
from krypton.render.parametric_map import RAS_TO_LPS, drop_values

pytestmark = pytest.mark.browser
PARAMETRIC_MAP = "1.2.840.10008.5.1.4.1.1.30"


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
    assert dash_duo.find_element("#pacs-send").get_attribute("disabled")  # nothing to send

    dash_duo.find_element("#volume-stride").clear()
    dash_duo.find_element("#volume-stride").send_keys("8")
    dash_duo.wait_for_contains_text("#volume-estimate", "positions", timeout=30)
    dash_duo.wait_for_element("#volume-run:not([disabled])", timeout=30).click()
    dash_duo.wait_for_contains_text("#volume-summary", "positions computed", timeout=180)
    dash_duo.find_element(".volume-panel button[id*='json']").click()
    exported = downloaded(dash_duo, ".json").read_text()
    shown = json.loads(exported)

    dash_duo.wait_for_element("#pacs-send:not([disabled])", timeout=30).click()
    dash_duo.wait_for_contains_text("#pacs-sent", "Sent to the PACS", timeout=60)
    # README's picture of the PACS search beside the panel (out/ is ignored by git; copy
    # it to docs/pacs.png)
    dash_duo.driver.execute_script(
        "document.querySelector('.pacs-search').scrollIntoView({block: 'start'})"
    )
    dash_duo.driver.save_screenshot(str(Path(__file__).parents[1] / "out" / "pacs.png"))

    client = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD)).client
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

    from webapp.volume_runs import volume_heatmap

    heatmap = volume_heatmap({**shown, "values": np.array(shown["values"], dtype=float)})
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
