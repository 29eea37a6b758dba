"""A volume's heatmap as DICOM: one Secondary Capture image per axial slice of the block
the model saw, all in one new series of the source's study, each referencing the source
series (highdicom). The slices are the model's resampled voxels, not the source's, so
each image references the series rather than one source image, and says so."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["first_dicom_header", "capture_series", "capture_series_zip"]


def first_dicom_header(source: bytes):
    """The header of the first DICOM file in ``source`` (a zip of a series, or one
    multi-frame file), read through the bounded inflater (:func:`krypton.io.dicom.read_header`);
    ValueError when there is none."""
    from pydicom.errors import InvalidDicomError

    from ..io.dicom import read_header

    def read(data: bytes):
        return read_header(data, "the source")

    if zipfile.is_zipfile(io.BytesIO(source)):
        with zipfile.ZipFile(io.BytesIO(source)) as archive:
            for info in archive.infolist():
                if info.is_dir() or info.file_size > 2**30:
                    continue
                try:
                    return read(archive.read(info))
                except (InvalidDicomError, OSError, ValueError):
                    continue
        raise ValueError("the zip holds no DICOM file to reference")
    try:
        return read(source)
    except (InvalidDicomError, OSError, ValueError) as exc:
        raise ValueError(f"the source is not DICOM ({exc}); no DICOM export") from None


def capture_series(
    header,
    pictures: list[Image.Image],
    *,
    description: str,
    comments: str,
    pixel_spacing: tuple[float, float] | None = None,
    include_identity: bool = False,
) -> list[bytes]:
    """One Secondary Capture (Part 10 bytes) per picture, instance numbers in order, in a
    new series of ``header``'s study that references ``header``'s series. Patient
    identity is copied only with ``include_identity``."""
    import pydicom
    from pydicom.dataset import Dataset
    from pydicom.uid import generate_uid

    from .dicom_capture import heatmap_sc_image

    series = generate_uid()
    files = []
    for number, picture in enumerate(pictures, start=1):
        capture = heatmap_sc_image(
            header,
            np.asarray(picture.convert("RGB"), dtype=np.uint8),
            series_uid=series,
            instance_number=number,
            pixel_spacing=pixel_spacing,
            orientation=("L", "P"),  # axial: columns to the left, rows back
            description=description,
            comments=comments,
            include_identity=include_identity,
        )
        capture.DerivationDescription = (
            f"Occlusion sensitivity heatmap, axial slice {number} of {len(pictures)} of the "
            f"model's resampled block; references the source series, not one source image"
        )[:1024]
        if "SeriesInstanceUID" in header:
            reference = Dataset()
            reference.SeriesInstanceUID = header.SeriesInstanceUID
            if "SOPInstanceUID" in header:
                instance = Dataset()
                instance.ReferencedSOPClassUID = header.SOPClassUID
                instance.ReferencedSOPInstanceUID = header.SOPInstanceUID
                reference.ReferencedInstanceSequence = [instance]
            capture.ReferencedSeriesSequence = [reference]
        buffer = io.BytesIO()
        pydicom.dcmwrite(buffer, capture, enforce_file_format=True)
        files.append(buffer.getvalue())
    return files


def slice_pictures(unit: np.ndarray, heatmap) -> list[Image.Image]:
    """The heatmap over every axial slice of the model's block: ``unit`` (D, H, W) the
    block windowed to [0, 1], each cell's value on the voxels nearest its centre."""
    from .overlay import overlay
    from .volumes import voxel_values

    per_voxel = voxel_values(heatmap, unit.shape)
    depth, height, width = unit.shape
    return [
        overlay(
            Image.fromarray((np.clip(unit[z], 0, 1) * 255).astype(np.uint8)).convert("RGB"),
            per_voxel[z], np.arange(width), np.arange(height), 1, heatmap.prob,
        )
        for z in range(depth)
    ]  # fmt: skip


def capture_series_zip(files: list[bytes], folder: str = "krypton-heatmap") -> bytes:
    """The series' files in one zip (``folder``/slice_001.dcm, ...)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for number, data in enumerate(files, start=1):
            archive.writestr(str(Path(folder) / f"slice_{number:03d}.dcm"), data)
    return buffer.getvalue()
