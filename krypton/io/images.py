"""Image files in: any mode and bit depth to RGB, within the decode budget, DICOM
through krypton.io.dicom. Heatmap pictures out are krypton.render's.

No tensors here; shared by the CLI, the batch runner and the web app.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ._decoding import (
    DECODE_BUDGET,
    MAX_SIDE,
    MIN_SIDE,
    PILLOW_DECODE_FACTOR,
    ImageLoadError,
    plain_reason,
    reduced_to_max_side,
)
from .dicom import is_dicom, load_dicom

__all__ = [
    "ImageLoadError",
    "MAX_SIDE",
    "MIN_SIDE",
    "load_image",
    "plain_reason",
    "to_rgb",
]

MAX_PIXELS = 50_000_000  # refuse decompression bombs long before memory runs out


def load_image(
    source: str | Path | bytes, window: str | tuple | None = None, frame: int | None = None
) -> Image.Image:
    """Open an image file or bytes as an 8-bit RGB PIL image, with clear errors.

    DICOM files (by their 'DICM' marker or a .dcm name) are windowed as
    :func:`krypton.io.dicom.load_dicom` describes: ``window`` (a preset name or
    (centre, width)) and ``frame`` apply to them and are ignored for other images.
    Every decode is admitted by :data:`krypton.io._decoding.DECODE_BUDGET` from the file's
    header first, and images over :data:`MAX_SIDE` are reduced while (JPEG) or right
    after (other formats) decoding, in their own sample type.
    """
    name = "uploaded data" if isinstance(source, (bytes, bytearray)) else str(source)
    if is_dicom(source) or (
        not isinstance(source, (bytes, bytearray)) and str(source).lower().endswith(".dcm")
    ):
        return _checked_size(load_dicom(source, window=window, frame=frame).picture, name)
    try:
        if isinstance(source, (bytes, bytearray)):
            if not source:
                raise ImageLoadError("the file is empty")
            handle = io.BytesIO(source)
        else:
            handle = open(source, "rb")
        with handle:
            with Image.open(handle) as image:
                return _decoded(image, name)
    except ImageLoadError:
        raise
    except FileNotFoundError as exc:
        raise ImageLoadError(f"no such file: {name}") from exc
    except UnidentifiedImageError as exc:
        raise ImageLoadError(
            f"{name} is not an image file Krypton can read (PNG, JPEG, TIFF, BMP, ...)"
        ) from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageLoadError(
            f"{name} could not be decoded ({plain_reason(exc)}); it may be truncated or corrupt"
        ) from exc


# Bytes per pixel of Pillow's own buffers: multi-band 8-bit modes are stored as 4 bytes.
_MODE_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2}


def _decoded(image: Image.Image, name: str) -> Image.Image:
    """An opened (not yet decoded) Pillow image, decoded within the budget, reduced and
    converted to RGB."""
    if image.width * image.height > MAX_PIXELS:
        raise ImageLoadError(
            f"{name} is {image.width}x{image.height} pixels; the limit is "
            f"{MAX_PIXELS // 1_000_000} megapixels"
        )
    if min(image.width, image.height) < MIN_SIDE:
        raise ImageLoadError(
            f"{name} is {image.width}x{image.height} pixels; images need at "
            f"least {MIN_SIDE} pixels on each side"
        )
    if image.format == "JPEG":  # decode at 1/2, 1/4 or 1/8 scale where that still covers
        image.draft(image.mode, (MAX_SIDE, MAX_SIDE))
    per_pixel = _MODE_BYTES.get(image.mode, 4)
    what = f"{image.width}x{image.height} pixels ({image.mode})"
    cost = DECODE_BUDGET.cost(name, what, image.size, per_pixel, PILLOW_DECODE_FACTOR)
    with DECODE_BUDGET.reserve(cost) as record:
        image.load()
        record.output = image.width * image.height * per_pixel
        reduced = _reduced_in_strips(image)
    # Cameras store portrait photos sideways plus an orientation tag.
    return _checked_size(to_rgb(ImageOps.exif_transpose(reduced)), name)


def _reduced_in_strips(image: Image.Image) -> Image.Image:
    """``image`` box-reduced by the whole factor that brings its long side to between
    MAX_SIDE and twice that (unchanged if already within), in its own sample type, a
    strip of rows at a time: no full-size copy. 16-bit images come back as mode "I",
    palette and 1-bit ones as RGBA and L."""
    factor = max(image.size) // MAX_SIDE
    if factor < 2:
        return image
    info = dict(image.info)
    work_mode = {"P": "RGBA", "PA": "RGBA", "1": "L"}.get(image.mode, image.mode)
    if work_mode.startswith("I;16"):
        work_mode = "I"
    width, height = image.width // factor, image.height // factor
    reduced = Image.new(work_mode, (width, height))
    rows = max(1, (1 << 20) // max(1, image.width)) // factor * factor or factor
    for top in range(0, height * factor, rows):
        strip = image.crop((0, top, width * factor, min(top + rows, height * factor)))
        if strip.mode != work_mode:
            strip = strip.convert(work_mode)
        reduced.paste(strip.reduce(factor), (0, top // factor))
    reduced.info.update(info)
    exif = image.getexif()
    if exif:
        reduced.info["exif"] = exif.tobytes()
    return reduced


def _checked_size(rgb: Image.Image, name: str) -> Image.Image:
    """Refuse images under MIN_SIDE; reduce those over MAX_SIDE (aspect kept)."""
    if min(rgb.width, rgb.height) < MIN_SIDE:
        raise ImageLoadError(
            f"{name} is {rgb.width}x{rgb.height} pixels; images need at least {MIN_SIDE} "
            f"pixels on each side"
        )
    return reduced_to_max_side(rgb)


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB: grayscale, palette, alpha, 16-bit and float.

    High bit-depth images are rescaled by their actual range rather than clipped, so a
    16-bit scan that uses only the low 12 bits is not rendered black. Transparency is
    composited onto white.
    """
    if image.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        array = np.asarray(image, dtype=np.float64)
        if not np.isfinite(array).all():
            bad = int(np.count_nonzero(~np.isfinite(array)))
            raise ImageLoadError(
                f"the image has {bad} NaN or infinite pixel value(s); "
                f"it cannot be shown or explained faithfully"
            )
        low, high = float(np.min(array)), float(np.max(array))
        scaled = np.zeros_like(array) if high <= low else (array - low) / (high - low)
        image = Image.fromarray(np.round(scaled * 255).astype(np.uint8), mode="L")
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, rgba)
    return image.convert("RGB")
