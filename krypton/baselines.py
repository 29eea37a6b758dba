"""Maps that never look at the model, and the randomisation check's verdict.

A method's pointing or deletion score means little until it beats maps that read only the
picture: a uniform random map (chance), a centre prior, Sobel edges and local contrast
(:func:`model_free_maps`). On the held-out fundus images local contrast pointed at a
lesion of the explained class 72% of the time and edges 69%, above Grad-CAM at its
default layer: conspicuity, not faithfulness. The randomisation check (Adebayo et al.,
2018) asks the opposite of a method: after the model's weights are re-initialised its
map must share little with the trained model's; a model-free map shares all of it and
must fail (:func:`randomisation_verdict`).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
from scipy import ndimage
from skimage.filters import sobel

from .methods import MethodMap, agreement, on_grid

__all__ = [
    "MODEL_FREE",
    "RANDOMISATION_THRESHOLD",
    "model_free_maps",
    "randomisation_verdict",
    "passes_randomisation",
]

MODEL_FREE = ("random", "centre", "edges", "contrast")

# |Spearman| of the absolute maps, trained against fully re-initialised, below which a
# method passes the randomisation check (the reviewer asked for one stated bound)
RANDOMISATION_THRESHOLD = 0.5


def _intensity(image: torch.Tensor) -> np.ndarray:
    """The input's channels averaged: (H, W) or (D, H, W) as float64."""
    return image.detach().double().mean(dim=0).cpu().numpy()


def _pixel_map(name: str, picture: np.ndarray, patch: tuple[int, ...]) -> np.ndarray:
    """One model-free map per pixel (higher: more conspicuous)."""
    if name == "edges":
        return sobel(picture)
    if name == "contrast":  # the standard deviation over a patch-sized window
        mean = ndimage.uniform_filter(picture, size=patch, mode="nearest")
        square = ndimage.uniform_filter(picture**2, size=patch, mode="nearest")
        return np.sqrt(np.maximum(square - mean**2, 0.0))
    if name == "centre":  # nearer the middle is higher
        grids = np.meshgrid(*(np.arange(n) - (n - 1) / 2 for n in picture.shape), indexing="ij")
        return -np.sqrt(sum(g.astype(np.float64) ** 2 for g in grids))
    raise ValueError(f"no model-free map named {name!r}; choose from {', '.join(MODEL_FREE)}")


def model_free_maps(image: torch.Tensor, like: MethodMap, seed: int = 0) -> dict[str, MethodMap]:
    """The model-free maps of ``image`` ((C, H, W) or (C, D, H, W)) on ``like``'s grid
    (occlusion's cells: each map averaged over a cell's patch, as Grad-CAM's and IG's
    are): ``random`` (uniform, drawn from ``seed``: chance), ``centre``, ``edges`` (Sobel
    magnitude of the channel mean) and ``contrast`` (its standard deviation over a
    patch-sized window). Cells ``like`` did not compute stay NaN."""
    picture = _intensity(image)
    missing = ~np.isfinite(like.importance)
    maps = {}
    for name in MODEL_FREE:
        began = time.perf_counter()
        if name == "random":
            values = np.random.default_rng(seed).random(like.importance.shape)
        else:
            pixels = torch.from_numpy(_pixel_map(name, picture, like.patch))
            values = on_grid(pixels, like.axes, like.patch)
        values = np.where(missing, np.nan, values)
        maps[name] = MethodMap(
            name, values, like.axes, like.patch, like.label, like.prob,
            time.perf_counter() - began, f"model-free ({name}); reads the picture only",
        )  # fmt: skip
    return maps


def randomisation_verdict(
    original: MethodMap, randomised: MethodMap, threshold: float = RANDOMISATION_THRESHOLD
) -> dict:
    """Whether a method passes the randomisation check: its map on the re-initialised
    model against its map on the trained one. Passes when the |Spearman| of the absolute
    maps is below ``threshold``, or when the map went flat (nothing of the trained map
    is left: the outcome the check hopes for, not a case to drop). Fails when it is at or
    above ``threshold``, or when the map is undefined (NaN or infinite where the trained
    map has values: no evidence of passing). Returns ``passed``, ``spearman_abs`` (NaN
    where flat or undefined) and ``why`` in words."""
    computed = np.isfinite(original.importance)
    values = randomised.importance[computed]
    if not computed.any() or not np.isfinite(values).all():
        return {"passed": False, "spearman_abs": math.nan, "why": "the map is undefined (NaN)"}
    if np.ptp(values) == 0:
        return {"passed": True, "spearman_abs": math.nan, "why": "the map went flat"}
    trained = original.importance[computed]
    if np.ptp(trained) == 0:
        return {"passed": False, "spearman_abs": math.nan, "why": "the trained map is flat"}
    rho = agreement(_absolute(original), _absolute(randomised))["spearman"]
    if not math.isfinite(rho):
        return {"passed": False, "spearman_abs": rho, "why": "no rank correlation"}
    passed = abs(rho) < threshold
    relation = "below" if passed else "at or above"
    return {
        "passed": passed,
        "spearman_abs": rho,
        "why": f"|Spearman| {abs(rho):.2f} {relation} {threshold}",
    }


def _absolute(method_map: MethodMap) -> MethodMap:
    """The same map with its importance's magnitude."""
    return dataclasses.replace(method_map, importance=np.abs(method_map.importance))


def passes_randomisation(found: dict, threshold: float = RANDOMISATION_THRESHOLD) -> bool:
    """The verdict of one :func:`krypton.methods.similarity` record (a step of the
    cascade): flat passes, NaN where not flat fails, else |Spearman of |map|| below
    ``threshold`` passes; the same rule as :func:`randomisation_verdict`."""
    if found["flat"]:
        return True
    rho = found["spearman_abs"]
    return bool(math.isfinite(rho) and abs(rho) < threshold)
