"""Every result Krypton sends carries its finding as a DICOM Structured Report (a TID 1500
Measurement Report in a Comprehensive 3D SR): the class, how sure, the class explained,
the out-of-distribution verdict, the strongest cell drawn on the source slice it lies on,
the algorithm and its settings, and references to the source, the Parametric Map and the
captures. Checked against what Krypton did not make: dicom3tools' verifier, and the
Parametric Map's own pixels on the referenced slice."""

from __future__ import annotations

import highdicom as hd
import numpy as np
import pydicom
import pytest
from test_pacs import dciodvfy_errors
from test_volume_cli import hu_volume, volume_model, write_series  # noqa: F401

import krypton
from krypton.pacs import dicomweb, results
from krypton.registry.ood import caveat
from krypton.render.exports import dicom_comments
from krypton.render.structured_report import ood_words, strongest_cell

COMPREHENSIVE_3D_SR = "1.2.840.10008.5.1.4.1.1.88.34"
FLAGGED = {"score": 9.5, "threshold": 4.2, "flagged": True, "stage": "layer3",
           "warning": "this volume does not look like the model's training volumes"}  # fmt: skip


def _sent(monkeypatch, model, heatmap, source, settings) -> tuple[list, results.SentResult]:
    stored: list = []
    monkeypatch.setattr(dicomweb, "store", lambda pacs, datasets, study: stored.extend(datasets))
    sent = results.send_result(None, "1.2", model, heatmap, source, "KRYPTON_TEST", settings)
    return stored, sent


def _group(report):
    """The report's one measurement group, read back by highdicom."""
    parsed = hd.sr.Comprehensive3DSR.from_dataset(report)
    (group,) = parsed.content.get_planar_roi_measurement_groups()
    return group


def _items(node):
    """Every content item under ``node``, depth first."""
    for item in node.get("ContentSequence", []):
        yield item
        yield from _items(item)


def _concept(item) -> str:
    return (
        str(item.ConceptNameCodeSequence[0].CodeValue) if "ConceptNameCodeSequence" in item else ""
    )


def _region_image(region) -> str:
    """The SOP Instance UID of the image a region is drawn on."""
    return str(region.ContentSequence[0].ReferencedSOPSequence[0].ReferencedSOPInstanceUID)


def _measured(group) -> dict[str, float]:
    return {m.name.value: m.value for m in group.get_measurements()}


def test_a_volume_result_sends_a_report_whose_region_lies_on_the_map_s_strongest_cell(
    monkeypatch,
    tmp_path,
    volume_model,  # noqa: F811
    hu_volume,  # noqa: F811
):
    from krypton.io.volumes import read_dicom_series

    write_series(tmp_path / "series", hu_volume)
    headers = [pydicom.dcmread(p) for p in sorted((tmp_path / "series").iterdir())]
    prepared = volume_model.prepare_volume(read_dicom_series(tmp_path / "series"))
    heatmap = krypton.explain(volume_model, prepared.tensor, patch=16, stride=16, label=1,
                              fill=volume_model.gray_fill())  # fmt: skip
    heatmap.extra["ood"] = FLAGGED
    settings = {"patch": 16, "stride": 16, "label": 1}
    stored, sent = _sent(monkeypatch, volume_model, heatmap,
                         results.VolumeSource(prepared, headers), settings)  # fmt: skip
    reports = [d for d in stored if d.SOPClassUID == COMPREHENSIVE_3D_SR]
    (report,) = reports  # one result: one map and one report
    (pmap,) = [d for d in stored if d.SOPClassUID == results.PARAMETRIC_MAP_STORAGE]
    assert sent.report_series == report.SeriesInstanceUID
    assert "Structured Report of the finding" in sent.words()
    assert report.StudyInstanceUID == headers[0].StudyInstanceUID
    assert report.PatientID == headers[0].PatientID
    # the evidence: the source series, the map and the captures
    evidence = {s.SeriesInstanceUID for e in report.CurrentRequestedProcedureEvidenceSequence
                for s in e.ReferencedSeriesSequence}  # fmt: skip
    assert evidence == {headers[0].SeriesInstanceUID, pmap.SeriesInstanceUID, sent.capture_series}

    group = _group(report)
    predicted = int(np.argmax(heatmap.base_probs))
    assert group.finding_type.meaning == volume_model.class_name(predicted)
    measured = _measured(group)
    _, drop = strongest_cell(heatmap)
    assert measured["PROBABILITY"] == pytest.approx(heatmap.base_probs[predicted], abs=1e-5)
    assert measured["DROP"] == pytest.approx(drop, abs=1e-5)
    verdicts = {e.name.value: e.value for e in group.get_qualitative_evaluations()}
    assert verdicts["OUT_OF_DIST"].meaning == "Yes"
    assert measured["OOD_SCORE"] == pytest.approx(9.5)  # the form OHIF shows
    assert verdicts["EXPLAINED_CLASS"].meaning == volume_model.class_name(1)
    assert ood_words(report).startswith("WARNING: this volume does not look like")
    parameters = [str(item.TextValue) for item in _items(report)
                  if _concept(item) == "111002"]  # fmt: skip
    assert "patch=16x16x16" in parameters and "mode=exact" in parameters, parameters

    # The region's slice and rectangle, read against the map: on that slice's frame the
    # map holds the strongest cell's drop at the rectangle's centre, and no more anywhere.
    region = group.roi
    referenced = _region_image(region)
    assert referenced in {h.SOPInstanceUID for h in headers}
    frame = next(
        number for number, g in enumerate(pmap.PerFrameFunctionalGroupsSequence)
        if g.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID
        == referenced
    )  # fmt: skip
    drops = np.asarray(pmap.pixel_array, dtype=np.float32)[frame]
    corners = np.asarray(region.GraphicData, dtype=np.float64).reshape(-1, 2)[:4]
    column, row = (corners.min(axis=0) + corners.max(axis=0)) / 2
    assert drops[int(row), int(column)] == pytest.approx(drop, abs=1e-5)
    assert drops.max() == pytest.approx(drop, abs=1e-5)
    assert dciodvfy_errors(report, tmp_path) == []


def test_an_image_result_reports_its_finding_on_the_source_s_own_pixels(monkeypatch, tmp_path):
    from pydicom.data import get_testdata_file

    model = krypton.load_model("fundus-demo")
    path = get_testdata_file("CT_small.dcm")
    source = pydicom.dcmread(path)
    from krypton.io.dicom import load_dicom

    image = model.preprocess(load_dicom(path).picture)
    heatmap = krypton.explain(model, image, patch=56, stride=56)
    settings = {"patch": 56, "stride": 56, "label": heatmap.label}
    stored, sent = _sent(monkeypatch, model, heatmap, results.ImageSource(path), settings)
    (report,) = [d for d in stored if d.SOPClassUID == COMPREHENSIVE_3D_SR]
    assert sent.map_series and sent.report_series == report.SeriesInstanceUID
    group = _group(report)
    region = group.roi
    assert _region_image(region) == source.SOPInstanceUID
    corners = np.asarray(region.GraphicData, dtype=np.float64).reshape(-1, 2)
    # a 56-pixel cell of the 224-pixel input is a quarter of the source's side
    sides = corners.max(axis=0) - corners.min(axis=0)
    assert sides == pytest.approx([source.Columns / 4, source.Rows / 4])
    # fundus-demo finds a CT slice unlike its photographs: the report says so, as the
    # map's Image Comments do
    assert heatmap.extra["ood"]["flagged"]
    assert ood_words(report) == dicom_comments(caveat(heatmap.extra["ood"]))
    (pmap,) = [d for d in stored if d.SOPClassUID == results.PARAMETRIC_MAP_STORAGE]
    assert str(pmap.ImageComments) == ood_words(report)
    assert dciodvfy_errors(report, tmp_path) == []
