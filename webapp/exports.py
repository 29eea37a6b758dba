"""The image panel's downloads: PNG, DICOM Secondary Capture, .npy/.npz, CSV, JSON
values, each carrying the out-of-distribution warning of a flagged image; and the file
name that says what each is (the volume panel's too)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from krypton.io.images import ImageLoadError
from krypton.registry.ood import caveat
from krypton.render.dicom_capture import heatmap_capture
from krypton.render.exports import all_classes_npz, heatmap_title, values_csv, values_npy
from krypton.render.overlay import OverlayStyle, heatmap_picture

from .helpers import InputError
from .result_schema import ResultRecord

EXPORT_MIN_SIDE = 512  # pixels: exports are drawn at least this large


def picture_title(result: ResultRecord) -> str:
    """The class a kept result's picture names (the page's and the PNG download's),
    marked where the heatmap is partial (a cancelled run's)."""
    return result["label_name"] + (" (partial: run cancelled)" if result.get("partial") else "")


def export_stem(result: ResultRecord) -> str:
    """A file name that says what the export is: model, image (or volume), mode, region,
    class, and "partial" for a cancelled run's heatmap."""
    region = result.get("region")
    if not region:
        where = "whole"
    elif len(region) == 6:  # a volume's (z0, y0, x0, z1, y1, x1)
        where = "z{}-{}_y{}-{}_x{}-{}".format(*(region[i] for i in (0, 3, 1, 4, 2, 5)))
    else:
        where = f"x{region[0]}-{region[2]}_y{region[1]}-{region[3]}"
    name = Path(str(result["image"])).name
    double = name.lower().endswith(".nii.gz")
    parts = [
        "krypton",
        result["model"],
        name[: -len(".nii.gz")] if double else Path(name).stem,
        result["mode"],
        f"p{result['patch']}s{result['stride']}",
        where,
        result["label_name"],
        *(["partial"] if result.get("partial") else []),  # a cancelled run's cells so far
    ]
    return "-".join(re.sub(r"[^A-Za-z0-9_.-]+", "_", str(p)).strip("_.-") or "x" for p in parts)[
        :180
    ]


def export_png(
    original: Image.Image, result: ResultRecord, style: OverlayStyle | None = None
) -> bytes:
    """The heatmap over the image at the uploaded resolution (at least 512 px), drawn as
    the page shows it (``style``), with a colour bar naming its scale and a title: model,
    class, probability, mode, patch/stride, date."""
    values = np.asarray(result["values"], dtype=np.float32)
    title = heatmap_title(
        result["model"],
        picture_title(result),
        result["prob"],
        result["mode"],
        result["patch"],
        result["stride"],
        result.get("date", ""),
    )
    warning = caveat(result.get("ood"))
    height, width = result["input_size"]
    return heatmap_picture(
        original,
        values,
        np.asarray(result["xs"]),
        np.asarray(result["ys"]),
        result["patch"],
        result["prob"],
        (height, width),
        title,
        EXPORT_MIN_SIDE,
        style,
        warning=warning,
    )


def export_dicom(
    source: bytes, result: ResultRecord, style: OverlayStyle | None = None, include_identity=False
) -> bytes:
    """The overlay as a DICOM Secondary Capture in the source's study, referencing the
    source image: the same frame, in the same window, at the file's own resolution."""
    record = result.get("dicom")
    if not record:
        raise InputError("the DICOM export needs a DICOM image; this one was not")
    window = record.get("requested")
    height, width = result["input_size"]
    try:
        return heatmap_capture(
            source,
            values=result["values"],
            xs=result["xs"],
            ys=result["ys"],
            patch=result["patch"],
            stride=result["stride"],
            prob=result["prob"],
            input_size=(height, width),
            label_name=result["label_name"],
            mode=result["mode"],
            model_name=result["model"],
            window=tuple(window) if isinstance(window, list) else window,
            frame=record["frame"],
            style=style,
            weights=result.get("weights_checksum", ""),
            include_identity=include_identity,
            warning=caveat(result.get("ood")),
        )
    except (ImageLoadError, ValueError) as exc:
        raise InputError(f"the DICOM export failed: {exc}") from exc


def export_npy(result: ResultRecord) -> bytes:
    """The explained class's values (krypton.render.exports: the CLI's and batch's schema)."""
    return values_npy(result["values"])


def export_all_classes(result: ResultRecord) -> bytes:
    """Every class's probabilities (rows x cols x classes) with positions and names."""
    if result.get("class_values") is None:
        raise InputError("this run kept only the explained class (approximate mode)")
    return all_classes_npz(
        result["class_values"],
        result["xs"],
        result["ys"],
        result["classes"],
        result["base_probs"],
        caveat(result.get("ood")),
    )


def export_csv(result: ResultRecord) -> str:
    """One row per evaluated position (krypton.render.exports), after the
    out-of-distribution warning's comment line when the image was flagged."""
    return values_csv(result["values"], result["xs"], result["ys"], caveat(result.get("ood")))


def jsonable(value: Any):
    """json.dumps default for numpy values."""
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
