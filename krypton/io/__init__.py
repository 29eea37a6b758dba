"""Readers: images in Pillow's formats and DICOM, every decode admitted by one budget
(:mod:`krypton.io._decoding`). Pictures out are :mod:`krypton.render`'s."""

from . import images as _images
from .images import *  # noqa: F403 (re-exported: the names in its __all__)

__all__ = _images.__all__
