"""The image panel: one :class:`webapp.panels.subject_panel.SubjectPanel` of rank 2 made of
the image kind's parts — its intake, its settings and estimate, its result — as the
volume panel is made of the volume kind's (webapp.panels.volume.panel)."""

from __future__ import annotations

from ... import ids
from ...layout import EXPORTS
from ...panel_scope import IMAGE_PANEL
from ..subject_panel import SubjectPanel
from .estimate import ImageEstimate
from .intake import ImageIntake
from .result import ImageResult

__all__ = ["ImagePanel"]


class ImagePanel(ImageIntake, ImageEstimate, ImageResult, SubjectPanel):
    """The image panel: the callbacks every panel has (the subject panel's), then its
    intake's, its settings' and its result's own."""

    scope, rank = IMAGE_PANEL, 2
    export_formats = tuple(fmt for _, fmt, _ in EXPORTS)
    hidden_while_running = (ids.RESULT_PANEL_BODY, IMAGE_PANEL.compare_panel)
    summary_warns = False  # the top 5 beside the picture carries the warning, once

    def register_own(self, app) -> None:
        """Attach the image kind's own callbacks to ``app``."""
        self.register_intake_callbacks(app)
        self.register_settings_callbacks(app)
        self.register_result_callbacks(app)
