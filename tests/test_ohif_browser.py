"""Krypton's map where a radiologist reads it: OHIF v3 (npm @ohif/app's prebuilt viewer,
with its Parametric Map extension) served by Debian's nginx beside Debian's Orthanc, in
a real Chromium with software WebGL. A CT is stored in Orthanc, explained and sent back
as Krypton's Send stores it; OHIF opens the study, the map is double-clicked (OHIF fuses
it over the CT), and the fused volume is read back from OHIF's own page objects
(``window.cornerstone``'s cache): the slices that hold the map's maximum must be those of
Krypton's strongest cell.

Before, OHIF drew the map mirrored head to foot (frames stored from high z to low z,
which OHIF fills in file order), and on a CT at another geometry than the model's it
could not overlay the map at all (48 frames of 48 x 48 at 5 mm matched no slice)."""

from __future__ import annotations

import json
import math
import shutil
import time

import numpy as np
import pytest
from scipy.ndimage import zoom
from test_pacs import PASSWORD, USER, _free_port, orthanc  # noqa: F401

import krypton
from demo.pacs import ct_series
from demo.viewer import fetch_ohif, start_viewer
from krypton.pacs import dicomweb
from krypton.pacs.results import VolumeSource, result_key, send_result
from krypton.render.parametric_map import (
    RAS_TO_LPS,
    drop_values,
    drops_on_slices,
    source_slices,
)
from krypton.render.volumes import lowest_voxel
from krypton.synthetic.chestct import ChestCTGenerator

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(shutil.which("npm") is None, reason="npm is not installed"),
]
MAP_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def viewer(orthanc, tmp_path_factory):  # noqa: F811
    """OHIF on one origin with Orthanc (nginx proxies /dicom-web/ with the sign-in)."""
    folder = tmp_path_factory.mktemp("viewer")
    process, url = start_viewer(fetch_ohif(), folder, _free_port(), orthanc, USER, PASSWORD)
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--use-angle=swiftshader", "--enable-unsafe-swiftshader",
                     "--ignore-gpu-blocklist", "--window-size=1400,1000"):  # fmt: skip
        options.add_argument(argument)
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    driver = webdriver.Chrome(
        service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver"),
        options=options,
    )
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def model():
    return krypton.registry.load_model("chestct-demo")


def _ct(shape: tuple[int, int, int], spacing: tuple[float, float, float]) -> np.ndarray:
    """The nodule sample (48³ at 5 mm) on another grid over the same body, centred, air
    where the new grid is larger."""
    sample = ChestCTGenerator(seed=40).sample(label=1, nodules=1).volume
    moved = zoom(sample, [48 * 5.0 / s / 48 for s in spacing], order=1)
    hu = np.full(shape, -1000.0, dtype=np.float32)
    source, target = [], []
    for have, want in zip(moved.shape, shape, strict=True):
        start = abs(have - want) // 2
        if have >= want:
            source.append(slice(start, start + want))
            target.append(slice(0, want))
        else:
            source.append(slice(0, have))
            target.append(slice(start, start + have))
    hu[tuple(target)] = moved[tuple(source)]
    return hu


def _sent(orthanc_root: str, model, hu: np.ndarray, spacing) -> tuple[str, float, list[float]]:
    """Store ``hu`` as a CT series, explain it as a PACS series is explained and send the
    result as Send does: (the study, the z of Krypton's strongest cell's centre, the z of
    the source slices its drop covers)."""
    from krypton.io.volumes import read_dicom_series

    datasets = ct_series(hu, spacing, "Ohif^Test", origin=(-120.0, -120.0, -60.0))
    study, series = str(datasets[0].StudyInstanceUID), str(datasets[0].SeriesInstanceUID)
    pacs = dicomweb.connect(dicomweb.PacsSettings(orthanc_root, USER, PASSWORD))
    dicomweb.store(pacs, datasets, study)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        files = dicomweb.fetch_series(pacs, study, series, Path(folder))
        volume = read_dicom_series(folder)
        headers = dicomweb.fetched_headers(files)
    prepared = model.prepare_volume(volume)
    heatmap = krypton.explain(
        model, prepared.tensor, patch=16, stride=8, mode="exact", fill=model.gray_fill()
    )
    settings = {"mode": "exact", "patch": 16, "stride": 8, "label": heatmap.label}
    send_result(pacs, study, model, heatmap, VolumeSource(prepared, headers),
                result_key(series, model, settings), settings)  # fmt: skip
    centre = np.array([*lowest_voxel(heatmap), 1.0])
    centre_z = float((RAS_TO_LPS @ prepared.affine @ centre)[2])
    slices = source_slices(headers)
    drops = drops_on_slices(drop_values(heatmap, tuple(model.input_size)), prepared.affine, slices)
    holding = [float(header.ImagePositionPatient[2]) for header, frame in zip(slices, drops)
               if frame.max() >= drops.max() - 1e-6]  # fmt: skip
    return study, centre_z, holding


READ_VOLUMES = """
const out = [];
for (const v of window.cornerstone.cache.getVolumes()) {
  let data = null;
  try { data = v.voxelManager.getCompleteScalarDataArray(); } catch (e) { data = null; }
  if (!data) continue;
  const [nx, ny, nz] = v.dimensions, plane = nx * ny;
  let max = -Infinity;
  for (let i = 0; i < data.length; i++) if (data[i] > max) max = data[i];
  const slices = [];
  for (let k = 0; k < nz; k++) {
    let top = -Infinity;
    for (let i = k * plane; i < (k + 1) * plane; i++) if (data[i] > top) top = data[i];
    if (top >= max - 1e-6 * Math.abs(max)) slices.push(k);
  }
  out.push({id: v.volumeId, dimensions: v.dimensions, spacing: v.spacing, origin: v.origin,
            direction: Array.from(v.direction), max, slices});
}
return JSON.stringify(out);
"""


# the study browser's entry of a series without a thumbnail whose text holds arguments[0]
ENTRY = """
return Array.from(document.querySelectorAll('[data-cy="study-browser-thumbnail-no-image"]'))
  .find(e => e.textContent.includes(arguments[0])) || null;
"""


def _opened_study(browser, viewer_url: str, study: str, label: str):
    """Open ``study`` in OHIF and wait until its viewport is up and the study browser
    lists an entry whose text holds ``label``: (what finds that entry again, the
    deadline of the whole wait, :data:`MAP_TIMEOUT_S` from now)."""
    browser.get(f"{viewer_url}/viewer?StudyInstanceUIDs={study}")
    deadline = time.monotonic() + MAP_TIMEOUT_S

    def entry():
        return browser.execute_script(ENTRY, label)

    shown = "return (window.cornerstone?.getEnabledElements?.() || []).length"
    while not (entry() and browser.execute_script(shown)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert entry() is not None, f"OHIF lists no {label} entry for the study"
    return entry, deadline


def _fused_map(browser, viewer_url: str, study: str) -> dict:  # noqa: F811
    """Open ``study`` in OHIF, double-click its map, and OHIF's volume of it once
    loaded: dimensions, spacing, origin, direction, the slices holding its maximum, and
    the viewport's coloured pixels before (the CT alone: gray)."""
    entry, deadline = _opened_study(browser, viewer_url, study, "PMAP")
    _skip_tour(browser)
    before = int(browser.execute_script(COLOURED_PIXELS, FAINT))  # the CT alone
    _double_click(browser, entry)
    while time.monotonic() < deadline:
        volumes = json.loads(browser.execute_script(READ_VOLUMES))
        maps = [v for v in volumes if v["id"].startswith("pmap")]
        if maps and maps[0]["max"] > 0:
            return {**maps[0], "coloured_before": before}
        time.sleep(1.0)
    errors = [e["message"][:300] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    raise AssertionError(f"OHIF fused no map in {MAP_TIMEOUT_S} s: {errors[-5:]}")


COLOURED_PIXELS = """
const canvas = document.querySelector('canvas.cornerstone-canvas');
const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
const least = arguments[0];
let coloured = 0;
for (let i = 0; i < data.length; i += 4) {
  const r = data[i], g = data[i + 1], b = data[i + 2];
  if (Math.max(Math.abs(r - g), Math.abs(g - b), Math.abs(r - b)) > least) coloured++;
}
return coloured;
"""
FAINT = 8  # a pixel this far from gray is tinted: small drops are drawn faint
DRAWN_WITHIN_S = 30  # OHIF renders the fusion some frames after it loads it (longer when busy)


def _coloured_on(
    browser, fused: dict, k: int, least: int = 40, enough: int = 1000, reset: bool = False
) -> int:
    """The viewport's coloured pixels (the CT is gray: colour is the overlay; ``least``:
    how far from gray a pixel must be) with the view on slice ``k`` of the fused map, or,
    with ``reset``, after what OHIF's Reset button does (the camera reset and the view
    rendered again); read until ``enough`` are drawn or :data:`DRAWN_WITHIN_S` pass: the
    most seen."""
    nx, ny, _ = fused["dimensions"]
    sx, sy, sz = fused["spacing"]
    ox, oy, oz = fused["origin"]
    view = (
        "const e = window.cornerstone.getEnabledElements()[0];"
        + ("e.viewport.resetCamera();" if reset else "e.viewport.jumpToWorld(arguments[0]);")
        + "e.renderingEngine.render();"
    )
    most, deadline = 0, time.monotonic() + DRAWN_WITHIN_S
    while most < enough and time.monotonic() < deadline:
        # asked again each round: OHIF may still be setting the fused view up, and a
        # view set before it finishes is not drawn
        browser.execute_script(view, [ox + nx * sx / 2, oy + ny * sy / 2, oz + k * sz])
        time.sleep(1.0)
        most = max(most, int(browser.execute_script(COLOURED_PIXELS, least)))
    return most


GEOMETRIES = {
    "48x48x48-5mm": ((48, 48, 48), (5.0, 5.0, 5.0)),  # the model's own grid, as the sample
    "40x128x128-3mm": ((40, 128, 128), (3.0, 3.0, 3.0)),
    "48x512x512-0.7mm": ((48, 512, 512), (5.0, 0.7, 0.7)),  # a clinical CT's rows
}


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_ohif_draws_the_map_on_the_slices_of_kryptons_strongest_cell(
    browser,
    viewer,
    orthanc,  # noqa: F811
    model,
    geometry,
):
    shape, spacing = GEOMETRIES[geometry]
    study, centre_z, holding = _sent(orthanc, model, _ct(shape, spacing), spacing)
    fused = _fused_map(browser, viewer, study)
    assert fused["dimensions"] == [shape[2], shape[1], shape[0]]  # x, y, z: the CT's grid
    assert fused["spacing"] == pytest.approx([spacing[2], spacing[1], spacing[0]])
    assert fused["direction"][8] == pytest.approx(1.0)  # slice index grows with z
    slices_z = [fused["origin"][2] + k * spacing[0] for k in fused["slices"]]
    print(f"OHIF {geometry}: the map's maximum on z {min(slices_z):.1f}-{max(slices_z):.1f} mm;"
          f" Krypton's strongest cell centred at z {centre_z:.1f} mm, its drop on "
          f"{min(holding):.1f}-{max(holding):.1f} mm")  # fmt: skip
    # the slices OHIF shows the largest drop on are those Krypton's cell covers (one
    # slice's slack at each end), and they hold the cell's centre
    assert abs(min(slices_z) - min(holding)) <= spacing[0] + 1e-6
    assert abs(max(slices_z) - max(holding)) <= spacing[0] + 1e-6
    assert min(slices_z) - spacing[0] <= centre_z <= max(slices_z) + spacing[0]
    middle = fused["slices"][len(fused["slices"]) // 2]
    assert _coloured_on(browser, fused, middle) > 1000  # and it is drawn there


def test_ohif_draws_a_coronal_series_map_on_the_slices_of_kryptons_strongest_cell(
    browser,
    viewer,
    orthanc,  # noqa: F811
    model,
):
    """A coronal series (slices stacked front to back) reaches the model turned to its
    axial axes; its map, written back onto the coronal slices, lies in OHIF on the
    coronal slices that hold Krypton's strongest cell."""
    from stored_ways import stored

    phantom = zoom(ChestCTGenerator(seed=40).sample(label=1, nodules=1).volume, 2.0, order=1)
    datasets = stored(phantom.astype(np.float32), 2.5, "coronal")
    study, series = str(datasets[0].StudyInstanceUID), str(datasets[0].SeriesInstanceUID)
    pacs = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD))
    dicomweb.store(pacs, datasets, study)
    prepared, geometry = dicomweb.load_series(pacs, study, series, model.volume_target())
    assert prepared.orientation == "PIL to the model's SPL"
    heatmap = krypton.explain(
        model, prepared.tensor, patch=16, stride=8, mode="exact", fill=model.gray_fill()
    )
    settings = {"mode": "exact", "patch": 16, "stride": 8, "label": heatmap.label}
    headers = list(geometry.headers)
    send_result(pacs, study, model, heatmap, VolumeSource(prepared, headers),
                result_key(series, model, settings), settings)  # fmt: skip
    normal = np.array([0.0, 1.0, 0.0])  # the coronal slices' normal: toward the back (LPS)
    centre = RAS_TO_LPS @ prepared.affine @ np.array([*lowest_voxel(heatmap), 1.0])
    drops = drops_on_slices(drop_values(heatmap, tuple(model.input_size)), prepared.affine,
                            headers)  # fmt: skip
    top = drops.max() - 1e-6
    holding = [float(np.asarray(h.ImagePositionPatient, float) @ normal)
               for h, frame in zip(headers, drops, strict=True) if frame.max() >= top]  # fmt: skip
    fused = _fused_map(browser, viewer, study)
    assert fused["dimensions"] == [96, 96, 96]
    direction = np.asarray(fused["direction"]).reshape(3, 3)
    assert abs(abs(float(direction[2] @ normal)) - 1.0) < 1e-6  # OHIF stacks along it
    along = [float(np.asarray(fused["origin"]) @ normal) + k * 2.5 * float(direction[2] @ normal)
             for k in fused["slices"]]  # fmt: skip
    print(f"OHIF coronal: the map's maximum {min(along):.1f}-{max(along):.1f} mm back; "
          f"Krypton's cell centred {float(centre[:3] @ normal):.1f} mm, its drop on "
          f"{min(holding):.1f}-{max(holding):.1f} mm")  # fmt: skip
    assert abs(min(along) - min(holding)) <= 2.5 + 1e-6
    assert abs(max(along) - max(holding)) <= 2.5 + 1e-6
    assert min(along) - 2.5 <= float(centre[:3] @ normal) <= max(along) + 2.5


def _one_frame_maps(orthanc_root: str, tmp_path, monkeypatch, capsys) -> tuple[str, str, float]:
    """One CT slice in two studies: in the first, Krypton's image map of it (the CLI's
    Send, fundus-demo: the 2-D model the page offers for a slice); in the second, a
    one-frame Parametric Map built as highdicom's own documentation builds one (a 0.9
    square). (Krypton's study, the control's study, Krypton's largest drop.)"""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    from krypton.cli import main

    slice_ = ChestCTGenerator(seed=21).sample(label=1).volume[20:21]
    ours, control = (ct_series(slice_, (5.0,) * 3, name, origin=(5, 6, 7))
                     for name in ("Slice^Krypton", "Slice^Control"))  # fmt: skip
    pacs = dicomweb.connect(dicomweb.PacsSettings(orthanc_root, USER, PASSWORD))
    for datasets in (ours, control):
        dicomweb.store(pacs, datasets, datasets[0].StudyInstanceUID)
    monkeypatch.setenv("KRYPTON_DICOMWEB_URL", orthanc_root)
    monkeypatch.setenv("KRYPTON_DICOMWEB_USER", USER)
    monkeypatch.setenv("KRYPTON_DICOMWEB_PASSWORD", PASSWORD)
    out = tmp_path / "slice.png"
    assert main(["explain", "--dicomweb", "--study", str(ours[0].StudyInstanceUID), "--model",
                 "fundus-demo", "--patch", "56", "--stride", "28", "--out", str(out),
                 "--send"]) == 0  # fmt: skip
    values = np.load(out.with_suffix(".npy"))
    prob = float(capsys.readouterr().out.split("probability ")[1].split()[0])
    source = control[0]
    square = np.zeros((1, source.Rows, source.Columns), np.float32)
    square[0, 10:30, 10:30] = 0.9
    mapping = hd.pm.RealWorldValueMapping(
        lut_label="CONTROL", lut_explanation="a 0.9 square", unit=codes.UCUM.NoUnits,
        value_range=(0.0, 1.0), slope=1.0, intercept=0.0,
    )  # fmt: skip
    made = hd.pm.ParametricMap(
        source_images=[source], pixel_array=square, series_instance_uid=hd.UID(),
        series_number=9902, sop_instance_uid=hd.UID(), instance_number=1,
        manufacturer="control", manufacturer_model_name="control", software_versions="1",
        device_serial_number="1", contains_recognizable_visual_features=False,
        real_world_value_mappings=[mapping],
        voi_lut_transformations=[hd.VOILUTTransformation(window_center=0.5, window_width=1.0)],
    )  # fmt: skip
    dicomweb.store(pacs, [made], str(source.StudyInstanceUID))
    return str(ours[0].StudyInstanceUID), str(source.StudyInstanceUID), prob - float(values.min())


def test_ohif_draws_a_one_frame_map_over_its_slice_krypton_s_and_highdicom_s(
    browser,
    viewer,
    orthanc,  # noqa: F811
    tmp_path,
    monkeypatch,
    capsys,
):
    """An image's map (one frame over a CT slice) in OHIF 3.13: its values arrive intact
    (OHIF shows them x 100) and it is drawn over the slice, faint where the drops are
    small (here at most 0.08: fundus-demo barely reacts to a CT); a one-frame map made as
    highdicom documents it (a 0.9 square) is drawn plainly. On an idle host OHIF leaves a
    fused one-frame map undrawn until the view changes (seen: 0 tinted pixels for 12 s,
    then 58,350 and 121,043 after Reset; beside two CPU burners it drew them unasked), so
    the test presses what Reset does and reads what is drawn."""
    ours, control, largest = _one_frame_maps(orthanc, tmp_path, monkeypatch, capsys)
    fused = _fused_map(browser, viewer, ours)
    assert fused["coloured_before"] == 0  # the CT alone is gray, even to the faint test
    assert fused["dimensions"][2] == 1
    assert fused["max"] == pytest.approx(100 * largest, abs=0.2)  # the values arrive
    assert _coloured_on(browser, fused, 0, least=FAINT, reset=True) > 1000  # and drawn
    fused = _fused_map(browser, viewer, control)
    assert fused["max"] == pytest.approx(90.0, abs=0.01)
    assert _coloured_on(browser, fused, 0, reset=True) > 1000


READ_REPORT = """
const sets = (window.services?.displaySetService?.getActiveDisplaySets() || [])
  .filter(d => d.Modality === 'SR');
if (!sets.length || !sets[0].isLoaded) return null;
const found = (sets[0].measurements || []).map(m => ({
  identifier: m.TrackingIdentifier,
  labels: (m.labels || []).map(l => `${l.label}: ${l.value}`),
  images: (m.coords || []).map(c => c.ReferencedSOPSequence?.ReferencedSOPInstanceUID
                                   || c.ReferencedSOPSequence?.[0]?.ReferencedSOPInstanceUID),
  points: (m.coords || []).map(c => Array.from(c.GraphicData || [])),
}));
const shown = [];
for (const e of (window.cornerstone?.getEnabledElements?.() || [])) {
  const id = e.viewport.getCurrentImageId?.();
  if (!id) continue;
  const plane = window.cornerstone.metaData.get('imagePlaneModule', id) || {};
  const instance = window.cornerstone.metaData.get('instance', id) || {};
  shown.push({z: (plane.imagePositionPatient || [])[2], sop: instance.SOPInstanceUID || null});
}
const drawn = (window.cornerstoneTools?.annotation?.state?.getAllAnnotations?.() || [])
  .map(a => a.metadata?.referencedImageId || '');
return JSON.stringify({found, shown, drawn: drawn.length});
"""


def _opened_report(browser, viewer_url: str, study: str) -> dict:
    """Open ``study`` in OHIF, double-click Krypton's finding (the SR entry), and what
    OHIF read of it and shows: its measurements (labels, the image each is drawn on),
    the image each viewport shows (its z), and how many annotations are drawn."""
    entry, deadline = _opened_study(browser, viewer_url, study, "Krypton finding")
    read, clicked = None, -math.inf
    while time.monotonic() < deadline:
        if time.monotonic() - clicked > 10.0:  # the first-visit tour, once the viewport
            _skip_tour(browser)  # is up, covers the page and takes a click meant for the
            _double_click(browser, entry)  # entry (seen in a fresh run): close it, again
            clicked = time.monotonic()
        answer = browser.execute_script(READ_REPORT)
        read = None if answer is None else json.loads(answer)
        if read and read["found"] and any(v["sop"] for v in read["shown"]):
            return read
        time.sleep(1.0)
    errors = [e["message"][:300] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    raise AssertionError(f"OHIF showed no finding in {MAP_TIMEOUT_S} s: {read} {errors[-5:]}")


def _skip_tour(browser) -> None:
    """Close OHIF's first-visit tour, which covers the page: while it animates in, its
    button is not yet interactable to WebDriver (a fresh run failed so), and a script
    click closes it all the same."""
    from selenium.common.exceptions import (
        ElementNotInteractableException,
        StaleElementReferenceException,
    )
    from selenium.webdriver.common.by import By

    for skip in browser.find_elements(By.XPATH, "//*[normalize-space(text())='Skip all']"):
        try:
            skip.click()
        except ElementNotInteractableException:
            browser.execute_script("arguments[0].click()", skip)
        except StaleElementReferenceException:
            pass  # the tour re-rendered or closed itself


def _double_click(browser, entry) -> None:
    """Double-click the study browser's ``entry()``, found again while it re-renders as
    the series load."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.action_chains import ActionChains

    for _attempt in range(5):
        try:
            ActionChains(browser).double_click(entry()).perform()
            return
        except StaleElementReferenceException:
            time.sleep(0.5)


def test_ohif_opens_kryptons_finding_on_the_slice_of_its_strongest_cell(
    browser,
    viewer,
    orthanc,  # noqa: F811
    model,
):
    """The Structured Report Send stores with the map, opened in OHIF 3.13: its one
    measurement is drawn on a slice that holds Krypton's strongest cell (the slices the
    map's largest drop lies on), and its text carries the class, the probability and the
    out-of-distribution verdict."""
    shape, spacing = GEOMETRIES["40x128x128-3mm"]
    study, centre_z, holding = _sent(orthanc, model, _ct(shape, spacing), spacing)
    read = _opened_report(browser, viewer, study)
    (finding,) = read["found"]
    text = " | ".join(finding["labels"])
    print(f"OHIF's finding: {finding['identifier']}: {text}; shown {read['shown']}; "
          f"Krypton's cell centred at z {centre_z:.1f} mm, its drop on "
          f"{min(holding):.1f}-{max(holding):.1f} mm")  # fmt: skip
    assert "probability of NODULE" in text or "probability of NORMAL" in text, text
    assert "unusualness" in text and "the training data (threshold" in text, text
    assert "drop in P(" in text, text
    (shown,) = [view for view in read["shown"] if view["sop"] in finding["images"]]
    assert min(holding) - spacing[0] - 1e-6 <= float(shown["z"]) <= max(holding) + spacing[0] + 1e-6
    assert read["drawn"] >= 1  # the rectangle is an annotation on the page
