"""Model registry: one small JSON file per model in ``krypton/shipped_models/``.

A registry file names the architecture, where the weights come from, the input size, the
normalisation and the class names, optionally the default patch side ("patch", else 16;
the app, the CLI and the benchmark of the default model start from it), plus, later,
calibration and tuning results:

    {"name": "oct-resnet18", "architecture": "resnet18",
     "weights": {"source": "file", "path": "oct-resnet18.pt", "format": "state_dict"},
     "input_size": [224, 224], "mean": [...], "std": [...],
     "classes": ["CNV", "DME", "DRUSEN", "NORMAL"]}

Weight sources: ``torchvision`` (ImageNet weights through torchvision's weights API, cached
under TORCH_HOME) and ``file`` (a state_dict for a torchvision architecture with any class
count, or a TorchScript file). ``available_models()`` says which can be loaded here and,
for those that cannot, why and what fixes it; nothing is ever silently random.
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import re
import shutil
import threading
import unicodedata
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from torch import nn

from .approximate.tuning import TauTuning
from .capture_lock import CAPTURE_LOCK
from .models import (
    DEFAULT_PATCH,
    IMAGENET_MEAN,
    IMAGENET_STD,
    LoadedModel,
    WeightsUnavailableError,
    torchvision_weights_path,
)

__all__ = [
    "ModelInfo",
    "CheckpointError",
    "RegistryError",
    "models_dir",
    "user_models_dir",
    "available_models",
    "load_model",
    "register_model",
    "remove_model",
    "read_entry",
    "validate_entry",
    "default_model_name",
    "MAX_INPUT_SIDE",
    "MAX_CLASSES",
]

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # used with fullmatch
MAX_INPUT_SIDE = 1024  # pixels; larger inputs cost gigabytes per batch
MAX_CLASSES = 10_000
MAX_CLASS_NAME = 200  # characters
_RESERVED = ".reserved"  # one folder per lower-cased name: registration is atomic


class RegistryError(ValueError):
    """A registry file is missing, malformed, or names an unknown model."""


class CheckpointError(ValueError):
    """A weights file is not a usable checkpoint for the declared architecture."""


@dataclass(frozen=True)
class ModelInfo:
    """What the registry knows about one model, and whether it can be loaded here."""

    name: str
    description: str
    architecture: str | None
    classes: tuple[str, ...]
    input_size: tuple[int, int]
    available: bool
    reason: str | None  # why it is unavailable
    fix: str | None  # the command or step that makes it available
    default: bool
    path: Path
    user: bool = False  # registered by a user (removable), not shipped


def models_dir() -> Path:
    """The shipped models: $KRYPTON_MODELS_DIR, else the package's shipped_models/
    (package data, so an installed wheel finds them from any folder; read-only for
    registration: users' models never go here)."""
    configured = os.environ.get("KRYPTON_MODELS_DIR")
    if configured:
        return Path(configured)
    return Path(str(resources.files("krypton") / "shipped_models"))


def krypton_home() -> Path:
    """Krypton's data folder: $KRYPTON_HOME, default ~/.krypton."""
    configured = os.environ.get("KRYPTON_HOME")
    return Path(configured) if configured else Path.home() / ".krypton"


def user_models_dir() -> Path:
    """Where models registered by users live: $KRYPTON_HOME/models."""
    return krypton_home() / "models"


def _search_dirs(directory: Path | None) -> list[tuple[Path, bool]]:
    """(folder, holds user models) to search: the given folder alone, else shipped then
    user models."""
    if directory is not None:
        return [(Path(directory), True)]
    return [(models_dir(), False), (user_models_dir(), True)]


def _imagenet_classes() -> list[str]:
    return list(torchvision.models.ResNet18_Weights.DEFAULT.meta["categories"])


def read_entry(path: Path) -> dict[str, Any]:
    """Parse and validate one registry file."""
    try:
        entry = json.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise RegistryError(f"no registry file {path}") from exc
    except json.JSONDecodeError as exc:
        raise RegistryError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(entry, dict):
        raise RegistryError(f"{path} must hold a JSON object")
    entry.setdefault("name", Path(path).stem)
    return validate_entry(entry, str(path))


def validate_entry(entry: dict[str, Any], path: str) -> dict[str, Any]:
    """Check a registry entry's fields (``path`` names it in messages); fills defaults."""
    weights = entry.get("weights")
    if not isinstance(weights, dict) or weights.get("source") not in ("torchvision", "file"):
        raise RegistryError(
            f"{path}: 'weights' must be an object with source 'torchvision' or 'file'"
        )
    if weights["source"] == "file":
        if not weights.get("path"):
            raise RegistryError(f"{path}: file weights need a 'path'")
        if weights.get("format", "state_dict") not in ("state_dict", "torchscript"):
            raise RegistryError(f"{path}: weights format must be 'state_dict' or 'torchscript'")
    architecture = entry.get("architecture")
    needs_architecture = (
        weights["source"] == "torchvision" or weights.get("format", "state_dict") == "state_dict"
    )
    if needs_architecture:
        if not architecture:
            raise RegistryError(
                f"{path}: 'architecture' (a torchvision model name) is "
                f"required for state_dict weights"
            )
        if architecture not in torchvision.models.list_models(torchvision.models):
            raise RegistryError(f"{path}: unknown torchvision architecture '{architecture}'")
    classes = entry.get("classes")
    if classes == "imagenet":
        entry["classes"] = _imagenet_classes()
    elif not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
        raise RegistryError(f"{path}: 'classes' must be a non-empty list of names or 'imagenet'")
    size = entry.get("input_size", [224, 224])
    if not (
        isinstance(size, list)
        and len(size) == 2
        and all(
            isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= MAX_INPUT_SIDE
            for v in size
        )
    ):
        raise RegistryError(
            f"{path}: 'input_size' must be [height, width], each from 16 to {MAX_INPUT_SIDE} pixels"
        )
    entry["input_size"] = size
    for key, default in (("mean", IMAGENET_MEAN), ("std", IMAGENET_STD)):
        value = entry.get(key, list(default))
        if not (isinstance(value, list) and len(value) == 3):
            raise RegistryError(f"{path}: '{key}' must be three numbers")
        entry[key] = value
    if any(s <= 0 for s in entry["std"]):
        raise RegistryError(f"{path}: 'std' values must be positive")
    patch = entry.get("patch", DEFAULT_PATCH)
    if not (isinstance(patch, int) and not isinstance(patch, bool) and 1 <= patch <= min(size)):
        raise RegistryError(
            f"{path}: 'patch' (the default patch side) must be a whole number of pixels "
            f"from 1 to {min(size)}"
        )
    entry["patch"] = patch
    return entry


def _weights_file(entry: dict, directory: Path) -> Path:
    path = Path(entry["weights"]["path"])
    return path if path.is_absolute() else directory / path


def _availability(entry: dict, directory: Path) -> tuple[bool, str | None, str | None]:
    weights = entry["weights"]
    if weights["source"] == "torchvision":
        cached = torchvision_weights_path(entry["architecture"])
        if os.path.exists(cached):
            return True, None, None
        return (
            False,
            f"ImageNet weights are not cached at {cached} and this machine cannot download them",
            "make models (where the network allows)",
        )
    path = _weights_file(entry, directory)
    if not path.exists():
        return False, f"weights file {path} is missing", f"put the weights at {path}"
    return True, None, None


def _entries(directory: Path | None = None) -> list[tuple[Path, dict, bool]]:
    """(file, entry, is a user model) for every readable registry file; a name found in
    an earlier folder hides the same name (any case) in a later one."""
    entries: list[tuple[Path, dict, bool]] = []
    seen: set[str] = set()
    for folder, user in _search_dirs(directory):
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.json")):
            try:
                entry = read_entry(path)
            except RegistryError:
                continue  # a broken file is reported by load_model, not by the listing
            folded = _folded(entry["name"])
            if folded in seen or not NAME_PATTERN.fullmatch(entry["name"]):
                continue  # a look-alike of a listed name, or a name no one could type
            seen.add(folded)
            entries.append((path, entry, user))
    return entries


def available_models(directory: Path | None = None) -> list[ModelInfo]:
    """Every registered model with its availability and, if unavailable, why."""
    infos = []
    for path, entry, user in _entries(directory):
        available, reason, fix = _availability(entry, path.parent)
        infos.append(
            ModelInfo(
                entry["name"],
                entry.get("description", ""),
                entry.get("architecture"),
                tuple(entry["classes"]),
                tuple(entry["input_size"]),
                available,
                reason,
                fix,
                bool(entry.get("default", False)),
                path,
                user,
            )
        )
    return infos


def default_model_name(directory: Path | None = None) -> str | None:
    """The available model marked default, else the first available one."""
    infos = [info for info in available_models(directory) if info.available]
    for info in infos:
        if info.default:
            return info.name
    return infos[0].name if infos else None


def find_entry(name: str, directory: Path | None = None) -> tuple[Path, dict]:
    """The registry file and entry of ``name`` (in ``directory``, or shipped then user
    models)."""
    for path, entry, _ in _entries(directory):
        if entry["name"] == name:
            return path, entry
    if isinstance(name, str) and NAME_PATTERN.fullmatch(name):
        for folder, _ in _search_dirs(directory):
            candidate = folder / f"{name}.json"
            if candidate.exists():  # exists but did not parse: say why
                return candidate, read_entry(candidate)
    known = ", ".join(e["name"] for _, e, _ in _entries(directory)) or "none"
    where = directory or f"{models_dir()} or {user_models_dir()}"
    raise RegistryError(f"no model named '{name}' in {where} (registered: {known})")


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
        nn.Module.register_parameter = _register_parameter_maybe_on_meta
    _meta_build.active = True
    try:
        yield
    finally:
        _meta_build.active = False
        with _meta_patch_lock:
            _meta_patch_users -= 1
            if not _meta_patch_users:
                nn.Module.register_parameter = _register_parameter


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
    try:  # parameters on the meta device: shapes without memory, a mismatch costs nothing
        with _parameters_on_meta():
            skeleton = torchvision.models.get_model(architecture, **kwargs)
    except TypeError as exc:
        raise CheckpointError(f"cannot build {architecture} with {classes} classes: {exc}") from exc
    expected = skeleton.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"{source} does not match torchvision's {architecture}: "
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
    model = torchvision.models.get_model(architecture, **kwargs)  # now for real: it fits
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    if architecture == "inception_v3" and model.aux_logits:
        model.aux_logits = False
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
    )


def _load_density(entry: dict, directory: Path):
    """The model's out-of-distribution reference (krypton.ood), if its entry names one
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
    (:mod:`krypton.ood`), stored beside the weights; the check also learns a boundary
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


def _reference_density(module: nn.Module, entry: dict, folder: Path):
    """Fit the out-of-distribution check on a folder of the user's in-distribution
    images: a seeded 80/20 split into reference and held-out images."""
    from PIL import Image

    from .imaging import ImageLoadError, load_image
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


def normalised_name(name: object) -> str:
    """A model name as the registry keeps it: NFKC-normalised and stripped, then 1-64
    letters, digits, '.', '_' or '-' starting with a letter or digit (no control
    character, no look-alike of another name); anything else is refused."""
    text = unicodedata.normalize("NFKC", name).strip() if isinstance(name, str) else ""
    if not NAME_PATTERN.fullmatch(text):
        shown = repr(name) if isinstance(name, str) else type(name).__name__
        raise RegistryError(
            f"model name {shown} must be 1-64 letters, digits, '.', '_' or "
            f"'-', starting with a letter or digit"
        )
    return text


def _folded(name: str) -> str:
    """What two names must not share: the same text regardless of case and of Unicode
    compatibility forms."""
    return unicodedata.normalize("NFKC", str(name)).strip().casefold()


def _same_name(first: str, second: str) -> bool:
    return _folded(first) == _folded(second)


def _refuse_taken_name(name: str, directory: Path | None) -> None:
    for path, entry, _ in _entries(directory):
        if _same_name(entry["name"], name) or _same_name(path.stem, name):
            raise RegistryError(
                f"a model named '{entry['name']}' is already registered "
                f"({path}); names are unique regardless of case"
            )


_entry_writes = threading.Lock()


def write_entry(path: Path, entry: dict[str, Any]) -> None:
    """The one writer of registry files: ``entry`` is validated (a copy: defaults are not
    written back), then written to a temporary file beside ``path`` and moved over it,
    so a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    validate_entry(copy.deepcopy(entry), str(path))
    data = (json.dumps(entry, indent=2) + "\n").encode()
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def update_entry(path: Path, **records: Any) -> dict[str, Any]:
    """Set top-level records of the registry file at ``path`` (``tuning=``,
    ``calibration=``), keeping everything else; writers in this process take turns.
    Returns the entry as written."""
    with _entry_writes:
        try:
            entry = json.loads(Path(path).read_text())
        except (FileNotFoundError, json.JSONDecodeError) as exc:
            raise RegistryError(f"cannot update {path}: {exc}") from exc
        entry.update(records)
        write_entry(path, entry)
        return entry


def _write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary name beside ``path``, then link it there (never replaces)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    try:
        os.link(temporary, path)  # fails if ``path`` appeared meanwhile
    finally:
        temporary.unlink()


def remove_model(name: str, directory: Path | None = None) -> Path:
    """Delete a user-registered model (its registry file, weights and reservation).

    Shipped models cannot be removed this way. Returns the removed registry file.
    """
    path, entry = find_entry(name, directory)
    user_folders = [Path(directory)] if directory is not None else [user_models_dir()]
    if path.parent.resolve() not in [f.resolve() for f in user_folders]:
        raise RegistryError(
            f"'{name}' is a shipped model ({path}); only models users registered can be removed"
        )
    weights = entry.get("weights", {})
    if weights.get("source") == "file":
        weights_path = _weights_file(entry, path.parent)
        if weights_path.parent.resolve() == path.parent.resolve():
            weights_path.unlink(missing_ok=True)
    path.unlink()
    shutil.rmtree(path.parent / _RESERVED / entry["name"].lower(), ignore_errors=True)
    return path


def _check_output(module: nn.Module, input_size: tuple[int, int], classes: int) -> None:
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
