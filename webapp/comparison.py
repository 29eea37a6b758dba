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
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch
from PIL import Image

import krypton
from krypton import methods as krypton_methods
from krypton.estimator import (
    Estimate,
    format_duration,
    record_run,
)
from krypton.methods import (
    GRADIENT_METHODS,
    SIGN_CONVENTION,
    MethodMap,
    PixelAttribution,
    gradcam_candidates,
    on_grid,
    pairwise_agreement,
    path_detail,
    pixel_attribution,
)
from krypton.render.methods import TITLES, methods_picture

from .gradient_steps import (
    STEP_MODE,
    compare_steps,
    estimate_note,
    maps_logged,
    step_estimate,
)
from .gradient_store import KeptAttributions, attribution_key
from .helpers import InputError
from .result_schema import ResultRecord

__all__ = [
    "TOP_SHARE",
    "agreement_rows",
    "available",
    "flat_notes",
    "compare_steps",
    "compute_methods",
    "estimate_note",
    "layer_choices",
    "layer_names",
    "step_estimate",
    "comparison_json",
    "comparison_png",
    "maps_left",
    "method_maps",
    "pending_note",
    "pending_record",
    "steps_left",
    "stage_text",
]

TOP_SHARE = 0.05  # the top-k overlap's k: the most important 5% of cells
# stage(done, total, method, class) before each step; raising stops the run
Stage = Callable[[int, int, str, int], None]
# shown(the maps so far as the record keeps them, the (method, class) steps left)
Shown = Callable[[dict, list[tuple[str, int]]], None]


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
    *,
    source: tuple = (),
    shown: Shown | None = None,
    kept: KeptAttributions | None = None,
    budget: int | None = None,
) -> dict:
    """Grad-CAM and Integrated Gradients of ``tensor`` on the run's grid ``axes`` (cells of
    ``patch`` per axis), for every class of a model with few classes or else ``label``:
    the record :func:`methods_record` makes. The explained class comes first, both
    methods, then the others; ``shown(record so far, steps left)`` hears of each map as it
    is done, so the page can show it before the rest. Integrated Gradients' path starts
    from ``fill``, the run's occluder: the same "absent" input for both. Grad-CAM reads
    ``layer``, one of :func:`layer_choices`' (None: the deepest convolutional block).
    ``source`` names the input and model (the cells' key, webapp.runs.cell_key): maps
    ``kept`` for it (the services' :class:`KeptAttributions`) are not computed again.
    ``budget``: Integrated Gradients' most gradient evaluations per map (None: the
    library's default, krypton.methods.IG_MAX_STEPS)."""
    chosen = chosen_layer(model, layer)
    budget = int(budget or krypton_methods.IG_MAX_STEPS)
    order = compare_steps(model, label)
    keys = {step: attribution_key(source, *step, chosen, fill) for step in order}
    known = {s: kept.get(keys[s], budget) for s in order} if kept is not None and source else {}
    found = {step: attribution for step, attribution in known.items() if attribution}
    left = [step for step in order if step not in found]
    planned = step_estimate(model, load, left, budget) if left else None  # as the page says
    # the whole step is logged against its estimate where that rested on this host's
    # logged maps: an estimate from the calibration, made before any map was logged here,
    # is of another kind, and its error (the calibration's day, its three samples) set
    # the range's bounds for the next twenty steps (2.7-2.8x wide, bench.estimates)
    judged = planned is not None and maps_logged(model, left)
    for done, (method, step_label) in enumerate(order):
        if stage is not None:
            stage(done, len(order), method, step_label)
        if (method, step_label) not in found:
            attribution = pixel_attribution(
                model, tensor, method, step_label, fill=fill, layer=chosen, max_steps=budget
            )
            if kept is not None:
                kept.put(keys[(method, step_label)], attribution)
            # each map's time, logged as the occlusion's runs are: the next estimate says it
            record_run(model.name, f"{STEP_MODE}-{method}", 0, (1, 0), attribution.seconds,
                       load=load)  # fmt: skip
            found[(method, step_label)] = attribution
        if shown is not None and done + 1 < len(order):
            shown(methods_record(found, axes, patch), order[done + 1 :])
    if judged:  # the whole step against its estimate: the next one's range
        seconds = sum(found[step].seconds for step in left)
        record_run(model.name, STEP_MODE, 0, (len(left), 0), seconds,
                   estimated=planned.seconds, load=load)  # fmt: skip
    return methods_record(found, axes, patch)


def methods_record(
    found: dict[tuple[str, int], PixelAttribution], axes: Sequence[np.ndarray], patch: int
) -> dict:
    """The result record's maps: per method with any class done, its values on the grid
    (*grid, classes, ascending), the classes, seconds and what ran per class, and what
    ran over them all (``detail``)."""
    extent = (int(patch),) * len(axes)
    record = {}
    for method in GRADIENT_METHODS:
        done = sorted(label for kind, label in found if kind == method)
        if not done:
            continue
        kept = [found[(method, label)] for label in done]
        planes = [on_grid(torch.from_numpy(k.values), axes, extent) for k in kept]
        if method == "gradcam":
            detail = kept[0].detail
        else:
            detail = path_detail([(int(k.steps or 0), float(k.gap or 0.0)) for k in kept])
        record[method] = {
            "values": np.stack(planes, -1).astype(np.float32),
            "labels": done,
            "seconds": [float(k.seconds) for k in kept],
            "detail": detail,
            "details": [k.detail for k in kept],
        }
        if method == "integrated_gradients":  # each path's evaluations, gap and budget
            record[method]["paths"] = [
                [int(k.steps or 0), float(k.gap or 0.0), int(k.budget or 0)] for k in kept
            ]
    return record


def chosen_layer(model: krypton.LoadedModel, layer: str | None) -> str:
    """Grad-CAM's layer for a run: ``layer`` if it is one of the model's blocks (else the
    page's refusal), None for the deepest."""
    names = layer_names(model)
    if layer is None:
        return names[-1]
    if layer not in names:
        raise InputError(
            f"Grad-CAM cannot read {layer!r} of {model.name}: choose one of its "
            f"convolutional blocks ({', '.join(names)})"
        )
    return layer


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


def maps_left(
    model: krypton.LoadedModel,
    kept: KeptAttributions,
    source: tuple,
    fill,
    label: int,
    layer: str | None = None,
    budget: int | None = None,
) -> list[tuple[str, int]]:
    """The maps a Compare run of the input ``source`` names would compute (those not
    ``kept`` from an earlier run, Integrated Gradients' at ``budget``), in their order
    (:func:`compare_steps`)."""
    chosen = chosen_layer(model, layer)
    budget = int(budget or krypton_methods.IG_MAX_STEPS)
    return [
        (method, label)
        for method, label in compare_steps(model, label)
        if kept.get(attribution_key(source, method, label, chosen, fill), budget) is None
    ]


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
    kept = result.get("methods") or {}
    left = steps_left(result)
    if not kept and not left:
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
        found = kept.get(method)
        if found is None or label not in found["labels"]:
            if (method, label) in left:  # still to come, or stopped before it (the note)
                continue
            computed = sorted({c for entry in kept.values() for c in entry["labels"]})
            names = ", ".join(result["classes"][c] for c in computed) or "no class"
            return (
                f"Grad-CAM and Integrated Gradients were computed for {names} only; "
                f"press Run to compare for {result['label_name']}"
            )
        index = found["labels"].index(label)
        values = np.asarray(found["values"], np.float64)[..., index]
        detail = (found.get("details") or [found["detail"]] * len(found["labels"]))[index]
        maps[method] = MethodMap(
            method, values, axes, patch, label, prob, float(found["seconds"][index]), detail
        )
    return maps


def steps_left(result: ResultRecord) -> set[tuple[str, int]]:
    """The (method, class) maps a Compare run has not computed yet: still to come, or
    stopped before (:func:`pending_record`)."""
    pending = result.get("methods_pending") or {}
    return {(str(method), int(label)) for method, label in pending.get("steps", [])}


def pending_record(
    steps: Sequence[tuple[str, int]], estimate: Estimate | None, stopped: bool = False
) -> dict | None:
    """What the result record says of the maps a Compare run has not computed: which
    (``steps``), whether the run stopped before them (``stopped``: cancelled or failed)
    and the seconds they should take here (``estimate``); None once there are none."""
    if not steps:
        return None
    seconds = None if estimate is None else float(estimate.seconds)
    return {"steps": [[str(m), int(c)] for m, c in steps], "stopped": bool(stopped),
            "seconds_left": seconds}  # fmt: skip


def pending_note(result: ResultRecord) -> str:
    """The Compare view's line about the maps not there yet, in the page's words ("" when
    every map is done): which are being computed and about how long is left, or that the
    run was cancelled before them."""
    pending = result.get("methods_pending") or {}
    steps = [(str(m), int(c)) for m, c in pending.get("steps", [])]
    if not steps:
        return ""
    label, name = int(result["label"]), result["label_name"]
    here = " and ".join(TITLES[m] for m, c in steps if c == label)
    done = sum(len(entry["labels"]) for entry in (result.get("methods") or {}).values())
    if pending.get("stopped"):
        what = f"{here} for {name}" if here else f"the other classes' {len(steps)} maps"
        return (
            f"The run was stopped before {what}: press Run to compute "
            f"{'them' if len(steps) > 1 else 'it'} (the maps shown are kept, not computed "
            f"again)."
        )
    left = pending.get("seconds_left")
    when = "" if left is None else f"; about {format_duration(left)} left"
    progress = f"{done} of {done + len(steps)} maps done{when}"
    if here:
        return f"Computing {here} for {name} ({progress})."
    return f"Computing the other classes' maps ({progress}); switch class to see them."


def available(result: ResultRecord) -> bool:
    """Whether the result has the three maps for its class on screen (the Compare view
    and its download), read from what the run kept: the maps themselves are built once
    per redraw, by the view that draws them (:func:`method_maps`)."""
    kept = result.get("methods")
    if not kept:
        return False
    label = int(result["label"])
    return all(label in kept.get(method, {}).get("labels", ()) for method in GRADIENT_METHODS)


def flat_notes(maps: dict[str, MethodMap], class_name: str) -> list[str]:
    """A line for each map that says nothing (krypton.methods.MethodMap.flat): the same
    value in every cell, drawn in one colour without a scale and ranked against none."""
    return [
        f"{TITLES[method]} finds no evidence for {class_name}: its map is the same in every "
        f"cell ({found.value_range()[1]:.2g}), so it has no colour scale and no rank "
        f"correlation with the others."
        for method, found in maps.items()
        if found.flat()
    ]


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
    record = {
        "class": result["label_name"],
        "importance": SIGN_CONVENTION,
        "top_share": TOP_SHARE,
        "methods": {method: found.record() for method, found in maps.items()},
        "agreement": pairwise_agreement(maps, TOP_SHARE),
    }
    missing = [method for method in GRADIENT_METHODS if method not in maps]
    if missing:  # a run stopped (or still going) before them
        record["not_computed"] = missing
    return record


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
