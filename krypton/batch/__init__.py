"""Many images at once: folder and CSV runs that resume (:mod:`.folder`); the same runs
through Celery workers are :mod:`krypton.batch.broker` (needs the ``team`` extra)."""

from . import folder as _folder
from .folder import *  # noqa: F403 (re-exported: the names in its __all__)

__all__ = _folder.__all__
