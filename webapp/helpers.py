"""Pure helpers for the web app: uploads, DICOM views, stored images and results, regions
and settings, refinement order. (Figures, exports and the model card have their own
modules.)

No Dash callbacks and no tensor algebra here; everything is testable on its own.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
from PIL import Image

from krypton.io.dicom import WINDOW_PRESETS, DicomImage, is_dicom, load_dicom
from krypton.io.images import ImageLoadError, load_image


class InputError(ValueError):
    """Something the user gave that the app cannot use; shown in the page."""


# why the page lists volume models disabled (and refuses a request naming one)
VOLUME_MODEL_REASON = (
    "a volume model: explain a CT or MR volume with it in the Volume panel below, with "
    "`krypton explain SERIES --model NAME` or with krypton.explain"
)


# -- images --------------------------------------------------------------------------------


def upload_is_dicom(data: bytes, filename: str | None) -> bool:
    """DICOM by its 'DICM' marker, or by a .dcm name (files without a preamble)."""
    return is_dicom(data) or str(filename or "").lower().endswith((".dcm", ".dicom"))


def decode_upload(data: bytes, filename: str | None = None) -> Image.Image:
    """An uploaded file's bytes as an RGB image (DICOM in the file's own window), with
    messages that name the user's file."""
    try:
        return load_image(data)
    except ImageLoadError as exc:
        raise InputError(str(exc).replace("uploaded data", filename or "the file")) from exc


# -- DICOM ---------------------------------------------------------------------------------

WINDOW_CHOICES = ("file", *WINDOW_PRESETS, "manual")


def requested_window(
    preset: str | None, centre: float | None = None, width: float | None = None
) -> str | tuple[float, float] | None:
    """The page's window choice as load_dicom takes it: None (the file's), a preset name,
    or (centre, width) for a manual window."""
    if preset in (None, "", "file"):
        return None
    if preset in WINDOW_PRESETS:
        return preset
    if preset != "manual":
        raise InputError(f"unknown window {preset!r}")
    try:
        centre, width = float(centre), float(width)
    except (TypeError, ValueError):
        raise InputError("give the window's centre and width as numbers") from None
    if not np.isfinite(centre) or not np.isfinite(width) or width < 1:
        raise InputError("the window width must be at least 1 (and both numbers finite)")
    return centre, width


def dicom_view(
    data: bytes, source_key: str, window=None, frame: int | None = None, name: str = "the file"
) -> tuple[DicomImage, dict]:
    """A DICOM file windowed for the page, and the record the page keeps of it (no
    identifying tag: modality, body part, study date, sizes, window, frame, spacing)."""
    try:
        loaded = load_dicom(data, window=window, frame=frame)
    except (ImageLoadError, ValueError) as exc:
        raise InputError(str(exc).replace("uploaded data", name)) from exc
    record = {
        "source": source_key,
        "requested": list(window) if isinstance(window, tuple) else window,
        "window": None if loaded.window is None else [float(v) for v in loaded.window],
        "window_source": loaded.window_source,
        "frame": loaded.frame,
        "frames": loaded.frames,
        "pixel_spacing": None if loaded.pixel_spacing is None else list(loaded.pixel_spacing),
        "info": dict(loaded.info),
    }
    return loaded, record


def dicom_name(record: dict) -> str:
    """A name for a DICOM image that carries nothing from the file's identity: modality
    and a short content hash (never the uploaded file name, which often names the
    patient)."""
    modality = re.sub(r"[^A-Za-z0-9]+", "", record["info"].get("modality", "")) or "DICOM"
    frame = f"-frame{record['frame'] + 1}" if record["frames"] > 1 else ""
    return f"{modality}-{record['source'][:8]}{frame}"


def dicom_description(record: dict, model_size: tuple[int, int], patch: int | None) -> str:
    """The page's line about a DICOM image: what it is, how it is windowed, which frame,
    and the patch in millimetres where the file records its pixel spacing."""
    info = record["info"]
    parts = [info.get("modality") or "DICOM"]
    if info.get("body_part"):
        parts.append(info["body_part"].lower())
    if info.get("study_date"):
        date = info["study_date"]
        parts.append(f"study {date[:4]}-{date[4:6]}-{date[6:8]}" if len(date) == 8 else date)
    parts.append(f"{info.get('size', '?')} px")
    if record["window"] is not None:
        centre, width = record["window"]
        parts.append(f"window C {centre:g} / W {width:g} ({record['window_source']})")
    else:
        parts.append(f"shown with the file's {record['window_source']}")
    if record["frames"] > 1:
        parts.append(
            f"frame {record['frame'] + 1} of {record['frames']} (a multi-frame file: the "
            f"2-D model sees one frame; pick it below)"
        )
    spacing = record.get("pixel_spacing")
    if spacing and patch:
        columns, rows = (int(v) for v in str(info.get("size", "0x0")).split("x"))
        mm_y = spacing[0] * rows / model_size[0] * patch
        mm_x = spacing[1] * columns / model_size[1] * patch
        parts.append(f"patch {patch} px ≈ {mm_x:.1f} × {mm_y:.1f} mm")
    elif patch:
        parts.append("no pixel spacing in the file (sizes in pixels only)")
    return " · ".join(parts)


def owner_tag(session: str) -> str:
    """What stored uploads are bound to: a short digest of the uploading tab's session."""
    return hashlib.blake2b(str(session or "").encode(), digest_size=8).hexdigest()


def result_nbytes(result: dict) -> int:
    """What a kept result costs: its arrays (the per-class ones dominate)."""
    total = 0
    for key in ("values", "class_values"):
        value = result.get(key)
        if value is not None:
            total += int(np.asarray(value).nbytes)
    return total + 8 * (len(result.get("base_probs") or ()) + len(result.get("xs") or ()))


class ResultStore:
    """The last result of each session, kept on the server, bounded by count and by
    bytes (least recently used first out). Exports and refinements read it from here,
    never from the browser. A result whose per-class probabilities alone exceed half the
    byte budget is kept without them (re-colouring by class then asks for a new run)."""

    def __init__(self, max_sessions: int = 256, max_bytes: int = 512 * 2**20):
        self.max_sessions, self.max_bytes = max_sessions, max_bytes
        self._results: OrderedDict[str, dict] = OrderedDict()
        self._bytes: dict[str, int] = {}
        self._dropped: OrderedDict[str, None] = OrderedDict()  # sessions that lost theirs
        self._lock = threading.Lock()

    def put(self, session: str, result: Mapping[str, Any]) -> None:
        per_class = result.get("class_values")
        if per_class is not None and np.asarray(per_class).nbytes > self.max_bytes // 2:
            size = np.asarray(per_class).nbytes / 2**20
            result = dict(
                result,
                class_values=None,
                classes_dropped=(
                    f"the probabilities of every class ({size:.0f} MB) were not kept: over "
                    f"half the server's result budget ({self.max_bytes / 2**20:g} MB, "
                    f"KRYPTON_RESULT_STORE_MB)"
                ),
            )
        size = result_nbytes(result)
        with self._lock:
            self._dropped.pop(session, None)
            self._results[session] = result
            self._bytes[session] = size
            self._results.move_to_end(session)
            while len(self._results) > 1 and (
                len(self._results) > self.max_sessions or sum(self._bytes.values()) > self.max_bytes
            ):
                dropped, _ = self._results.popitem(last=False)
                self._bytes.pop(dropped, None)
                self._dropped[dropped] = None
                while len(self._dropped) > 4 * self.max_sessions:
                    self._dropped.popitem(last=False)

    def get(self, session: str | None) -> dict | None:
        with self._lock:
            result = self._results.get(session or "")
            if result is not None:
                self._results.move_to_end(session)
            return result

    def dropped(self, session: str | None) -> bool:
        """Whether ``session``'s last result was let go to stay within the limits."""
        with self._lock:
            return (session or "") in self._dropped

    def usage(self) -> tuple[int, int]:
        """(results, bytes) kept."""
        with self._lock:
            return len(self._results), sum(self._bytes.values())


# -- regions and settings ------------------------------------------------------------------


def region_from_selection(selected: dict | None, size: tuple[int, int]) -> list[int] | None:
    """A plotly box selection to (x0, y0, x1, y1) in model-input pixels, clamped."""
    if not selected or "range" not in selected:
        return None
    ranges = selected["range"]
    if "x" not in ranges or "y" not in ranges:
        return None
    height, width = size
    xs = sorted(float(v) for v in ranges["x"])
    ys = sorted(float(v) for v in ranges["y"])
    x0 = int(np.clip(np.floor(xs[0] + 0.5), 0, width))
    x1 = int(np.clip(np.ceil(xs[1] + 0.5), 0, width))
    y0 = int(np.clip(np.floor(ys[0] + 0.5), 0, height))
    y1 = int(np.clip(np.ceil(ys[1] + 0.5), 0, height))
    if x1 <= x0 or y1 <= y0:
        return None
    return [x0, y0, x1, y1]
