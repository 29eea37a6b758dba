"""Volumes in: a DICOM series (a folder or a zip of single-slice files) or a NIfTI file,
as one (D, H, W) array of modality values with its voxel spacing, and resampling to the
spacing a model was trained on.

A series is checked before any pixel is decoded: one series only (mixed series are
refused, each named), every slice with the same orientation, size and pixel spacing,
slices sorted by their Image Position (Patient) along the slice normal, and evenly spaced
(a missing slice or a duplicate is refused, naming where).

Every size that decides what reading costs is read or bounded before anything is
allocated or inflated, against the same decode budget as a 2-D file
(:data:`krypton.io._decoding.DECODE_BUDGET`), and through the 2-D path's guards: deflated
DICOM files go through its bounded inflater, compressed frames through its codestream
check. A series' files (as inflated) are held within the budget; a multi-frame file has at
most :data:`MAX_SLICES` frames; a NIfTI file's voxels are costed at their stored type and
the bytes before them (which a .nii.gz must inflate to reach them) count too; voxel
spacings are finite, positive and at most :data:`MAX_SPACING_MM`. Resampling for a model
computes only the model's block (:func:`prepare_for_model`), whatever the source's
spacing.
"""

from __future__ import annotations

import io
import math
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ._decoding import (
    DECODE_BUDGET,
    DICOM_DECODE_FACTOR,
    ImageLoadError,
    megabytes,
    plain_reason,
)
from .model_grid import BlockBuilder, ModelGrid, plan_grid

__all__ = [
    "Volume",
    "ModelVolume",
    "read_dicom_series",
    "read_multiframe_dicom",
    "read_nifti",
    "read_volume",
    "resample",
    "resampled_shape",
    "prepare_for_model",
    "MAX_SLICES",
    "MAX_SPACING_MM",
    "check_files_size",
]

# Slices are evenly spaced when every gap is within this share of the median gap.
SPACING_TOLERANCE = 0.01
# Direction cosines agree when they differ by less than this.
ORIENTATION_TOLERANCE = 1e-4
# Most files a series, or frames a multi-frame file, may have: more is not a scan but a
# folder of everything (or a file built to take minutes of CPU; each frame costs time).
MAX_SLICES = 2048
# Largest voxel spacing accepted, mm: CT and MR voxels are a fraction of a millimetre to a
# few; more is a header error (or a file built so that resampling it allocates gigabytes).
MAX_SPACING_MM = 20.0
# What a NIfTI read allocates per voxel (tracemalloc, 64x64x48, .nii and .nii.gz, with and
# without scaling, uint8 to float64; tests/test_volume_intake.py): the stored values twice
# (a gzip stream's bytes and their array), float64 values when the file scales them, then
# the float32 values and their transposed copy; up to 32.2 bytes measured (scaled float64
# from a gzip stream), which this charges 33.
NIFTI_WORK_BYTES = 9.0


def nifti_bytes_per_voxel(itemsize: int) -> float:
    """The decode budget's charge per voxel of a NIfTI file storing ``itemsize`` bytes."""
    return 2.0 * itemsize + 8.0 + NIFTI_WORK_BYTES


NIFTI_SUFFIXES = (".nii", ".nii.gz", ".hdr", ".img", ".hdr.gz", ".img.gz")
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "spacing", checked_spacing(self.spacing, self.source))

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.voxels.shape)  # type: ignore[return-value]


def checked_spacing(spacing, name: str) -> tuple[float, float, float]:
    """``spacing`` as three floats, each finite, positive and at most
    :data:`MAX_SPACING_MM`; else :class:`ImageLoadError` naming what was found."""
    try:
        values = tuple(float(s) for s in spacing)
    except (TypeError, ValueError):
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) and 0 < v <= MAX_SPACING_MM for v in values):
        shown = " x ".join(f"{v:g}" for v in values) if values else repr(spacing)
        raise ImageLoadError(
            f"{name} declares a voxel spacing of {shown} mm; a CT or MR volume's voxels "
            f"measure more than 0 and at most {MAX_SPACING_MM:g} mm on each axis"
        )
    return values  # type: ignore[return-value]


def check_files_size(source: str | Path, count: int, total: int) -> None:
    """The files' bytes (a zip's as it declares them inflated, before inflating any; a
    PACS series' as its listing declares them, before fetching any) are held together
    while the headers are read: they must fit the decode budget."""
    DECODE_BUDGET.cost(
        str(source), f"{count} files of {total / 2**20:,.0f} MB together", (max(total, 1),), 1, 1
    )


def series_files(source: Path, stack: ExitStack) -> list[tuple[str, Callable[[], bytes], int]]:
    """(name, read its bytes, its size) of every file in a folder (recursively) or a zip
    archive, at most :data:`MAX_SLICES` (a zip's sizes as it declares them inflated:
    zipfile inflates no more than an entry declares, then checks its CRC, so they bound
    what reading costs even in an archive that lies); a zip stays open in ``stack``. The
    whole read and the streamed one (:mod:`krypton.io.series_intake`) both list so."""
    if source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file())
        if len(files) > MAX_SLICES:
            raise ImageLoadError(f"{source} holds {len(files)} files, over {MAX_SLICES}")
        return [(str(p.relative_to(source)), p.read_bytes, p.stat().st_size) for p in files]
    try:
        archive = stack.enter_context(zipfile.ZipFile(source))
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ImageLoadError(f"{source} is neither a folder nor a zip archive") from exc
    members = [e for e in archive.infolist() if not e.is_dir()]
    if len(members) > MAX_SLICES:
        raise ImageLoadError(f"{source} holds {len(members)} files, over {MAX_SLICES}")

    def reader(entry: zipfile.ZipInfo) -> Callable[[], bytes]:
        def read() -> bytes:
            try:
                return archive.read(entry)
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
                raise ImageLoadError(
                    f"{source}: {entry.filename} is damaged ({plain_reason(exc)})"
                ) from exc

        return read

    return [(entry.filename, reader(entry), entry.file_size) for entry in members]


def _members(source: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every file in a folder (recursively) or a zip archive, once their
    sizes together pass the decode budget (a whole read holds them all)."""
    with ExitStack() as stack:
        files = series_files(source, stack)
        check_files_size(source, len(files), sum(size for *_, size in files))
        for name, read, _ in files:
            yield name, read()


def _headers(source: Path) -> list[tuple[str, object, int]]:
    """(name, dataset, size in bytes) of every DICOM file in the source, deflated ones
    inflated through the 2-D path's bounded inflater: together they may inflate as far as
    one deflated file may (:func:`krypton.io.dicom.inflated_limit`). Other files are
    skipped. Each file is parsed once, its pixel data kept undecoded (a header-only pass
    and a second full parse cost a 2,048-slice series of tiny slices two thirds of its
    read); decoding waits for the budget's verdict on the whole series."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    from .dicom import _inflated, inflated_limit

    found, inflated, limit = [], 0, inflated_limit()
    for name, data in _members(source):
        try:  # deflated files together inflate at most as far as one deflated file may
            plain = _inflated(data, name, limit - inflated)
        except ImageLoadError as exc:
            raise ImageLoadError(
                f"{exc}; a series' deflated files together may inflate to {megabytes(limit)}"
            ) from None
        inflated += len(plain) if plain is not data else 0
        data = plain
        try:
            dataset = pydicom.dcmread(io.BytesIO(data))
        except (InvalidDicomError, EOFError, OSError, ValueError, TypeError) as exc:
            try:  # not DICOM at all: skipped; DICOM whose pixel data breaks: refused
                pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
            except (InvalidDicomError, EOFError, OSError, ValueError, TypeError):
                continue
            raise ImageLoadError(
                f"{name}: its pixel data cannot be read ({plain_reason(exc)}); it may be truncated"
            ) from None
        found.append((name, dataset, len(data)))
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


def _slice_named(name: str, header, position: float | None = None) -> str:
    """A slice as a user finds it in a viewer: its instance number and where it lies
    along the normal (mm), its file name only where it has no instance number."""
    number = getattr(header, "InstanceNumber", None)
    said = f"instance {number}" if number not in (None, "") else name
    return said if position is None else f"{said} (at {position:.5g} mm)"


def _sorted_slices(headers, source: Path) -> tuple[list, float, tuple[float, float]]:
    """The slices in order along the normal, the slice spacing and the pixel spacing;
    a refusal names the slices by instance number and position."""
    first_name, first, _ = headers[0]
    orientation = _vector(first, "ImageOrientationPatient", 6, first_name)
    pixel_spacing = _vector(first, "PixelSpacing", 2, first_name)
    size = (getattr(first, "Rows", None), getattr(first, "Columns", None))
    normal = np.cross(orientation[:3], orientation[3:])
    placed = []
    for name, header, nbytes in headers:
        said, before = _slice_named(name, header), _slice_named(first_name, first)
        if not np.allclose(
            _vector(header, "ImageOrientationPatient", 6, name),
            orientation,
            atol=ORIENTATION_TOLERANCE,
        ):
            raise ImageLoadError(
                f"{said} is oriented differently from {before}: a series must share one orientation"
            )
        if (getattr(header, "Rows", None), getattr(header, "Columns", None)) != size:
            raise ImageLoadError(f"{said} has another size than {before}")
        if not np.allclose(_vector(header, "PixelSpacing", 2, name), pixel_spacing):
            raise ImageLoadError(f"{said} has another pixel spacing than {before}")
        position = _vector(header, "ImagePositionPatient", 3, name)
        placed.append((float(position @ normal), name, header, nbytes))
    placed.sort(key=lambda item: item[0])
    if len(placed) < 2:
        raise ImageLoadError(f"{source} holds one slice: a volume needs at least two")
    gaps = np.diff([item[0] for item in placed])
    step = float(np.median(gaps))
    if step <= 0:
        raise ImageLoadError(f"{source}: slices share one position; is a slice duplicated?")
    for index, gap in enumerate(gaps):
        if abs(gap - step) > SPACING_TOLERANCE * step:
            (low, low_name, low_header, _), (high, high_name, high_header, _) = placed[
                index : index + 2
            ]
            what = "a gap" if gap > step else "slices closer than the rest (a duplicate?)"
            missing = round(gap / step) - 1 if gap > step else 0
            lost = (
                f"; about {missing} slice{'s' if missing != 1 else ''} missing" if missing else ""
            )
            raise ImageLoadError(
                f"{source}: {what} between {_slice_named(low_name, low_header, low)} and "
                f"{_slice_named(high_name, high_header, high)}: {gap:.3g} mm where the "
                f"series steps {step:.3g} mm{lost}; a series must be evenly spaced"
            )
    return placed, step, (float(pixel_spacing[0]), float(pixel_spacing[1]))


def read_dicom_series(source: str | Path) -> Volume:
    """A DICOM series from a folder or a zip of single-slice files, in modality values
    (the modality LUT applied: Hounsfield units for CT), slices in order along the normal.
    Raises :class:`ImageLoadError` naming what is wrong with the series. Its files, their
    inflation and their decode are held within one reservation of the decode budget."""
    source = Path(source)
    with DECODE_BUDGET.reserve(_held_while_reading(source)) as held:
        return _read_series(source, held)


def _held_while_reading(source: Path) -> int:
    """What reading a series' headers holds: its files (a zip's as declared) and what
    deflated ones may inflate to."""
    from .dicom import inflated_limit

    return _declared_size(source) + inflated_limit()


def _declared_size(source: Path) -> int:
    """A folder's files' bytes, or a zip's entries' as it declares them inflated (0 for a
    source that is neither: :func:`_members` says what is wrong with it)."""
    if source.is_dir():
        return sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
    try:
        with zipfile.ZipFile(source) as archive:
            return sum(e.file_size for e in archive.infolist() if not e.is_dir())
    except (zipfile.BadZipFile, OSError, ValueError):
        return 0


def _read_series(source: Path, held) -> Volume:
    from pydicom.pixels import apply_modality_lut

    from .dicom import _decode_frame, _frame_cost

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
    DECODE_BUDGET.grow(held, cost + sum(size for *_, size in placed))
    voxels = np.empty((len(placed), rows, columns), dtype=np.float32)
    for index, (_, name, dataset, _) in enumerate(placed):
        _frame_cost(dataset, name, 0)  # the codestream's own size, before decoding
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
    """A NIfTI-1/-2 file (.nii, .nii.gz) or an ANALYZE pair (.hdr/.img), nibabel, as
    (D, H, W): the file's third axis becomes the slices, its first the columns. Before
    any voxel is read: one real value per voxel (not RGB or complex), the decode budget
    asked for the voxels at their stored type, and the bytes before them bounded (a
    .nii.gz inflates everything up to its data: an offset 8 GiB in costs a minute)."""
    try:
        import nibabel
    except ImportError as exc:  # pragma: no cover - a pinned requirement
        raise ImageLoadError("reading NIfTI needs nibabel (pip install nibabel)") from exc
    source = Path(source)
    try:
        image = nibabel.load(str(source))
        proxy = image.dataobj  # where and how the voxels are stored, as the file says
        dtype, offset = np.dtype(proxy.dtype), int(proxy.offset)
        zooms = _stored_zooms(image)
    except Exception as exc:  # nibabel raises many kinds on a damaged file
        raise ImageLoadError(
            f"{source} is not a NIfTI file Krypton can read ({plain_reason(exc)})"
        ) from exc
    shape = tuple(int(s) for s in image.shape)
    if len(shape) == 4 and shape[3] == 1:
        shape = shape[:3]
    if len(shape) != 3:
        raise ImageLoadError(f"{source} has shape {image.shape}; a volume is 3-D")
    if dtype.fields is not None or dtype.kind not in "biuf":
        raise ImageLoadError(
            f"{source} stores {dtype} voxels; a CT or MR volume holds one real value per "
            f"voxel (not RGB or complex)"
        )
    what = f"a {'x'.join(map(str, shape))} NIfTI volume of {dtype.name} voxels"
    cost = DECODE_BUDGET.cost(str(source), what, shape, nifti_bytes_per_voxel(dtype.itemsize), 1.0)
    _check_nifti_data(image, source, offset, int(np.prod(shape)) * dtype.itemsize)
    spacing = checked_spacing((zooms[2], zooms[1], zooms[0]), str(source))
    with DECODE_BUDGET.reserve(cost):
        try:
            data = np.asarray(image.dataobj, dtype=np.float32).reshape(shape)
        except Exception as exc:  # a truncated or corrupt stream: EOFError, zlib, OSError
            raise ImageLoadError(
                f"{source}: its voxels cannot be read ({plain_reason(exc)}); the file "
                f"may be truncated"
            ) from exc
        # (x, y, z) -> (z, y, x): slices first, as a DICOM series and the engine hold them
        voxels = np.ascontiguousarray(np.transpose(data, (2, 1, 0)))
    affine = np.asarray(image.affine, dtype=np.float64)[:, [2, 1, 0, 3]]
    return Volume(voxels, spacing, f"NIfTI {source.name}", affine=affine)


def _stored_zooms(image) -> list[float]:
    """The voxel sizes the header stores (nibabel's loaded header has replaced a zero with
    one and a negative with its size, which would hide a damaged or hostile header)."""
    from nibabel.openers import ImageOpener

    holder = image.file_map.get("header") or image.file_map["image"]
    with ImageOpener(holder.filename) as handle:
        stored = image.header_class.from_fileobj(handle, check=False)
    return [float(z) for z in np.asarray(stored["pixdim"], dtype=np.float64)[1:4]]


def _check_nifti_data(image, source: Path, offset: int, stored: int) -> None:
    """Where a NIfTI file's voxels lie must be reachable within the budget: on disk, the
    file must hold them; compressed, the bytes inflated to reach and read them (the
    offset plus the voxels) must fit the decode budget."""
    holder = image.file_map["image"]
    path = Path(holder.filename) if holder.filename else source
    if offset < 0:
        raise ImageLoadError(f"{source} puts its voxels at byte {offset}")
    if path.name.endswith(".gz"):
        reach = offset + stored
        if reach > DECODE_BUDGET.limit_bytes:
            raise ImageLoadError(
                f"{source} is compressed and puts its voxels {megabytes(offset)} into the "
                f"stream: reading them inflates {megabytes(reach)}, over this server's "
                f"decode budget of {megabytes(DECODE_BUDGET.limit_bytes)}"
            )
        return
    size = path.stat().st_size if path.is_file() else 0
    if offset + stored > size:
        raise ImageLoadError(
            f"{source} is truncated: its header puts {stored:,} bytes of voxels at byte "
            f"{offset:,}, but the file holds {size:,} bytes"
        )


def read_multiframe_dicom(source: str | Path) -> Volume:
    """An enhanced multi-frame DICOM file (Enhanced CT / MR, their Legacy Converted forms,
    any image whose per-frame functional groups place each frame) as one volume, in
    modality values, slices in order along the normal. highdicom assembles it and refuses
    frames that do not form one evenly spaced volume. Before that: the file's size and
    (deflated) inflated size within the budget, at most :data:`MAX_SLICES` frames, every
    compressed frame's codestream the size the header says, the decode budget asked."""
    from .dicom import inflated_limit

    source = Path(source)
    try:
        size = source.stat().st_size
    except OSError as exc:
        raise ImageLoadError(f"{source} cannot be read ({plain_reason(exc)})") from exc
    check_files_size(source, 1, size)  # held whole while its header is read
    with DECODE_BUDGET.reserve(size + inflated_limit()) as held:
        return _read_multiframe(source, held)


def _read_multiframe(source: Path, held) -> Volume:
    import highdicom
    import pydicom

    from .dicom import _frame_cost, _inflated, check_codestreams

    name = source.name
    data = _inflated(source.read_bytes(), name)  # deflated: within the budget, once
    try:
        header = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
    except Exception as exc:  # pydicom raises many kinds on a damaged file
        raise ImageLoadError(
            f"{source} is not a DICOM file Krypton can read ({plain_reason(exc)})"
        ) from exc
    frames = int(getattr(header, "NumberOfFrames", 1) or 1)
    if frames < 2:
        raise ImageLoadError(
            f"{source} holds one frame: a volume is a series (a folder or a zip of its "
            f"slices), a multi-frame file or NIfTI"
        )
    if frames > MAX_SLICES:
        raise ImageLoadError(f"{source} declares {frames} frames, over {MAX_SLICES}")
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
    DECODE_BUDGET.grow(held, cost + len(data))
    dataset = pydicom.dcmread(io.BytesIO(data))
    _frame_cost(dataset, name, 0)  # native data present, header sizes
    check_codestreams(dataset, name)  # every compressed frame, before decoding one
    try:
        image = highdicom.Image.from_dataset(dataset, copy=False)
        assembled = image.get_volume(dtype=np.float32)
    except (RuntimeError, ValueError, AttributeError, KeyError, TypeError) as exc:
        raise ImageLoadError(
            f"{source}: its frames do not form one evenly spaced volume ({plain_reason(exc)})"
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
        checked_spacing(assembled.spacing, str(source)),
        f"multi-frame DICOM {source.name} ({frames} frames)",
        str(getattr(header, "SeriesInstanceUID", "")) or None,
        getattr(header, "Modality", None),
        LPS_TO_RAS @ lps,
    )


def read_volume(source: str | Path) -> Volume:
    """A DICOM series (folder or zip), a multi-frame DICOM file or a NIfTI / ANALYZE file,
    chosen by what ``source`` is. Whatever the file holds, a problem is an
    :class:`ImageLoadError` that says what was found."""
    path = Path(source)
    if path.name.lower().endswith(NIFTI_SUFFIXES):
        reader = read_nifti
    elif path.is_file() and not zipfile.is_zipfile(path):
        reader = read_multiframe_dicom
    else:
        reader = read_dicom_series
    with reader_errors(path):
        return reader(path)


@contextmanager
def reader_errors(path: Path) -> Iterator[None]:
    """A reader library's own error on a malformed file, as an :class:`ImageLoadError`
    naming the file (Krypton's own refusals pass unchanged)."""
    try:
        yield
    except ImageLoadError:
        raise
    except Exception as exc:  # pydicom, nibabel and highdicom raise many kinds
        raise ImageLoadError(
            f"{path.name} could not be read as a volume ({plain_reason(exc)})"
        ) from exc


def resampled_shape(
    shape: tuple[int, ...], spacing: tuple[float, ...], target: tuple[float, ...]
) -> tuple[int, int, int]:
    """The (D, H, W) a volume of ``shape`` at ``spacing`` has at ``target`` spacing (mm),
    its extent kept; computed, nothing allocated."""
    if len(target) != 3 or not all(math.isfinite(t) and t > 0 for t in target):
        raise ValueError(f"spacing must be three positive distances in mm, got {target}")
    return tuple(  # type: ignore[return-value]
        max(1, int(round(size * old / new))) for size, old, new in zip(shape, spacing, target)
    )


def _resampled_affine(volume: Volume, shape: tuple[int, int, int]) -> np.ndarray | None:
    if volume.affine is None:  # new index n sits at old index (n + 0.5) * scale - 0.5
        return None
    scale = np.array(volume.shape, float) / np.array(shape, float)
    to_old = np.eye(4)
    to_old[:3, :3] = np.diag(scale)
    to_old[:3, 3] = 0.5 * scale - 0.5
    return volume.affine @ to_old


def resample(volume: Volume, spacing: tuple[float, float, float]) -> Volume:
    """The volume resampled (trilinear) to ``spacing`` (slice, row, column) in mm, so a
    model sees voxels of the size it was trained on; the extent in mm is kept. The whole
    result must fit the decode budget (:func:`prepare_for_model` computes only a model's
    block)."""
    shape = resampled_shape(volume.shape, volume.spacing, spacing)
    if shape == volume.shape:
        return volume
    what = f"resampled to {'x'.join(map(str, shape))} voxels"
    DECODE_BUDGET.cost(volume.source, what, shape, 4.0, 2.0)
    resized = _trilinear(volume.voxels, shape, [(0, side) for side in shape])
    return Volume(
        resized,
        tuple(float(s) for s in spacing),  # type: ignore[arg-type]
        volume.source,
        volume.series_uid,
        volume.modality,
        _resampled_affine(volume, shape),
    )


def _trilinear(
    voxels: np.ndarray, shape: tuple[int, ...], spans: list[tuple[int, int]]
) -> np.ndarray:
    """Voxels ``spans`` (start, stop per axis) of ``voxels`` resized trilinearly to
    ``shape``, as ``F.interpolate(mode="trilinear", align_corners=False)`` computes them
    (the same source coordinates and weights), one axis at a time: nothing of the full
    resized volume is allocated, only the spans asked for. Axes that shrink go first."""
    grid = torch.from_numpy(np.ascontiguousarray(voxels, dtype=np.float32))
    order = sorted(range(3), key=lambda a: (spans[a][1] - spans[a][0]) / max(grid.shape[a], 1))
    for axis in order:
        size, (start, stop) = grid.shape[axis], spans[axis]
        scale = size / shape[axis]
        wanted = torch.arange(start, stop, dtype=torch.float32)
        where = ((wanted + 0.5) * scale - 0.5).clamp(min=0.0)
        low = where.floor().long().clamp(max=size - 1)
        high = (low + 1).clamp(max=size - 1)
        weight = (where - low.float()).view([-1 if a == axis else 1 for a in range(3)])
        below, above = grid.index_select(axis, low), grid.index_select(axis, high)
        grid = below + (above - below) * weight
    return grid.numpy()


@dataclass(frozen=True)
class ModelVolume:
    """A volume as a model takes it: ``tensor`` (1, D, H, W), normalised, in the model's
    orientation; ``affine``: the tensor's voxel index (i, j, k, 1) to scanner mm (RAS+),
    None when the source had none; ``corner``: where the tensor's first voxel lies in the
    resampled volume (negative where it was padded); ``values``: the same block in
    modality units (CT: HU), before the model's window, for display in another window
    (padding: the window's low end); ``orientation``: how the source was turned to the
    model's axes (:meth:`krypton.io.model_grid.ModelGrid.orientation_text`) and
    ``off_axis_degrees`` how oblique it is."""

    tensor: torch.Tensor
    affine: np.ndarray | None
    corner: tuple[int, int, int]
    resampled_shape: tuple[int, int, int]
    values: np.ndarray | None = None
    orientation: str = "as stored"
    off_axis_degrees: float = 0.0


def prepare_for_model(
    volume: Volume,
    spacing: tuple[float, float, float],
    window: tuple[float, float],
    size: tuple[int, int, int],
    mean: float,
    std: float,
    orientation: str | None = None,
) -> ModelVolume:
    """Turn to the model's ``orientation`` (axis codes; None: as stored), resample to its
    ``spacing``, take the centred block of ``size`` (padding with the window's low end,
    air in CT, where the volume is smaller), scale the modality ``window`` to [0, 1]
    (clipped) and normalise with ``mean`` and ``std``: the convention of
    :mod:`krypton.io.model_grid`. Only the block is computed: its cost follows ``size``,
    never the source's spacing."""
    grid = plan_grid(volume.shape, volume.spacing, volume.affine, spacing, size, orientation)
    builder = BlockBuilder(grid, window[0])
    for index in grid.slices_needed():
        builder.add(int(index), volume.voxels[index])
    return model_volume(grid, builder.block(), window, mean, std)


def model_volume(
    grid: ModelGrid, block: np.ndarray, window: tuple[float, float], mean: float, std: float
) -> ModelVolume:
    """The model's input from its ``block`` of modality values over ``grid``."""
    low, high = window
    unit = np.clip((block - low) / (high - low), 0.0, 1.0).astype(np.float32)
    tensor = (torch.from_numpy(unit)[None] - mean) / std
    return ModelVolume(
        tensor, grid.affine, grid.corner, grid.resampled_shape, block,
        grid.orientation_text(), grid.off_axis_degrees,
    )  # fmt: skip
