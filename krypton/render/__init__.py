"""Pictures and files out: heatmap overlays and colour scales (:mod:`.overlay`), and the
one writer of npy / npz / CSV files and titles (:mod:`.exports`) that the CLI, batch
runs and the app share. DICOM exports are :mod:`krypton.io.dicom`'s."""

from .exports import (
    NPZ_KEYS,
    all_classes_npz,
    heatmap_title,
    values_csv,
    values_npy,
)
from .overlay import (
    HEATMAP_SCALES,
    OverlayStyle,
    StyledHeatmap,
    heatmap_limits,
    heatmap_picture,
    heatmap_rgba,
    overlay,
    styled_heatmap,
)

__all__ = [
    "NPZ_KEYS",
    "heatmap_title",
    "values_npy",
    "all_classes_npz",
    "values_csv",
    "heatmap_limits",
    "HEATMAP_SCALES",
    "OverlayStyle",
    "StyledHeatmap",
    "styled_heatmap",
    "heatmap_rgba",
    "overlay",
    "heatmap_picture",
]
