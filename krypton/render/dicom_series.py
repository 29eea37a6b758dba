"""A volume's heatmap as DICOM: one Secondary Capture image per axial slice of the block
the model saw, all in one new series of the source's study, each referencing the source
series (highdicom). The slices are the model's resampled voxels, not the source's: each
names the source slice nearest it where the source's geometry is known, else one image of
the series, and says which."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = [
    "first_dicom_header",
    "dicom_headers",
    "capture_series",
    "capture_series_zip",
    "nearest_sources",
    "slice_pictures",
]


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


def dicom_headers(source: bytes) -> list:
    """The headers of every DICOM file in a zip of a series (or of one file), read through
    the bounded inflater: what a result stored back into the source's study references."""
    from pydicom.errors import InvalidDicomError

    from ..io.dicom import read_header

    if not zipfile.is_zipfile(io.BytesIO(source)):
        return [first_dicom_header(source)]
    headers = []
    with zipfile.ZipFile(io.BytesIO(source)) as archive:
        for info in archive.infolist():
            if info.is_dir() or info.file_size > 2**30:
                continue
            try:
                headers.append(read_header(archive.read(info), "the source"))
            except (InvalidDicomError, OSError, ValueError):
                continue
    if not headers:
        raise ValueError("the zip holds no DICOM file to reference")
    return headers


def capture_series(
    header,
    pictures: list[Image.Image],
    *,
    description: str,
    comments: str,
    pixel_spacing: tuple[float, float] | None = None,
    include_identity: bool = False,
    sources: list | None = None,
) -> list[bytes]:
    """One Secondary Capture (Part 10 bytes) per picture, instance numbers in order, in a
    new series of ``header``'s study. Each names the source image it was derived from:
    ``sources[i]`` for picture ``i`` where given (the source slice nearest the block's,
    :func:`nearest_sources`), else ``header``. Patient identity is copied only with
    ``include_identity``."""
    import pydicom
    from pydicom.uid import generate_uid

    from .dicom_capture import heatmap_sc_image, reference_source

    if sources is not None and len(sources) != len(pictures):
        raise ValueError(f"{len(sources)} source images for {len(pictures)} pictures")
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
        source = header if sources is None else sources[number - 1]
        capture.DerivationDescription = (
            f"Occlusion sensitivity heatmap, axial slice {number} of {len(pictures)} of the "
            f"model's resampled block; the source image named is "
            + ("the source slice nearest it" if sources is not None else "one of the series")
        )[:1024]
        reference_source(capture, source)
        buffer = io.BytesIO()
        pydicom.dcmwrite(buffer, capture, enforce_file_format=True)
        files.append(buffer.getvalue())
    return files


def nearest_sources(sources: list, voxel_affine: np.ndarray, depth: int) -> list:
    """For each of the ``depth`` axial slices of a block whose voxel (z, y, x) indices
    map to RAS+ mm by ``voxel_affine``, the source slice (a header with Image Position
    and Orientation (Patient), LPS) whose plane lies nearest the slice's plane."""
    from .parametric_map import RAS_TO_LPS

    cosines = np.asarray(sources[0].ImageOrientationPatient, dtype=float)
    normal = np.cross(cosines[:3], cosines[3:])
    heights = np.array([np.dot(normal, np.asarray(s.ImagePositionPatient, float)) for s in sources])
    to_lps = RAS_TO_LPS @ np.asarray(voxel_affine, dtype=float)
    chosen = []
    for z in range(depth):
        point = to_lps @ np.array([z, 0.0, 0.0, 1.0])  # any voxel of slice z: its plane
        chosen.append(sources[int(np.argmin(np.abs(heights - np.dot(normal, point[:3]))))])
    return chosen


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
