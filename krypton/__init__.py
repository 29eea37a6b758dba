"""Krypton: fast occlusion-based explanations of CNN predictions.

Incremental view maintenance over a CNN's tensors (Nakandala et al., SIGMOD 2019): each
occluded image is a small update to the materialised tensors of the original image, so only
what the patch changes is recomputed — the same heatmap, several times sooner.

    >>> heatmap = krypton.explain(model, image, patch=16, stride=4, mode="exact")

The engine has no UI dependencies; the Dash app lives in ``app.py``.
"""

from ._version import __version__
from .approximate import ApproximateSettings
from .engine import UnsupportedModelError
from .engine.analysis import LayerCost, SpeedupReport, analyze, theoretical_speedup
from .explain_settings import ExplainSettings, StopRun
from .explainer import MODES, Heatmap, OcclusionExplainer, Prediction, explain, grid
from .registry import (
    CheckpointError,
    ModelInfo,
    RegistryError,
    available_models,
    load_model,
    register_model,
)
from .registry.models import LoadedModel, WeightsUnavailableError

__all__ = [
    "__version__",
    "ApproximateSettings",
    "CheckpointError",
    "ExplainSettings",
    "LoadedModel",
    "ModelInfo",
    "RegistryError",
    "WeightsUnavailableError",
    "available_models",
    "load_model",
    "register_model",
    "MODES",
    "Heatmap",
    "LayerCost",
    "OcclusionExplainer",
    "Prediction",
    "SpeedupReport",
    "StopRun",
    "UnsupportedModelError",
    "analyze",
    "explain",
    "grid",
    "theoretical_speedup",
]
