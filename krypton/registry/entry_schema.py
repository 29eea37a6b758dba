"""The schema of a registry entry (one JSON file per model, read by
:func:`krypton.registry.entries.read_entry`): typed mappings that mypy checks the
registry's readers and writers against. No ``from __future__ import annotations`` here:
the TypedDicts must see ``NotRequired`` to know which fields are optional."""

from typing import Any, Literal, NotRequired, TypedDict

__all__ = ["RegistryEntry", "WeightsSource", "VolumeSettings"]


class WeightsSource(TypedDict):
    """Where a model's weights come from: torchvision's ImageNet weights (``id``, the
    weights enum's name, for the record) or a ``file`` beside the registry file (a
    ``state_dict`` for ``architecture``, or a ``torchscript`` module)."""

    source: Literal["torchvision", "file"]
    id: NotRequired[str]
    path: NotRequired[str]
    format: NotRequired[Literal["state_dict", "torchscript"]]


class VolumeSettings(TypedDict):
    """A volume model's input: the voxel spacing it was trained at (mm), the modality
    window its input scales to [0, 1] and the occluder's value, in modality units."""

    spacing_mm: list[float]
    window_hu: list[float]
    fill_hu: float


class RegistryEntry(TypedDict):
    """One registry file as :func:`read_entry` returns it: validated, with its defaults
    filled (name, classes, input size, normalisation, default patch). The records after
    ``volume`` are written later: the out-of-distribution reference (registration),
    the demo's training and evaluation, approximate mode's tuning and the runtime
    calibration."""

    name: str
    weights: WeightsSource
    classes: list[str]
    input_size: list[int]  # [H, W], or [D, H, W] for a volume model
    mean: list[float]
    std: list[float]
    patch: int  # the default patch side
    architecture: NotRequired[str]  # a torchvision or Krypton architecture's name
    description: NotRequired[str]
    default: NotRequired[bool]  # the app's and the CLI's default model
    volume: NotRequired[VolumeSettings]
    ood: NotRequired[dict[str, Any]]
    training: NotRequired[dict[str, Any]]
    evaluation: NotRequired[dict[str, Any]]
    tuning: NotRequired[dict[str, Any]]
    calibration: NotRequired[dict[str, Any]]
