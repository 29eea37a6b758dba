"""The volume panel: one :class:`webapp.panels.subject_panel.SubjectPanel` of rank 3 made of
the volume kind's parts — its intake, its settings and estimate, its three linked views,
its result — as the image panel is made of the image kind's (webapp.panels.image.panel).
The run and everything it decides is webapp.runs, as an image's."""

from __future__ import annotations

from dash import State

from ...panel_scope import VOLUME_PANEL
from ...run_strip import values
from ...volume_layout import VOLUME_EXPORTS
from ..subject_panel import SubjectPanel
from .estimate import VolumeEstimate
from .intake import VolumeIntake
from .result import VolumeResult
from .views import SLIDERS, VolumeViews

__all__ = ["VolumePanel"]


class VolumePanel(VolumeIntake, VolumeEstimate, VolumeViews, VolumeResult, SubjectPanel):
    """The volume panel: the callbacks every panel has (the subject panel's), then its
    intake's, its estimate's, its views' and its result's own. Its request is read from
    the cube, stride, mode, class, region and crosshair."""

    scope, rank = VOLUME_PANEL, 3
    export_formats = tuple(fmt for _, fmt, _ in VOLUME_EXPORTS)

    def register_own(self, app) -> None:
        """Attach the volume kind's own callbacks to ``app``."""
        self.register_intake_callbacks(app)
        self.register_views_callbacks(app)
        self.register_settings_callbacks(app)
        self.register_result_callbacks(app)

    def run_settings(self) -> list[State]:
        return [
            *values(VOLUME_PANEL.patch, VOLUME_PANEL.stride, VOLUME_PANEL.mode, VOLUME_PANEL.label),
            State(VOLUME_PANEL.region, "data"),
            *values(*SLIDERS, VOLUME_PANEL.compare, VOLUME_PANEL.compare_layer,
                    VOLUME_PANEL.compare_steps),
        ]  # fmt: skip
