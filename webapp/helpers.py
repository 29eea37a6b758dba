"""Pure helpers for the web app: uploads, regions, figures, refinement and exports.

No Dash callbacks and no tensor algebra here; everything is testable on its own.
"""

from __future__ import annotations

import base64
import binascii
import csv
import hashlib
import html
import io
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from PIL import Image

from krypton.imaging import MAX_SIDE, ImageLoadError, heatmap_limits, heatmap_picture, load_image

MAX_UPLOAD_BYTES = 25 * 1024 * 1024
HEX_COLOUR = re.compile(r"^#?([0-9a-fA-F]{6})$")


class InputError(ValueError):
    """Something the user gave that the app cannot use; shown in the page."""


# -- images --------------------------------------------------------------------------------


def decode_upload(
    contents: str, filename: str | None = None, max_bytes: int = MAX_UPLOAD_BYTES
) -> Image.Image:
    """A dcc.Upload data URL to an RGB image, with messages a user can act on."""
    name = filename or "the file"
    if not contents or "," not in contents:
        raise InputError(f"{name} could not be read")
    header, encoded = contents.split(",", 1)
    try:
        data = base64.b64decode(encoded, validate=False)
    except (binascii.Error, ValueError) as exc:
        raise InputError(f"{name} could not be decoded") from exc
    if len(data) > max_bytes:
        raise InputError(
            f"{name} is {len(data) / 2**20:.1f} MB; the limit is {max_bytes / 2**20:g} MB"
        )
    try:
        return load_image(data)
    except ImageLoadError as exc:
        raise InputError(str(exc).replace("uploaded data", name)) from exc


def image_key(image: Image.Image) -> str:
    """Content hash of an image (same pixels, same key)."""
    digest = hashlib.blake2b(image.tobytes(), digest_size=12)
    digest.update(repr(image.size).encode())
    return digest.hexdigest()


class ImageStore:
    """Images kept on the server by content key, so the browser only holds the key.

    Bounded: at most ``max_bytes`` of PNG files and ``max_count`` images; the least
    recently used go first. Images arrive already reduced to what any model can use
    (:data:`krypton.imaging.MAX_SIDE`), and are stored at that resolution.
    """

    def __init__(self, directory: Path, max_bytes: int = 256 * 2**20, max_count: int = 500):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.max_count = max_bytes, max_count
        self._lock = threading.Lock()

    def put(self, image: Image.Image) -> str:
        if max(image.size) > MAX_SIDE:
            image = image.copy()
            image.thumbnail((MAX_SIDE, MAX_SIDE), Image.LANCZOS)
        key = image_key(image)
        path = self.directory / f"{key}.png"
        with self._lock:
            if path.exists():
                os.utime(path)
            else:
                temporary = path.with_suffix(".tmp")
                image.save(temporary, format="PNG")
                os.replace(temporary, path)
            self._evict(keep=path)
        return key

    def get(self, key: str) -> Image.Image:
        if not re.fullmatch(r"[0-9a-f]{24}", key or ""):
            raise InputError("unknown image; load it again")
        path = self.directory / f"{key}.png"
        try:
            with self._lock:
                os.utime(path)  # recently used
            with Image.open(path) as image:
                return image.convert("RGB")
        except FileNotFoundError:
            raise InputError("the image is no longer on the server; load it again") from None

    def usage(self) -> tuple[int, int]:
        """(images, bytes) stored."""
        files = list(self.directory.glob("*.png"))
        return len(files), sum(f.stat().st_size for f in files)

    def _evict(self, keep: Path) -> None:
        files = []
        for path in self.directory.glob("*.png"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        files.sort()
        total = sum(size for _, size, _ in files)
        count = len(files)
        for _, size, path in files:
            if total <= self.max_bytes and count <= self.max_count:
                break
            if path == keep:
                continue
            path.unlink(missing_ok=True)
            total -= size
            count -= 1


class ResultStore:
    """The last result of each session, kept on the server (bounded, least recently used
    first out). Exports and refinements read it from here, never from the browser."""

    def __init__(self, max_sessions: int = 256):
        self.max_sessions = max_sessions
        self._results: OrderedDict[str, dict] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, session: str, result: dict) -> None:
        with self._lock:
            self._results[session] = result
            self._results.move_to_end(session)
            while len(self._results) > self.max_sessions:
                self._results.popitem(last=False)

    def get(self, session: str | None) -> dict | None:
        with self._lock:
            result = self._results.get(session or "")
            if result is not None:
                self._results.move_to_end(session)
            return result


def model_view(image: Image.Image, input_size: tuple[int, int]) -> Image.Image:
    """The image as the model sees it (resized to its input size)."""
    height, width = input_size
    return image.convert("RGB").resize((width, height), Image.BILINEAR)


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


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


def check_region(region: list[int] | None, size: tuple[int, int], patch: int, stride: int) -> None:
    """Refuse a region the occluding patch cannot be placed in, with a clear message."""
    height, width = size
    x0, y0, x1, y1 = region or (0, 0, width, height)
    if x1 - x0 < patch or y1 - y0 < patch:
        raise InputError(
            f"the region is {x1 - x0}x{y1 - y0} pixels, smaller than the "
            f"{patch}-pixel patch; draw a larger region or pick a smaller patch"
        )
    if stride < 1:
        raise InputError("the stride must be at least 1")


def parse_colour(choice: str, custom: str | None) -> tuple[float, float, float]:
    """Occlusion colour as RGB in [0, 1]: gray, black or a custom #rrggbb."""
    if choice == "gray":
        return (0.5, 0.5, 0.5)
    if choice == "black":
        return (0.0, 0.0, 0.0)
    match = HEX_COLOUR.match((custom or "").strip())
    if not match:
        raise InputError(f"custom colour must look like #808080, got {custom!r}")
    value = match.group(1)
    return tuple(int(value[i : i + 2], 16) / 255 for i in (0, 2, 4))


def normalised_fill(rgb: tuple[float, float, float], mean, std) -> tuple[float, ...]:
    """An RGB colour in [0, 1] expressed in the model's normalised input space."""
    return tuple((c - m) / s for c, m, s in zip(rgb, mean, std))


# -- refinement ----------------------------------------------------------------------------


def order_coarse_to_fine(ys: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """Order grid cells so a coarse sub-grid comes first: the first batches already cover
    the whole region and later ones sharpen it."""
    rows = np.searchsorted(np.unique(ys), ys)
    cols = np.searchsorted(np.unique(xs), xs)
    level = np.zeros(len(ys), dtype=int)
    for step in (8, 4, 2, 1):
        on_grid = (rows % step == 0) & (cols % step == 0) & (level == 0)
        level[on_grid] = step
    return np.argsort(-level, kind="stable")


def fill_for_display(values: np.ndarray) -> np.ndarray:
    """Unknown (NaN) cells take the nearest known value, for the live partial picture."""
    known = ~np.isnan(values)
    if known.all() or not known.any():
        return values
    from scipy.ndimage import distance_transform_edt

    _, (rows, cols) = distance_transform_edt(~known, return_indices=True)
    return values[rows, cols]


# -- figures --------------------------------------------------------------------------------


def plotly_text(text: str) -> str:
    """User text (class, model and file names) for a Plotly title: Plotly renders a subset
    of HTML there (links, styles), so every markup character is escaped."""
    return html.escape(str(text), quote=True)


def image_figure(image: Image.Image, region: list[int] | None) -> go.Figure:
    """The model-input image; drag a box on it to choose the region."""
    figure = go.Figure(go.Image(source=data_url(image), hoverinfo="x+y"))
    if region:
        x0, y0, x1, y1 = region
        figure.add_shape(
            type="rect",
            x0=x0 - 0.5,
            y0=y0 - 0.5,
            x1=x1 - 0.5,
            y1=y1 - 0.5,
            line={"color": "#00e5ff", "width": 2},
        )
    figure.update_layout(
        dragmode="select",
        margin={"l": 0, "r": 0, "t": 0, "b": 0},
        xaxis={"visible": False},
        yaxis={"visible": False},
        height=420,
        uirevision="image",
        newselection={"mode": "immediate"},
    )
    return figure


def heatmap_figure(
    image: Image.Image, values: np.ndarray, xs, ys, patch: int, prob: float, title: str = ""
) -> go.Figure:
    """The heatmap over the image: jet_r, red = lowest probability = most sensitive."""
    low, high = heatmap_limits(prob)
    figure = go.Figure(go.Image(source=data_url(image), hoverinfo="skip"))
    centres_x = np.asarray(xs) + (patch - 1) / 2
    centres_y = np.asarray(ys) + (patch - 1) / 2
    figure.add_trace(
        go.Heatmap(
            z=values,
            x=centres_x,
            y=centres_y,
            zmin=low,
            zmax=high,
            colorscale="Jet",
            reversescale=True,
            opacity=0.55,
            hoverongaps=False,
            hovertemplate="patch at (%{x:.0f}, %{y:.0f}): p = %{z:.4f}<extra></extra>",
            colorbar={
                "title": {"text": "probability<br>(red = most<br>sensitive)"},
                "thickness": 14,
            },
        )
    )
    figure.update_layout(
        margin={"l": 0, "r": 0, "t": 30 if title else 0, "b": 0},
        title={"text": plotly_text(title), "font": {"size": 13}},
        xaxis={"visible": False},
        yaxis={"visible": False, "autorange": "reversed"},
        height=420,
    )
    return figure


# -- exports -------------------------------------------------------------------------------


EXPORT_MIN_SIDE = 512  # pixels: exports are drawn at least this large


def export_stem(result: dict) -> str:
    """A file name that says what the export is: model, image, mode, region, class."""
    region = (
        "whole"
        if not result.get("region")
        else "x{}-{}_y{}-{}".format(
            result["region"][0], result["region"][2], result["region"][1], result["region"][3]
        )
    )
    parts = [
        "krypton",
        result["model"],
        Path(str(result["image"])).stem,
        result["mode"],
        f"p{result['patch']}s{result['stride']}",
        region,
        result["label_name"],
    ]
    return "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", str(p)).strip("_.-") or "x" for p in parts)[
        :180
    ]


def export_png(original: Image.Image, result: dict) -> bytes:
    """The heatmap over the image at the uploaded resolution (at least 512 px), with a
    colour bar and a title: model, class, probability, mode, patch/stride, date."""
    values = np.asarray(result["values"], dtype=np.float32)
    title = (
        f"{result['model']} · {result['label_name']} (p = {result['prob']:.3f}) · "
        f"{result['mode']} · patch {result['patch']}, stride {result['stride']} · "
        f"{result.get('date', '')}"
    )
    return heatmap_picture(
        original,
        values,
        np.asarray(result["xs"]),
        np.asarray(result["ys"]),
        result["patch"],
        result["prob"],
        result["input_size"],
        title,
        EXPORT_MIN_SIDE,
    )


def export_npy(result: dict) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(result["values"], dtype=np.float32))
    return buffer.getvalue()


def export_all_classes(result: dict) -> bytes:
    """Every class's probabilities (rows x cols x classes) with positions and names."""
    if result.get("class_values") is None:
        raise InputError("this run kept only the explained class (approximate mode)")
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer,
        probabilities=np.asarray(result["class_values"]),
        xs=np.asarray(result["xs"]),
        ys=np.asarray(result["ys"]),
        classes=np.asarray(result["classes"]),
        unoccluded=np.asarray(result["base_probs"]),
    )
    return buffer.getvalue()


def export_csv(result: dict) -> str:
    values = np.asarray(result["values"], dtype=np.float32)
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["x", "y", "probability"])
    for row, y in enumerate(result["ys"]):
        for col, x in enumerate(result["xs"]):
            if not np.isnan(values[row, col]):
                writer.writerow([int(x), int(y), f"{values[row, col]:.6f}"])
    return text.getvalue()


def jsonable(value: Any):
    """json.dumps default for numpy values."""
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
