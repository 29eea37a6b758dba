"""One phantom stored the ways scanners store a patient: axial head-first, axial with its
instance numbers reversed, axial feet-first, coronal, sagittal and axial tilted about the
patient's left-right axis. The phantom is (z, y, x) in the model's own axes (SPL: slices
toward the head, rows toward the back, columns toward the patient's left), isotropic,
its voxel (z, y, x) at LPS ``ORIGIN + (x, y, z) * spacing``; each way writes the same
patient positions with its own Image Orientation and Position, as a scanner would."""

from __future__ import annotations

import numpy as np

from demo.pacs import ct_series

ORIGIN = np.array([-120.0, -120.0, -150.0])  # LPS mm of the phantom's first voxel
WAYS = ("axial", "axial-reversed-numbers", "feet-first", "coronal", "sagittal")


def _rotation_about_x(degrees: float) -> np.ndarray:
    angle = np.radians(degrees)
    return np.array(
        [[1, 0, 0], [0, np.cos(angle), -np.sin(angle)], [0, np.sin(angle), np.cos(angle)]]
    )


def stored(phantom: np.ndarray, spacing: float, way: str, tilt: float = 0.0) -> list:
    """``phantom`` (z, y, x) HU, ``spacing`` mm on every axis, as the CT series ``way``
    writes it (pydicom datasets, one per slice, instance numbers in slice order unless
    reversed)."""
    depth, height, width = phantom.shape
    lps = lambda z, y, x: ORIGIN + np.array([x, y, z], float) * spacing  # noqa: E731
    if way in ("axial", "axial-reversed-numbers", "tilted"):
        planes = [phantom[z] for z in range(depth)]
        row, column = np.array([1.0, 0, 0]), np.array([0, 1.0, 0])
        corners = [lps(z, 0, 0) for z in range(depth)]
    elif way == "feet-first":  # rows toward the back, columns toward the patient's right
        planes = [phantom[z, :, ::-1] for z in range(depth - 1, -1, -1)]
        row, column = np.array([-1.0, 0, 0]), np.array([0, 1.0, 0])
        corners = [lps(z, 0, width - 1) for z in range(depth - 1, -1, -1)]
    elif way == "coronal":  # rows toward the feet, columns toward the left; slices back
        planes = [phantom[::-1, y, :] for y in range(height)]
        row, column = np.array([1.0, 0, 0]), np.array([0, 0, -1.0])
        corners = [lps(depth - 1, y, 0) for y in range(height)]
    elif way == "sagittal":  # rows toward the feet, columns toward the back; slices right
        planes = [phantom[::-1, :, x] for x in range(width - 1, -1, -1)]
        row, column = np.array([0, 1.0, 0]), np.array([0, 0, -1.0])
        corners = [lps(depth - 1, 0, x) for x in range(width - 1, -1, -1)]
    else:
        raise ValueError(way)
    if way == "tilted":  # the whole stack turned about the left-right axis through ORIGIN
        turn = _rotation_about_x(tilt)
        row, column = turn @ row, turn @ column
        corners = [ORIGIN + turn @ (corner - ORIGIN) for corner in corners]
    datasets = ct_series(np.stack(planes), (spacing,) * 3, f"Ways^{way}")
    for number, (dataset, corner) in enumerate(zip(datasets, corners, strict=True)):
        dataset.ImageOrientationPatient = [float(v) for v in (*row, *column)]
        dataset.ImagePositionPatient = [float(v) for v in corner]
        if way == "axial-reversed-numbers":
            dataset.InstanceNumber = len(datasets) - number
    return datasets


def source_to_phantom(datasets: list, spacing: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each dataset, the phantom's (z, y, x) index of each of its pixels: where a map
    on that slice lies in the phantom (rows x columns x 3, integers)."""
    out = []
    for dataset in datasets:
        rows, columns = int(dataset.Rows), int(dataset.Columns)
        cosines = np.asarray(dataset.ImageOrientationPatient, float)
        corner = np.asarray(dataset.ImagePositionPatient, float)
        r, c = np.meshgrid(np.arange(rows), np.arange(columns), indexing="ij")
        points = (corner + c[..., None] * cosines[:3] * spacing
                  + r[..., None] * cosines[3:] * spacing)  # fmt: skip
        xyz = np.rint((points - ORIGIN) / spacing).astype(int)
        out.append(xyz[..., ::-1])
    return out
