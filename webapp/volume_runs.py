"""Volumes on the page, orchestrated without a browser: reading an uploaded volume, the
block a volume model sees, one occlusion run over it (or a 3-D region of it) with a live
picture, reuse of every cell computed before, another class, and the exports.

The volume panel (webapp/panels/volume.py) only calls these. Tensor algebra stays in the
engine (krypton.explain on (C, D, H, W)); pictures of the three views are
webapp.volume_views.
"""

from __future__ import annotations

import dataclasses
import io
import json
import tempfile
import threading
import time
import uuid
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import krypton
from krypton.engine.capture_lock import CAPTURE_LOCK
from krypton.estimator import (
    MIN_LOGGED_RUNS,
    NotCalibratedError,
    estimate_for_counts,
)
from krypton.explainer import snap_start
from krypton.io.images import ImageLoadError
from krypton.io.volumes import ModelVolume, Volume, read_volume

from . import comparison
from .helpers import InputError
from .lifecycle import Provenance
from .model_card import ood_text
from .runs import (
    PlannedRun,
    count_known,
    estimate_text,
    finished_run,
    host_load,
    plan_text,
    relabel,
    result_heatmap,
    run_cells,
    run_threads,
    speed_text,
)

__all__ = [
    "VolumeRequest",
    "PreparedVolume",
    "VolumeCache",
    "volume_suffix",
    "read_uploaded_volume",
    "execute_volume",
    "relabel_volume",
    "volume_summary",
    "export_volume_json",
]

# report(done, total, the grid's values so far or None, the grid's (zs, ys, xs) or None):
# after every chunk; raising stops the run. The grid is the one the run computes (a region
# snapped onto the last run's grid included), so the live picture is drawn where it is.
VolumeReporter = Callable[[int, int, "np.ndarray | None", "tuple | None"], None]


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


def read_uploaded_volume(data: bytes, filename: str | None) -> Volume:
    """An uploaded volume's bytes as a :class:`~krypton.io.volumes.Volume` (the decode
    budget and the series checks of krypton.io.volumes apply); bad files raise InputError."""
    suffix = volume_suffix(data, filename)
    if suffix == ".zip" and not zipfile.is_zipfile(io.BytesIO(data)):
        raise InputError(f"{filename or 'the file'} is not a readable zip archive")
    with tempfile.TemporaryDirectory(prefix="krypton-volume-") as folder:
        path = Path(folder) / f"volume{suffix}"
        path.write_bytes(data)
        try:
            volume = read_volume(path)
        except (ImageLoadError, ValueError, OSError) as exc:
            text = str(exc).replace(str(path), filename or "the file")
            raise InputError(text.replace(path.name, filename or "the file")) from None
    name = filename or "volume"
    return dataclasses.replace(volume, source=f"{name} ({volume.source.split(' ')[0]})")


@dataclass(frozen=True)
class SourceInfo:
    """What the page says of a volume as read (its voxels are not kept once prepared)."""

    shape: tuple[int, int, int]
    spacing: tuple[float, float, float]
    modality: str | None
    series_uid: str | None

    @classmethod
    def of(cls, volume: Volume) -> SourceInfo:
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


@dataclass(frozen=True)
class VolumeRequest:
    """What the user asked for in the volume panel."""

    source_key: str
    name: str
    model: str
    patch: int
    stride: int
    mode: str
    label: int | None = None
    region: tuple[int, int, int, int, int, int] | None = None  # (z0, y0, x0, z1, y1, x1)
    snap: bool = True  # move a region's grid onto the last run's grid to reuse its cells
    compare: bool = False  # also Grad-CAM and Integrated Gradients on the run's grid
    compare_layer: str | None = None  # Grad-CAM's (None: the deepest conv block)


def check_volume_region(region, size: tuple[int, int, int], patch: int, stride: int) -> None:
    """Refuse a region the cube cannot be placed in, in the page's words."""
    if stride < 1 or patch < 1:
        raise InputError("the patch and the stride must be at least 1 voxel")
    low, high = (region[:3], region[3:]) if region else ((0, 0, 0), size)
    extent = [b - a for a, b in zip(low, high)]
    if not all(0 <= a < b <= s for a, b, s in zip(low, high, size)):
        raise InputError(f"the region {list(region or ())} is outside the {size} block")
    if min(extent) < patch:
        raise InputError(
            f"the region is {'x'.join(map(str, extent))} voxels (z x y x x), smaller than the "
            f"{patch}-voxel cube on some axis; draw a larger region or pick a smaller patch"
        )


def snap_volume_region(region, origin, stride: int, patch: int) -> tuple[int, ...]:
    """``region`` with its first corner moved forward onto the grid through ``origin``
    (z, y, x), by the images' rule (:func:`krypton._inputs.snap_start`)."""
    low = (snap_start(a, b, o, stride, patch) for a, b, o in zip(region[:3], region[3:], origin))
    return (*low, *(int(b) for b in region[3:]))


def _grid_axes(size, patch: int, stride: int, region) -> tuple[np.ndarray, ...]:
    from krypton.explainer import grid

    return grid(size, patch, stride, region)


def volume_provenance(
    source_key: str, model: str, weights: str, region, patch, stride, mode: str, label
) -> Provenance:
    """What a volume run explains, in the image panel's terms: the volume's content key,
    the model and its weights, the region as asked (z0, y0, x0, z1, y1, x1), the cube, the
    stride, the mode and the class (volumes fill with the model's own value: no colour)."""
    return Provenance.make(
        image=source_key, model=model, weights=weights, region=region, patch=patch,
        stride=stride, mode=mode, colour=(), label=label,
    )  # fmt: skip


def execute_volume(
    services,
    session: str,
    request: VolumeRequest,
    report: VolumeReporter,
    stage: comparison.Stage | None = None,
) -> dict:
    """Run one volume heatmap (exact and naive through the image panel's own loop,
    :func:`webapp.runs.run_cells`: known cells reused, the rest in coarse-to-fine chunks
    of listed positions; approximate in one call with its stage-one picture) and keep its
    result record for ``session``; with ``request.compare``, the gradient methods on its
    grid after it, as the image panel's (webapp.comparison)."""
    if request.mode not in krypton.MODES:
        raise InputError(f"unknown mode {request.mode!r}")
    started = time.perf_counter()
    loaded = services.volume_model(request.model)
    prepared = services.prepared_volume(request.source_key, session, request.model)
    size = tuple(loaded.input_size)
    region = tuple(int(v) for v in request.region) if request.region else None
    check_volume_region(region, size, request.patch, request.stride)  # type: ignore[arg-type]
    tensor = prepared.model_input.tensor
    base_probs = volume_prediction(loaded, prepared)
    label = int(np.argmax(base_probs)) if request.label is None else int(request.label)
    if not 0 <= label < len(base_probs):
        raise InputError(f"class {label} does not exist for {request.model}")
    weights = services.weights_checksum(request.model)
    explainer = services.volume_explainer(request.model)
    fill = loaded.gray_fill()
    note, speed, planned = "", None, None
    load = host_load()  # before this run computes: what it competes with
    run_threads(load)
    if request.mode == "exact":  # this run times incremental against naive itself
        explainer.forget_plans()
    if request.mode == "approximate":
        grid = _grid_axes(size, request.patch, request.stride, region)
        heatmap = explainer.explain(
            tensor, patch=request.patch, stride=request.stride, mode="approximate",
            fill=fill, label=label, region=region,
            progress=lambda done, total: report(done, total, None, None),
            partial=lambda values: report(0, 0, np.asarray(values, np.float32), grid),
        )  # fmt: skip
        axes = heatmap.axes
        values, class_values = heatmap.values, None
        evaluated, reused = heatmap.positions_evaluated, 0
        extra = heatmap.extra
        counts = (extra.get("stage_one_positions", evaluated), extra.get("stage_two_positions", 0))
        plan = heatmap.extra.get("plan")
    else:
        known, region, note = _volume_known(services, request, weights, loaded, region)
        had_cells = bool(known.cells)
        axes = _grid_axes(size, request.patch, request.stride, region)
        left = int(np.prod([len(a) for a in axes])) - count_known(known, axes)
        planned = left_estimate(request, left, load)  # what the panel showed

        def report_cells(done: int, total: int, values: np.ndarray | None = None) -> None:
            report(done, total, values, None if values is None else axes)

        values, class_values, reused, evaluated, plan, speed = run_cells(  # the images' loop
            explainer, tensor, axes, request.patch, request.mode, fill, label, known,
            report_cells,
        )  # fmt: skip
        known.set_origin((int(axes[0][0]), int(axes[1][0]), int(axes[2][0])))
        counts = (evaluated, 0)
        if region is not None and not reused and had_cells and not note:
            note = "no cells reused: none of the earlier positions lies in this region's grid"
    # for every run, whatever was computed: a run served from known cells warns as well
    # (the explainer checks an image once, however many calls ask)
    ood = explainer.ood_report(tensor)
    seconds = time.perf_counter() - started
    # the whole run against a naive one and the runtime log, as the image panel's
    speed = finished_run(request.model, request.mode, request.patch, (speed, seconds),
                         (evaluated, counts), planned, load)  # fmt: skip
    methods = None
    if request.compare:  # after the occlusion's clock, as the image panel's
        methods = comparison.compute_methods(
            loaded, tensor, axes, request.patch, fill, label, stage, load, request.compare_layer
        )
    result = {
        "id": uuid.uuid4().hex,
        "kind": "volume",
        "source_key": request.source_key,
        "image": request.name,
        "model": request.model,
        "weights_checksum": weights,
        "mode": request.mode,
        "label": label,
        # what it explains, compared with the page as the image panel's results are
        "provenance": volume_provenance(
            request.source_key,
            request.model,
            weights,
            request.region,
            request.patch,
            request.stride,
            request.mode,
            label,
        ).as_dict(),  # fmt: skip
        "label_name": loaded.class_name(label),
        "classes": list(loaded.classes),
        "prob": float(base_probs[label]),
        "base_probs": base_probs.tolist(),
        "patch": request.patch,
        "stride": request.stride,
        "input_size": list(size),
        "region": None if region is None else list(region),
        "zs": np.asarray(axes[0]).tolist(),
        "ys": np.asarray(axes[1]).tolist(),
        "xs": np.asarray(axes[2]).tolist(),
        "values": np.asarray(values, np.float32),
        "class_values": class_values,
        "seconds": seconds,
        "estimate": planned,  # what the panel estimated for the positions left
        "evaluated": evaluated,
        "reused": reused,
        "reuse_note": note,
        "plan": plan,
        "speed": speed,  # incremental vs naive, timed side by side in this run, or None
        "ood": ood,
        "dicom_source": prepared.source.series_uid is not None,
        "affine": None
        if prepared.model_input.affine is None
        else np.asarray(prepared.model_input.affine).tolist(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "methods": methods,  # Grad-CAM and Integrated Gradients (webapp.comparison), or None
    }
    services.results.put(volume_session(session), result)
    return result


def _volume_known(services, request: VolumeRequest, weights: str, loaded, region, peek=False):
    """The cells known for a volume run's settings (the images' cache: one bound for
    both), its region moved onto the last run's grid where snapping reuses them, and what
    the panel says about that; ``peek``: look without keeping an entry (None if none)."""
    # no stride: a cell's value depends on where the cube sits, not on the grid's step,
    # so a new stride reuses every cell of the last grid that lies on its own (as images)
    key = ("volume", request.source_key, weights, loaded.preprocessing, request.patch, request.mode)
    known = services.cells.peek(key) if peek else services.cells.get(key)
    note = ""
    if known is not None and region is not None and request.snap and known.origin is not None:
        snapped = snap_volume_region(region, known.origin, request.stride, request.patch)
        if snapped != region:
            note = (
                f"region moved onto the last run's grid, from corner {list(region[:3])} "
                f"to {list(snapped[:3])}, to reuse its cells"
            )
            region = snapped
            size = tuple(loaded.input_size)
            check_volume_region(region, size, request.patch, request.stride)
    return known, region, note


def plan_volume_run(services, request: VolumeRequest) -> PlannedRun:
    """The volume run as :func:`execute_volume` will run it (webapp.runs.plan_run)."""
    loaded = services.volume_model(request.model)
    region = tuple(int(v) for v in request.region) if request.region else None
    check_volume_region(region, tuple(loaded.input_size), request.patch, request.stride)
    if request.mode not in ("exact", "naive"):
        known = None
    else:
        weights = services.weights_checksum(request.model)
        known, region, _ = _volume_known(services, request, weights, loaded, region, peek=True)
    axes = _grid_axes(tuple(loaded.input_size), request.patch, request.stride, region)
    positions = int(np.prod([len(a) for a in axes]))
    return PlannedRun(region, positions, count_known(known, axes))


def volume_prediction(loaded, prepared: PreparedVolume) -> np.ndarray:
    """The model's class probabilities for the block it sees of a prepared volume (the
    panel's class box names the prediction before any run)."""
    with torch.inference_mode(), CAPTURE_LOCK.shared():
        logits = loaded.module(prepared.model_input.tensor.unsqueeze(0))
    return torch.softmax(logits[0].float(), 0).cpu().numpy()


def strongest_voxel(result: dict) -> tuple[int, int, int] | None:
    """(z, y, x) of the centre of the result's strongest cell (the class's lowest
    probability under the cube: its largest drop), in model voxels, within the block;
    None where no cell has a value."""
    values = np.asarray(result["values"], np.float64)
    if not np.isfinite(values).any():
        return None
    cell = np.unravel_index(int(np.nanargmin(values)), values.shape)
    size = result.get("input_size") or [None] * 3
    centre = []
    for axis, name in enumerate(("zs", "ys", "xs")):
        voxel = int(result[name][cell[axis]]) + int(result["patch"]) // 2
        centre.append(voxel if size[axis] is None else min(voxel, int(size[axis]) - 1))
    return tuple(centre)  # type: ignore[return-value]


def volume_session(session: str) -> str:
    """Where a tab's volume result is kept, apart from its image result."""
    return f"{session}/volume"


def left_estimate(request: VolumeRequest, positions: int, load: float) -> dict | None:
    """The estimate of a volume run's ``positions`` left to compute, as the panel gives
    it; None where there is none yet."""
    try:
        found = estimate_for_counts(
            request.model, request.mode, request.patch, (positions, 0), load=load
        )
    except (NotCalibratedError, ValueError):
        return None
    return dataclasses.asdict(found)


def volume_estimate(
    model: str, size, patch: int, stride: int, mode: str, region, load: float | None = None
) -> str:
    """What the panel says before Run: the positions, and the time this host's last runs
    of the model, mode and cube predict at ``load`` (sampled now where None; none before
    the first run here, for a model without a calibration)."""
    try:
        check_volume_region(region, tuple(size), patch, stride)
        axes = _grid_axes(tuple(size), patch, stride, region)
    except (InputError, ValueError) as exc:
        return str(exc)
    grid = "x".join(str(len(a)) for a in axes)
    count = int(np.prod([len(a) for a in axes]))
    positions = f"{count} position{'' if count == 1 else 's'} on a {grid} grid"
    if mode == "approximate":
        return f"{positions}; drill-down evaluates a share of them"
    try:
        load = host_load() if load is None else load
        found = estimate_for_counts(model, mode, patch, (count, 0), load=load)
    except (NotCalibratedError, ValueError):
        return (
            f"{positions}; no time estimate yet (it is learnt from "
            f"this host's runs of {model} in {mode} mode at this cube: {MIN_LOGGED_RUNS} needed)"
        )
    return f"{positions}; estimated {estimate_text(dataclasses.asdict(found))}, from {found.source}"


def relabel_volume(result: dict, label: int) -> dict:
    """The same volume result for another class: the image runs' one rule
    (:func:`webapp.runs.relabel`), so a result whose per-class probabilities the store
    dropped says so, as an image's does."""
    return relabel(result, label)


def volume_summary(result: dict) -> list[str]:
    """The result as the panel states it."""
    from .lifecycle import format_duration

    lines = [f"{result['label_name']}: p = {result['prob']:.3f}"]
    warning = ood_text(result.get("ood"))
    if warning:
        lines.append(warning)
    grid = "x".join(str(len(result[a])) for a in ("zs", "ys", "xs"))
    where = "the whole block" if not result.get("region") else f"region {result['region']}"
    named = f"{result['image']} · " if result.get("image") else ""  # which volume it explains
    if result["evaluated"]:
        lines.append(
            f"{named}{result['mode']} · {result['evaluated']} positions computed in "
            f"{format_duration(result['seconds'])}"
            + (
                f" (estimated {estimate_text(result['estimate'])})"
                if result.get("estimate")
                else ""
            )
            + f" ({grid} grid over {where}, cube {result['patch']}, stride {result['stride']})"
        )
    else:
        lines.append(
            f"{named}{result['mode']} · nothing computed: every cell was known from earlier runs"
        )
    if result["mode"] == "exact" and result["evaluated"]:
        if result.get("plan"):
            lines.append(f"Plan: {plan_text(result['plan'], result.get('speed'))}")
        lines.append(speed_text(result.get("speed"), "exact"))
    if result.get("reused"):
        lines.append(f"Reused {result['reused']} cells from earlier runs")
    if result.get("reuse_note"):
        lines.append(result["reuse_note"][0].upper() + result["reuse_note"][1:])
    return lines


def export_volume_json(result: dict) -> str:
    """Settings and result of a volume run as JSON (values as nested lists, NaN as null),
    with its warnings, and, as the image export, without the key that names the server's
    stored file (a file that leaves the server names none)."""

    def plain(value):
        if isinstance(value, np.ndarray):
            return [plain(v) for v in value.tolist()] if value.ndim else plain(value.item())
        if isinstance(value, float) and not np.isfinite(value):
            return None
        if isinstance(value, list):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    skipped = ("class_values", "source_key", "methods")
    kept = {k: v for k, v in result.items() if k not in skipped}
    if kept.get("provenance"):  # its "image" is the same stored-file key
        kept["provenance"] = {k: v for k, v in kept["provenance"].items() if k != "image"}
    kept["warnings"] = [text for text in (ood_text(result.get("ood")),) if text]
    compared = comparison.comparison_json(result)
    if compared is not None:  # the three maps for the class shown, and their agreement
        kept["comparison"] = compared
    return json.dumps(plain(kept), indent=1)


def grid_heatmap(values: np.ndarray, axes, patch: int) -> krypton.Heatmap:
    """Values on the grid ``axes`` (zs, ys, xs) as a Heatmap (for drawing a live picture)."""
    zs, ys, xs = (np.asarray(a) for a in axes)
    return krypton.Heatmap(
        values=values, xs=xs, ys=ys, zs=zs, label=0, prob=float("nan"), mode="", seconds=0.0,
        patch=patch, stride=None, positions_evaluated=0, macs_spent=0, macs_naive=0,
    )  # fmt: skip


def export_dicom_series(result: dict, source: bytes, prepared: PreparedVolume) -> bytes:
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

    warning = ood_text(result.get("ood"))
    comments = (f"WARNING: {warning} " if warning else "") + (
        f"Krypton {result['mode']} occlusion heatmap. Model {result['model']} (weights "
        f"{result['weights_checksum']}); class {result['label_name']}, p = {result['prob']:.4f};"
        f" cube {result['patch']} voxels, stride {result['stride']}; the model's "
        f"{'x'.join(map(str, unit.shape))} block, resampled from the source. Not a diagnosis: "
        f"shows where occluding the volume changed the model's output."
    )
    files = capture_series(
        header, pictures, description=f"Krypton heatmap {result['label_name']}",
        comments=comments,
    )  # fmt: skip
    return capture_series_zip(files)
