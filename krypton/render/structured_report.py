"""A result's finding as a DICOM Structured Report: a TID 1500 Measurement Report in a
Comprehensive 3D SR (highdicom's), stored beside the result's Parametric Map.

What a PACS and a viewer read from it, without opening Krypton:

- **who said it**: the observer is a device (Krypton, the model's name); the algorithm is
  identified by name, version and parameters (the model's registry name and weights
  digest, mode, patch, stride, fill);
- **the finding**: the class the model predicts (its name from the model's card, coded in
  Krypton's own scheme, :data:`SCHEME`), that class's probability, and the class the map
  explains with its probability where it is another;
- **the out-of-distribution verdict** as a qualitative evaluation (yes or no, the
  score and threshold in its words);
- **the region**: the heatmap's strongest cell (the largest drop in the explained
  class's probability when the patch covers it) as a rectangle (SCOORD polyline) on the
  source image it lies on (for a volume, the source slice nearest the cell's centre),
  with that drop as a measurement whose source is the Parametric Map;
- **the evidence**: the source series, the Parametric Map and the Secondary Captures,
  listed in the report's evidence sequence.

The report's region and values come from :func:`strongest_cell` and the source's own
geometry (:class:`Region`), so the app, the CLI, a study batch and a worker write one
report for one result. Like the map, it is a finding of a model, not a diagnosis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "SCHEME",
    "Region",
    "strongest_cell",
    "image_region",
    "volume_region",
    "finding_report",
    "ood_words",
]

SCHEME = "99KRYPTON"  # Krypton's private coding scheme: its classes and measures
SERIES_NUMBER = 9902  # the map is 9901
STRUCTURED_REPORT_STORAGE = "1.2.840.10008.5.1.4.1.1.88.34"  # Comprehensive 3D SR


@dataclass(frozen=True)
class Region:
    """The strongest cell on one source image: the image's SOP class and instance UIDs,
    the rectangle's corners as (column, row) in the image's pixel coordinates (0, 0 the
    top left corner of the top left pixel, as SCOORD has them), the cell's drop in the
    explained class's probability, and the instance numbers of the source slices the
    cell reaches (empty for an image)."""

    sop_class_uid: str
    sop_instance_uid: str
    corners: np.ndarray
    drop: float
    slices: tuple[int, ...] = ()


def strongest_cell(heatmap) -> tuple[tuple[int, ...], float]:
    """The index of the cell whose occlusion dropped the explained class's probability
    most, (i, j) or (k, i, j) into ``heatmap.values``, and that drop."""
    drops = float(heatmap.prob) - np.asarray(heatmap.values, dtype=np.float64)
    if not np.isfinite(drops).any():
        raise ValueError("the heatmap has no computed cell to report")
    index = np.unravel_index(int(np.nanargmax(drops)), drops.shape)
    return tuple(int(i) for i in index), float(drops[index])


def image_region(heatmap, input_size: Sequence[int], source) -> Region:
    """The strongest cell of an image's ``heatmap`` on its DICOM ``source`` (a header
    suffices): the model saw the whole image resized to ``input_size`` (H, W), so the
    cell's corners scale by the source's rows and columns over it."""
    from .volumes import _sides

    (i, j), drop = strongest_cell(heatmap)
    height, width = (int(v) for v in input_size)
    patch_h, patch_w = _sides(heatmap.patch, 2)
    rows, columns = int(source.Rows), int(source.Columns)
    top, left = float(heatmap.ys[i]) * rows / height, float(heatmap.xs[j]) * columns / width
    bottom = min(float(heatmap.ys[i] + patch_h) * rows / height, rows)
    right = min(float(heatmap.xs[j] + patch_w) * columns / width, columns)
    corners = np.array([[left, top], [right, top], [right, bottom], [left, bottom]])
    return Region(str(source.SOPClassUID), str(source.SOPInstanceUID), corners, drop)


def volume_region(heatmap, voxel_affine: np.ndarray, slices: Sequence) -> Region:
    """The strongest cell of a volume's ``heatmap`` on the source slice nearest its
    centre: the cell's box in the model's voxels (voxel n covers [n - 0.5, n + 0.5)),
    placed in the patient by ``voxel_affine`` (the prepared volume's, RAS+), projected
    onto that slice and bounded by its pixels. ``slices``: the source's slices in
    ascending order along their normal (:func:`krypton.render.parametric_map.source_slices`)."""
    from .parametric_map import RAS_TO_LPS, _normal
    from .volumes import _sides

    (k, i, j), drop = strongest_cell(heatmap)
    sides = _sides(heatmap.patch, 3)
    first = (float(heatmap.zs[k]), float(heatmap.ys[i]), float(heatmap.xs[j]))
    low = np.array(first) - 0.5
    high = low + np.array(sides, dtype=np.float64)
    box = np.array(np.meshgrid(*zip(low, high), indexing="ij")).reshape(3, -1).T
    to_patient = RAS_TO_LPS @ np.asarray(voxel_affine, dtype=np.float64)
    points = (to_patient[:3, :3] @ box.T).T + to_patient[:3, 3]  # LPS mm, 8 x 3
    centre = points.mean(axis=0)
    cosines = np.asarray(slices[0].ImageOrientationPatient, dtype=np.float64)
    normal = _normal(cosines)
    depth = [float(normal @ np.asarray(s.ImagePositionPatient, float)) for s in slices]
    nearest = int(np.argmin(np.abs(np.asarray(depth) - float(normal @ centre))))
    reach = normal @ points.T
    covered = tuple(
        int(s.get("InstanceNumber") or n + 1)
        for n, s in enumerate(slices)
        if reach.min() <= depth[n] <= reach.max()
    )
    target = slices[nearest]
    row_spacing, column_spacing = (float(v) for v in target.PixelSpacing)
    offset = points - np.asarray(target.ImagePositionPatient, dtype=np.float64)
    columns_at = offset @ cosines[:3] / column_spacing + 0.5  # pixel centres sit at n + 0.5
    rows_at = offset @ cosines[3:] / row_spacing + 0.5
    left, right = np.clip([columns_at.min(), columns_at.max()], 0, int(target.Columns))
    top, bottom = np.clip([rows_at.min(), rows_at.max()], 0, int(target.Rows))
    corners = np.array([[left, top], [right, top], [right, bottom], [left, bottom]])
    return Region(str(target.SOPClassUID), str(target.SOPInstanceUID), corners, drop, covered)


def _code(value: str, meaning: str):
    import highdicom as hd

    return hd.sr.CodedConcept(value=value[:16], scheme_designator=SCHEME, meaning=meaning[:64])


def _class_code(model, index: int):
    name = model.class_name(index)
    return _code(name.upper().replace(" ", "_"), name)


def finding_report(
    heatmap,
    model,
    region: Region | None,
    evidence: Sequence,
    parametric_map=None,
    *,
    settings: dict,
    warning: str = "",
):
    """The Comprehensive 3D SR of ``heatmap``'s finding (module docstring): ``region``
    the strongest cell on its source image (None: none to draw it on), ``evidence`` the
    datasets it rests on (the source's, then the map and captures: the first gives the
    patient and study),
    ``parametric_map`` the map its drop is read from (None: an image without one),
    ``warning`` a flagged input's caveat (:func:`krypton.registry.ood.caveat`),
    ``settings`` the run's value settings (:func:`krypton.pacs.results.value_settings`)."""
    import highdicom as hd
    from pydicom.sr.codedict import codes
    from pydicom.uid import generate_uid

    from .._fingerprint import model_fingerprint
    from .._version import __version__

    algorithm = hd.sr.AlgorithmIdentification(
        name=f"Krypton occlusion sensitivity, {model.name}"[:64],
        version=str(__version__),
        # each one "name=value": highdicom writes a parameter's text as given
        parameters=[  # type: ignore[arg-type]
            f"model={model.name}",
            f"weights={model_fingerprint(model.module)[1][:16]}",
            *(f"{key}={_parameter(value)}" for key, value in settings.items() if key != "label"),
        ],
    )
    device = hd.sr.ObserverContext(
        observer_type=codes.DCM.Device,
        observer_identifying_attributes=hd.sr.DeviceObserverIdentifyingAttributes(
            uid=generate_uid(entropy_srcs=["Krypton", model.name]),
            name="Krypton",
            manufacturer_name="Krypton",
            model_name=model.name[:64],
        ),
    )
    tracking = hd.sr.TrackingIdentifier(uid=hd.UID(), identifier=_region_words(region)[:64])
    described = dict(
        finding_type=_class_code(model, _predicted(heatmap)),
        method=_code("OCCLUSION", f"occlusion sensitivity, {heatmap.mode} mode"),
        algorithm_id=algorithm,
        measurements=_measurements(heatmap, model, parametric_map),
        qualitative_evaluations=_evaluations(heatmap, model),
    )
    if region is None:  # no image to draw it on (a multi-frame source): the values alone
        group = hd.sr.MeasurementsAndQualitativeEvaluations(tracking, **described)
    else:
        group = hd.sr.PlanarROIMeasurementsAndQualitativeEvaluations(
            tracking_identifier=tracking,
            referenced_region=hd.sr.ImageRegion(
                graphic_type=hd.sr.GraphicTypeValues.POLYLINE,
                graphic_data=np.vstack([region.corners, region.corners[:1]]).astype(np.float32),
                source_image=hd.sr.SourceImageForRegion(
                    region.sop_class_uid, region.sop_instance_uid
                ),
            ),
            **described,
        )
    report = hd.sr.MeasurementReport(
        observation_context=hd.sr.ObservationContext(observer_device_context=device),
        procedure_reported=_procedure(str(evidence[0].get("Modality", ""))),
        imaging_measurements=[group],
    )
    comment = _comment(warning)
    if comment:
        report[0].ContentSequence.append(comment)
    created = hd.sr.Comprehensive3DSR(
        evidence=list(evidence),
        content=report,
        series_instance_uid=hd.UID(),
        series_number=SERIES_NUMBER,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer="Krypton",
        is_complete=True,
    )
    created.SeriesDescription = _series_words(heatmap, model)[:64]
    return created


# TID 1500's report-level Qualitative Evaluations container, which may hold text
EVALUATIONS = ("C0034375", "UMLS", "Qualitative Evaluations")


def _comment(warning: str):
    """The report-level evaluations: a flagged input's caveat in the words every DICOM
    Krypton writes carries (:func:`krypton.render.exports.dicom_comments`); None if none."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    from .exports import dicom_comments

    words = dicom_comments(warning)
    if not words:
        return None
    container = hd.sr.ContainerContentItem(
        name=hd.sr.CodedConcept(*EVALUATIONS), relationship_type="CONTAINS"
    )
    container.ContentSequence = [
        hd.sr.TextContentItem(name=codes.DCM.Comment, value=words, relationship_type="CONTAINS")
    ]
    return container


def ood_words(report) -> str:
    """The caveat a stored report carries ("" if none): the text of its report-level
    Qualitative Evaluations (what :func:`finding_report` wrote for a flagged input)."""
    for item in report.ContentSequence:
        concept = item.ConceptNameCodeSequence[0]
        if (concept.CodeValue, concept.CodingSchemeDesignator) == EVALUATIONS[:2]:
            return " ".join(str(text.TextValue) for text in item.ContentSequence)
    return ""


def _procedure(modality: str):
    from pydicom.sr.codedict import codes

    if modality == "CT":
        return codes.LN.CTUnspecifiedBodyRegion
    if modality == "MR":
        return codes.LN.MRIUnspecifiedBodyRegion
    return codes.SCT.ImagingProcedure


def _parameter(value) -> str:
    if isinstance(value, (list, tuple)):
        return "x".join(str(v) for v in value)
    return str(value)


def _predicted(heatmap) -> int:
    if heatmap.base_probs is None:
        return int(heatmap.label)
    return int(np.argmax(heatmap.base_probs))


def _region_words(region: Region | None) -> str:
    if region is None or not region.slices:
        return "Krypton strongest cell"
    first, last = min(region.slices), max(region.slices)
    where = f"image {first}" if first == last else f"images {first}-{last}"
    return f"Krypton strongest cell, {where}"


def _series_words(heatmap, model) -> str:
    predicted = _predicted(heatmap)
    probability = _probability(heatmap, predicted)
    return f"Krypton finding: {model.class_name(predicted)} p={probability:.3f}, {model.name}"


def _probability(heatmap, index: int) -> float:
    if heatmap.base_probs is None:
        return float(heatmap.prob)
    return float(heatmap.base_probs[index])


def _measurements(heatmap, model, parametric_map) -> list:
    import highdicom as hd
    from pydicom.sr.codedict import codes

    predicted = _predicted(heatmap)
    unit = codes.UCUM.NoUnits
    measured = [
        hd.sr.Measurement(
            name=_code("PROBABILITY", f"probability of {model.class_name(predicted)}"),
            value=round(_probability(heatmap, predicted), 6),
            unit=unit,
        )
    ]
    if int(heatmap.label) != predicted:
        measured.append(
            hd.sr.Measurement(
                name=_code("EXPLAINED_PROB", f"probability of {model.class_name(heatmap.label)}"),
                value=round(float(heatmap.prob), 6),
                unit=unit,
            )
        )
    source = None
    if parametric_map is not None:
        source = [
            hd.sr.SourceImageForMeasurement(
                str(parametric_map.SOPClassUID), str(parametric_map.SOPInstanceUID)
            )
        ]
    ood = heatmap.extra.get("ood")
    if ood:  # also as a number: what OHIF 3.13 shows of a group (its NUM items, not CODE)
        measured.append(
            hd.sr.Measurement(
                name=_code("OOD_SCORE", f"unusualness, {_verdict(ood)}"),
                value=round(float(ood["score"]), 3),
                unit=unit,
            )
        )
    measured.append(
        hd.sr.Measurement(
            name=_code(
                "DROP", f"drop in P({model.class_name(heatmap.label)}) with this patch occluded"
            ),
            value=round(strongest_cell(heatmap)[1], 6),
            unit=unit,
            referenced_images=source,
        )
    )
    return measured


def _evaluations(heatmap, model) -> list:
    import highdicom as hd
    from pydicom.sr.codedict import codes

    evaluations = [
        hd.sr.QualitativeEvaluation(
            name=_code("EXPLAINED_CLASS", "class the map explains"),
            value=_class_code(model, int(heatmap.label)),
        )
    ]
    ood = heatmap.extra.get("ood")
    if ood:
        evaluations.append(
            hd.sr.QualitativeEvaluation(
                name=_code("OUT_OF_DIST", f"out of distribution: {_verdict(ood)}"),
                value=codes.SCT.Yes if ood.get("flagged") else codes.SCT.No,
            )
        )
    return evaluations


def _verdict(ood: dict) -> str:
    """'UNLIKE the training data (threshold 4.2)', or 'like ...': the out-of-distribution
    verdict in a code meaning's 64 characters."""
    said = "UNLIKE" if ood.get("flagged") else "like"
    return f"{said} the training data (threshold {float(ood['threshold']):.1f})"
