"""Volumes on the page: reading an uploaded volume (the decode budget and the series
checks of krypton.io.volumes apply), the block a volume model sees, its prediction, the
panel's estimate line, the strongest voxel and the DICOM series export. The run itself
is :func:`webapp.runs.execute`, as an image's."""

from __future__ import annotations

import dataclasses
import io
import tempfile
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import krypton
from krypton.estimator import MIN_LOGGED_RUNS, Estimate, plain_basis
from krypton.explainer import grid
from krypton.io.images import ImageLoadError
from krypton.io.series_intake import VolumeGeometry, read_source
from krypton.io.volumes import ModelVolume, Volume
from krypton.registry.ood import caveat
from krypton.render.exports import dicom_comments

from ..helpers import InputError
from ..result_schema import ResultRecord
from .records import result_heatmap
from .regions import check_bounds, whole
from .timing import counts_estimate, estimate_text, host_load

__all__ = [
    "volume_suffix",
    "read_uploaded_source",
    "prepare_uploaded_volume",
    "UploadedVolume",
    "SourceInfo",
    "PreparedVolume",
    "VolumeCache",
    "volume_prediction",
    "volume_estimate",
    "volume_estimate_found",
    "strongest_voxel",
    "export_dicom_series",
]


def volume_suffix(data: bytes, filename: str | None) -> str:
    """What kind of volume an upload is, by its name or else its first bytes: '.nii.gz',
    '.nii', '.zip' (a DICOM series) or '.dcm' (a multi-frame DICOM file)."""
    name = (filename or "").lower()
    for suffix in (".nii.gz", ".nii", ".zip", ".dcm"):
        if name.endswith(suffix):
            return suffix
    if data[:2] == b"\x1f\x8b":
        return ".nii.gz"
    if data[:4] == b"PK\x03\x04":
        return ".zip"
    if data[344:348] in (b"n+1\x00", b"ni1\x00"):
        return ".nii"
    if data[128:132] == b"DICM":
        return ".dcm"
    raise InputError(
        f"{filename or 'the file'} is not a volume: give a NIfTI file (.nii, .nii.gz), a zip "
        f"of one DICOM series or a multi-frame DICOM file"
    )


@contextmanager
def _uploaded_file(data: bytes, filename: str | None) -> Iterator[Path]:
    """The upload's bytes as a file a reader takes (its kind by :func:`volume_suffix`);
    a reader's refusal names the upload, not the temporary file."""
    suffix = volume_suffix(data, filename)
    if suffix == ".zip" and not zipfile.is_zipfile(io.BytesIO(data)):
        raise InputError(f"{filename or 'the file'} is not a readable zip archive")
    with tempfile.TemporaryDirectory(prefix="krypton-volume-") as folder:
        path = Path(folder) / f"volume{suffix}"
        path.write_bytes(data)
        try:
            yield path
        except (ImageLoadError, ValueError, OSError) as exc:
            text = str(exc).replace(str(path), filename or "the file")
            raise InputError(text.replace(path.name, filename or "the file")) from None


def _named(source: str, filename: str | None) -> str:
    return f"{filename or 'volume'} ({source.split(' ')[0]})"


def read_uploaded_source(data: bytes, filename: str | None) -> UploadedVolume:
    """What an upload is, read once at upload (a bad file is refused here): a series'
    headers checked, a NIfTI or multi-frame file read whole within the decode budget."""
    with _uploaded_file(data, filename) as path:
        geometry, volume = read_source(path)
    geometry = dataclasses.replace(geometry, source=_named(geometry.source, filename))
    return UploadedVolume(geometry, volume)


def prepare_uploaded_volume(
    stored: Callable[[], bytes], filename: str | None, loaded, kept: UploadedVolume | None = None
) -> tuple[ModelVolume, VolumeGeometry]:
    """The upload as the volume model ``loaded`` takes it: from ``kept`` voxels where
    the upload was read whole, else streamed slice by slice from its bytes (``stored()``
    reads them, only then)."""
    try:
        if kept is not None and kept.volume is not None:
            return loaded.prepare_volume(kept.volume), kept.geometry
        with _uploaded_file(stored(), filename) as path:
            prepared, geometry = loaded.read_volume(path)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return prepared, dataclasses.replace(geometry, source=_named(geometry.source, filename))


@dataclass(frozen=True)
class UploadedVolume:
    """An upload as read: what it is and, for a file read whole, its voxels (a series'
    are streamed when a model needs them, never kept)."""

    geometry: VolumeGeometry
    volume: Volume | None

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.geometry.shape


@dataclass(frozen=True)
class SourceInfo:
    """What the page says of a volume as read (its voxels are not kept once prepared)."""

    shape: tuple[int, int, int]
    spacing: tuple[float, float, float]
    modality: str | None
    series_uid: str | None

    @classmethod
    def of(cls, volume: Volume | VolumeGeometry) -> SourceInfo:
        return cls(volume.shape, volume.spacing, volume.modality, volume.series_uid)


@dataclass(frozen=True)
class PreparedVolume:
    """A volume as the page shows it and a model takes it: ``source`` (what was read),
    ``model_input`` (:class:`~krypton.io.volumes.ModelVolume`) and ``unit`` (D, H, W) in
    [0, 1], the windowed block the model sees (what the three views draw)."""

    source: SourceInfo
    model_input: ModelVolume
    unit: np.ndarray


class VolumeCache:
    """Volumes by key, least recently used out: prepared ones by (stored file, tab,
    model), so moving a slider redraws from memory, and the last ones read by (stored
    file, tab), so preparing one for a model does not read the file twice. A miss
    (another worker, evicted) reads the stored file again."""

    def __init__(self, max_items: int = 6):
        self.max_items = max_items
        self._items: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    def peek(self, key: tuple) -> Any:
        """What is kept under ``key`` (None: nothing), nothing built."""
        with self._lock:
            return self._items.get(key)

    def get(self, key: tuple, build: Callable[[], Any]) -> Any:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                return found
        prepared = build()
        with self._lock:
            self._items[key] = prepared
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)
        return prepared


def volume_prediction(loaded, prepared: PreparedVolume) -> np.ndarray:
    """The model's class probabilities for the block it sees of a prepared volume (the
    panel's class box names the prediction before any run)."""
    # one plain forward pass, as the run's own prediction (VolumeSubject.predict)
    explainer = krypton.OcclusionExplainer(loaded)
    return explainer.predict(prepared.model_input.tensor, views=False, ood=False).probabilities


def strongest_voxel(result: ResultRecord) -> tuple[int, int, int] | None:
    """(z, y, x) of the centre of the result's strongest cell (the class's lowest
    probability under the cube: its largest drop), in model voxels, within the block;
    None where no cell has a value."""
    values = np.asarray(result["values"], np.float64)
    if not np.isfinite(values).any():
        return None
    cell = np.unravel_index(int(np.nanargmin(values)), values.shape)
    size = result.get("input_size") or [None] * 3
    centre = []
    for axis, cells in enumerate((result["zs"], result["ys"], result["xs"])):
        voxel = int(cells[cell[axis]]) + int(result["patch"]) // 2
        centre.append(voxel if size[axis] is None else min(voxel, int(size[axis]) - 1))
    return tuple(centre)  # type: ignore[return-value]


def volume_estimate(*settings, **named) -> str:
    """What the volume panel says before Run (:func:`volume_estimate_found`'s line)."""
    return volume_estimate_found(*settings, **named)[0]


def volume_estimate_found(
    model: str,
    size,
    patch: int,
    stride: int,
    mode: str,
    region,
    load: float | None = None,
    known: int = 0,
) -> tuple[str, Estimate | None, int]:
    """What the volume panel says before Run: the positions, and the time this host's
    last runs of the model, mode and cube predict at ``load`` (sampled now where None;
    none before the first run here, for a model without a calibration) for the positions
    not ``known`` yet (exact and naive runs reuse them: the run's own estimate,
    :func:`webapp.runs.timing.counts_estimate`). Returns (the line, the estimate or None,
    the grid's positions)."""
    size = tuple(int(s) for s in size)
    bounds = (tuple(region[:3]), tuple(region[3:])) if region else whole(size)
    try:
        check_bounds(bounds, size, patch, stride)
        axes = grid(size, patch, stride, bounds)
    except (InputError, ValueError) as exc:
        return str(exc), None, 0
    shape = "x".join(str(len(a)) for a in axes)
    count = int(np.prod([len(a) for a in axes]))
    positions = f"{count} position{'' if count == 1 else 's'} on a {shape} grid"
    if mode == "approximate":
        return f"{positions}; drill-down evaluates a share of them", None, count
    if known:
        positions += f", {min(known, count)} of them known from an earlier run"
    load = host_load() if load is None else load
    found = counts_estimate(model, mode, patch, count, min(known, count), load)
    if found is None:
        return (
            (
                f"{positions}; no time estimate yet (it is learnt from this host's runs of "
                f"{model} in {mode} mode at this cube: {MIN_LOGGED_RUNS} needed)"
            ),
            None,
            count,
        )
    said = estimate_text(dataclasses.asdict(found))
    text = f"{positions}; estimated {said}, {plain_basis(found.source)}"
    return text, found, count


def export_dicom_series(result: ResultRecord, source: bytes, prepared: PreparedVolume) -> bytes:
    """The heatmap over every axial slice of the model's block as a DICOM Secondary
    Capture series (zipped) in the source's study, referencing the source series."""
    from krypton.render.dicom_series import (
        capture_series,
        capture_series_zip,
        first_dicom_header,
        slice_pictures,
    )

    try:
        header = first_dicom_header(source)
    except ValueError as exc:
        raise InputError(f"no DICOM export: {exc}") from None
    unit = prepared.unit
    pictures = slice_pictures(unit, result_heatmap(result))

    settings = (
        f"Krypton {result['mode']} occlusion heatmap. Model {result['model']} (weights "
        f"{result['weights_checksum']}); class {result['label_name']}, p = {result['prob']:.4f};"
        f" cube {result['patch']} voxels, stride {result['stride']}; the model's "
        f"{'x'.join(map(str, unit.shape))} block, resampled from the source. Not a diagnosis: "
        f"shows where occluding the volume changed the model's output."
    )
    comments = dicom_comments(caveat(result.get("ood")), settings)
    files = capture_series(
        header, pictures, description=f"Krypton heatmap {result['label_name']}",
        comments=comments,
    )  # fmt: skip
    return capture_series_zip(files)
