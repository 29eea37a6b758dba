"""The volume kind of panel, one file per part, named as the image kind's: intake (an
upload, a sample or a PACS series), estimate (the models offered and the runtime
estimate), views (three linked views through a crosshair, the region, the live picture),
result (the request, the kept result, Compare rows and files), and panel (the one class
they make)."""

from __future__ import annotations

from .estimate import default_volume_model, volume_model_options
from .panel import VolumePanel

__all__ = ["VolumePanel", "default_volume_model", "volume_model_options"]
