"""A run's result record, image or volume, and everything said of it: the summary lines,
another class from the kept probabilities, the JSON export (one privacy rule), and the
record as the library's :class:`krypton.Heatmap`."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, cast

import numpy as np

import krypton
from krypton.estimator import format_duration

from .. import comparison, model_card
from ..exports import picture_title
from ..helpers import InputError
from ..result_schema import ResultRecord
from .provenance import Provenance, ResultView, result_view
from .request import RunRequest
from .timing import estimate_text, plan_text, speed_text

__all__ = [
    "DROPPED_RESULT",
    "NOT_KEPT",
    "kept_result",
    "switch_class",
    "ResultUnavailable",
    "provenance",
    "shown_view",
    "result_record",
    "update_kept",
    "result_heatmap",
    "grid_heatmap",
    "summary_lines",
    "relabel",
    "export_json",
    "partial_fields",
    "partial_text",
    "picture_title",
    "refuse_partial",
]

# the field that names the server's stored file: a file that leaves the server names none
PRIVATE_FIELDS = ("source_key",)


def provenance(request: RunRequest, weights: str, label: int | None) -> Provenance:
    """What a run explains (webapp.runs.provenance: the page shows a result only beside the
    settings it was computed for): the stored input's key, the model and its weights, the
    region as asked, patch, stride, mode, fill colour (none for a volume: its model's own
    gray), class and the approximate settings."""
    return Provenance.make(
        image=request.key, model=request.model, weights=weights, region=request.region,
        patch=request.patch, stride=request.stride, mode=request.mode,
        colour=request.fill_rgb or (), label=label,
        approximate=(request.target_ssim, request.r_drill_down, request.target_speedup),
    )  # fmt: skip


def shown_view(result: ResultRecord, asked: RunRequest | None, weights: str | None) -> ResultView:
    """Whether the kept ``result`` may be shown beside what the panel shows now: ``asked``,
    the panel's settings as a request (None: they make none), with the model's weights
    as the server has them now (``weights``). An empty class box stands for the class
    the run explained (the volume panel's "the prediction"). One rule for both panels'
    pictures, summaries and downloads (webapp.runs.provenance.result_view)."""
    kept = Provenance.from_dict(result["provenance"])
    if asked is None or weights is None:
        return result_view(kept, None)
    label = kept.label if asked.label is None else asked.label
    return result_view(kept, provenance(asked, weights, label))


def result_record(
    request: RunRequest,
    loaded: krypton.LoadedModel,
    weights: str,
    heatmap: krypton.Heatmap,
    region: tuple[int, ...] | None,
    dicom: dict | None,
) -> ResultRecord:
    """The result record of the run ``heatmap`` (the library's, its seconds the whole
    run's) of ``request``, an image's and a volume's alike: the settings, the prediction,
    the grid and its values, the plan, the ``dicom`` source (the subject's, either
    kind's); the run adds how it reused cells and what it claims, the subject its own
    fields. :func:`result_heatmap` reads it back."""
    label = int(heatmap.label)
    base_probs = np.asarray(heatmap.base_probs)
    approximate = request.mode == "approximate"
    record: ResultRecord = {
        "id": uuid.uuid4().hex,
        "source_key": request.key,
        "provenance": provenance(request, weights, label).as_dict(),
        "mode": request.mode,
        "model": request.model,
        "weights_checksum": weights,
        "image": request.name,
        "label": label,
        "label_name": loaded.class_name(label),
        "classes": list(loaded.classes),
        "prob": float(base_probs[label]),
        "base_probs": base_probs.tolist(),
        "patch": request.patch,
        "stride": request.stride,
        "input_size": list(loaded.input_size),
        "region": None if region is None else list(region),
        "dicom": dicom,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "ys": np.asarray(heatmap.ys).tolist(),
        "xs": np.asarray(heatmap.xs).tolist(),
        "values": np.asarray(heatmap.values, np.float32),
        "class_values": None if approximate else heatmap.class_values,
        "seconds": heatmap.seconds,
        "evaluated": heatmap.positions_evaluated,
        "approximate": dict(heatmap.extra) if approximate else {},
        "plan": heatmap.extra.get("plan"),
        "host": heatmap.extra.get("host"),  # threads, who chose them, the schedules run
    }
    if heatmap.zs is not None:  # a volume's slices
        record["zs"] = np.asarray(heatmap.zs).tolist()
    return record


# what either panel says when the server let a run's result go
DROPPED_RESULT = (
    "This heatmap is no longer kept on the server (results are kept within "
    "KRYPTON_RESULT_STORE_MB, least recently used first); press Run to compute it again."
)
# what a download or a Send says where the page's handle names no result kept for it
NOT_KEPT = "The heatmap is no longer on the server; press Run again."


def kept_result(results, key: str, handle: dict | None) -> tuple[ResultRecord | None, str]:
    """The result kept under ``key`` (:func:`webapp.runs.results_key`) that the page's
    ``handle`` names, or None and why not in the page's words: the store is away (team
    mode's Redis), the result was let go (:data:`DROPPED_RESULT`), or "" where the handle
    names none or another run's. One rule for every reader: the panels' redraws, class
    switches, downloads and the PACS send."""
    if not handle:
        return None, ""
    try:
        result = results.get(key)
    except InputError as exc:  # team mode: Redis is away
        return None, str(exc)
    if result is not None and result.get("id") == handle.get("id"):
        return result, ""
    if result is None and results.dropped(key):
        return None, DROPPED_RESULT
    return None, ""


def update_kept(
    results, key: str, result: ResultRecord, fields: dict, first: bool = False
) -> ResultRecord:
    """``fields`` of the run ``result`` changed (a Compare run's maps as they come), in
    the record kept under ``key`` and returned: the run's record as kept, with a class
    the user switched to meanwhile (:func:`switch_class`) still switched. ``first``: the
    run's first keep, in place of the tab's last result. Once another run's result is
    kept there (a newer run), nothing is written: ``result`` is no longer the tab's."""
    run = str(result["id"]).split(":")[0]
    stored = None if first else results.get(key)
    if stored is not None and str(stored.get("id", "")).split(":")[0] == run:
        updated = cast(ResultRecord, {**stored, **fields})
    elif first or stored is None:
        updated = cast(ResultRecord, {**result, **fields})
    else:
        return cast(ResultRecord, {**result, **fields})
    results.put(key, updated)
    return updated


class ResultUnavailable(InputError):
    """The kept result cannot be read: the store is away, or it let the result go."""


def switch_class(results, key: str, handle: dict | None, label: int | None) -> ResultRecord | None:
    """The kept result ``handle`` names, re-coloured for ``label`` from every class's
    probabilities and kept under ``key`` in its place with an id of its own (the page's
    handle changes, so the panel redraws); None where there is nothing to do (no class,
    another run's result, the class already shown). Raises InputError with the page's
    words where it cannot be done: :class:`ResultUnavailable` where the result cannot be
    read (the store is away, or it let the result go), else :func:`relabel`'s (this run
    kept one class only, the class does not exist)."""
    if label is None:
        return None
    result, why = kept_result(results, key, handle)
    if why:
        raise ResultUnavailable(why)
    if result is None or int(label) == int(result["label"]):
        return None
    relabelled = relabel(result, int(label))
    relabelled["id"] = f"{str(result['id']).split(':')[0]}:{int(label)}"
    results.put(key, relabelled)
    return relabelled


def _axes(result: ResultRecord) -> tuple[np.ndarray, ...]:
    """The record's grid, tensor order."""
    axes = (result.get("zs"), result["ys"], result["xs"])
    return tuple(np.asarray(axis) for axis in axes if axis is not None)


def result_heatmap(result: ResultRecord) -> krypton.Heatmap:
    """A kept result, an image's or a volume's, as the library's :class:`krypton.Heatmap`
    (the exports and what is sent to a PACS)."""
    return krypton.Heatmap(
        values=np.asarray(result["values"], np.float32),
        xs=np.asarray(result["xs"]),
        ys=np.asarray(result["ys"]),
        zs=np.asarray(result["zs"]) if result.get("zs") is not None else None,
        label=int(result["label"]),
        prob=float(result["prob"]),
        mode=result["mode"],
        seconds=float(result["seconds"]),
        patch=int(result["patch"]),
        stride=int(result["stride"]),
        positions_evaluated=int(result["evaluated"]),
        macs_spent=0,
        macs_naive=0,
        extra={"ood": result.get("ood"), "plan": result.get("plan")},
        base_probs=np.asarray(result["base_probs"]),
    )


def grid_heatmap(values: np.ndarray, axes, patch: int) -> krypton.Heatmap:
    """Values on the grid ``axes`` (tensor order, either rank) as a Heatmap, for drawing
    a live picture."""
    *zs, ys, xs = (np.asarray(a) for a in axes)
    return krypton.Heatmap(
        values=values, xs=xs, ys=ys, zs=zs[0] if zs else None, label=0, prob=float("nan"),
        mode="", seconds=0.0, patch=patch, stride=None, positions_evaluated=0, macs_spent=0,
        macs_naive=0,
    )  # fmt: skip


def _grid_words(result: ResultRecord) -> tuple[str, str]:
    """(before, after) the run line: a volume's line names the file and its grid (the
    volume panel has no picture of the whole grid beside it); an image's adds nothing."""
    if result.get("kind") != "volume":
        return "", ""
    grid = "x".join(str(len(a)) for a in _axes(result))
    where = "the whole block" if not result.get("region") else f"region {result['region']}"
    named = f"{result['image']} · " if result.get("image") else ""
    return named, f" ({grid} grid over {where}, cube {result['patch']}, stride {result['stride']})"


def partial_fields(known: int, positions: int) -> dict:
    """What a cancelled run's record says of itself: the grid's cells known when it
    stopped, of how many, and when it stopped (the page's Cancel waits for a record
    stopped after its click: webapp.run_strip)."""
    return {"known": int(known), "positions": int(positions), "stopped_at": time.time()}


def partial_text(result: ResultRecord) -> str:
    """The sentence a partial heatmap (a cancelled run's) is shown with; "" for a whole
    one."""
    partial = result.get("partial")
    if not partial:
        return ""
    return (
        f"Partial heatmap: the run was cancelled with {partial['known']:,} of "
        f"{partial['positions']:,} positions known; the blank cells were not computed. "
        f"Press Run to compute only the rest."
    )


def refuse_partial(result: ResultRecord, what: str) -> None:
    """Raise InputError where ``result`` is a cancelled run's partial heatmap: ``what``
    (a DICOM file, a PACS study) would carry blank cells as if they were measured."""
    if result.get("partial"):
        raise InputError(
            f"This heatmap is partial (the run was cancelled): it is not written to {what}. "
            f"Press Run to complete it first."
        )


def summary_lines(result: ResultRecord, ood: bool = True) -> list[str]:
    """The result as the page states it: label, what ran and how long, against what; with
    the out-of-distribution warning unless ``ood`` is False (a panel whose prediction
    beside the picture says it already: one warning per screen)."""
    lines = [f"{result['label_name']}: p = {result['prob']:.3f}"]
    if result.get("partial"):
        lines.append(partial_text(result))
    warning = model_card.ood_text(result.get("ood")) if ood else ""
    if warning:
        lines.append(warning)
    before, after = _grid_words(result)
    if result["evaluated"]:
        line = (
            f"{before}{result['mode']} · {result['evaluated']} positions computed in "
            f"{format_duration(result['seconds'])}"
        )
        if result.get("estimate") and not result.get("partial"):
            line += f" (estimated {estimate_text(result['estimate'])})"
        lines.append(line + after)
        speed = speed_text(result.get("speed"), result["mode"])
        if speed:
            lines.append(speed)
    else:
        lines.append(
            f"{before}{result['mode']} · nothing computed: every cell was known from earlier runs"
        )
    if result.get("plan") and result["mode"] == "exact":
        lines.append(f"Plan: {plan_text(result['plan'], result.get('speed'))}")
    if result.get("reused"):
        lines.append(f"Reused {result['reused']} cells from earlier runs")
    if result.get("reuse_note"):
        lines.append(result["reuse_note"][0].upper() + result["reuse_note"][1:])
    return lines


def relabel(result: ResultRecord, label: int) -> ResultRecord:
    """The same result for another class, from the probabilities kept for every class."""
    if result.get("class_values") is None and result.get("classes_dropped"):
        raise InputError(result["classes_dropped"] + "; press Run to explain the new class")
    if result.get("class_values") is None:
        raise InputError(
            "this heatmap was computed for one class only (approximate "
            "mode chooses its positions by the class); press Run to explain "
            "the new class"
        )
    if not 0 <= label < len(result["classes"]):
        raise InputError(f"class {label} does not exist")
    kept = result.get("provenance")
    if kept is not None:  # the same run, now explaining this class
        kept = Provenance.from_dict(kept).with_label(label).as_dict()
    relabelled = result.copy()
    relabelled.update(
        {
            "provenance": kept,
            "label": label,
            "label_name": result["classes"][label],
            "prob": float(result["base_probs"][label]),
            "values": np.asarray(result["class_values"])[..., label].astype(np.float32),
        }
    )
    return relabelled


def _plain(value):
    """A record's value as JSON holds it: arrays as nested lists, NaN and infinity as null."""
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def export_json(result: ResultRecord) -> str:
    """The JSON export of an image's or a volume's run: settings, the class's values on
    the grid (NaN as null) and its warnings, with the Compare maps for the class shown.
    Nothing that names the server's stored files leaves with it: no stored-file key, no
    provenance image key, no DICOM source path."""
    skipped = ("class_values", "methods", "methods_pending", *PRIVATE_FIELDS)
    summary: dict[str, Any] = {k: v for k, v in result.items() if k not in skipped}
    summary["warnings"] = [text for text in (model_card.ood_text(result.get("ood")),) if text]
    compared = comparison.comparison_json(result)
    if compared is not None:  # the three maps for the class shown, and their agreement
        summary["comparison"] = compared
    if summary.get("provenance"):  # its image is the stored input's key
        summary["provenance"] = {k: v for k, v in summary["provenance"].items() if k != "image"}
    if summary.get("dicom"):
        summary["dicom"] = {k: v for k, v in summary["dicom"].items() if k != "source"}
    return json.dumps(_plain(summary), indent=1)
