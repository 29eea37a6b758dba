"""Pictures and files out: heatmap overlays and colour scales (:mod:`.overlay`), and the
one writer of npy / npz / CSV files and titles (:mod:`.exports`) that the CLI, batch
runs and the app share. DICOM exports are :mod:`krypton.io.dicom`'s."""

from . import exports as _exports
from . import overlay as _overlay
from .exports import *  # noqa: F403 (re-exported: the names in its __all__)
from .overlay import *  # noqa: F403 (re-exported: the names in its __all__)

__all__ = _exports.__all__ + _overlay.__all__
