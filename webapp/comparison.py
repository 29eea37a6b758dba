"""The Compare view's record: Grad-CAM and Integrated Gradients beside a run's occlusion
map, on its grid, for images and volumes alike.

A run with Compare ticked computes the two gradient methods (krypton.methods, through
Captum) after its occlusion cells, in the same background job, queue place and result
record. What the page, the class switch and the exports read from that record is here:
the three maps for the class on screen, how alike they rank the cells, and the files.
Sign convention (krypton.methods): every map is *evidence for the class, higher is
more*; occlusion's is the probability's drop under the patch.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image

import krypton
from krypton.estimator import (
    Estimate,
    calibrated_step,
    format_duration,
    plain_basis,
    recent_estimate,
    record_run,
)
from krypton.methods import (
    GRADIENT_METHODS,
    SIGN_CONVENTION,
    MethodMap,
    attribution_maps,
    gradcam_candidates,
    pairwise_agreement,
)
from krypton.render.methods import TITLES, methods_picture

from .helpers import InputError
from .result_schema import ResultRecord

__all__ = [
    "EVERY_CLASS_UP_TO",
    "TOP_SHARE",
    "agreement_rows",
    "available",
    "compute_methods",
    "estimate_note",
    "layer_choices",
    "layer_names",
    "step_estimate",
    "comparison_json",
    "comparison_png",
    "method_maps",
    "stage_text",
]

# A model with at most this many classes gets both gradient maps for every class, so the
# class switch shows all three methods at once (IG costs a backward pass per path step and
# class); past it, the run's class only, and another class asks for a new run.
EVERY_CLASS_UP_TO = 4
TOP_SHARE = 0.05  # the top-k overlap's k: the most important 5% of cells
# stage(done, total, method, class) before each step; raising stops the run
Stage = Callable[[int, int, str, int], None]


def compute_methods(
    model: krypton.LoadedModel,
    tensor: torch.Tensor,
    axes: Sequence[np.ndarray],
    patch: int,
    fill,
    label: int,
    stage: Stage | None = None,
    load: float | None = None,
    layer: str | None = None,
) -> dict:
    """Grad-CAM and Integrated Gradients of ``tensor`` on the run's grid ``axes`` (cells of
    ``patch`` per axis), for every class of a model with few classes or else ``label``:
    per method its values (*grid, classes computed), the classes, seconds per class and
    what ran. Integrated Gradients' path starts from ``fill``, the run's occluder: the
    same "absent" input for both. Grad-CAM reads ``layer``, one of
    :func:`layer_choices`' (None: the deepest convolutional block)."""
    if layer is not None and layer not in layer_names(model):
        raise InputError(
            f"Grad-CAM cannot read {layer!r} of {model.name}: choose one of its "
            f"convolutional blocks ({', '.join(layer_names(model))})"
        )
    labels = step_labels(model, label)
    started = time.perf_counter()
    found = attribution_maps(
        model, tensor, axes, (int(patch),) * len(axes), labels, fill=fill,
        progress=stage, layer=layer,
    )  # fmt: skip
    # the step's whole time, logged as the occlusion's runs are: the next estimate says it
    record_run(model.name, STEP_MODE, 0, (len(labels), 0), time.perf_counter() - started,
               load=load)  # fmt: skip
    return {
        method: {
            "values": np.asarray(values, np.float32),
            "labels": labels,
            "seconds": [float(s) for s in seconds],
            "detail": detail,
        }
        for method, (values, seconds, detail) in found.items()
    }


STEP_MODE = "compare"  # the gradient step's rows in the runtime log


_layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its blocks
_layers_lock = threading.Lock()


def layer_names(model: krypton.LoadedModel) -> tuple[str, ...]:
    """The convolutional blocks Grad-CAM may read in ``model``, shallowest first
    (krypton.methods.gradcam_candidates on a blank input of the model's size; the last
    is the default): worked out once per model, with one forward pass."""
    with _layers_lock:
        found = _layers.get(model.module)
    if found is None:
        device = next(model.module.parameters(), torch.zeros(())).device
        blank = torch.zeros(len(model.mean), *model.input_size, device=device)
        found = tuple(gradcam_candidates(model, blank))
        with _layers_lock:
            _layers[model.module] = found
    return found


def layer_choices(model: krypton.LoadedModel) -> list[dict]:
    """The layer picker's options for ``model``: its blocks, deepest first, the default
    (the deepest) said so."""
    names = layer_names(model)
    return [
        {"label": f"{name} (the default)" if index == 0 else name, "value": name}
        for index, name in enumerate(reversed(names))
    ]


def step_estimate(model: krypton.LoadedModel, load: float | None = None) -> Estimate | None:
    """Seconds the gradient step after the occlusion should take here
    (krypton.estimator.recent_estimate over this host's logged steps for the model; before
    the first, the model's calibration of the step for the classes it will compute)."""
    found = recent_estimate(model.name, STEP_MODE, 0, load, ("such step", "such steps"))
    if found is None:
        found = calibrated_step(model.name, len(step_labels(model, 0)), load)
    return found


def step_labels(model: krypton.LoadedModel, label: int) -> list[int]:
    """The classes the gradient step computes: every class of a model with few, else the
    explained ``label``."""
    classes = len(model.classes)
    return list(range(classes)) if classes <= EVERY_CLASS_UP_TO else [int(label)]


def estimate_note(model: krypton.LoadedModel, load: float | None = None) -> str:
    """What the estimate line adds while Compare is ticked: the gradient step that runs
    after the occlusion, and how long it should take here (:func:`step_estimate`)."""
    classes = len(model.classes)
    which = f"all {classes} classes" if classes <= EVERY_CLASS_UP_TO else "the explained class"
    found = step_estimate(model, load)
    if found is None:
        return (
            f"Then Grad-CAM and Integrated Gradients for {which}: their time is measured "
            f"on the first compared run here."
        )
    return (
        f"Then Grad-CAM and Integrated Gradients for {which}: about "
        f"{format_duration(found.seconds)} more ({format_duration(found.low)}–"
        f"{format_duration(found.high)}; {plain_basis(found.source)})."
    )


def stage_text(done: int, total: int, method: str, label: int, classes: Sequence[str]) -> str:
    """A gradient step in the page's words, for the run's status line."""
    return (
        f"Occlusion done · {TITLES[method]} for {classes[label]} "
        f"({done + 1} of {total} comparison steps)"
    )


def _axes(result: ResultRecord) -> tuple[np.ndarray, ...]:
    axes = (result.get("zs"), result["ys"], result["xs"])
    return tuple(np.asarray(axis) for axis in axes if axis is not None)


def method_maps(result: ResultRecord) -> dict[str, MethodMap] | str:
    """The three maps for the result's class on screen (occlusion first), or, where the
    run computed the gradient methods for other classes only, why not in the page's
    words. ``{}`` for a run without Compare."""
    kept = result.get("methods")
    if not kept:
        return {}
    axes = _axes(result)
    patch = (int(result["patch"]),) * len(axes)
    label, prob = int(result["label"]), float(result["prob"])
    occlusion = prob - np.asarray(result["values"], np.float64)
    maps = {
        "occlusion": MethodMap(
            "occlusion",
            occlusion,
            axes,
            patch,
            label,
            prob,
            float(result["seconds"]),
            f"{result['mode']} mode",
        )  # fmt: skip
    }
    for method in GRADIENT_METHODS:
        found = kept[method]
        if label not in found["labels"]:
            return (
                f"Grad-CAM and Integrated Gradients were computed for "
                f"{result['classes'][found['labels'][0]]} only; press Run to compare "
                f"for {result['label_name']}"
            )
        index = found["labels"].index(label)
        values = np.asarray(found["values"], np.float64)[..., index]
        maps[method] = MethodMap(
            method, values, axes, patch, label, prob, float(found["seconds"][index]),
            found["detail"],
        )  # fmt: skip
    return maps


def available(result: ResultRecord) -> bool:
    """Whether the result has the three maps for its class on screen (the Compare view
    and its download), read from what the run kept: the maps themselves are built once
    per redraw, by the view that draws them (:func:`method_maps`)."""
    kept = result.get("methods")
    if not kept:
        return False
    label = int(result["label"])
    return all(label in kept[method]["labels"] for method in GRADIENT_METHODS)


def agreement_rows(maps: dict[str, MethodMap]) -> list[dict]:
    """Every pair's rank correlation and top-5% overlap (krypton.methods), with titles."""
    return [
        {**row, "titles": [TITLES[name] for name in row["methods"]]}
        for row in pairwise_agreement(maps, TOP_SHARE)
    ]


def comparison_json(result: ResultRecord) -> dict | None:
    """The comparison as the exports carry it: each map for the class on screen
    (MethodMap.record: nested lists on the grid, NaN as null, its seconds and what ran),
    every pair's agreement and the sign convention; None for a run without Compare (or
    for another class)."""
    maps = method_maps(result)
    if not isinstance(maps, dict) or not maps:
        return None
    return {
        "class": result["label_name"],
        "importance": SIGN_CONVENTION,
        "top_share": TOP_SHARE,
        "methods": {method: found.record() for method, found in maps.items()},
        "agreement": pairwise_agreement(maps, TOP_SHARE),
    }


def comparison_png(result: ResultRecord, background: np.ndarray | Image.Image) -> bytes:
    """The three maps side by side, each over ``background`` (the picture the model saw,
    or the volume's block: three views through each map's strongest cell) with its own
    colour scale."""
    if isinstance(background, Image.Image):
        background = np.asarray(background.convert("RGB"))
    maps = method_maps(result)
    if isinstance(maps, str):
        raise InputError(maps)
    if not maps:
        raise InputError("this run did not compare methods; tick Compare and press Run")
    return methods_picture(maps, background)
