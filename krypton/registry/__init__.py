"""Models by name: registry entries and their one atomic, validated writer
(:mod:`.entries`), loading a model (:mod:`.loading`) into a :class:`.models.LoadedModel`,
registering a user's model (:mod:`.registration`), and the out-of-distribution check
(:mod:`.ood`)."""

from .entries import (
    MAX_CLASSES,
    MAX_INPUT_SIDE,
    CheckpointError,
    ModelInfo,
    RegistryError,
    available_models,
    default_model_name,
    models_dir,
    read_entry,
    remove_model,
    user_models_dir,
    validate_entry,
)
from .loading import (
    load_model,
)
from .registration import (
    register_model,
)

__all__ = [
    "ModelInfo",
    "CheckpointError",
    "RegistryError",
    "models_dir",
    "user_models_dir",
    "available_models",
    "remove_model",
    "read_entry",
    "validate_entry",
    "default_model_name",
    "MAX_INPUT_SIDE",
    "MAX_CLASSES",
    "load_model",
    "register_model",
]
