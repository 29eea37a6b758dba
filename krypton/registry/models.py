"""Loading models with their input size, normalisation and class names.

ImageNet models come through torchvision's weights API (cached under TORCH_HOME). Where
the weights are not cached and cannot be downloaded, loading fails with the reason — unless
random weights are asked for explicitly (benchmarks), and then the result says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torchvision
from PIL import Image
from torch import nn

from ..approximate.tuning import TauTuning

if TYPE_CHECKING:
    from .entry_schema import VolumeSettings
    from .ood import FeatureDensity, OodResult

__all__ = [
    "LoadedModel",
    "WeightsUnavailableError",
    "load_torchvision_model",
    "torchvision_weights_path",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "TORCHVISION_MODELS",
    "DEFAULT_PATCH",
    "DEFAULT_STRIDE",
    "DEFAULT_VOLUME_STRIDE",
    "CALIBRATION_PATCHES",
    "preprocess_picture",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# The occluding patch's side in pixels where neither the user nor the model's registry
# entry ("patch") says otherwise: the paper's setting for 224-px inputs.
DEFAULT_PATCH = 16
# The stride where the user does not give one, the same in the app and the CLI: 4 pixels
# for an image; 5 voxels for a volume (729 positions over a 48-voxel block at cube 8,
# where 4 would be 1,331).
DEFAULT_STRIDE = 4
DEFAULT_VOLUME_STRIDE = 5
# The patch sides `krypton calibrate` times by default and the app offers (kept here, not
# in estimator.py, so the CLI can name them without importing scikit-learn at start-up).
CALIBRATION_PATCHES = (4, 8, 12, 16, 32)
TORCHVISION_MODELS = (
    "resnet18",
    "vgg16",
    "inception_v3",
    "densenet121",
    "mobilenet_v2",
    "efficientnet_b0",
)


class WeightsUnavailableError(RuntimeError):
    """Trained weights for a model cannot be had on this machine."""


def preprocess_picture(
    image: Image.Image, input_size: Sequence[int], mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """A picture as an image model takes it: RGB, resized bilinearly to ``input_size``
    (height, width), scaled to [0, 1] and normalised per channel: (3, H, W). One rule for
    a registered model's inputs and a demo's training inputs alike."""
    height, width = input_size
    resized = image.convert("RGB").resize((width, height), Image.Resampling.BILINEAR)
    array = np.asarray(resized, dtype=np.float32) / 255.0
    tensor = torch.from_numpy(array).permute(2, 0, 1)
    mean_ = torch.tensor(list(mean), dtype=torch.float32).view(-1, 1, 1)
    std_ = torch.tensor(list(std), dtype=torch.float32).view(-1, 1, 1)
    return (tensor - mean_) / std_


@dataclass
class LoadedModel:
    """A model ready to explain: eval module, classes, input size and preprocessing."""

    name: str
    module: nn.Module
    classes: list[str]
    input_size: tuple[int, ...]  # (height, width), or (depth, height, width) for volumes
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    random_weights: bool = False
    description: str = ""
    extra: dict = field(default_factory=dict)
    tuning: TauTuning | None = None  # approximate mode's tuned τ (registry models only)
    ood: FeatureDensity | None = None  # in-distribution features (registry models only)
    patch: int = DEFAULT_PATCH  # the patch side its heatmaps are made with by default
    # a volume model's registry "volume": spacing_mm, window_hu, fill_hu (None for 2-D)
    volume: VolumeSettings | None = None

    @property
    def is_volume(self) -> bool:
        """A 3-D model: it takes (1, D, H, W) volumes (:meth:`prepare_volume`)."""
        return len(self.input_size) == 3

    @property
    def preprocessing(self) -> tuple:
        """What turns a file into this model's input: its size and normalisation and, for
        a volume model, its spacing, window and fill. Two registry entries sharing one
        checkpoint but not this see different inputs (their cells differ)."""
        settings = self.volume.items() if self.volume else ()
        volume = tuple(sorted((key, repr(value)) for key, value in settings))
        return (tuple(self.input_size), tuple(self.mean), tuple(self.std), volume)

    @property
    def default_stride(self) -> int:
        """The stride its heatmaps are made with where none is given (app and CLI)."""
        return DEFAULT_VOLUME_STRIDE if self.is_volume else DEFAULT_STRIDE

    def prepare_volume(self, volume):
        """A :class:`~krypton.io.volumes.Volume` as this volume model takes it: resampled
        to its voxel spacing, windowed, its centred input block, normalised
        (:func:`~krypton.io.volumes.prepare_for_model`)."""
        from ..io.volumes import prepare_for_model

        if not self.is_volume or self.volume is None:
            raise ValueError(f"{self.name} is a 2-D model; it explains images, not volumes")
        return prepare_for_model(
            volume,
            tuple(self.volume["spacing_mm"]),  # type: ignore[arg-type]
            tuple(self.volume["window_hu"]),  # type: ignore[arg-type]
            self.input_size,  # type: ignore[arg-type]
            self.mean[0],
            self.std[0],
            self.volume.get("orientation"),
        )

    def volume_target(self):
        """What this volume model takes (:class:`~krypton.io.series_intake.ModelTarget`):
        its spacing, window, input size, normalisation and orientation."""
        from ..io.series_intake import ModelTarget

        if not self.is_volume or self.volume is None:
            raise ValueError(f"{self.name} is a 2-D model; it explains images, not volumes")
        return ModelTarget(
            tuple(self.volume["spacing_mm"]),  # type: ignore[arg-type]
            tuple(self.volume["window_hu"]),  # type: ignore[arg-type]
            tuple(self.input_size),  # type: ignore[arg-type]
            self.mean[0],
            self.std[0],
            self.volume.get("orientation"),
        )

    def read_volume(self, source, progress=None):
        """The volume at ``source`` (a series folder or zip, a multi-frame DICOM or a
        NIfTI file) as this model takes it, a series streamed slice by slice into its
        block: (:class:`~krypton.io.volumes.ModelVolume`, what was read)
        (:func:`~krypton.io.series_intake.read_for_model`)."""
        from ..io.series_intake import read_for_model

        return read_for_model(source, self.volume_target(), progress)

    def windowed(self, model_input) -> np.ndarray:
        """A prepared volume (:meth:`prepare_volume`) back in its window's units, [0, 1]
        between the window's ends (D, H, W): what the views and captures draw."""
        tensor = model_input.tensor[0].detach().cpu().numpy()
        return tensor * float(self.std[0]) + float(self.mean[0])

    def to(self, device: torch.device | str) -> LoadedModel:
        """Move the module to ``device`` (see :func:`krypton.devices.resolve_device`)."""
        self.module.to(device)
        return self

    def check_ood(self, image: torch.Tensor) -> OodResult | None:
        """Whether a preprocessed image (3, H, W) looks like this model's training images
        (:mod:`krypton.registry.ood`); None when the model has no reference set."""
        if self.ood is None:
            return None
        from ..engine.capture_lock import CAPTURE_LOCK
        from .ood import check

        # exclusive: the check hooks the module's layers, and a forward of the same module
        # in another thread (a run in progress) must neither trip nor feed those hooks
        device = next(self.module.parameters(), image).device
        with CAPTURE_LOCK.exclusive():
            return check(self.ood, self.module, image.to(device), self.name)

    def prepare(self, source) -> torch.Tensor:
        """This model's input from a picture or a volume, whichever its rank takes: a
        PIL image for an image model (:meth:`preprocess`: (3, H, W)), a
        :class:`~krypton.io.volumes.Volume` for a volume model (:meth:`prepare_volume`'s
        tensor, (1, D, H, W); that method also says where the block sits in the volume).
        The other kind is refused with what this model takes."""
        from ..io.volumes import Volume

        if isinstance(source, Image.Image):
            if self.is_volume:
                raise ValueError(f"{self.name} is a 3-D model; it explains volumes, not images")
            return self.preprocess(source)
        if isinstance(source, Volume):
            return self.prepare_volume(source).tensor
        raise TypeError(
            f"prepare takes a PIL image or a krypton.io.volumes.Volume, got {type(source).__name__}"
        )

    def preprocess(self, image: Image.Image) -> torch.Tensor:
        """Resize to the input size and normalise: (3, H, W) float tensor
        (:func:`preprocess_picture` with this model's size and normalisation)."""
        return preprocess_picture(image, self.input_size, self.mean, self.std)

    def gray_fill(self) -> tuple[float, ...]:
        """Occluding value of mid-gray (0.5) in this model's input space; for a volume
        model, its registry's "fill_hu" (CT demo: lung parenchyma) there."""
        if self.volume is not None:
            low, high = self.volume["window_hu"]
            unit = min(max((self.volume["fill_hu"] - low) / (high - low), 0.0), 1.0)
            return ((unit - self.mean[0]) / self.std[0],)
        return tuple((0.5 - m) / s for m, s in zip(self.mean, self.std))

    def class_name(self, index: int) -> str:
        return self.classes[index] if 0 <= index < len(self.classes) else str(index)


def torchvision_weights_path(name: str) -> str:
    """Where torchvision keeps the DEFAULT weights of ``name`` (under TORCH_HOME)."""
    weights = torchvision.models.get_model_weights(name).DEFAULT
    return os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))


def load_torchvision_model(
    name: str,
    random_weights: bool = False,
    download: bool = False,
    progress: Callable | None = None,
) -> LoadedModel:
    """An ImageNet model from torchvision with its trained weights.

    Args:
        name: torchvision model name, e.g. "resnet18".
        random_weights: build the architecture with random weights instead (benchmarks);
            the returned model has ``random_weights=True``.
        download: allow torchvision to download weights that are not cached.
    """
    try:
        weights_enum = torchvision.models.get_model_weights(name)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"unknown torchvision model '{name}'") from exc
    weights = weights_enum.DEFAULT
    classes = list(weights.meta.get("categories", []))
    size = 299 if name.startswith("inception") else 224
    # torchvision's own init: under PyTorch's default one Inception3's activations vanish
    extra_kwargs = {"aux_logits": False, "init_weights": True} if name == "inception_v3" else {}
    if random_weights:
        torch.manual_seed(0)
        module = torchvision.models.get_model(name, weights=None, **extra_kwargs)
        return LoadedModel(
            name,
            module.eval(),
            classes,
            (size, size),
            random_weights=True,
            description=f"{name} architecture with RANDOM weights (untrained)",
        )
    path = torchvision_weights_path(name)
    if not os.path.exists(path) and not download:
        raise WeightsUnavailableError(
            f"ImageNet weights for {name} are not cached at {path} and this machine cannot "
            f"download them; run `make models` where the network allows, or copy the file "
            f"there"
        )
    try:
        module = torchvision.models.get_model(
            name,
            weights=weights,
            **({"aux_logits": True, "init_weights": False} if name == "inception_v3" else {}),
        )
    except Exception as exc:  # network errors surface as many exception types
        raise WeightsUnavailableError(f"could not load ImageNet weights for {name}: {exc}") from exc
    if name == "inception_v3":
        module.aux_logits = False
        module.AuxLogits = None
    return LoadedModel(
        name,
        module.eval(),
        classes,
        (size, size),
        description=f"{name} trained on ImageNet ({weights})",
    )
