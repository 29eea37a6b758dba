"""Loading a registered model: its checkpoint (a state_dict for a torchvision
architecture, built on the meta device first, or TorchScript), its tuning and its
out-of-distribution reference, as a :class:`~krypton.registry.models.LoadedModel`."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from ..approximate.tuning import TauTuning
from .architectures import ARCHITECTURES
from .entries import CheckpointError, RegistryEntry, _availability, _weights_file, find_entry
from .models import (
    LoadedModel,
    WeightsUnavailableError,
)

__all__ = ["load_model"]


def _unwrap_state_dict(checkpoint: Any, source: str) -> dict[str, torch.Tensor]:
    if isinstance(checkpoint, nn.Module):
        checkpoint = checkpoint.state_dict()
    if isinstance(checkpoint, dict):
        for key in ("state_dict", "model_state_dict", "model"):
            if isinstance(checkpoint.get(key), dict):
                checkpoint = checkpoint[key]
                break
    if (
        not isinstance(checkpoint, dict)
        or not checkpoint
        or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in checkpoint.items()
        )
    ):
        raise CheckpointError(
            f"{source} is not a state_dict (a mapping of parameter names to tensors)"
        )
    if all(k.startswith("module.") for k in checkpoint):  # saved from DataParallel
        checkpoint = {k[len("module.") :]: v for k, v in checkpoint.items()}
    return checkpoint


_meta_build = threading.local()
_meta_patch_lock = threading.Lock()
_meta_patch_users = 0
_register_parameter = nn.Module.register_parameter


def _register_parameter_maybe_on_meta(module: nn.Module, name: str, param) -> None:
    _register_parameter(module, name, param)
    if param is not None and getattr(_meta_build, "active", False):
        module._parameters[name] = nn.Parameter(param.to("meta"), param.requires_grad)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules this thread builds inside the block keep their parameters on the meta
    device: each is moved there as it is registered (before its initialisation runs), so
    a network of any size costs its buffers only. ``torch.device("meta")`` cannot do
    this: some builders (RegNet's) compute their widths with tensors. Other threads
    build as usual meanwhile."""
    global _meta_patch_users
    with _meta_patch_lock:
        _meta_patch_users += 1
        # a patch of torch's own method while this thread builds (restored below)
        nn.Module.register_parameter = _register_parameter_maybe_on_meta  # type: ignore[method-assign, assignment]
    _meta_build.active = True
    try:
        yield
    finally:
        _meta_build.active = False
        with _meta_patch_lock:
            _meta_patch_users -= 1
            if not _meta_patch_users:
                nn.Module.register_parameter = _register_parameter  # type: ignore[method-assign]


def _maker(architecture: str) -> str:
    return "Krypton" if architecture in ARCHITECTURES else "torchvision"


def _load_state_dict_model(architecture: str, path: Path, classes: int) -> nn.Module:
    source = path.name
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # pickled objects other than tensors
        raise CheckpointError(
            f"{source} holds Python objects, not only tensors (a whole pickled model, or "
            f"an optimizer or custom class), and Krypton never runs pickled code; save "
            f"model.state_dict() with torch.save and upload that"
        ) from exc
    except Exception as exc:  # zip errors, truncated files, text...
        raise CheckpointError(
            f"{source} is not a PyTorch checkpoint torch.load can read ({type(exc).__name__})"
        ) from exc
    state = _unwrap_state_dict(checkpoint, source)
    kwargs: dict[str, Any] = {"weights": None, "num_classes": classes}
    if architecture == "inception_v3":
        kwargs.update(aux_logits=any(k.startswith("AuxLogits.") for k in state), init_weights=False)
    if architecture in ARCHITECTURES:  # Krypton's own (registry/architectures.py)
        kwargs = {"num_classes": classes}

    def build() -> nn.Module:
        if architecture in ARCHITECTURES:
            return ARCHITECTURES[architecture](**kwargs)
        return torchvision.models.get_model(architecture, **kwargs)

    try:  # parameters on the meta device: shapes without memory, a mismatch costs nothing
        with _parameters_on_meta():
            skeleton = build()
    except TypeError as exc:
        raise CheckpointError(f"cannot build {architecture} with {classes} classes: {exc}") from exc
    expected = skeleton.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match {_maker(architecture)}'s {architecture}: "
            + (f"missing {len(missing)} keys (e.g. {', '.join(missing[:3])})" if missing else "")
            + ("; " if missing and unexpected else "")
            + (
                f"unexpected {len(unexpected)} keys (e.g. {', '.join(unexpected[:3])})"
                if unexpected
                else ""
            )
        )
    mismatched = [
        (k, tuple(state[k].shape), tuple(v.shape))
        for k, v in expected.items()
        if tuple(state[k].shape) != tuple(v.shape)
    ]
    if mismatched:
        key, got, want = mismatched[0]
        hint = (
            " (does the class list match the checkpoint's output layer?)"
            if key.endswith(
                (
                    "fc.weight",
                    "fc.bias",
                    "classifier.6.weight",
                    "classifier.weight",
                    "classifier.1.weight",
                )
            )
            else ""
        )
        raise CheckpointError(
            f"{source}: {key} has shape {got} in the checkpoint but "
            f"{want} in {architecture} with {classes} classes{hint}"
        )
    model = build()  # now for real: it fits
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    if architecture == "inception_v3" and model.aux_logits:
        model.aux_logits = False  # type: ignore[assignment]  # Inception3's flag, a bool
        model.AuxLogits = None
    return model


def _load_torchscript(path: Path) -> nn.Module:
    try:
        return torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:
        raise CheckpointError(
            f"{path.name} is not a TorchScript file ({type(exc).__name__}: {str(exc)[:200]})"
        ) from exc


def load_model(name: str, directory: Path | None = None) -> LoadedModel:
    """Load a registered model: eval module, classes, input size and preprocessing."""
    path, entry = find_entry(name, directory)
    directory = path.parent
    available, reason, fix = _availability(entry, directory)
    if not available:
        raise WeightsUnavailableError(f"model '{name}' is unavailable: {reason}; fix: {fix}")
    weights = entry["weights"]
    classes = entry["classes"]
    if weights["source"] == "torchvision":
        from .models import load_torchvision_model

        loaded = load_torchvision_model(entry["architecture"])
        module = loaded.module
    elif weights.get("format", "state_dict") == "torchscript":
        module = _load_torchscript(_weights_file(entry, directory))
    else:
        module = _load_state_dict_model(
            entry["architecture"], _weights_file(entry, directory), len(classes)
        )
    module.eval()
    return LoadedModel(
        name=entry["name"],
        module=module,
        classes=list(classes),
        input_size=tuple(entry["input_size"]),
        mean=tuple(entry["mean"]),
        std=tuple(entry["std"]),
        description=entry.get("description", ""),
        extra={"registry_file": str(path), "entry": entry},
        tuning=TauTuning.from_record(entry.get("tuning")),
        ood=_load_density(entry, directory),
        patch=entry["patch"],
        volume=entry.get("volume"),
    )


def _load_density(entry: RegistryEntry, directory: Path):
    """The model's out-of-distribution reference (krypton.registry.ood), if its entry names one
    inside its folder; a missing or unreadable file means no check, said in the card."""
    from .ood import FeatureDensity

    record = entry.get("ood")
    if not isinstance(record, dict) or not isinstance(record.get("path"), str):
        return None
    path = (directory / record["path"]).resolve()
    if path.parent != directory.resolve() or not path.is_file():
        return None
    try:
        return FeatureDensity.load(path)
    except (OSError, ValueError, KeyError):
        return None
