"""The files a heatmap leaves as, written in one place for the CLI, `krypton batch` and
the web app, so their schemas cannot drift: the title every picture carries, the
explained class's values (.npy), every class's (.npz) and the positions as CSV. The
pictures themselves are krypton.render's (PNG) and krypton.io.dicom's (DICOM)."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence

import numpy as np

__all__ = [
    "NPZ_KEYS",
    "WARNING_KEY",
    "WARNING_SUFFIX",
    "dicom_comments",
    "heatmap_title",
    "values_npy",
    "all_classes_npz",
    "values_csv",
]

# The .npz schema: every class's probabilities (rows x cols x classes), the positions'
# x and y, the class names and the unoccluded image's probabilities; and, only for an
# image the out-of-distribution check flagged, WARNING_KEY with the warning's text.
NPZ_KEYS = ("probabilities", "xs", "ys", "classes", "unoccluded")
WARNING_KEY = "warning"
# Beside a .npy (which holds one array and nothing else), a flagged image's warning goes
# to a text file of this suffix: STEM.npy and STEM.warning.txt.
WARNING_SUFFIX = ".warning.txt"


def dicom_comments(warning: str, text: str = "") -> str:
    """The Image Comments of every DICOM Krypton writes (Secondary Captures and
    Parametric Maps, downloaded, written by the CLI or sent to a PACS): a flagged
    input's ``warning`` (krypton.registry.ood.caveat) first, in one wording,
    "WARNING: <caveat>.", then ``text``. Before, the app's volume download said
    "WARNING: Warning: ...", the library's Send the caveat alone, the image capture a
    third form."""
    said = f"WARNING: {warning.strip().rstrip('.')}." if warning.strip() else ""
    return " ".join(part for part in (said, text.strip()) if part)


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
    warning: str = "",
) -> bytes:
    """Every class's probabilities with the positions and names (NPZ_KEYS), and the
    out-of-distribution ``warning`` under WARNING_KEY when there is one."""
    buffer = io.BytesIO()
    arrays = (np.asarray(class_values), np.asarray(xs), np.asarray(ys))
    named = (np.asarray(list(classes)), np.asarray(unoccluded))
    contents = dict(zip(NPZ_KEYS, arrays + named))
    if warning:
        contents[WARNING_KEY] = np.asarray(warning)
    np.savez_compressed(buffer, **contents)
    return buffer.getvalue()


def values_csv(
    values: np.ndarray,
    xs: Sequence[int] | np.ndarray,
    ys: Sequence[int] | np.ndarray,
    warning: str = "",
) -> str:
    """One row per evaluated position: x, y (top-left corner) and the probability; an
    out-of-distribution ``warning`` first, as a comment line ("# warning: ..."; pandas
    reads past it with ``comment="#"``)."""
    values = np.asarray(values, dtype=np.float32)
    text = io.StringIO()
    if warning:
        text.write(f"# warning: {' '.join(warning.split())}\n")
    writer = csv.writer(text)
    writer.writerow(["x", "y", "probability"])
    for row, y in enumerate(ys):
        for col, x in enumerate(xs):
            if not np.isnan(values[row, col]):
                writer.writerow([int(x), int(y), f"{values[row, col]:.6f}"])
    return text.getvalue()
