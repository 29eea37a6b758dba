"""Kept so that ``krypton.imaging.load_image`` still works: the readers live in
:mod:`krypton.io` now."""

from .io.images import (
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
