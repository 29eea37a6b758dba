"""The image kind of panel, one file per part, named as the volume kind's: intake (an
upload, a sample, a PACS image, a DICOM window, the region), estimate (the model's card,
prediction, controls and runtime estimate), result (the request, live picture, heatmap and
downloads), and panel (the one class they make)."""

from __future__ import annotations

from .panel import ImagePanel
from .result import RUN_MESSAGE_OUTPUT, RUN_OUTPUTS, parse_colour, waiting_progress

__all__ = ["ImagePanel", "RUN_MESSAGE_OUTPUT", "RUN_OUTPUTS", "parse_colour", "waiting_progress"]
