"""The Compare view's gradient step: which maps a run computes, in what order, and how
long they should take on this host (webapp.comparison computes them and keeps them in the
run's record; the estimate line and the run's status read this)."""

from __future__ import annotations

from collections.abc import Sequence

import krypton
from krypton import methods as krypton_methods
from krypton.estimator import (
    Estimate,
    calibrated_step,
    format_duration,
    logged_runs,
    plain_basis,
    recent_estimate,
    with_host_range,
)
from krypton.methods import GRADIENT_METHODS

__all__ = [
    "EVERY_CLASS_UP_TO",
    "STEP_MODE",
    "STEP_WINDOW",
    "compare_steps",
    "estimate_note",
    "maps_logged",
    "step_estimate",
    "step_labels",
]

# A model with at most this many classes gets both gradient maps for every class, so the
# class switch shows all three methods at once (IG costs a backward pass per path step and
# class); past it, the run's class only, and another class asks for a new run.
EVERY_CLASS_UP_TO = 4

STEP_MODE = "compare"  # the gradient step's rows in the runtime log


def compare_steps(model: krypton.LoadedModel, label: int) -> list[tuple[str, int]]:
    """The gradient maps a Compare run computes, in order: both methods for the explained
    ``label`` first, then for the model's other classes where it has few
    (:func:`step_labels`)."""
    labels = step_labels(model, label)
    ordered = [int(label)] + [other for other in labels if other != int(label)]
    return [(method, each) for each in ordered for method in GRADIENT_METHODS]


def step_labels(model: krypton.LoadedModel, label: int) -> list[int]:
    """The classes the gradient step computes: every class of a model with few, else the
    explained ``label``."""
    classes = len(model.classes)
    return list(range(classes)) if classes <= EVERY_CLASS_UP_TO else [int(label)]


# Each method's map time is the mean over its maps of this many recent whole steps: a
# path needs more or fewer evaluations on one image or class than another (16-224 on
# the three fundus samples), and five maps, the median of fewer than two images, moved
# the estimate with each image
STEP_WINDOW = 5


def maps_logged(model: krypton.LoadedModel, steps: Sequence[tuple[str, int]]) -> bool:
    """Whether this host has logged a map of every method among ``steps``: the step's
    estimate then rests on them, not on the calibration (:func:`step_estimate`)."""
    methods = {method for method, _ in steps}
    return all(logged_runs(model.name, f"{STEP_MODE}-{m}", 0, limit=1) for m in methods)


def step_estimate(
    model: krypton.LoadedModel,
    load: float | None = None,
    steps: Sequence[tuple[str, int]] | None = None,
    budget: int | None = None,
) -> Estimate | None:
    """Seconds the gradient maps ``steps`` ((method, class) pairs; default: every map a
    Compare run of ``model`` computes, :func:`compare_steps`) should take here: per
    method, the mean of this host's logged maps of it over its last STEP_WINDOW steps
    (krypton.estimator.recent_estimate), times how many of it are left; before each
    method has been logged, the model's calibration of the step for those classes. None
    without either. An Integrated Gradients ``budget`` above the default scales its maps
    by as much (a path left to compute at a larger budget is one that spent the default
    one)."""
    steps = compare_steps(model, 0) if steps is None else list(steps)
    if not steps:
        return Estimate(0.0, 0.0, 0.0, "nothing left")
    whole = compare_steps(model, 0)
    parts = []
    for method in GRADIENT_METHODS:
        count = sum(1 for kind, _ in steps if kind == method)
        if not count:
            continue
        per_step = sum(1 for kind, _ in whole if kind == method)
        found = recent_estimate(
            model.name, f"{STEP_MODE}-{method}", 0, load, ("gradient map", "gradient maps"),
            limit=STEP_WINDOW * per_step, mean=True,
        )  # fmt: skip
        if found is None:  # not logged yet: the calibration of the classes left
            return calibrated_step(model.name, len({label for _, label in steps}), load)
        default = krypton_methods.IG_MAX_STEPS
        larger = method == "integrated_gradients" and budget and budget > default
        parts.append((count * (budget / default if budget and larger else 1.0), found))
    seconds = sum(count * found.seconds for count, found in parts)
    low = sum(count * found.low for count, found in parts)
    high = sum(count * found.high for count, found in parts)
    # the slowest method's basis (Integrated Gradients' where it is left); the range from
    # how this host's whole steps met their estimates, once five are logged: the maps'
    # spread one by one (a path that needs more evaluations on one class than another)
    # made the range 2.6-14x wide, where whole steps vary less
    summed = Estimate(seconds, low, high, parts[-1][1].source)
    return with_host_range(summed, model.name, STEP_MODE, load=load)


def estimate_note(
    model: krypton.LoadedModel,
    load: float | None = None,
    left: Sequence[tuple[str, int]] | None = None,
    budget: int | None = None,
) -> str:
    """What the estimate line adds while Compare is ticked: the gradient maps that follow
    the heatmap, and how long the ones ``left`` to compute (default: all,
    :func:`maps_left`) should take here (:func:`step_estimate`)."""
    classes = len(model.classes)
    which = f"all {classes} classes" if classes <= EVERY_CLASS_UP_TO else "the explained class"
    if left is not None and not left:
        return (
            f"Grad-CAM and Integrated Gradients for {which} are known from an earlier run: "
            f"shown with the heatmap."
        )
    steps = compare_steps(model, 0) if left is None else list(left)
    found = step_estimate(model, load, steps, budget)
    maps = f"{len(steps)} gradient map{'s' * (len(steps) != 1)}"
    known = (
        ""
        if left is None or len(steps) == len(compare_steps(model, 0))
        else (" (the rest are known from an earlier run)")
    )
    head = (
        f"The heatmap shows when it is done; Grad-CAM and Integrated Gradients for {which} "
        f"follow, the explained class first: {maps}{known}"
    )
    if found is None:
        return f"{head}, their time measured on the first compared run here."
    return (
        f"{head}, about {format_duration(found.seconds)} more ({format_duration(found.low)}–"
        f"{format_duration(found.high)}), {plain_basis(found.source)}."
    )
