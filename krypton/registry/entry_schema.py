"""The schema of a registry entry (one JSON file per model, read by
:func:`krypton.registry.entries.read_entry`): typed mappings that mypy checks the
registry's readers and writers against. No ``from __future__ import annotations`` here:
the TypedDicts must see ``NotRequired`` to know which fields are optional."""

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "CalibrationRecord",
    "CostFit",
    "EvaluationRecord",
    "GradientStep",
    "OodRecord",
    "RECORDS",
    "RegistryEntry",
    "TauChoiceRecord",
    "TrainingRecord",
    "TuningHeldOut",
    "TuningRecord",
    "VolumeSettings",
    "WeightsSource",
]


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
    # axis codes of the input's (D, H, W) axes as nibabel writes them ("SPL": slices
    # toward the head, rows toward the back, columns toward the patient's left); volumes
    # are turned to them (krypton.io.model_grid); absent: volumes reach it as stored
    orientation: NotRequired[str]


class OodRecord(TypedDict):
    """The out-of-distribution reference (written by registration): its file beside the
    entry, the density below which an input is flagged, and what the reference was."""

    path: str
    threshold: float
    reference: NotRequired[str]


class TauChoiceRecord(TypedDict):
    """The τ approximate mode uses by default and what it kept on the tuning images."""

    tau: float
    target_ssim: NotRequired[float]
    curve_tau: NotRequired[float]  # τ from the SSIM curve alone
    quality_floor: NotRequired[float]  # the lowest τ that kept SSIM and localisation
    minimum_kept: NotRequired[float | None]
    lowest_overlap: NotRequired[float | None]


class TuningHeldOut(TypedDict):
    """The chosen τ measured on images the tuning did not see."""

    images: int
    target_ssim: float
    tau: float
    fraction_at_or_above: float
    worst_shortfall: float
    mean_ssim: float
    minimum_kept: float
    lowest_overlap: float


class TuningRecord(TypedDict):
    """Approximate mode's tuning (``krypton tune``, :func:`krypton.tune.tune_tau`): the
    fitted SSIM(τ) = aτ² + bτ + c (§5) and the sampled curve behind it."""

    coefficients: list[float]  # [a, b, c]
    chosen: NotRequired[TauChoiceRecord]
    taus: NotRequired[list[float]]
    patch: NotRequired[int]
    stride: NotRequired[int]
    sample_images: NotRequired[int]
    mean_ssim_by_tau: NotRequired[dict[str, float]]
    localisation_by_tau: NotRequired[dict[str, dict[str, float]]]
    tau_for_target: NotRequired[dict[str, float]]
    frozen_gates: NotRequired[int]
    date: NotRequired[str]
    machine: NotRequired[str]
    held_out: NotRequired[TuningHeldOut]
    seconds: NotRequired[float]
    sample: NotRequired[str]  # what the tuning images were


class CostFit(TypedDict):
    """One patch size's and mode's runtime model (thesis §7.1.3): seconds as a linear
    function of the run's counted positions, with its held-out error."""

    coefficients: list[float]
    intercept: float
    fit_runs: NotRequired[int]
    held_out_runs: NotRequired[int]
    held_out_median_abs_error_percent: NotRequired[float | None]
    date: NotRequired[str]


class GradientStep(TypedDict):
    """Seconds of one class's Grad-CAM and Integrated Gradients step, as timed here."""

    seconds_per_class: list[float]
    date: NotRequired[str]
    threads: NotRequired[int]


class CalibrationRecord(TypedDict):
    """The runtime estimator's calibration (``krypton calibrate``): cost fits per patch
    size (its side as a string) and mode, and the gradient step's time."""

    models: dict[str, dict[str, CostFit]]
    date: NotRequired[str]
    machine: NotRequired[str]
    image_size: NotRequired[list[int]]
    tau: NotRequired[float]
    r_drill_down: NotRequired[float]
    target_speedup: NotRequired[float]
    held_out_median_abs_error_percent: NotRequired[float | None]
    held_out_runs: NotRequired[int]
    held_out_patches: NotRequired[list[int]]
    gradient_step: NotRequired[GradientStep]
    weights: NotRequired[str]  # the weights' checksum the fits were timed with


class TrainingRecord(TypedDict, total=False):
    """How a demo model was trained, for its card: a 2-D demo's stages as a list, a 3-D
    demo's by name (``first`` …), each the stage's own settings and seconds."""

    architecture: str
    stages: list[dict[str, Any]]
    images: int
    train_seconds: float
    machine: str
    first: dict[str, Any]
    second: dict[str, Any]
    third: dict[str, Any]
    fourth: dict[str, Any]
    fifth: dict[str, Any]
    sixth: dict[str, Any]
    seventh: dict[str, Any]
    eighth: dict[str, Any]


class EvaluationRecord(TypedDict, total=False):
    """A demo model's measured card: each test set's numbers by its name."""

    held_out: dict[str, Any]
    held_out_varied: dict[str, Any]
    held_out_varied_nodules: dict[str, Any]
    independent: dict[str, Any]
    pointing: dict[str, Any]
    pointing_independent: dict[str, Any]
    pointing_game_strict: dict[str, Any]
    multi_lesion_coverage: dict[str, Any]
    real_samples: dict[str, Any]
    ood: dict[str, Any]
    evaluated: str
    machine: str
    seconds: dict[str, Any]


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
    # the DICOM modalities it is made for (CT, MR, OP...): a shipped model that lacks a
    # file's modality gives way to one that has it (krypton.registry.model_for_modality)
    modalities: NotRequired[list[str]]
    volume: NotRequired[VolumeSettings]
    ood: NotRequired[OodRecord]
    training: NotRequired[TrainingRecord]
    evaluation: NotRequired[EvaluationRecord]
    tuning: NotRequired[TuningRecord]
    calibration: NotRequired[CalibrationRecord]


# the records written after registration, each checked by the writer against its type
RECORDS: dict[str, type] = {
    "ood": OodRecord,
    "training": TrainingRecord,
    "evaluation": EvaluationRecord,
    "tuning": TuningRecord,
    "calibration": CalibrationRecord,
}
