"""A volume read straight into a model's block: a DICOM series (a folder or a zip of its
slices) is read one slice at a time, each slice resampled into the block as it is read
(:class:`krypton.io.model_grid.BlockBuilder`), so a 512 x 512 x 600 CT never becomes a
float volume; a NIfTI or multi-frame file is read whole (:mod:`krypton.io.volumes`'s
readers, within their budgets) and then prepared the same way.

What a series costs is what it really holds, against the decode budget
(:data:`krypton.io._decoding.DECODE_BUDGET`): the slices' headers, one file and its
inflation while it is read, one slice's decode and the model's block
(:func:`streamed_cost`), reserved once the headers are read and before any pixel is
decoded; each slice's own decode is checked against that as it comes. Slices no model
voxel reads are not decoded.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._decoding import (
    DECODE_BUDGET,
    DECODE_BUDGET_ENV,
    DICOM_DECODE_FACTOR,
    ImageLoadError,
    megabytes,
    plain_reason,
)
from .model_grid import BlockBuilder, plan_grid
from .volumes import (
    NIFTI_SUFFIXES,
    ModelVolume,
    Volume,
    _one_series,
    _series_affine,
    _sorted_slices,
    model_volume,
    prepare_for_model,
    read_volume,
    reader_errors,
    series_files,
)

__all__ = [
    "ModelTarget",
    "VolumeGeometry",
    "read_for_model",
    "read_source",
    "streamed_cost",
    "HEADER_BYTES",
]

# What one slice's header (pixels left out) holds in memory as pydicom keeps it: a CT
# slice's 150-300 elements measured at 40-90 kB (tracemalloc), charged at the top.
HEADER_BYTES = 96 * 1024
# The block's copies while it is built and handed over: the sum, the block, the unit
# values and the tensor (float32 each).
BLOCK_COPIES = 4

# Progress of a read: (slices read, slices in all)
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ModelTarget:
    """What a volume model takes: its voxel ``spacing`` (mm, its axes), the modality
    ``window`` scaled to [0, 1], its input ``size``, the normalisation and the axis
    codes of its ``orientation`` (None: volumes reach it as stored)."""

    spacing: tuple[float, float, float]
    window: tuple[float, float]
    size: tuple[int, int, int]
    mean: float
    std: float
    orientation: str | None = None


@dataclass(frozen=True)
class VolumeGeometry:
    """What a volume was, as read (its voxels are not kept): (z, y, x) ``shape`` and
    ``spacing`` in its stored order, what it was read from, its series and modality,
    its (z, y, x) index-to-RAS ``affine`` and, for a series, its slices' headers without
    pixels in order along the normal (what a map written back references)."""

    shape: tuple[int, int, int]
    spacing: tuple[float, float, float]
    source: str
    series_uid: str | None = None
    modality: str | None = None
    affine: np.ndarray | None = None
    headers: tuple = ()


def streamed_cost(
    count: int, rows: int, columns: int, bits: int, size: tuple[int, ...], file_bytes: int
) -> int:
    """The bytes a streamed read of ``count`` slices of ``rows`` x ``columns`` at
    ``bits`` into a block of ``size`` holds at most: the headers, one file of
    ``file_bytes`` (and as much again inflated), one slice's decode (as a 2-D frame's,
    :data:`DICOM_DECODE_FACTOR` over its float values) and the block's copies."""
    block = int(np.prod(size)) * 4 * BLOCK_COPIES
    decode = int(rows * columns * max(bits / 8, 4.0) * DICOM_DECODE_FACTOR)
    return count * HEADER_BYTES + 2 * int(file_bytes) + decode + block


def read_for_model(
    source: str | Path, target: ModelTarget, progress: Progress | None = None
) -> tuple[ModelVolume, VolumeGeometry]:
    """The volume at ``source`` as the model of ``target`` takes it, and what it was. A
    series is streamed (module docstring); ``progress`` hears each slice read."""
    path = Path(source)
    if not _is_series(path):
        volume = read_volume(path)
        return prepare_for_model(volume, *_settings(target)), _geometry_of(volume)
    with reader_errors(path):
        return _stream_series(path, target, progress)


def _settings(target: ModelTarget) -> tuple:
    return (target.spacing, target.window, target.size, target.mean, target.std,
            target.orientation)  # fmt: skip


def _file_limit() -> int:
    """The largest file a series may hold: one file and its inflation within a quarter
    of the decode budget each."""
    return DECODE_BUDGET.limit_bytes // 4


def _plain(data: bytes, name: str) -> bytes:
    """A file's bytes, deflated ones inflated within the budget."""
    from .dicom import _inflated

    return _inflated(data, name, _file_limit())


def _header(data: bytes, name: str):  # type: ignore[no-untyped-def]
    """The file's header without its pixels (nor a copy of the file); None for a file
    that is not DICOM."""
    from .dicom import read_header

    try:
        return read_header(data, name)
    except ImageLoadError:
        return None


def _stream_series(
    source: Path, target: ModelTarget, progress: Progress | None
) -> tuple[ModelVolume, VolumeGeometry]:
    with ExitStack() as stack:
        entries = series_files(source, stack)
        with DECODE_BUDGET.reserve(_header_cost(source, entries)) as held:
            found = _series_headers(source, entries)
            return _read_slices(found, target, progress, held)


def read_source(source: str | Path) -> tuple[VolumeGeometry, Volume | None]:
    """What the volume at ``source`` is (shape, spacing, frame, a series' headers) and,
    for a file read whole (NIfTI, multi-frame DICOM), its voxels; a series' pixels are
    left for :func:`read_for_model` to stream (its headers are checked here: one series,
    one orientation and size, evenly spaced)."""
    path = Path(source)
    if not _is_series(path):
        volume = read_volume(path)
        return _geometry_of(volume), volume
    with reader_errors(path), ExitStack() as stack:
        entries = series_files(path, stack)
        with DECODE_BUDGET.reserve(_header_cost(path, entries)):
            return _series_headers(path, entries, codestreams=True).geometry, None


def _codestream_error(data: bytes, name: str, header) -> ImageLoadError | None:  # type: ignore[no-untyped-def]
    """A compressed slice's codestream checked against its header from the bytes the
    header was read from, nothing decoded (None where it is native or passes): a series
    whose 64 x 64 slices hide 16384 x 16384 codestreams is refused when it is opened, not
    when a model first reads it."""
    import pydicom

    from .dicom import _frame_cost

    syntax = getattr(getattr(header, "file_meta", None), "TransferSyntaxUID", None)
    if syntax is None or not syntax.is_encapsulated:
        return None
    try:
        _frame_cost(pydicom.dcmread(io.BytesIO(data)), name, 0)
    except ImageLoadError as exc:
        return exc
    return None


@dataclass(frozen=True)
class _Headers:
    """A series' headers read and checked: its slices in order along the normal (name,
    header), how to read each file, the largest file and what the series is."""

    slices: list
    readers: dict
    largest: int
    geometry: VolumeGeometry


def _header_cost(source: Path, entries: list) -> int:
    """What reading the headers holds: each header, one file and its inflation; a file
    over the share one may have is refused by name."""
    for name, _, size in entries:
        if size > _file_limit():
            raise ImageLoadError(
                f"{source}: {name} holds {megabytes(size)}, over the "
                f"{megabytes(_file_limit())} one file of a series may hold within this "
                f"server's decode budget of {megabytes(DECODE_BUDGET.limit_bytes)} "
                f"({DECODE_BUDGET_ENV})"
            )
    largest = max((size for *_, size in entries), default=0)
    return len(entries) * HEADER_BYTES + 2 * largest


def _series_headers(source: Path, entries: list, codestreams: bool = False) -> _Headers:
    """Every DICOM file's header (others skipped), checked as one evenly spaced series;
    with ``codestreams``, each compressed slice's codestream too (:func:`_codestream_error`,
    from the same read of the file; reported after the series' own checks)."""
    readers: dict[str, Callable[[], bytes]] = {}
    headers = []
    hidden: ImageLoadError | None = None  # the first codestream a header understates
    for name, read, size in entries:
        data = _plain(read(), name)
        header = _header(data, name)
        if header is None:
            continue  # not DICOM: skipped, as a folder's other files are
        if codestreams and hidden is None:
            hidden = _codestream_error(data, name, header)
        readers[name] = read
        headers.append((name, header, size))
    if not headers:
        raise ImageLoadError(f"{source} holds no DICOM files")
    uid = _one_series(headers, source)
    placed, step, pixel_spacing = _sorted_slices(headers, source)
    if hidden is not None:
        raise hidden
    first = placed[0][2]
    geometry = VolumeGeometry(
        (len(placed), int(first.Rows), int(first.Columns)), (step, *pixel_spacing),
        f"DICOM series ({len(placed)} slices)", uid, getattr(first, "Modality", None),
        _series_affine(first, step, pixel_spacing), tuple(item[2] for item in placed),
    )  # fmt: skip
    largest = max(size for *_, size in headers)
    return _Headers([(item[1], item[2]) for item in placed], readers, largest, geometry)


def _read_slices(
    found: _Headers, target: ModelTarget, progress: Progress | None, held
) -> tuple[ModelVolume, VolumeGeometry]:
    """The model's block from a series' slices, one at a time, within ``held`` grown to
    what streaming costs (:func:`streamed_cost`)."""
    geometry = found.geometry
    count, rows, columns = geometry.shape
    bits = int(getattr(geometry.headers[0], "BitsAllocated", 16) or 16)
    cost = streamed_cost(count, rows, columns, bits, target.size, found.largest)
    DECODE_BUDGET.cost(
        geometry.source, f"a {count}-slice series of {rows}x{columns} {bits}-bit slices read "
        f"slice by slice", (max(cost, 1),), 1, 1,
    )  # fmt: skip
    DECODE_BUDGET.grow(held, cost)
    grid = plan_grid(geometry.shape, geometry.spacing, geometry.affine, target.spacing,
                     target.size, target.orientation)  # fmt: skip
    builder = BlockBuilder(grid, target.window[0])
    needed = {int(i) for i in grid.slices_needed()}
    for index, (name, header) in enumerate(found.slices):
        if index in needed:
            builder.add(index, _slice_values(found.readers[name](), name, header, (rows, columns)))
        if progress is not None:
            progress(index + 1, count)
    prepared = model_volume(grid, builder.block(), target.window, target.mean, target.std)
    return prepared, geometry


def _is_series(path: Path) -> bool:
    """A folder, or a zip that is not a NIfTI file's name."""
    return path.is_dir() or (
        not path.name.lower().endswith(NIFTI_SUFFIXES) and zipfile.is_zipfile(path)
    )


def _geometry_of(volume: Volume) -> VolumeGeometry:
    return VolumeGeometry(volume.shape, volume.spacing, volume.source, volume.series_uid,
                          volume.modality, volume.affine)  # fmt: skip


def _slice_values(data: bytes, name: str, header, size: tuple[int, int]) -> np.ndarray:
    """One slice's modality values (the modality LUT applied: HU for CT), decoded within
    the reservation: its header must be the one its first read found."""
    import pydicom
    from pydicom.errors import InvalidDicomError
    from pydicom.pixels import apply_modality_lut

    from .dicom import _decode_frame, _frame_cost

    try:
        dataset = pydicom.dcmread(io.BytesIO(_plain(data, name)))
    except (InvalidDicomError, EOFError, OSError, ValueError, TypeError) as exc:
        raise ImageLoadError(
            f"{name}: its pixel data cannot be read ({plain_reason(exc)}); it may be truncated"
        ) from None
    if str(dataset.get("SOPInstanceUID", "")) != str(header.get("SOPInstanceUID", "")):
        raise ImageLoadError(f"{name} changed while it was read")
    _frame_cost(dataset, name, 0)  # the codestream's own size, before decoding
    pixels = _decode_frame(dataset, name, None)
    if pixels.shape != size:
        raise ImageLoadError(f"{name} is not a single-frame grayscale slice")
    return np.asarray(apply_modality_lut(pixels, dataset), np.float32)
