"""The page's callbacks, one module per panel: image (loading, DICOM window, region),
settings (prediction, controls, estimate), run (Run/Cancel, progress, live picture),
result (heatmap, summary, downloads), kept_result (another class, once for both
panels), compare (three methods side by side), models (adding your own), volume (a CT
or MR volume in three linked views, its run and exports) and pacs (the PACS search,
and Send for both panels). Each panel is a class handed the server's Services; its
callbacks are its methods (testable without a browser), attached by ``register``. No
tensor algebra and no run orchestration here: those are krypton and webapp.runs."""

from __future__ import annotations

from ..services import Services
from .compare import ComparePanel
from .image import ImagePanel
from .kept_result import KeptResultPanel
from .models import ModelsPanel, model_options
from .pacs import PacsPanel
from .result import ResultPanel
from .run import RUN_MESSAGE_OUTPUT, RUN_OUTPUTS, RunPanel, waiting_progress
from .settings import SettingsPanel
from .volume import VolumePanel, default_volume_model, volume_model_options

__all__ = [
    "RUN_MESSAGE_OUTPUT",
    "RUN_OUTPUTS",
    "default_volume_model",
    "model_options",
    "volume_model_options",
    "register_callbacks",
    "waiting_progress",
]


def register_callbacks(app, manager, services: Services) -> None:
    """Attach every panel's callbacks to ``app``; runs are background jobs on ``manager``."""
    for panel in (
        ImagePanel(services),
        SettingsPanel(services),
        RunPanel(services, manager),
        ResultPanel(services),
        KeptResultPanel(services),
        ModelsPanel(services),
        VolumePanel(services, manager),
        ComparePanel(services),
        PacsPanel(services),
    ):
        panel.register(app)
