"""Readers: images in Pillow's formats and DICOM, every decode admitted by one budget
(:mod:`krypton.io._decoding`). Pictures out are :mod:`krypton.render`'s."""

from .images import (
    MAX_SIDE,
    MIN_SIDE,
    ImageLoadError,
    load_image,
    to_rgb,
)

__all__ = [
    "ImageLoadError",
    "MAX_SIDE",
    "MIN_SIDE",
    "load_image",
    "to_rgb",
]
