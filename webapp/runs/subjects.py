"""What a run explains — an image or a volume — and only what differs between them: which
model and store it reads, its tensor and fill, the panel's region form and words, the
key its cells are kept under, and the fields only its results carry. Everything else
(:func:`webapp.runs.execute`) is one body for both: rank is a number."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

import krypton
from krypton.io.images import plain_reason

from .. import helpers
from ..gradient_store import KeptAttributions
from ..helpers import InputError
from ..image_store import ImageStore
from ..result_schema import ImageFields, VolumeFields
from .cells import CellCache
from .regions import Bounds, whole
from .request import RunRequest

__all__ = ["Services", "Subject", "ImageSubject", "VolumeSubject", "subject_for", "results_key"]


def normalised_fill(rgb: tuple[float, float, float], mean, std) -> tuple[float, ...]:
    """An RGB colour in [0, 1] expressed in the model's normalised input space."""
    return tuple((c - m) / s for c, m, s in zip(rgb, mean, std))


class Services(Protocol):  # what webapp.services.Services provides
    images: ImageStore
    results: helpers.ResultStore
    cells: CellCache  # or team mode's RedisCellCache, which has its interface
    gradients: KeptAttributions  # Compare's gradient maps, per process

    def model(self, name: str, rank: int | None = 2) -> krypton.LoadedModel: ...
    def explainer(self, name: str, rank: int | None = 2) -> krypton.OcclusionExplainer: ...
    def weights_checksum(self, name: str) -> str: ...
    def prepared_volume(self, key: str, session: str, model: str, name: str | None = None): ...


def results_key(session: str, rank: int) -> str:
    """Where a tab's last result of this rank is kept: an image's and a volume's apart."""
    return session if rank == 2 else f"{session}/volume"


class Subject(Protocol):
    """What :func:`webapp.runs.execute` needs of the input it explains."""

    request: RunRequest
    loaded: krypton.LoadedModel
    size: tuple[int, ...]  # the model input's spatial size, tensor order
    dicom: dict | None  # its DICOM source (the result record's ``dicom``), None if not DICOM

    def bounds(self) -> Bounds: ...
    def flat(self, bounds: Bounds) -> tuple[int, ...]: ...
    def tensor(self) -> torch.Tensor: ...
    def predict(self, tensor: torch.Tensor) -> krypton.Prediction: ...
    def fill(self): ...
    def snapped_note(self, before: Bounds, after: Bounds) -> str: ...
    def offset_note(self, offset: tuple[int, ...]) -> str: ...
    def record(self) -> ImageFields | VolumeFields: ...


def subject_for(services: Services, session: str, request: RunRequest) -> Subject:
    """The image or volume ``request`` explains, by its rank."""
    if request.rank == 2:
        return ImageSubject(services, request)
    if request.rank == 3:
        return VolumeSubject(services, session, request)
    raise InputError(f"a run explains an image or a volume, not rank {request.rank}")


def cell_key(request: RunRequest, weights: str, preprocessing: tuple = ()) -> tuple:
    """What determines a computed cell's value, so the key of the cells a run may reuse
    (both cell caches, embedded and team mode): the input, ``weights`` (the weights
    checksum: a model replaced under the same name never reuses its predecessor's
    cells), the model's ``preprocessing`` (LoadedModel.preprocessing: one checkpoint
    under two entries with other sizes or normalisations sees other inputs), patch, the
    occluder's colour (a volume's is its model's gray, part of its preprocessing) and
    mode. No stride: a cell's value depends on where the patch sits, not on the grid's
    step. No tab: a reload keeps them."""
    colour = tuple(round(float(c), 6) for c in request.fill_rgb or ())
    return (request.rank, request.key, weights, preprocessing, request.patch, colour,
            request.mode)  # fmt: skip


class ImageSubject:
    """A stored picture, explained by a 2-D model; its region is (x0, y0, x1, y1)."""

    def __init__(self, services: Services, request: RunRequest):
        if request.fill_rgb is None:
            raise InputError("choose the occluder's colour")
        self.services, self.request = services, request
        self.loaded = services.model(request.model)
        self.size = tuple(int(s) for s in self.loaded.input_size)
        self.dicom = request.dicom  # its stored file, window, frame and headers

    def bounds(self) -> Bounds:
        if not self.request.region:
            return whole(self.size)
        x0, y0, x1, y1 = (int(v) for v in self.request.region)
        return (y0, x0), (y1, x1)

    def flat(self, bounds: Bounds) -> tuple[int, ...]:
        (y0, x0), (y1, x1) = bounds
        return (x0, y0, x1, y1)

    def tensor(self) -> torch.Tensor:
        return self.loaded.prepare(self.services.images.get(self.request.key))

    def predict(self, tensor: torch.Tensor) -> krypton.Prediction:
        # through the captured graph: its views serve the run (a model that cannot be
        # captured runs naive only)
        found = self.services.explainer(self.request.model).predict(tensor)
        if found.capture_error and self.request.mode != "naive":
            raise InputError(
                f"{self.request.mode.capitalize()} mode needs a model Krypton can trace "
                f"layer by layer, and this one cannot be ({plain_reason(found.capture_error)}); "
                f"choose "
                f"Naive"
            )
        return found

    def fill(self):
        return normalised_fill(self.request.fill_rgb, self.loaded.mean, self.loaded.std)

    def snapped_note(self, before: Bounds, after: Bounds) -> str:
        down, right = (int(a) - int(b) for a, b in zip(after[0], before[0]))
        return (
            f"the region's grid was moved by {right} px right and {down} px down onto the "
            f"last run's grid, to reuse its cells"
        )

    def offset_note(self, offset: tuple[int, ...]) -> str:
        down, across = offset
        return (
            f"no cells reused: the new region's grid is offset by {across} px across and "
            f"{down} px down from the last run's; turn on 'snap to the last grid' to reuse them"
        )

    def record(self) -> ImageFields:
        return {"fill_rgb": list(self.request.fill_rgb or ())}


class VolumeSubject:
    """A stored volume (NIfTI or DICOM series), as its volume model takes it; its region
    is (z0, y0, x0, z1, y1, x1) and it is occluded with the model's own gray."""

    def __init__(self, services: Services, session: str, request: RunRequest):
        self.services, self.request = services, request
        self.loaded = services.model(request.model, rank=3)
        self.size = tuple(int(s) for s in self.loaded.input_size)
        self.prepared = services.prepared_volume(request.key, session, request.model)
        series = self.prepared.source.series_uid  # the series it was read from, if DICOM
        self.dicom = None if series is None else {"source": request.key, "series": series}

    def bounds(self) -> Bounds:
        if not self.request.region:
            return whole(self.size)
        region = tuple(int(v) for v in self.request.region)
        return region[:3], region[3:]

    def flat(self, bounds: Bounds) -> tuple[int, ...]:
        return (*bounds[0], *bounds[1])

    def tensor(self) -> torch.Tensor:
        return self.prepared.model_input.tensor

    def predict(self, tensor: torch.Tensor) -> krypton.Prediction:
        # one plain forward pass, as the panel's class box has it before any run
        explainer = self.services.explainer(self.request.model, rank=3)
        return explainer.predict(tensor, views=False)

    def fill(self):
        return self.loaded.gray_fill()

    def snapped_note(self, before: Bounds, after: Bounds) -> str:
        return (
            f"region moved onto the last run's grid, from corner {list(before[0])} "
            f"to {list(after[0])}, to reuse its cells"
        )

    def offset_note(self, offset: tuple[int, ...]) -> str:
        return (
            f"no cells reused: the new region's grid is offset by {list(offset)} voxels "
            f"(z, y, x) from the last run's; turn on 'snap to the last grid' to reuse them"
        )

    def record(self) -> VolumeFields:
        affine = self.prepared.model_input.affine
        return {
            "kind": "volume",
            "affine": None if affine is None else np.asarray(affine).tolist(),
        }
