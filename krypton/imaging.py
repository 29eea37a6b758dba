"""Kept so that ``krypton.imaging.load_image`` still works: the readers live in
:mod:`krypton.io` now."""

from .io import images as _images
from .io.images import *  # noqa: F403 (re-exported: the names in its __all__)

__all__ = _images.__all__
