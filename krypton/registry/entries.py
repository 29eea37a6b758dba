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
import json
import os
import re
import shutil
import threading
import unicodedata
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, cast

import torchvision

from .architectures import ARCHITECTURES
from .entry_schema import RECORDS, RegistryEntry, VolumeSettings, WeightsSource
from .models import (
    DEFAULT_PATCH,
    IMAGENET_MEAN,
    IMAGENET_STD,
    torchvision_weights_path,
)

__all__ = [
    "RegistryEntry",
    "WeightsSource",
    "VolumeSettings",
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
    "model_for_modality",
    "MAX_INPUT_SIDE",
    "MAX_CLASSES",
]


NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # used with fullmatch
MAX_INPUT_SIDE = 1024  # pixels; larger inputs cost gigabytes per batch
MAX_VOLUME_SIDE = 256  # voxels a side for a volume model's input
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
    input_size: tuple[int, ...]  # (H, W), or (D, H, W) for a volume model
    available: bool
    reason: str | None  # why it is unavailable
    fix: str | None  # the command or step that makes it available
    default: bool
    path: Path
    user: bool = False  # registered by a user (removable), not shipped
    modalities: tuple[str, ...] = ()  # the DICOM modalities it is made for, if it says

    @property
    def is_volume(self) -> bool:
        """A 3-D model: it explains volumes (CLI and API), not 2-D images."""
        return len(self.input_size) == 3


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


def read_entry(path: Path) -> RegistryEntry:
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


def validate_entry(entry: dict[str, Any], path: str) -> RegistryEntry:
    """Check a registry entry's fields (``path`` names it in messages) and fill its
    defaults: what it returns is a :class:`RegistryEntry` (records the schema does not
    name, such as a writer's own, are kept as they are)."""
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
        if architecture not in ARCHITECTURES and architecture not in torchvision.models.list_models(
            torchvision.models
        ):
            raise RegistryError(
                f"{path}: unknown architecture '{architecture}' (torchvision's, or Krypton's: "
                f"{', '.join(ARCHITECTURES)})"
            )
    classes = entry.get("classes")
    if classes == "imagenet":
        entry["classes"] = _imagenet_classes()
    elif not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
        raise RegistryError(f"{path}: 'classes' must be a non-empty list of names or 'imagenet'")
    size = entry.get("input_size", [224, 224])
    volume = isinstance(size, list) and len(size) == 3
    low, high = (8, MAX_VOLUME_SIDE) if volume else (16, MAX_INPUT_SIDE)
    if not (
        isinstance(size, list)
        and len(size) in (2, 3)
        and all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in size)
    ):
        raise RegistryError(
            f"{path}: 'input_size' must be [height, width], each from 16 to {MAX_INPUT_SIDE} "
            f"pixels, or for a volume model [depth, height, width], each from 8 to "
            f"{MAX_VOLUME_SIDE} voxels"
        )
    entry["input_size"] = size
    channels = 1 if volume else 3
    for key, default in (("mean", IMAGENET_MEAN), ("std", IMAGENET_STD)):
        value = entry.get(key, None if volume else list(default))
        if not (
            isinstance(value, list)
            and len(value) == channels
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        ):
            raise RegistryError(f"{path}: '{key}' must be {channels} number(s)")
        entry[key] = value
    if volume:
        _validate_volume(entry, path)
    if any(s <= 0 for s in entry["std"]):
        raise RegistryError(f"{path}: 'std' values must be positive")
    patch = entry.get("patch", DEFAULT_PATCH)
    if not (isinstance(patch, int) and not isinstance(patch, bool) and 1 <= patch <= min(size)):
        raise RegistryError(
            f"{path}: 'patch' (the default patch side) must be a whole number of pixels "
            f"from 1 to {min(size)}"
        )
    entry["patch"] = patch
    modalities = entry.get("modalities", [])
    if not (isinstance(modalities, list) and all(_modality(m) for m in modalities)):
        raise RegistryError(
            f"{path}: 'modalities' must be a list of DICOM modality codes such as \"CT\""
        )
    return cast(RegistryEntry, entry)  # every field the schema requires, checked above


def _modality(code: object) -> bool:
    """A DICOM modality code (PS3.3 C.7.3.1.1.1): up to 16 capitals, digits or _."""
    if not isinstance(code, str) or not 0 < len(code) <= 16:
        return False
    return code.replace("_", "").isalnum() and code == code.upper()


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _validate_records(entry: dict[str, Any], path: str) -> None:
    """What the writer checks of the records written after registration (:data:`RECORDS`):
    objects with the fields their readers need. A tuning record without its three
    coefficients had been written and then broke every load of the model. Reading stays
    as tolerant as its readers are (a broken out-of-distribution record means no check,
    said in the card), so a file written before this check still loads."""
    for name, kind in RECORDS.items():
        if name not in entry:
            continue
        record = entry[name]
        if not isinstance(record, dict):
            raise RegistryError(f"{path}: '{name}' must be an object")
        missing = sorted(set(kind.__required_keys__) - set(record))  # type: ignore[attr-defined]
        if missing:
            raise RegistryError(f"{path}: the '{name}' record lacks {', '.join(missing)}")
    tuning = entry.get("tuning")
    if tuning is not None and not (
        isinstance(tuning["coefficients"], list)
        and len(tuning["coefficients"]) == 3
        and all(_number(c) for c in tuning["coefficients"])
    ):
        raise RegistryError(f"{path}: tuning 'coefficients' must be three numbers (a, b, c)")
    ood = entry.get("ood")
    if ood is not None and not (isinstance(ood["path"], str) and _number(ood["threshold"])):
        raise RegistryError(f"{path}: 'ood' needs a file name 'path' and a number 'threshold'")
    calibration = entry.get("calibration")
    if calibration is not None and not isinstance(calibration["models"], dict):
        raise RegistryError(f"{path}: calibration 'models' must be an object")


def _validate_volume(entry: dict[str, Any], path: str) -> None:
    """A volume model's "volume": the voxel spacing it was trained at (mm), the modality
    window its input scales to [0, 1] and the occluder's value, in modality units."""
    volume = entry.get("volume")

    def numbers(key: str, count: int) -> bool:
        value = volume.get(key) if isinstance(volume, dict) else None
        return (
            isinstance(value, list)
            and len(value) == count
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        )

    if not (
        numbers("spacing_mm", 3)
        and all(v > 0 for v in volume["spacing_mm"])
        and numbers("window_hu", 2)
        and volume["window_hu"][0] < volume["window_hu"][1]
        and isinstance(volume.get("fill_hu"), (int, float))
    ):
        raise RegistryError(
            f"{path}: a volume model needs 'volume': {{'spacing_mm': [slice, row, column] > 0, "
            f"'window_hu': [low, high], 'fill_hu': the occluder's value}}"
        )
    if "orientation" in volume:
        from ..io.model_grid import check_axis_codes

        try:
            check_axis_codes(volume["orientation"])
        except ValueError as exc:
            raise RegistryError(f"{path}: the volume's {exc}") from None


def _weights_file(entry: RegistryEntry, directory: Path) -> Path:
    path = Path(entry["weights"]["path"])
    return path if path.is_absolute() else directory / path


def _availability(entry: RegistryEntry, directory: Path) -> tuple[bool, str | None, str | None]:
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


def _entries(directory: Path | None = None) -> list[tuple[Path, RegistryEntry, bool]]:
    """(file, entry, is a user model) for every readable registry file; a name found in
    an earlier folder hides the same name (any case) in a later one."""
    entries: list[tuple[Path, RegistryEntry, bool]] = []
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
                tuple(entry.get("modalities", ())),
            )
        )
    return infos


def model_for_modality(modality: str, current: str, directory: Path | None = None) -> str | None:
    """The image model to explain a DICOM image of ``modality`` with instead of
    ``current``, or None to keep it: only a shipped model that is made for other
    modalities gives way (a demo for fundus photographs meeting a CT slice), and only to
    an available image model made for this one. A model a user registered is never
    swapped: it is theirs, whatever it declares."""
    infos = [info for info in available_models(directory) if not info.is_volume]
    chosen = next((info for info in infos if info.name == current), None)
    if chosen is None or chosen.user or not modality or modality in chosen.modalities:
        return None
    if not chosen.modalities:
        return None
    made_for = [info.name for info in infos if info.available and modality in info.modalities]
    return made_for[0] if made_for else None


def default_model_name(directory: Path | None = None) -> str | None:
    """The available image model marked default, else the first available one (volume
    models are never the default: the app and an image's explanation need a 2-D one)."""
    infos = [info for info in available_models(directory) if info.available and not info.is_volume]
    for info in infos:
        if info.default:
            return info.name
    return infos[0].name if infos else None


def find_entry(name: str, directory: Path | None = None) -> tuple[Path, RegistryEntry]:
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


def write_entry(path: Path, entry: RegistryEntry) -> None:
    """The one writer of registry files: ``entry`` (a :class:`RegistryEntry`, its
    records typed; defaults it may leave out are filled on reading) is validated, records
    included (a copy: defaults are not written back), then written to a temporary file
    beside ``path`` and moved over it, so a reader sees the old file or the new one,
    never half of one."""
    path = Path(path)
    checked = validate_entry(cast(dict[str, Any], copy.deepcopy(entry)), str(path))
    _validate_records(cast(dict[str, Any], checked), str(path))
    data = (json.dumps(entry, indent=2) + "\n").encode()
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        temporary.write_bytes(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def update_entry(path: Path, **records: Any) -> dict[str, Any]:
    """Set top-level records of the registry file at ``path`` (``tuning=`` a
    :class:`~krypton.registry.entry_schema.TuningRecord`, ``calibration=`` a
    :class:`~krypton.registry.entry_schema.CalibrationRecord`), keeping everything else;
    writers in this process take turns. Each is checked as :func:`write_entry` checks
    it. Returns the entry as written."""
    with _entry_writes:
        try:
            entry = json.loads(Path(path).read_text())
        except (FileNotFoundError, json.JSONDecodeError) as exc:
            raise RegistryError(f"cannot update {path}: {exc}") from exc
        entry.update(records)
        write_entry(path, cast(RegistryEntry, entry))  # checked there before it is written
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
