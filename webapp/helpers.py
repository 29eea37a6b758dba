"""Pure helpers for the web app: uploads, regions, figures, refinement and exports.

No Dash callbacks and no tensor algebra here; everything is testable on its own.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from PIL import Image

from krypton.io.dicom import WINDOW_PRESETS, DicomImage, heatmap_capture, is_dicom, load_dicom
from krypton.io.images import MAX_SIDE, ImageLoadError, load_image
from krypton.registry.ood import caveat
from krypton.render.exports import all_classes_npz, heatmap_title, values_csv, values_npy
from krypton.render.overlay import OverlayStyle, heatmap_picture, styled_heatmap

HEX_COLOUR = re.compile(r"^#?([0-9a-fA-F]{6})$")


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


def image_key(image: Image.Image) -> str:
    """Content hash of an image (same pixels, same key)."""
    digest = hashlib.blake2b(image.tobytes(), digest_size=12)
    digest.update(repr(image.size).encode())
    return digest.hexdigest()


def reduced_for_storage(image: Image.Image) -> Image.Image:
    """The image as the stores keep it: at most :data:`krypton.io.images.MAX_SIDE` a side."""
    if max(image.size) > MAX_SIDE:
        image = image.copy()
        image.thumbnail((MAX_SIDE, MAX_SIDE), Image.LANCZOS)
    return image


def check_stored_key(key: str, what: str) -> None:
    """A stored file's key is a content hash; anything else the page sent is refused."""
    if not re.fullmatch(r"[0-9a-f]{24}", key or ""):
        raise InputError(f"unknown {what}; load it again")


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

    def put(self, session: str, result: dict) -> None:
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


def model_view(image: Image.Image, input_size: tuple[int, int]) -> Image.Image:
    """The image as the model sees it (resized to its input size)."""
    height, width = input_size
    return image.convert("RGB").resize((width, height), Image.BILINEAR)


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# -- models --------------------------------------------------------------------------------


def _flagged_word(flagged: bool) -> str:
    return "flagged" if flagged else "not flagged"


def model_card_lines(loaded) -> list[str]:
    """What the page says about a model: what it is, each measured number with the set it
    was measured on, whether images are checked against its training distribution."""
    from krypton.approximate.tuning import choose_tau

    entry = loaded.extra.get("entry", {})
    lines = [
        loaded.description or loaded.name,
        f"{len(loaded.classes)} classes · input {loaded.input_size[0]}×{loaded.input_size[1]}",
    ]
    evaluation = entry.get("evaluation") or {}
    held_out, independent = evaluation.get("held_out"), evaluation.get("independent")
    if held_out:
        text = (
            f"Accuracy {held_out['accuracy']:.1%} on {held_out['images']} held-out images of "
            f"{held_out['test_set']}"
        )
        if independent:
            text += (
                f"; {independent['accuracy']:.1%} on {independent['images']} images of "
                f"{independent['test_set']}"
            )
        lines.append(text + ".")
    samples = evaluation.get("real_samples")
    if samples:
        micro = samples["microaneurysms"]
        lines.append(
            f"Real photographs: the Retina sample (no lesion) → {samples['retina']['class']} "
            f"(p {samples['retina']['p']:.2f}); the Microaneurysms sample → {micro['class']} "
            f"(p {micro['p']:.2f}), lowest heatmap cell "
            f"{'on' if micro['lowest_on_dot'] else 'not on'} one of its visible dark dots."
        )
    pointing, multi = (
        evaluation.get("pointing_game_strict"),
        evaluation.get("multi_lesion_coverage"),
    )
    if pointing and multi:
        region = pointing.get("hit_rate_region")
        lines.append(
            f"Strict pointing game {pointing['hit_rate']:.0%}"
            + ("" if region is None else f" by the lowest cell, {region:.0%} by the lowest region")
            + f" ({pointing['images']} single-lesion images, patch {pointing.get('patch', 16)}, "
            f"stride {pointing.get('stride', 8)}: within 8 px of the lesion); "
            f"multi-lesion coverage {multi['share']:.0%} ({multi['lesions']} lesions in "
            f"{multi['images']} images with 2-4, patch {multi.get('patch', 16)}: lesions under "
            f"the lowest 5% of cells)."
        )
    training = entry.get("training") or {}
    if not held_out and "held_out_accuracy" in training:
        lines.append(
            f"Held-out accuracy {training['held_out_accuracy']:.1%}, pointing game "
            f"{training['pointing_game']:.0%} (this project's generator, single-lesion images)"
        )
    if loaded.ood is not None:
        rates = evaluation.get("ood")
        text = (
            f"Out-of-distribution check: on (fitted on {loaded.ood.reference}; it flags an "
            f"image whose features at some stage of the network are unusually far from "
            f"theirs"
            + (
                f" or on the side of {loaded.ood.outliers:,} synthetic counter-examples"
                if loaded.ood.boundary is not None
                else ""
            )
            + ", and by design about 1% of genuine images)"
        )
        if rates:
            whole = (
                f"{rates['natural_whole_flagged']} of {rates['natural_whole_images']} natural "
                f"photographs as shipped and "
                if "natural_whole_flagged" in rates
                else ""
            )
            documents = (
                f"{rates['documents_flagged']:.0%} of {rates['documents_images']} typeset "
                f"text pages, "
                if "documents_flagged" in rates
                else ""
            )
            text += (
                f"; flags {whole}{rates['natural_flagged']:.0%} of {rates['natural_images']} "
                f"natural photographs and crops, {documents}"
                f"{rates['in_distribution_flagged']:.1%} of "
                f"{rates['in_distribution_images']} fresh in-distribution images"
            )
            real = rates.get("real_flagged")
            if real:
                text += (
                    f"; the real Retina sample {_flagged_word(real['retina'])}, the "
                    f"Microaneurysms sample {_flagged_word(real['microaneurysms'])}, "
                    f"{real['microaneurysm_tiles']} of its 9 tiles flagged"
                )
            scans = rates.get("tomography")
            if scans:
                samples = scans["app_samples_flagged"]
                text += (
                    f"; real CT and MR: {sum(samples.values())} of the {len(samples)} CT and "
                    f"MR samples here flagged, {scans['held_out_flagged']:.0%} of "
                    f"{scans['held_out_slices']} held-out slices (pydicom's and nibabel's "
                    f"test data)"
                )
        lines.append(text + ".")
    else:
        lines.append(
            "Out-of-distribution check: none for this model (register it with reference "
            "images to get one); its predictions on unfamiliar images are not flagged."
        )
    tuning = loaded.tuning
    lines.append(
        f"Approximate mode: {tuning.describe()}"
        if tuning
        else f"Approximate mode: τ {choose_tau(None).source}"
    )
    return lines


def ood_text(ood: dict | None) -> str:
    """The page's warning for an image the model's reference set says is unfamiliar."""
    text = caveat(ood)
    return f"Warning: {text}." if text else ""


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
    # down to one cell at the coarsest level: on a 224-px image at stride 4 (53 x 53
    # cells) the first 16 positions are then the 16-cell grid spread over the image
    for step in (64, 32, 16, 8, 4, 2, 1):
        on_grid = (rows % step == 0) & (cols % step == 0) & (level == 0)
        level[on_grid] = step
    return np.argsort(-level, kind="stable")


def fill_for_display(values: np.ndarray) -> np.ndarray:
    """Unknown (NaN) cells take the nearest known value, for the live partial picture (an
    image's grid or a volume's)."""
    known = ~np.isnan(values)
    if known.all() or not known.any():
        return values
    from scipy.ndimage import distance_transform_edt

    _, nearest = distance_transform_edt(~known, return_indices=True)
    return values[tuple(nearest)]


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


def overlay_style(data: dict | None) -> OverlayStyle:
    """The overlay controls' values (the overlay-store) as an OverlayStyle."""
    data = data or {}
    try:
        return OverlayStyle(
            opacity=float(data.get("opacity", 0.55)),
            threshold=float(data.get("threshold", 0.0)),
            scale=str(data.get("scale", "relative")),
            show=bool(data.get("show", True)),
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"overlay settings: {exc}") from None


def _wrapped(text: str, width: int = 22) -> str:
    """A colour-bar title broken into short lines (Plotly's <br>), escaped."""
    import textwrap

    return "<br>".join(plotly_text(line) for line in textwrap.wrap(text, width))


def heatmap_figure(
    image: Image.Image,
    values: np.ndarray,
    xs,
    ys,
    patch: int,
    prob: float,
    title: str = "",
    style: OverlayStyle | None = None,
    side_by_side: bool = False,
) -> go.Figure:
    """The heatmap over the image, red = most sensitive, with a colour bar that names its
    scale; ``side_by_side`` puts the plain image on the left (zoom and pan linked)."""
    from plotly.subplots import make_subplots

    style = style or OverlayStyle()
    styled = styled_heatmap(values, prob, style)
    raw = np.asarray(values, dtype=np.float64)
    source = data_url(image)
    columns = 2 if side_by_side else 1
    figure = make_subplots(rows=1, cols=columns, horizontal_spacing=0.02)
    for column in range(1, columns + 1):
        figure.add_trace(go.Image(source=source, hoverinfo="skip"), row=1, col=column)
    centres_x = np.asarray(xs) + (patch - 1) / 2
    centres_y = np.asarray(ys) + (patch - 1) / 2
    figure.add_trace(
        go.Heatmap(
            z=styled.values,
            x=centres_x,
            y=centres_y,
            zmin=styled.low,
            zmax=styled.high,
            colorscale="Jet",
            reversescale=styled.colormap == "jet_r",
            opacity=style.opacity,
            visible=style.show,
            customdata=np.dstack([raw, prob - raw]),
            hoverongaps=False,
            hovertemplate=(
                "patch at (%{x:.0f}, %{y:.0f}): p = %{customdata[0]:.4f}, "
                "drop %{customdata[1]:.4f}<extra></extra>"
            ),
            colorbar={"title": {"text": _wrapped(styled.label)}, "thickness": 14},
        ),
        row=1,
        col=columns,
    )
    figure.update_xaxes(visible=False)
    figure.update_yaxes(visible=False, autorange="reversed")
    if side_by_side:
        figure.update_xaxes(matches="x")
        figure.update_yaxes(matches="y", scaleanchor="x")
    figure.update_layout(
        margin={"l": 0, "r": 0, "t": 30 if title else 0, "b": 0},
        title={"text": plotly_text(title), "font": {"size": 13}},
        height=420,
    )
    if styled.note and style.show:  # no cell coloured: Plotly drops the colour bar too
        figure.add_annotation(
            text=_wrapped(styled.note, 60),
            xref="paper",
            yref="paper",
            x=0.5,
            y=0.02,
            showarrow=False,
            bgcolor="rgba(255, 255, 255, 0.85)",
            font={"size": 12},
        )
    return figure


# -- exports -------------------------------------------------------------------------------


EXPORT_MIN_SIDE = 512  # pixels: exports are drawn at least this large


def export_stem(result: dict) -> str:
    """A file name that says what the export is: model, image (or volume), mode, region,
    class."""
    region = result.get("region")
    if not region:
        where = "whole"
    elif len(region) == 6:  # a volume's (z0, y0, x0, z1, y1, x1)
        where = "z{}-{}_y{}-{}_x{}-{}".format(*(region[i] for i in (0, 3, 1, 4, 2, 5)))
    else:
        where = f"x{region[0]}-{region[2]}_y{region[1]}-{region[3]}"
    name = Path(str(result["image"])).name
    double = name.lower().endswith(".nii.gz")
    parts = [
        "krypton",
        result["model"],
        name[: -len(".nii.gz")] if double else Path(name).stem,
        result["mode"],
        f"p{result['patch']}s{result['stride']}",
        where,
        result["label_name"],
    ]
    return "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", str(p)).strip("_.-") or "x" for p in parts)[
        :180
    ]


def export_png(original: Image.Image, result: dict, style: OverlayStyle | None = None) -> bytes:
    """The heatmap over the image at the uploaded resolution (at least 512 px), drawn as
    the page shows it (``style``), with a colour bar naming its scale and a title: model,
    class, probability, mode, patch/stride, date."""
    values = np.asarray(result["values"], dtype=np.float32)
    title = heatmap_title(
        result["model"],
        result["label_name"],
        result["prob"],
        result["mode"],
        result["patch"],
        result["stride"],
        result.get("date", ""),
    )
    warning = caveat(result.get("ood"))
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
        style,
        warning=warning,
    )


def export_dicom(
    source: bytes, result: dict, style: OverlayStyle | None = None, include_identity=False
) -> bytes:
    """The overlay as a DICOM Secondary Capture in the source's study, referencing the
    source image: the same frame, in the same window, at the file's own resolution."""
    record = result.get("dicom")
    if not record:
        raise InputError("the DICOM export needs a DICOM image; this one was not")
    window = record.get("requested")
    try:
        return heatmap_capture(
            source,
            values=result["values"],
            xs=result["xs"],
            ys=result["ys"],
            patch=result["patch"],
            stride=result["stride"],
            prob=result["prob"],
            input_size=tuple(result["input_size"]),
            label_name=result["label_name"],
            mode=result["mode"],
            model_name=result["model"],
            window=tuple(window) if isinstance(window, list) else window,
            frame=record["frame"],
            style=style,
            weights=result.get("weights_checksum", ""),
            include_identity=include_identity,
            warning=caveat(result.get("ood")),
        )
    except (ImageLoadError, ValueError) as exc:
        raise InputError(f"the DICOM export failed: {exc}") from exc


def export_npy(result: dict) -> bytes:
    """The explained class's values (krypton.render.exports: the CLI's and batch's schema)."""
    return values_npy(result["values"])


def export_all_classes(result: dict) -> bytes:
    """Every class's probabilities (rows x cols x classes) with positions and names."""
    if result.get("class_values") is None:
        raise InputError("this run kept only the explained class (approximate mode)")
    return all_classes_npz(
        result["class_values"],
        result["xs"],
        result["ys"],
        result["classes"],
        result["base_probs"],
        caveat(result.get("ood")),
    )


def export_csv(result: dict) -> str:
    """One row per evaluated position (krypton.render.exports), after the
    out-of-distribution warning's comment line when the image was flagged."""
    return values_csv(result["values"], result["xs"], result["ys"], caveat(result.get("ood")))


def jsonable(value: Any):
    """json.dumps default for numpy values."""
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
