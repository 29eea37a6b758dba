"""A heatmap as DICOM Secondary Capture, in its source's study: the one place that decides
what a Krypton capture copies from its source (identity only when asked), the capture of
one image's heatmap over its DICOM frame, and the capture the volume series export builds
each slice with. Readers (:mod:`krypton.io.dicom`) read; this module writes and draws."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from ..io.dicom import _read, load_dicom
from .exports import dicom_comments
from .overlay import OverlayStyle, overlay, styled_heatmap

__all__ = ["heatmap_capture", "heatmap_sc_image", "reference_source", "secondary_capture"]


_AXIS_LETTERS = (("L", "R"), ("P", "A"), ("H", "F"))  # +x, -x; +y, -y; +z, -z (LPS)


def _patient_orientation(dataset) -> tuple[str, str]:
    """(row direction, column direction) as patient letters: from Image Orientation
    (Patient), the dominant axis of each direction cosine; else the file's Patient
    Orientation; else the axial convention ('L', 'P')."""
    cosines = dataset.get("ImageOrientationPatient")
    if cosines is not None and len(cosines) == 6:
        letters = []
        for vector in (cosines[:3], cosines[3:]):
            axis = int(np.argmax(np.abs(vector)))
            letters.append(_AXIS_LETTERS[axis][0 if float(vector[axis]) >= 0 else 1])
        return letters[0], letters[1]
    recorded = dataset.get("PatientOrientation")
    if recorded is not None and len(recorded) == 2 and all(len(str(v)) == 1 for v in recorded):
        return str(recorded[0]), str(recorded[1])
    return "L", "P"


def heatmap_sc_image(
    header,
    rgb: np.ndarray,
    *,
    series_uid: str,
    instance_number: int,
    pixel_spacing: tuple[float, float] | None,
    orientation: tuple[str, str],
    description: str,
    comments: str,
    include_identity: bool = False,
):
    """A Secondary Capture (highdicom SCImage) of ``rgb`` in the study of the source
    ``header``, in the series ``series_uid``: the one place that decides what a Krypton
    capture copies from its source. Patient and visit identity only with
    ``include_identity``; the study's UID, date and time always, so it files beside its
    source. The caller adds its derivation and references."""
    import highdicom as hd
    from pydicom.uid import generate_uid

    def copied(keyword: str):
        value = header.get(keyword) if include_identity else None
        return value if value not in ("", None) else None

    capture = hd.sc.SCImage(
        pixel_array=rgb,
        photometric_interpretation="RGB",
        bits_allocated=8,
        coordinate_system="PATIENT",
        study_instance_uid=str(header.get("StudyInstanceUID") or generate_uid()),
        series_instance_uid=series_uid,
        series_number=int(header.get("SeriesNumber") or 0) + 1000,
        sop_instance_uid=generate_uid(),
        instance_number=instance_number,
        manufacturer="Krypton",
        patient_id=copied("PatientID"),
        patient_name=copied("PatientName"),
        patient_birth_date=copied("PatientBirthDate"),
        patient_sex=copied("PatientSex"),
        accession_number=copied("AccessionNumber"),
        study_id=copied("StudyID"),
        study_date=header.get("StudyDate") or None,
        study_time=header.get("StudyTime") or None,
        referring_physician_name=copied("ReferringPhysicianName"),
        pixel_spacing=pixel_spacing,
        patient_orientation=orientation,
    )
    capture.SpecificCharacterSet = "ISO_IR 192"  # UTF-8: descriptions name scales with '–'
    capture.SeriesDescription = description[:64]
    capture.ImageComments = comments[:10240]
    capture.BurnedInAnnotation = "NO"
    capture.ImageType = ["DERIVED", "SECONDARY"]
    # General Series' Laterality is Type 2C (paired body parts): the source's, else empty
    capture.Laterality = header.get("Laterality") or ""
    return capture


def reference_source(capture, source, frame: int | None = None) -> None:
    """Name ``source`` (a dataset) as the image ``capture`` was derived from: its Source
    Image Sequence (with the frame, for a multi-frame source) and the Common Instance
    Reference's series and instance, which DICOM allows only beside such a reference."""
    from pydicom.dataset import Dataset

    if "SOPInstanceUID" not in source:
        return
    reference = Dataset()
    reference.ReferencedSOPClassUID = source.SOPClassUID
    reference.ReferencedSOPInstanceUID = source.SOPInstanceUID
    if frame is not None and int(source.get("NumberOfFrames", 1) or 1) > 1:
        reference.ReferencedFrameNumber = frame + 1
    capture.SourceImageSequence = [reference]
    if "SeriesInstanceUID" in source:
        instance = Dataset()
        instance.ReferencedSOPClassUID = source.SOPClassUID
        instance.ReferencedSOPInstanceUID = source.SOPInstanceUID
        series = Dataset()
        series.SeriesInstanceUID = source.SeriesInstanceUID
        series.ReferencedInstanceSequence = [instance]
        capture.ReferencedSeriesSequence = [series]


def secondary_capture(
    source: str | Path | bytes,
    picture: Image.Image,
    *,
    frame: int = 0,
    description: str = "Krypton occlusion heatmap",
    comments: str = "",
    include_identity: bool = False,
) -> bytes:
    """The heatmap overlay as a DICOM Secondary Capture image (highdicom) in the source's
    study, referencing the source image and series, as bytes of a Part 10 file.

    ``picture``: the overlay (RGB; normally the windowed frame at its own resolution with
    the heatmap drawn on it). Patient and visit identity (:data:`IDENTIFYING_KEYWORDS`)
    is copied only with ``include_identity`` — without it the object keeps the study,
    series and image UIDs that place it next to its source, and nothing that names the
    patient; a PACS that files by patient ID needs ``include_identity=True``.
    """
    import pydicom
    from pydicom.uid import generate_uid

    dataset, _ = _read(source)
    rgb = np.asarray(picture.convert("RGB"), dtype=np.uint8)
    spacing = dataset.get("PixelSpacing") or dataset.get("ImagerPixelSpacing")
    pixel_spacing = None
    if spacing and dataset.get("Rows") and dataset.get("Columns"):
        pixel_spacing = (
            float(spacing[0]) * int(dataset.Rows) / rgb.shape[0],
            float(spacing[1]) * int(dataset.Columns) / rgb.shape[1],
        )

    capture = heatmap_sc_image(
        dataset,
        rgb,
        series_uid=generate_uid(),
        instance_number=1,
        pixel_spacing=pixel_spacing,
        orientation=_patient_orientation(dataset),
        description=description,
        comments=comments,
        include_identity=include_identity,
    )
    capture.DerivationDescription = (
        f"Occlusion sensitivity heatmap over frame {frame} of the source image"
    )[:1024]
    reference_source(capture, dataset, frame)
    buffer = io.BytesIO()
    pydicom.dcmwrite(buffer, capture, enforce_file_format=True)
    return buffer.getvalue()


def heatmap_capture(
    source: str | Path | bytes,
    *,
    values: np.ndarray,
    xs,
    ys,
    patch: int,
    stride: int,
    prob: float,
    input_size: tuple[int, int],
    label_name: str,
    mode: str,
    model_name: str,
    window: str | tuple | None = None,
    frame: int | None = None,
    style=None,
    weights: str = "",
    include_identity: bool = False,
    warning: str = "",
) -> bytes:
    """A heatmap as a Secondary Capture of its DICOM source: the same frame in the same
    ``window``, at the file's own resolution, with the heatmap drawn as ``style`` (an
    :class:`krypton.render.OverlayStyle`) says and the settings in Image Comments,
    ``warning`` (an out-of-distribution caveat, say) first."""

    style = style or OverlayStyle()
    loaded = load_dicom(source, window=window, frame=frame)
    values = np.asarray(values, dtype=np.float32)
    picture = overlay(
        loaded.picture,
        values,
        np.asarray(xs),
        np.asarray(ys),
        patch,
        prob,
        input_size=tuple(input_size),
        style=style,
    )
    shown = loaded.window_text()
    settings = (
        f"Krypton {mode} occlusion heatmap. Model {model_name}"
        f"{f' (weights {weights})' if weights else ''}; class {label_name}, p = {prob:.4f}; "
        f"patch {patch} px, stride {stride} px (model input {input_size[1]}x"
        f"{input_size[0]}); {shown}; colours: jet, {styled_heatmap(values, prob, style).label};"
        f" opacity {style.opacity:.2f}. Not a diagnosis: shows where occluding the image "
        f"changed the model's output."
    )
    comments = dicom_comments(warning, settings)
    return secondary_capture(
        source,
        picture,
        frame=loaded.frame,
        description=f"Krypton heatmap {label_name}",
        comments=comments,
        include_identity=include_identity,
    )
