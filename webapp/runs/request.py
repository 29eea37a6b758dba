"""What the user asked for, and what a run tells the page while it computes: one request
for an image and a volume alike (rank is a number), and the picture so far."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from krypton.approximate.settings import DEFAULTS
from krypton.approximate.tuning import DEFAULT_TARGET_SSIM

__all__ = ["RunRequest", "Partial", "Reporter", "FIRST_CHUNK", "LARGEST_CHUNK"]

FIRST_CHUNK = 16  # positions in the first batch: the first picture comes within a second
LARGEST_CHUNK = 256


@dataclass(frozen=True)
class RunRequest:
    """What the user asked for in the image or the volume panel.

    ``key`` names the stored image or volume, ``name`` its file; ``region`` is in the
    panel's own flat form — (x0, y0, x1, y1) for an image, (z0, y0, x0, z1, y1, x1) for a
    volume — or None for the whole input; ``rank`` says which (2 or 3). ``fill_rgb`` is an
    image's occluder colour; a volume is occluded with its model's own gray (None)."""

    key: str
    name: str
    model: str
    patch: int
    stride: int
    mode: str
    fill_rgb: tuple[float, float, float] | None = None
    label: int | None = None
    region: tuple[int, ...] | None = None
    target_ssim: float | None = DEFAULT_TARGET_SSIM
    r_drill_down: float = DEFAULTS.r_drill_down
    target_speedup: float = DEFAULTS.target_speedup
    snap: bool = True  # move a new region's grid onto the last run's grid to reuse it
    compare: bool = False  # also Grad-CAM and Integrated Gradients on the run's grid
    compare_layer: str | None = None  # Grad-CAM's (None: the deepest conv block)
    # Integrated Gradients' most gradient evaluations per map (None: the library's default)
    compare_steps: int | None = None
    rank: int = 2  # 2: an image, 3: a volume
    # the page's record of a DICOM image (window, frame, spacing; no identity), or None
    dicom: dict | None = field(default=None, compare=False, hash=False)
    # the estimate the page showed for these settings (webapp.runs.shown_estimate), or None
    estimate: dict | None = field(default=None, compare=False, hash=False)


def fill_for_display(values: np.ndarray) -> np.ndarray:
    """Unknown (NaN) cells take the nearest known value, for the live partial picture (an
    image's grid or a volume's)."""
    known = ~np.isnan(values)
    if known.all() or not known.any():
        return values
    from scipy.ndimage import distance_transform_edt

    _, nearest = distance_transform_edt(~known, return_indices=True)
    return values[tuple(nearest)]


@dataclass(frozen=True)
class Partial:
    """The picture so far: the label's values on the run's grid (NaN where unknown)
    and, ready to draw, ``filled``: each unknown cell taking its nearest known one
    (:func:`fill_for_display`; NaN everywhere until one is known). ``axes`` are the
    grid's first pixels or voxels per axis in tensor order ((ys, xs) or (zs, ys, xs)):
    the grid the run computes, a snapped region's included. Made with :meth:`of`."""

    values: np.ndarray
    filled: np.ndarray
    axes: tuple[np.ndarray, ...]
    patch: int
    label_name: str
    prob: float

    @classmethod
    def of(cls, values: np.ndarray, axes, patch: int, label_name: str, prob: float) -> Partial:
        """The picture of ``values`` (NaN where unknown), filled to draw."""
        return cls(values, fill_for_display(values), axes, patch, label_name, prob)


# report(done, total, picture so far or None): called after every batch; raising stops
Reporter = Callable[[int, int, "Partial | None"], None]
