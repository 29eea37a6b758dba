"""Registering a user's model: checked checkpoint, class count and input size, an
optional out-of-distribution reference from the user's images, and one atomic entry
(:func:`~krypton.registry.entries.write_entry`)."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..engine.capture_lock import CAPTURE_LOCK
from .entries import (
    _RESERVED,
    MAX_CLASS_NAME,
    MAX_CLASSES,
    CheckpointError,
    RegistryEntry,
    RegistryError,
    _refuse_taken_name,
    _write_atomically,
    normalised_name,
    user_models_dir,
    validate_entry,
)
from .loading import _load_state_dict_model, _load_torchscript, load_model
from .models import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    LoadedModel,
)

__all__ = ["register_model"]


def register_model(
    name: str,
    weights: str | Path,
    classes: Sequence[str],
    *,
    architecture: str | None = None,
    format: str = "state_dict",
    input_size: Sequence[int] = (224, 224),
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    description: str = "",
    directory: Path | None = None,
    reference_images: str | Path | None = None,
) -> LoadedModel:
    """Add the user's own model: copy its weights into the registry and write its file.

    ``reference_images``: a folder of in-distribution images (at least 25: 80% fit the
    feature density, 20% set its threshold) for the out-of-distribution warning
    (:mod:`krypton.registry.ood`), stored beside the weights; the check also learns a boundary
    against 3,000 synthetic outlier images it draws itself (92 s for a ResNet18 at
    224 x 224 on two CPU cores).

    ``directory`` defaults to :func:`user_models_dir`; shipped models are never written.
    Names are unique regardless of case, an existing model is never overwritten, and the
    name is reserved atomically, so two registrations of one name cannot both succeed.
    The model is loaded and run once before anything is written, so a bad checkpoint is
    reported and leaves the registry unchanged. A TorchScript file runs its author's code:
    register one only if you trust it.
    """
    name = normalised_name(name)
    target = Path(directory) if directory is not None else user_models_dir()
    classes = [str(c).strip() for c in classes if str(c).strip()]
    if len(classes) > MAX_CLASSES:
        raise RegistryError(f"{len(classes)} class names given; the limit is {MAX_CLASSES}")
    long_names = [c for c in classes if len(c) > MAX_CLASS_NAME]
    if long_names:
        raise RegistryError(
            f"class names must be at most {MAX_CLASS_NAME} characters "
            f"('{long_names[0][:40]}...' is {len(long_names[0])})"
        )
    suffix = ".ts" if format == "torchscript" else ".pt"
    entry = validate_entry(
        {
            "name": name,
            "description": description or f"user model '{name}'",
            "architecture": architecture,
            "weights": {"source": "file", "path": f"{name}{suffix}", "format": format},
            "input_size": [int(v) for v in input_size],
            "mean": [float(v) for v in mean],
            "std": [float(v) for v in std],
            "classes": classes,
        },
        f"model '{name}'",
    )
    _refuse_taken_name(name, directory)
    source = Path(weights)
    if not source.is_file():
        raise CheckpointError(f"no weights file at {source}")
    if format == "torchscript":
        module = _load_torchscript(source)
    else:
        module = _load_state_dict_model(architecture, source, len(classes))
    _check_output(module.eval(), tuple(entry["input_size"]), len(classes))
    density = None
    if reference_images is not None:
        density = _reference_density(module, entry, Path(reference_images))
        entry["ood"] = {
            "path": f"{name}.ood.npz",
            "threshold": density.threshold,
            "reference": density.reference,
        }

    target.mkdir(parents=True, exist_ok=True)
    reservation = target / _RESERVED / name.lower()
    reservation.parent.mkdir(exist_ok=True)
    try:
        reservation.mkdir()  # atomic: the loser of a race for one name stops here
    except FileExistsError:
        raise RegistryError(f"a model named '{name}' is already registered") from None
    try:
        _refuse_taken_name(name, directory)  # registered before reservations existed
        weights_path = target / entry["weights"]["path"]
        entry_path = target / f"{name}.json"
        for path in (weights_path, entry_path):
            if path.exists():
                raise RegistryError(f"{path} already exists; it is left as it is")
        _write_atomically(weights_path, source.read_bytes())
        if density is not None:
            buffer = io.BytesIO()
            density.save(buffer)
            _write_atomically(target / entry["ood"]["path"], buffer.getvalue())
        _write_atomically(entry_path, (json.dumps(entry, indent=2) + "\n").encode())
    except BaseException:
        shutil.rmtree(reservation, ignore_errors=True)
        raise
    return load_model(name, directory)


REFERENCE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".dcm")


def _reference_density(module: nn.Module, entry: RegistryEntry, folder: Path):
    """Fit the out-of-distribution check on a folder of the user's in-distribution
    images: a seeded 80/20 split into reference and held-out images."""
    from PIL import Image

    from ..io.images import ImageLoadError, load_image
    from .models import LoadedModel
    from .ood import (
        MIN_HELD_OUT_IMAGES,
        MIN_REFERENCE_IMAGES,
        feature_statistics,
        fit_density,
        outlier_features,
    )

    if not folder.is_dir():
        raise RegistryError(f"reference images: {folder} is not a folder")
    paths = sorted(
        p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in REFERENCE_SUFFIXES
    )
    needed = MIN_REFERENCE_IMAGES + MIN_HELD_OUT_IMAGES
    if len(paths) < needed:
        raise RegistryError(
            f"reference images: {folder} has {len(paths)} images; the out-of-distribution "
            f"check needs at least {needed} (more is better: a few hundred)"
        )
    shaped = LoadedModel(
        entry["name"], module, entry["classes"], tuple(entry["input_size"]),
        tuple(entry["mean"]), tuple(entry["std"]),
    )  # fmt: skip
    tensors = []
    for path in paths:
        try:
            tensors.append(shaped.preprocess(load_image(path)))
        except (ImageLoadError, OSError) as exc:
            raise RegistryError(f"reference image {path.name}: {exc}") from exc
    order = np.random.default_rng(0).permutation(len(tensors))
    split = int(round(0.8 * len(tensors)))
    with CAPTURE_LOCK.shared():
        names, features = feature_statistics(module, torch.stack(tensors))
        outliers = outlier_features(
            module, shaped.input_size, lambda picture: shaped.preprocess(Image.fromarray(picture))
        )
    try:
        return fit_density(
            names,
            [f[order[:split]] for f in features],
            [f[order[split:]] for f in features],
            f"{len(paths)} reference images from the folder {folder.name}",
            outliers=outliers,
        )
    except ValueError as exc:
        raise RegistryError(f"reference images: {exc}") from exc


def _check_output(module: nn.Module, input_size: Sequence[int], classes: int) -> None:
    """One blank image through the model: the output must be (1, number of classes)."""
    height, width = input_size
    with torch.inference_mode(), CAPTURE_LOCK.shared():
        try:
            output = module(torch.zeros(1, 3, height, width))
        except Exception as exc:
            raise CheckpointError(
                f"the model fails on a {height}x{width} input: "
                f"{type(exc).__name__}: {str(exc)[:200]}"
            ) from exc
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != (1, classes):
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output)
        raise CheckpointError(
            f"the model outputs {shape} for one image but {classes} class names were given"
        )
