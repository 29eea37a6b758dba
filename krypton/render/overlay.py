"""Heatmap pictures out: drawn on the paper's colour limits, the page's overlay styles, an RGBA
overlay at the image's own resolution and the PNG for the record (numpy, Pillow and
matplotlib's colormaps). Reads no files: krypton.io.images and krypton.io.dicom read them."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ..approximate.tuning import heatmap_limits  # the scale quality is measured on

__all__ = [
    "heatmap_limits",
    "HEATMAP_SCALES",
    "OverlayStyle",
    "StyledHeatmap",
    "styled_heatmap",
    "heatmap_rgba",
    "overlay",
    "heatmap_picture",
]


HEATMAP_SCALES = ("relative", "absolute")


@dataclass(frozen=True)
class OverlayStyle:
    """How a heatmap is drawn over its image (the page's overlay controls).

    ``scale``: "relative" colours the probability with the patch on the paper's scale
    0.75p .. min(1, 1.25p) (p: the unoccluded probability); "absolute" colours the
    probability drop p - value on 0 .. 1, comparable across images. ``threshold``: only
    cells whose drop exceeds it are drawn. Red is the most sensitive cell on both.
    """

    opacity: float = 0.55
    threshold: float = 0.0
    scale: str = "relative"
    show: bool = True

    def __post_init__(self):
        if self.scale not in HEATMAP_SCALES:
            raise ValueError(f"scale must be one of {HEATMAP_SCALES}, got {self.scale!r}")
        if not 0.0 <= self.opacity <= 1.0:
            raise ValueError(f"opacity must be in [0, 1], got {self.opacity}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")


@dataclass(frozen=True)
class StyledHeatmap:
    """What to colour and how: values (NaN = not drawn), limits, colormap, scale label."""

    values: np.ndarray
    low: float
    high: float
    colormap: str  # a matplotlib name; "jet_r" or "jet"
    label: str
    note: str = ""  # said beside the picture when nothing is coloured (the threshold)


def styled_heatmap(values: np.ndarray, prob: float, style: OverlayStyle) -> StyledHeatmap:
    """The values as ``style`` colours them, with a label that names the scale."""
    values = np.asarray(values, dtype=np.float64)
    drop = prob - values
    if style.scale == "relative":
        low, high = heatmap_limits(prob)
        shown, colormap = values.copy(), "jet_r"
        label = (
            f"probability with the patch, relative scale: 75% to 125% of the prediction's "
            f"{prob:.3f} (at most 1)"
        )
    else:
        low, high = 0.0, 1.0
        shown, colormap = drop.copy(), "jet"
        label = "probability drop p − value, absolute scale 0–1"
    note = ""
    if style.threshold > 0:
        kept = drop > style.threshold
        shown[~kept] = np.nan
        label += f"; only drops > {style.threshold:.2f}"
        if not kept.any():
            finite = drop[np.isfinite(drop)]
            largest = f" (the largest is {finite.max():.3f})" if finite.size else ""
            note = (
                f"No cell's drop exceeds the threshold {style.threshold:.2f}{largest}, so "
                f"nothing is coloured; lower the threshold to see the heatmap."
            )
    return StyledHeatmap(shown, low, high, colormap, label + "; red = most sensitive", note)


def heatmap_rgba(
    values: np.ndarray, low: float, high: float, alpha: float = 0.6, colormap: str = "jet_r"
) -> np.ndarray:
    """Colours (jet_r by default: red = lowest probability = most sensitive); NaN cells
    transparent."""
    from matplotlib import colormaps

    span = max(high - low, 1e-12)
    filler = high if colormap == "jet_r" else low
    normalised = np.clip((np.nan_to_num(values, nan=filler) - low) / span, 0.0, 1.0)
    rgba = colormaps[colormap](normalised)
    rgba[..., 3] = np.where(np.isnan(values), 0.0, alpha)
    return (rgba * 255).round().astype(np.uint8)


def _cell_extent(xs, ys, patch: int | tuple[int, int]) -> tuple[float, float, float, float]:
    """(left, top, width, height) in input pixels of the area the cells tile: each cell
    stands for the patch (a square, or (height, width)) centred on its position."""
    patch_y, patch_x = (patch, patch) if isinstance(patch, int) else patch
    step_x = int(np.min(np.diff(xs))) if len(xs) > 1 else patch_x
    step_y = int(np.min(np.diff(ys))) if len(ys) > 1 else patch_y
    left = float(xs[0]) + patch_x / 2 - step_x / 2
    top = float(ys[0]) + patch_y / 2 - step_y / 2
    return left, top, step_x * len(xs), step_y * len(ys)


def overlay(
    image: Image.Image,
    values: np.ndarray,
    xs: np.ndarray,
    ys: np.ndarray,
    patch: int | tuple[int, int],
    prob: float,
    alpha: float | None = None,
    input_size: tuple[int, int] | None = None,
    style: OverlayStyle | None = None,
) -> Image.Image:
    """The heatmap drawn over the area its patch positions cover, on ``image`` at the
    image's own resolution (``xs``/``ys``/``patch`` in the model's input pixels,
    ``input_size`` = (H, W); default: the image's size)."""
    style = style or OverlayStyle(opacity=0.6 if alpha is None else alpha)
    base = image.convert("RGBA")
    if not style.show:
        return base.convert("RGB")
    height, width = input_size or (image.height, image.width)
    scale_x, scale_y = image.width / width, image.height / height
    styled = styled_heatmap(values, prob, style)
    colours = Image.fromarray(
        heatmap_rgba(styled.values, styled.low, styled.high, style.opacity, styled.colormap),
        mode="RGBA",
    )
    left, top, cells_w, cells_h = _cell_extent(xs, ys, patch)
    size = (max(1, round(cells_w * scale_x)), max(1, round(cells_h * scale_y)))
    colours = colours.resize(size, Image.NEAREST)
    layer = Image.new("RGBA", base.size, (0, 0, 0, 0))
    layer.paste(colours, (round(left * scale_x), round(top * scale_y)))
    return Image.alpha_composite(base, layer).convert("RGB")


def heatmap_picture(
    image: Image.Image,
    values: np.ndarray,
    xs: np.ndarray,
    ys: np.ndarray,
    patch: int | tuple[int, int],
    prob: float,
    input_size: tuple[int, int],
    title: str,
    min_side: int = 512,
    style: OverlayStyle | None = None,
    warning: str = "",
) -> bytes:
    """A PNG for the record: the heatmap over ``image`` at its own resolution (enlarged to
    ``min_side`` on the long side if smaller), a colour bar labelled with its scale and a
    title. ``xs``/``ys``/``patch`` are in the model's input pixels (``input_size`` = (H, W)).
    ``warning`` (an out-of-distribution caveat, say) is drawn under the title in red and
    kept in the PNG's "Warning" text chunk."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    style = style or OverlayStyle()
    picture = image.convert("RGB")
    if max(picture.size) < min_side:
        scale = min_side / max(picture.size)
        picture = picture.resize(
            (round(picture.width * scale), round(picture.height * scale)), Image.LANCZOS
        )
    width, height = picture.size
    scale_x, scale_y = width / input_size[1], height / input_size[0]
    left, top, cells_w, cells_h = _cell_extent(xs, ys, patch)
    extent = (
        left * scale_x,
        (left + cells_w) * scale_x,
        (top + cells_h) * scale_y,
        top * scale_y,
    )
    styled = styled_heatmap(values, prob, style)
    dpi = 100
    margin = 90 + (50 if warning else 0)  # pixels above the picture: title (and warning)
    figure = Figure(figsize=(width / dpi + 1.6, (height + margin) / dpi), dpi=dpi)
    axes = figure.add_axes((0.02, 0.02, width / (width + 160), 1 - margin / (height + margin)))
    axes.imshow(np.asarray(picture), interpolation="nearest")
    shown = axes.imshow(
        np.ma.masked_invalid(styled.values),
        cmap=colormaps[styled.colormap],
        vmin=styled.low,
        vmax=styled.high,
        alpha=style.opacity if style.show else 0.0,
        extent=extent,
        interpolation="nearest",
    )
    axes.set_xlim(0, width)
    axes.set_ylim(height, 0)
    axes.axis("off")
    bar = figure.colorbar(shown, ax=axes, fraction=0.04, pad=0.02)
    bar.set_label(styled.label, fontsize=7, wrap=True)
    bar.solids.set_alpha(1)
    axes.set_title(title, fontsize=9, wrap=True, parse_math=False)  # "$" is plain text
    if warning:  # above the title, in red, as the page shows it
        figure.text(0.02, 1 - 6 / (height + margin), f"WARNING: {warning}", color="red",
                    fontsize=8, wrap=True, va="top", parse_math=False)  # fmt: skip
    buffer = io.BytesIO()
    figure.savefig(
        buffer, format="png", dpi=dpi, metadata={"Warning": warning} if warning else None
    )
    return buffer.getvalue()
