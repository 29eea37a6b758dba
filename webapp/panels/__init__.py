"""The page's callbacks. A kind of panel is one folder with the same file names: image/
and volume/ each hold intake (how the subject arrives), estimate (the settings and the
runtime line), result (the request and the kept result) and panel (the one class of
those parts; volume/ adds views, its three linked views). subject_panel holds what every
panel does with a run, once for both kinds: the Run strip (run_strip), the kept result
shown beside what it explains (its summary and downloads offered), another class, the
downloads. Beside them: compare (the Compare settings and estimate, both panels), models
(adding your own) and pacs (the PACS search, and Send for both panels). Each panel is a
class handed the server's Services; its callbacks are its methods (testable without a
browser), attached by ``register``. No tensor algebra and no run orchestration here:
those are krypton and webapp.runs."""

from __future__ import annotations

from ..services import Services
from .compare import ComparePanel
from .image import RUN_MESSAGE_OUTPUT, RUN_OUTPUTS, ImagePanel, waiting_progress
from .models import ModelsPanel, model_options
from .pacs import PacsPanel
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
        ImagePanel(services, manager),
        ModelsPanel(services),
        VolumePanel(services, manager),
        ComparePanel(services),
        PacsPanel(services),
    ):
        panel.register(app)
