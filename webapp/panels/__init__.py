"""The page's callbacks. subject_panel holds what every panel does with a run, once for
both: the Run strip, the kept result shown beside what it explains (its summary and
downloads offered), another class, the downloads. Its two kinds: run (the image panel's
request, live picture, heatmap, Compare view and files) and volume (a CT or MR volume:
its request, three linked views and files; volume_intake reads it, volume_result keeps
its result). Beside them: image (loading, DICOM window, region), settings (prediction,
controls, estimate), compare (the Compare settings and estimate, both panels), models
(adding your own) and pacs (the PACS search, and Send for both panels). Each panel is
a class handed the server's Services; its callbacks are its methods (testable without a
browser), attached by ``register``. No tensor algebra and no run orchestration here:
those are krypton and webapp.runs."""

from __future__ import annotations

from ..services import Services
from .compare import ComparePanel
from .image import ImagePanel
from .models import ModelsPanel, model_options
from .pacs import PacsPanel
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
        ModelsPanel(services),
        VolumePanel(services, manager),
        ComparePanel(services),
        PacsPanel(services),
    ):
        panel.register(app)
