"""The files a heatmap leaves as, written in one place for the CLI, `krypton batch` and
the web app, so their schemas cannot drift: the title every picture carries, the
explained class's values (.npy), every class's (.npz) and the positions as CSV. The
pictures themselves are krypton.render's (PNG) and krypton.io.dicom's (DICOM)."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence

import numpy as np

__all__ = ["NPZ_KEYS", "heatmap_title", "values_npy", "all_classes_npz", "values_csv"]

# The .npz schema: every class's probabilities (rows x cols x classes), the positions'
# x and y, the class names and the unoccluded image's probabilities.
NPZ_KEYS = ("probabilities", "xs", "ys", "classes", "unoccluded")


def heatmap_title(
    model: str,
    label_name: str,
    prob: float,
    mode: str,
    patch: int,
    stride: int | None,
    date: str,
    note: str = "",
) -> str:
    """'model · class (p = 0.836) · exact · patch 16, stride 4 · date' (+ a note)."""
    return (
        f"{model} · {label_name} (p = {prob:.3f}) · {mode} · patch {patch}, stride {stride} · "
        f"{date}{note}"
    )


def values_npy(values: np.ndarray) -> bytes:
    """The explained class's probabilities with the patch at each position (float32)."""
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(values, dtype=np.float32))
    return buffer.getvalue()


def all_classes_npz(
    class_values: np.ndarray,
    xs: Sequence[int] | np.ndarray,
    ys: Sequence[int] | np.ndarray,
    classes: Sequence[str],
    unoccluded: Sequence[float] | np.ndarray,
) -> bytes:
    """Every class's probabilities with the positions and names (NPZ_KEYS)."""
    buffer = io.BytesIO()
    arrays = (np.asarray(class_values), np.asarray(xs), np.asarray(ys))
    named = (np.asarray(list(classes)), np.asarray(unoccluded))
    np.savez_compressed(buffer, **dict(zip(NPZ_KEYS, arrays + named)))
    return buffer.getvalue()


def values_csv(
    values: np.ndarray, xs: Sequence[int] | np.ndarray, ys: Sequence[int] | np.ndarray
) -> str:
    """One row per evaluated position: x, y (top-left corner) and the probability."""
    values = np.asarray(values, dtype=np.float32)
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["x", "y", "probability"])
    for row, y in enumerate(ys):
        for col, x in enumerate(xs):
            if not np.isnan(values[row, col]):
                writer.writerow([int(x), int(y), f"{values[row, col]:.6f}"])
    return text.getvalue()
