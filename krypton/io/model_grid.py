"""Where a volume model's voxels lie on the source, and the block built slice by slice.

**The convention**, used both ways (into the model here, back onto the source grid by
:func:`krypton.render.parametric_map.drops_on_slices`): the source is first turned into
the model's own orientation (axis codes such as ``SPL``, as nibabel and MONAI write
them) by axis permutation and flips only, never resampled for that (an oblique series
goes to its closest axes, and :attr:`ModelGrid.off_axis_degrees` says how far off it
is). Along each model axis the source's ``N`` voxels, spanning ``N x s`` mm, become
``R = round(N x s / t)`` voxels of ``t' = N x s / R`` mm over the same extent (the
model's spacing ``t``, stretched by at most half a voxel over the extent), and the
model's ``M`` voxels are the centred run of them starting at ``c = (R - M) // 2``
(counted in the model's orientation, so a flipped axis takes the same voxels). Model
voxel ``n``'s centre lies at source index ``(n + c + 0.5) x k - 0.5`` with ``k = N /
R`` (on a flipped axis counted from the other end), the middle of its extent of ``k``
source voxels; a source voxel belongs to the model voxel whose index range ``[n - 0.5,
n + 0.5)`` holds its centre (a centre on a boundary: the higher model index). Those are
the voxels it was made from, and the ones a map of it is written back onto
(:func:`krypton.render.parametric_map.drops_on_slices`). Values are linear along
each axis between the two nearest source voxel centres (``F.interpolate(mode=
"trilinear", align_corners=False)``'s weights), the ends held; model voxels beyond the
source (``r`` outside ``[0, R)``) take the window's low end (air in CT).

:class:`BlockBuilder` applies those weights one source slice at a time, so reading a
512 x 512 x 600 CT holds one slice and the model's block, never the source as floats;
slices no model voxel uses are not decoded at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "AXIS_CODES",
    "ModelGrid",
    "BlockBuilder",
    "axis_codes",
    "check_axis_codes",
    "off_axis_degrees",
    "plan_grid",
]

# nibabel's labels: each axis points toward the second of its pair (RAS+ is "RAS")
AXIS_CODES = (("L", "R"), ("P", "A"), ("I", "S"))
# An oblique series within this many degrees of its closest axes is said to be on them
ON_AXIS_DEGREES = 0.5


def check_axis_codes(codes: str) -> str:
    """``codes`` (e.g. ``"SPL"``: the model's first axis points to the patient's
    superior, its second posterior, its third left) when it names each of the three
    patient axes once; else ValueError."""
    import nibabel.orientations as orientations

    text = str(codes).upper()
    try:
        if len(text) != 3:
            raise ValueError(text)
        orientations.axcodes2ornt(tuple(text), AXIS_CODES)
    except ValueError:
        raise ValueError(
            f"orientation {codes!r} is not three axis codes naming each patient axis once "
            f"(one of L/R, one of P/A, one of I/S, e.g. 'SPL' or 'RAS')"
        ) from None
    return text


def axis_codes(affine: np.ndarray) -> str:
    """The closest axis codes of a (z, y, x) index-to-RAS ``affine``."""
    import nibabel.orientations as orientations

    return "".join(orientations.aff2axcodes(np.asarray(affine, float), AXIS_CODES))


def off_axis_degrees(affine: np.ndarray) -> float:
    """How many degrees the most oblique of ``affine``'s axes lies from the patient axis
    closest to it (0 for an axial, coronal or sagittal series)."""
    directions = np.asarray(affine, float)[:3, :3]
    norms = np.linalg.norm(directions, axis=0)
    cosines = np.abs(directions) / np.where(norms > 0, norms, 1.0)
    closest = np.clip(cosines.max(axis=0), -1.0, 1.0)
    return float(np.degrees(np.arccos(closest)).max())


@dataclass(frozen=True)
class _Axis:
    """One model axis: the source axis it reads, whether it runs the other way, its
    weights over the source (M x N, two non-zero per row at most) and which of its voxels
    lie inside the source."""

    source_axis: int
    flipped: bool
    resampled: int
    corner: int
    scale: float  # source voxels per model voxel (k = N / R)
    weights: np.ndarray
    inside: np.ndarray


@dataclass(frozen=True)
class ModelGrid:
    """The model's block over one source (module docstring): per model axis, its source
    axis and weights; ``affine`` maps a model voxel (i, j, k, 1) to RAS mm (None where
    the source had no frame); ``source_codes`` and ``model_codes`` the orientations
    (None: the model's is not recorded, and volumes reach it as stored)."""

    size: tuple[int, int, int]
    axes: tuple[_Axis, _Axis, _Axis]
    affine: np.ndarray | None
    source_codes: str | None
    model_codes: str | None
    off_axis_degrees: float

    @property
    def corner(self) -> tuple[int, int, int]:
        """Where the block starts in the resampled volume, per model axis (negative where
        it is padded)."""
        return tuple(axis.corner for axis in self.axes)  # type: ignore[return-value]

    @property
    def resampled_shape(self) -> tuple[int, int, int]:
        return tuple(axis.resampled for axis in self.axes)  # type: ignore[return-value]

    def slices_needed(self) -> np.ndarray:
        """The source slices (first source axis) that any model voxel reads."""
        for axis in self.axes:
            if axis.source_axis == 0:
                return np.flatnonzero(np.any(axis.weights != 0, axis=0))
        raise AssertionError("a grid reads every source axis")  # pragma: no cover

    def orientation_text(self) -> str:
        """What the record, the page and the CLI say of the turn to the model's axes."""
        if self.model_codes is None:
            return "as stored (the model's orientation is not recorded)"
        said = f"{self.source_codes} to the model's {self.model_codes}"
        if self.off_axis_degrees >= ON_AXIS_DEGREES:
            said += f"; {self.off_axis_degrees:.0f}° off axis, taken to its closest axes"
        return said


def _axis_weights(size: int, resampled: int, corner: int, flipped: bool, source: int) -> tuple:
    """(weights M x N, inside M) for one model axis (module docstring)."""
    scale = source / resampled
    n = np.arange(size)
    r = n + corner
    inside = (r >= 0) & (r < resampled)
    along_source = (resampled - 1 - r) if flipped else r
    where = np.clip((along_source + 0.5) * scale - 0.5, 0.0, source - 1)
    low = np.floor(where).astype(np.int64)
    high = np.minimum(low + 1, source - 1)
    fraction = (where - low).astype(np.float32)
    weights = np.zeros((size, source), np.float32)
    rows = np.flatnonzero(inside)
    np.add.at(weights, (rows, low[rows]), 1.0 - fraction[rows])
    np.add.at(weights, (rows, high[rows]), fraction[rows])
    return weights, inside


def plan_grid(
    source_shape: tuple[int, int, int],
    spacing: tuple[float, float, float],
    affine: np.ndarray | None,
    target_spacing: tuple[float, float, float],
    size: tuple[int, int, int],
    orientation: str | None = None,
) -> ModelGrid:
    """The model's block of ``size`` at ``target_spacing`` (model axes, mm) over a source
    of ``source_shape`` (z, y, x) at ``spacing``, placed by ``affine`` ((z, y, x) index to
    RAS mm), turned into ``orientation`` (axis codes; None: as stored)."""
    import nibabel.orientations as orientations

    if len(target_spacing) != 3 or not all(math.isfinite(t) and t > 0 for t in target_spacing):
        raise ValueError(f"spacing must be three positive distances in mm, got {target_spacing}")
    source_codes = axis_codes(affine) if affine is not None else None
    if orientation is not None and affine is not None:
        turn = orientations.ornt_transform(
            orientations.io_orientation(np.asarray(affine, float)),
            orientations.axcodes2ornt(tuple(check_axis_codes(orientation)), AXIS_CODES),
        )  # per source axis: (model axis, +1 / -1)
        order = {int(m): (s, int(f) < 0) for s, (m, f) in enumerate(turn)}
    else:
        order = {m: (m, False) for m in range(3)}
    axes = []
    for model_axis in range(3):
        source_axis, flipped = order[model_axis]
        count, step = int(source_shape[source_axis]), float(spacing[source_axis])
        resampled = max(1, int(round(count * step / float(target_spacing[model_axis]))))
        corner = (resampled - int(size[model_axis])) // 2
        weights, inside = _axis_weights(int(size[model_axis]), resampled, corner, flipped, count)
        axes.append(_Axis(source_axis, flipped, resampled, corner, count / resampled,
                          weights, inside))  # fmt: skip
    to_source = np.zeros((4, 4))  # model voxel (i, j, k, 1) -> source index (z, y, x, 1)
    to_source[3, 3] = 1.0
    for model_axis, axis in enumerate(axes):
        if axis.flipped:  # r' = R - 1 - (n + c)
            to_source[axis.source_axis, model_axis] = -axis.scale
            to_source[axis.source_axis, 3] = (axis.resampled - axis.corner - 0.5) * axis.scale - 0.5
        else:
            to_source[axis.source_axis, model_axis] = axis.scale
            to_source[axis.source_axis, 3] = (axis.corner + 0.5) * axis.scale - 0.5
    placed = None if affine is None else np.asarray(affine, float) @ to_source
    return ModelGrid(
        tuple(int(s) for s in size),  # type: ignore[arg-type]
        tuple(axes),  # type: ignore[arg-type]
        placed,
        source_codes,
        check_axis_codes(orientation) if orientation is not None and affine is not None else None,
        off_axis_degrees(affine) if affine is not None else 0.0,
    )


class BlockBuilder:
    """The model's block (modality values) built from source slices as they arrive
    (:meth:`add`, in any order), each one's contribution computed at once: two small
    matrix products in plane, then spread over the model voxels along the slice axis."""

    def __init__(self, grid: ModelGrid, padding: float):
        self.grid = grid
        self.padding = float(padding)
        self._slice_axis = next(m for m, a in enumerate(grid.axes) if a.source_axis == 0)
        self._row_axis = next(m for m, a in enumerate(grid.axes) if a.source_axis == 1)
        self._column_axis = next(m for m, a in enumerate(grid.axes) if a.source_axis == 2)
        sizes = grid.size
        self._sum = np.zeros(
            (sizes[self._slice_axis], sizes[self._row_axis], sizes[self._column_axis]),
            np.float32,
        )

    def add(self, index: int, pixels: np.ndarray) -> None:
        """Source slice ``index`` (rows x columns, modality values) into the block."""
        axes = self.grid.axes
        column = axes[self._slice_axis].weights[:, index]
        rows = np.flatnonzero(column)
        if rows.size == 0:
            return
        plane = np.asarray(pixels, np.float32)
        in_plane = axes[self._row_axis].weights @ plane @ axes[self._column_axis].weights.T
        self._sum[rows] += column[rows, None, None] * in_plane[None]

    def block(self) -> np.ndarray:
        """The block in model axis order (float32), the padding where it lies beyond the
        source."""
        order = np.argsort([self._slice_axis, self._row_axis, self._column_axis])
        block = np.ascontiguousarray(np.transpose(self._sum, order))
        inside = np.ones(block.shape, bool)
        for axis, spec in enumerate(self.grid.axes):
            inside &= spec.inside.reshape([-1 if a == axis else 1 for a in range(3)])
        block[~inside] = self.padding
        return block
