"""Volumes in: a DICOM series (a folder or a zip of single-slice files) or a NIfTI file,
as one (D, H, W) array of modality values with its voxel spacing, and resampling to the
spacing a model was trained on.

A series is checked before any pixel is decoded: one series only (mixed series are
refused, each named), every slice with the same orientation, size and pixel spacing,
slices sorted by their Image Position (Patient) along the slice normal, and evenly spaced
(a missing slice or a duplicate is refused, naming where). The whole volume's decode must
fit the same decode budget as a 2-D file (:data:`krypton.io._decoding.DECODE_BUDGET`).
"""

from __future__ import annotations

import io
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ._decoding import DECODE_BUDGET, DICOM_DECODE_FACTOR, ImageLoadError

__all__ = [
    "Volume",
    "ModelVolume",
    "read_dicom_series",
    "read_multiframe_dicom",
    "read_nifti",
    "read_volume",
    "resample",
    "prepare_for_model",
]

# Slices are evenly spaced when every gap is within this share of the median gap.
SPACING_TOLERANCE = 0.01
# Direction cosines agree when they differ by less than this.
ORIENTATION_TOLERANCE = 1e-4
# Most files a series may have: more is not a scan but a folder of everything.
MAX_SLICES = 2048
# DICOM's patient frame is LPS+; NIfTI's (and Volume.affine's) is RAS+
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


@dataclass(frozen=True)
class Volume:
    """A volume of modality values (CT: Hounsfield units) and where its voxels lie.

    ``voxels``: (D, H, W) float32, slices ordered along the slice normal; ``spacing``:
    (slice, row, column) distances in mm; ``source``: what it was read from; ``affine``:
    4x4, voxel index (z, y, x, 1) to scanner position in mm, RAS+ as NIfTI keeps it (None
    when the source did not say)."""

    voxels: np.ndarray
    spacing: tuple[float, float, float]
    source: str
    series_uid: str | None = None
    modality: str | None = None
    affine: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.voxels.shape)  # type: ignore[return-value]


def _check_files_size(source: Path, count: int, total: int) -> None:
    """The files' bytes (a zip's as it declares them inflated, before inflating any) are
    held together while the headers are read: they must fit the decode budget."""
    DECODE_BUDGET.cost(
        str(source), f"{count} files of {total / 2**20:,.0f} MB together", (max(total, 1),), 1, 1
    )


def _members(source: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every file in a folder (recursively) or a zip archive."""
    if source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file())
        if len(files) > MAX_SLICES:
            raise ImageLoadError(f"{source} holds {len(files)} files, over {MAX_SLICES}")
        _check_files_size(source, len(files), sum(p.stat().st_size for p in files))
        for path in files:
            yield str(path.relative_to(source)), path.read_bytes()
        return
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ImageLoadError(f"{source} is neither a folder nor a zip archive") from exc
    with archive:
        entries = [e for e in archive.infolist() if not e.is_dir()]
        if len(entries) > MAX_SLICES:
            raise ImageLoadError(f"{source} holds {len(entries)} files, over {MAX_SLICES}")
        # zipfile inflates no more than an entry declares (then checks its CRC), so the
        # declared sizes bound what reading costs, even in an archive that lies
        _check_files_size(source, len(entries), sum(e.file_size for e in entries))
        for entry in entries:
            try:
                data = archive.read(entry)
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
                raise ImageLoadError(f"{source}: {entry.filename} is damaged ({exc})") from exc
            yield entry.filename, data


def _headers(source: Path) -> list[tuple[str, object, bytes]]:
    """(name, header, bytes) of every DICOM file in the source; other files are skipped."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    found = []
    for name, data in _members(source):
        try:
            header = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
        except (InvalidDicomError, EOFError, OSError, ValueError, TypeError):
            continue
        found.append((name, header, data))
    if not found:
        raise ImageLoadError(f"{source} holds no DICOM files")
    return found


def _vector(header, keyword: str, length: int, name: str) -> np.ndarray:
    value = getattr(header, keyword, None)
    try:
        vector = np.array([float(v) for v in value], dtype=np.float64)
    except (TypeError, ValueError):
        vector = np.zeros(0)
    if vector.shape != (length,) or not np.all(np.isfinite(vector)):
        raise ImageLoadError(f"{name} has no valid {keyword}: a series needs it on every slice")
    return vector


def _one_series(headers: list[tuple[str, object, bytes]], source: Path) -> str | None:
    series: dict[str | None, int] = {}
    for _, header, _ in headers:
        uid = getattr(header, "SeriesInstanceUID", None)
        series[str(uid) if uid else None] = series.get(str(uid) if uid else None, 0) + 1
    if len(series) > 1:
        listed = ", ".join(f"{uid} ({count} files)" for uid, count in series.items())
        raise ImageLoadError(
            f"{source} mixes {len(series)} series: {listed}; give one series at a time"
        )
    return next(iter(series))


def _sorted_slices(headers, source: Path) -> tuple[list, float, tuple[float, float]]:
    """The slices in order along the normal, the slice spacing and the pixel spacing."""
    first_name, first, _ = headers[0]
    orientation = _vector(first, "ImageOrientationPatient", 6, first_name)
    pixel_spacing = _vector(first, "PixelSpacing", 2, first_name)
    size = (getattr(first, "Rows", None), getattr(first, "Columns", None))
    normal = np.cross(orientation[:3], orientation[3:])
    placed = []
    for name, header, data in headers:
        if not np.allclose(
            _vector(header, "ImageOrientationPatient", 6, name),
            orientation,
            atol=ORIENTATION_TOLERANCE,
        ):
            raise ImageLoadError(
                f"{name} is oriented differently from {first_name}: a series must share "
                f"one orientation"
            )
        if (getattr(header, "Rows", None), getattr(header, "Columns", None)) != size:
            raise ImageLoadError(f"{name} has another size than {first_name}")
        if not np.allclose(_vector(header, "PixelSpacing", 2, name), pixel_spacing):
            raise ImageLoadError(f"{name} has another pixel spacing than {first_name}")
        position = _vector(header, "ImagePositionPatient", 3, name)
        placed.append((float(position @ normal), name, header, data))
    placed.sort(key=lambda item: item[0])
    if len(placed) < 2:
        raise ImageLoadError(f"{source} holds one slice: a volume needs at least two")
    gaps = np.diff([item[0] for item in placed])
    step = float(np.median(gaps))
    if step <= 0:
        raise ImageLoadError(f"{source}: slices share one position; is a slice duplicated?")
    for index, gap in enumerate(gaps):
        if abs(gap - step) > SPACING_TOLERANCE * step:
            before, after = placed[index][1], placed[index + 1][1]
            what = "a gap" if gap > step else "slices closer than the rest (a duplicate?)"
            raise ImageLoadError(
                f"{source}: {what} between {before} and {after} ({gap:.3g} mm where the "
                f"series steps {step:.3g} mm); a series must be evenly spaced"
            )
    return placed, step, (float(pixel_spacing[0]), float(pixel_spacing[1]))


def read_dicom_series(source: str | Path) -> Volume:
    """A DICOM series from a folder or a zip of single-slice files, in modality values
    (the modality LUT applied: Hounsfield units for CT), slices in order along the normal.
    Raises :class:`ImageLoadError` naming what is wrong with the series."""
    import pydicom
    from pydicom.pixels import apply_modality_lut

    from .dicom import _decode_frame

    source = Path(source)
    headers = _headers(source)
    uid = _one_series(headers, source)
    placed, step, (row_spacing, column_spacing) = _sorted_slices(headers, source)
    first = placed[0][2]
    rows, columns = int(first.Rows), int(first.Columns)
    bits = int(getattr(first, "BitsAllocated", 16) or 16)
    what = f"a {len(placed)}x{rows}x{columns} {bits}-bit DICOM series"
    cost = DECODE_BUDGET.cost(
        str(source), what, (len(placed), rows, columns), max(bits / 8, 4.0), DICOM_DECODE_FACTOR
    )
    voxels = np.empty((len(placed), rows, columns), dtype=np.float32)
    with DECODE_BUDGET.reserve(cost):
        for index, (_, name, _, data) in enumerate(placed):
            dataset = pydicom.dcmread(io.BytesIO(data))
            pixels = _decode_frame(dataset, name, None)
            if pixels.shape != (rows, columns):
                raise ImageLoadError(f"{name} is not a single-frame grayscale slice")
            voxels[index] = apply_modality_lut(pixels, dataset)
    return Volume(
        voxels,
        (step, row_spacing, column_spacing),
        f"DICOM series ({len(placed)} slices)",
        uid,
        getattr(first, "Modality", None),
        _series_affine(first, step, (row_spacing, column_spacing)),
    )


def _series_affine(first, step: float, pixel_spacing: tuple[float, float]) -> np.ndarray:
    """(z, y, x, 1) -> RAS mm for a sorted series: DICOM's patient frame is LPS, so x and y
    change sign; rows step along the column direction cosine, columns along the row one."""
    orientation = np.array([float(v) for v in first.ImageOrientationPatient])
    along_row, along_column = orientation[:3], orientation[3:]
    normal = np.cross(along_row, along_column)
    lps = np.eye(4)
    lps[:3, 0] = normal * step
    lps[:3, 1] = along_column * pixel_spacing[0]
    lps[:3, 2] = along_row * pixel_spacing[1]
    lps[:3, 3] = [float(v) for v in first.ImagePositionPatient]
    return LPS_TO_RAS @ lps


def read_nifti(source: str | Path) -> Volume:
    """A NIfTI file (.nii or .nii.gz, nibabel) as (D, H, W): the file's third axis
    becomes the slices, its first the columns. The header's shape is checked against
    the decode budget before the data is read."""
    try:
        import nibabel
    except ImportError as exc:  # pragma: no cover - a pinned requirement
        raise ImageLoadError("reading NIfTI needs nibabel (pip install nibabel)") from exc
    source = Path(source)
    try:
        image = nibabel.load(str(source))
    except Exception as exc:  # nibabel raises many kinds on a damaged file
        raise ImageLoadError(f"{source} is not a NIfTI file nibabel can read ({exc})") from exc
    shape = tuple(int(s) for s in image.shape)
    if len(shape) == 4 and shape[3] == 1:
        shape = shape[:3]
    if len(shape) != 3:
        raise ImageLoadError(f"{source} has shape {image.shape}; a volume is 3-D")
    what = f"a {'x'.join(map(str, shape))} NIfTI volume"
    cost = DECODE_BUDGET.cost(str(source), what, shape, 4.0, 2.0)
    with DECODE_BUDGET.reserve(cost):
        data = np.asarray(image.dataobj, dtype=np.float32).reshape(shape)
    zooms = [float(z) for z in image.header.get_zooms()[:3]]
    # (x, y, z) -> (z, y, x): slices first, as a DICOM series and the engine hold them
    voxels = np.ascontiguousarray(np.transpose(data, (2, 1, 0)))
    affine = np.asarray(image.affine, dtype=np.float64)[:, [2, 1, 0, 3]]
    return Volume(voxels, (zooms[2], zooms[1], zooms[0]), f"NIfTI {source.name}", affine=affine)


def read_multiframe_dicom(source: str | Path) -> Volume:
    """An enhanced multi-frame DICOM file (Enhanced CT / MR, their Legacy Converted forms,
    any image whose per-frame functional groups place each frame) as one volume, in
    modality values, slices in order along the normal. highdicom assembles it and refuses
    frames that do not form one evenly spaced volume; the decode budget is asked first."""
    import highdicom
    import pydicom

    source = Path(source)
    try:
        header = pydicom.dcmread(str(source), stop_before_pixels=True)
        frames = int(getattr(header, "NumberOfFrames", 1) or 1)
    except Exception as exc:  # pydicom raises many kinds on a damaged file
        raise ImageLoadError(f"{source} is not a DICOM file pydicom can read ({exc})") from exc
    if frames < 2:
        raise ImageLoadError(
            f"{source} holds one frame: a volume is a series (a folder or a zip of its "
            f"slices), a multi-frame file or NIfTI"
        )
    if "PerFrameFunctionalGroupsSequence" not in header:
        raise ImageLoadError(
            f"{source} has {frames} frames but no per-frame functional groups, so nothing "
            f"places its frames in space (a cine or ultrasound clip, not a volume)"
        )
    rows, columns = int(header.Rows), int(header.Columns)
    bits = int(getattr(header, "BitsAllocated", 16) or 16)
    what = f"a {frames}x{rows}x{columns} {bits}-bit multi-frame DICOM"
    cost = DECODE_BUDGET.cost(
        str(source), what, (frames, rows, columns), max(bits / 8, 4.0), DICOM_DECODE_FACTOR
    )
    with DECODE_BUDGET.reserve(cost):
        try:
            assembled = highdicom.imread(str(source)).get_volume(dtype=np.float32)
        except (RuntimeError, ValueError, AttributeError, KeyError) as exc:
            raise ImageLoadError(
                f"{source}: its frames do not form one evenly spaced volume ({exc})"
            ) from exc
    voxels, lps = np.asarray(assembled.array, dtype=np.float32), np.asarray(assembled.affine)
    if voxels.ndim != 3:
        raise ImageLoadError(f"{source}: frames of shape {voxels.shape[1:]}; a volume is gray")
    normal = np.cross(lps[:3, 2], lps[:3, 1])  # along a row x along a column
    if float(lps[:3, 0] @ normal) < 0:  # slices first to last along the normal
        voxels = voxels[::-1]
        flip = np.eye(4)
        flip[0, 0], flip[0, 3] = -1.0, voxels.shape[0] - 1
        lps = lps @ flip
    return Volume(
        np.ascontiguousarray(voxels),
        tuple(float(s) for s in assembled.spacing),  # type: ignore[arg-type]
        f"multi-frame DICOM {source.name} ({frames} frames)",
        str(getattr(header, "SeriesInstanceUID", "")) or None,
        getattr(header, "Modality", None),
        LPS_TO_RAS @ lps,
    )


def read_volume(source: str | Path) -> Volume:
    """A DICOM series (folder or zip), a multi-frame DICOM file or a NIfTI file, chosen by
    what ``source`` is."""
    path = Path(source)
    if path.name.endswith((".nii", ".nii.gz")):
        return read_nifti(path)
    if path.is_file() and not zipfile.is_zipfile(path):
        return read_multiframe_dicom(path)
    return read_dicom_series(path)


def resample(volume: Volume, spacing: tuple[float, float, float]) -> Volume:
    """The volume resampled (trilinear) to ``spacing`` (slice, row, column) in mm, so a
    model sees voxels of the size it was trained on; the extent in mm is kept."""
    if len(spacing) != 3 or min(spacing) <= 0:
        raise ValueError(f"spacing must be three positive distances in mm, got {spacing}")
    shape = tuple(
        max(1, int(round(size * old / new)))
        for size, old, new in zip(volume.shape, volume.spacing, spacing)
    )
    if shape == volume.shape:
        return volume
    grid = torch.from_numpy(volume.voxels)[None, None]
    resized = F.interpolate(grid, size=shape, mode="trilinear", align_corners=False)
    affine = None
    if volume.affine is not None:  # new index n sits at old index (n + 0.5) * scale - 0.5
        scale = np.array(volume.shape, float) / np.array(shape, float)
        to_old = np.eye(4)
        to_old[:3, :3] = np.diag(scale)
        to_old[:3, 3] = 0.5 * scale - 0.5
        affine = volume.affine @ to_old
    return Volume(
        resized[0, 0].numpy(),
        tuple(float(s) for s in spacing),  # type: ignore[arg-type]
        volume.source,
        volume.series_uid,
        volume.modality,
        affine,
    )


@dataclass(frozen=True)
class ModelVolume:
    """A volume as a model takes it: ``tensor`` (1, D, H, W), normalised; ``affine``: the
    tensor's voxel index (z, y, x, 1) to scanner mm (RAS+), None when the source had none;
    ``corner``: where the tensor's first voxel lies in the resampled volume (negative
    where it was padded); ``values``: the same block in modality units (CT: HU), before
    the model's window, for display in another window (padding: the window's low end)."""

    tensor: torch.Tensor
    affine: np.ndarray | None
    corner: tuple[int, int, int]
    resampled_shape: tuple[int, int, int]
    values: np.ndarray | None = None


def prepare_for_model(
    volume: Volume,
    spacing: tuple[float, float, float],
    window: tuple[float, float],
    size: tuple[int, int, int],
    mean: float,
    std: float,
) -> ModelVolume:
    """Resample to the model's ``spacing``, take the centred block of ``size`` (padding
    with the window's low end, air in CT, where the volume is smaller), scale the modality
    ``window`` to [0, 1] (clipped) and normalise with ``mean`` and ``std``."""
    resampled = resample(volume, spacing)
    low, high = window
    corner = tuple((have - want) // 2 for have, want in zip(resampled.shape, size))
    block = np.full(size, low, np.float32)
    source = tuple(
        slice(max(c, 0), max(c, 0) + min(w, h - max(c, 0)))
        for c, w, h in zip(corner, size, resampled.shape)
    )
    target = tuple(
        slice(max(-c, 0), max(-c, 0) + (s.stop - s.start)) for c, s in zip(corner, source)
    )
    block[target] = resampled.voxels[source]
    unit = np.clip((block - low) / (high - low), 0.0, 1.0).astype(np.float32)
    affine = None
    if resampled.affine is not None:
        shift = np.eye(4)
        shift[:3, 3] = corner
        affine = resampled.affine @ shift
    tensor = (torch.from_numpy(unit)[None] - mean) / std
    return ModelVolume(tensor, affine, corner, resampled.shape, block)  # type: ignore[arg-type]
