"""Occlusion, Grad-CAM and Integrated Gradients side by side in one PNG (``krypton
compare``, ``krypton batch --methods``): each map over the image, or for a volume the three
views through each map's strongest cell, each with its own colour scale."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..methods import MethodMap

TITLES = {
    "occlusion": "Occlusion",
    "gradcam": "Grad-CAM",
    "integrated_gradients": "Integrated Gradients",
}


def methods_picture(maps: dict[str, MethodMap], background: np.ndarray) -> bytes:
    """One panel per method over the image (or, for a volume, the three views through
    each map's strongest cell), each with its own colour scale."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    volume = len(next(iter(maps.values())).axes) == 3  # an RGB picture has ndim 3 too
    rows = len(maps) if volume else 1
    columns = 3 if volume else len(maps)
    figure, grid = plt.subplots(rows, columns, figsize=(3.2 * columns, 3.3 * rows), squeeze=False)
    for number, (method, found) in enumerate(maps.items()):
        full = found.per_pixel(background.shape)
        if volume:
            centre = [int(round(c)) for c in found.strongest_cell_centre()]
            planes = [(background[centre[0]], full[centre[0]], "axial"),
                      (background[:, centre[1]], full[:, centre[1]], "coronal"),
                      (background[:, :, centre[2]], full[:, :, centre[2]], "sagittal")]  # fmt: skip
        else:
            planes = [(background, full, "")]
        for column, (plane, values, view) in enumerate(planes):
            axis = grid[number if volume else 0][column if volume else number]
            axis.imshow(plane, cmap="gray")  # an RGB picture keeps its colours
            shown = axis.imshow(values, cmap="jet", alpha=0.5)
            figure.colorbar(shown, ax=axis, fraction=0.046, label="evidence for the class")
            axis.set_title(f"{TITLES[method]} {view}\n{found.seconds:.2f} s · {found.detail}",
                           fontsize=8)  # fmt: skip
            axis.axis("off")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()
