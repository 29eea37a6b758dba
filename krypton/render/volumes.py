"""A volume's heatmap out: as NIfTI (the cells' values on their own grid, placed in the
scanner's frame) and as pictures of the three orthogonal views through one voxel.

Every cell stands for the patch centred on its position, as in 2-D
(:func:`krypton.render.overlay.heatmap_picture`): cell (k, i, j) sits at model voxel
``(zs[k], ys[i], xs[j]) + (patch - 1) / 2``.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from .overlay import heatmap_picture

__all__ = [
    "VIEWS",
    "cell_affine",
    "heatmap_nifti",
    "voxel_values",
    "lowest_voxel",
    "view_pngs",
    "view_centre",
    "volume_files",
]

# view name -> the axis (z, y, x) it slices across
VIEWS = {"axial": 0, "coronal": 1, "sagittal": 2}


def _sides(value, rank: int = 3) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (int(value),) * rank


def _axes(heatmap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if heatmap.zs is None:
        raise ValueError("this heatmap is of a 2-D image, not of a volume")
    return np.asarray(heatmap.zs), np.asarray(heatmap.ys), np.asarray(heatmap.xs)


def cell_affine(heatmap, voxel_affine: np.ndarray | None) -> np.ndarray:
    """4x4: heatmap cell index (k, i, j, 1) to scanner mm (RAS+), given the model input's
    voxel affine (index (z, y, x, 1) to mm; None: the model's voxel index itself)."""
    patch = _sides(heatmap.patch)
    to_voxel = np.eye(4)
    for axis, coordinates in enumerate(_axes(heatmap)):
        steps = np.diff(coordinates)
        if len(steps) and np.any(steps != steps[0]):
            raise ValueError("the heatmap's cells are not on a regular grid")
        to_voxel[axis, axis] = float(steps[0]) if len(steps) else float(patch[axis])
        to_voxel[axis, 3] = float(coordinates[0]) + (patch[axis] - 1) / 2
    return (np.eye(4) if voxel_affine is None else voxel_affine) @ to_voxel


def heatmap_nifti(heatmap, voxel_affine: np.ndarray | None, description: str = "") -> bytes:
    """The heatmap's values (probability of its class with the patch there) as a gzipped
    NIfTI-1 image, axes in NIfTI order (x, y, z) with :func:`cell_affine` for the frame."""
    import gzip

    import nibabel

    affine = cell_affine(heatmap, voxel_affine)[:, [2, 1, 0, 3]]  # (x, y, z) columns
    data = np.ascontiguousarray(np.transpose(heatmap.values.astype(np.float32), (2, 1, 0)))
    image = nibabel.Nifti1Image(data, affine)
    image.header.set_xyzt_units("mm")
    image.header["descrip"] = description[:79].encode("ascii", "replace")
    image.header["intent_name"] = b"probability"
    return gzip.compress(image.to_bytes(), compresslevel=6, mtime=0)


def voxel_values(heatmap, shape: tuple[int, ...]) -> np.ndarray:
    """The heatmap at every voxel (or, for an image's heatmap, every pixel) of the model's
    input, ``shape`` (D, H, W) or (H, W): each takes the cell whose patch centre is
    nearest along each axis, a voxel midway between two centres the higher one's (each
    cell holds ``[centre - stride / 2, centre + stride / 2)``); NaN beyond the cells'
    reach (that range of the outermost cells)."""
    values = np.asarray(heatmap.values, dtype=np.float32)
    axes = tuple(np.asarray(a) for a in heatmap.axes)
    patch = _sides(heatmap.patch, len(axes))
    picks, inside = [], []
    for size, coordinates, side in zip(shape, axes, patch):
        centres = np.asarray(coordinates) + (side - 1) / 2
        step = float(np.min(np.diff(centres))) if len(centres) > 1 else float(side)
        voxel = np.arange(size)
        offset = voxel[:, None] - centres[None, :]
        nearest = (np.abs(offset) - 1e-6 * (offset < 0)).argmin(axis=1)  # midway: the higher
        picks.append(nearest)
        away = voxel - centres[nearest]
        inside.append((away >= -step / 2) & (away < step / 2))
    grid = values[np.ix_(*picks)]
    reach = np.ones(len(inside) * (1,), dtype=bool)
    for axis, axis_inside in enumerate(inside):  # inside along every axis, broadcast
        reach = reach & axis_inside.reshape([-1 if a == axis else 1 for a in range(len(inside))])
    return np.where(reach, grid, np.nan).astype(np.float32)


def lowest_voxel(heatmap) -> tuple[int, int, int]:
    """The model voxel at the centre of the lowest cell (the patch that lowered the
    class's probability most)."""
    k, i, j = np.unravel_index(np.nanargmin(heatmap.values), heatmap.values.shape)
    patch = _sides(heatmap.patch)
    return tuple(  # type: ignore[return-value]
        int(c[n] + (p - 1) // 2) for c, n, p in zip(_axes(heatmap), (k, i, j), patch)
    )


def view_pngs(
    unit_volume: np.ndarray,
    heatmap,
    at: tuple[int, int, int],
    title: str,
    warning: str = "",
) -> dict[str, bytes]:
    """One PNG per view (:data:`VIEWS`) through voxel ``at`` (z, y, x) of the model's input:
    the input's slice in gray (``unit_volume``: (D, H, W) in [0, 1]) under the heatmap's
    values there, with colour bar and ``title``."""
    per_voxel = voxel_values(heatmap, unit_volume.shape)  # type: ignore[arg-type]
    pictures = {}
    for name, axis in VIEWS.items():
        index = [slice(None)] * 3
        index[axis] = at[axis]  # type: ignore[call-overload]
        gray = np.clip(unit_volume[tuple(index)], 0, 1)
        values = per_voxel[tuple(index)]
        if axis != 0:  # coronal and sagittal: head (high z) up
            gray, values = gray[::-1], values[::-1]
        image = Image.fromarray((gray * 255).astype(np.uint8))
        rows, columns = gray.shape
        pictures[name] = heatmap_picture(
            image,
            values,
            np.arange(columns),
            np.arange(rows),
            1,
            heatmap.prob,
            (rows, columns),
            f"{title} — {name} view, {'zyx'[axis]} = {at[axis]}",
            warning=warning,
        )
    return pictures


def view_centre(heatmap, size: tuple[int, ...], slices: str) -> tuple[int, int, int]:
    """The voxel the three views go through: the lowest cell's centre ("lowest") or the
    middle of the model's input ("middle")."""
    if slices == "lowest":
        return lowest_voxel(heatmap)
    if slices == "middle":
        return tuple(s // 2 for s in size)  # type: ignore[return-value]
    raise ValueError(f"slices must be 'lowest' or 'middle', got {slices!r}")


def volume_files(
    heatmap, prepared, model, slices: str = "lowest", warning: str = ""
) -> dict[str, bytes]:
    """One volume's explanation as files by suffix: ``.nii.gz`` (:func:`heatmap_nifti` in
    the source's frame), ``.axial.png``, ``.coronal.png``, ``.sagittal.png`` (the views
    through the lowest cell, or the input's middle with ``slices="middle"``) and ``.npy``.
    ``prepared``: the :class:`~krypton.io.volumes.ModelVolume` that was explained;
    ``warning``: the caveat the result carries (krypton.registry.ood.caveat), in each
    view's title and beside the .npy."""
    import time

    from .exports import WARNING_SUFFIX, heatmap_title, values_npy

    name = model.class_name(heatmap.label)
    title = heatmap_title(
        model.name, name, heatmap.prob, heatmap.mode, heatmap.patch, heatmap.stride,
        time.strftime("%Y-%m-%d %H:%M"),
    )  # fmt: skip
    at = view_centre(heatmap, model.input_size, slices)
    unit = prepared.tensor[0].numpy() * model.std[0] + model.mean[0]
    files = {".nii.gz": heatmap_nifti(heatmap, prepared.affine, f"krypton {model.name} {name}")}
    pictures = view_pngs(unit, heatmap, at, title, warning)  # type: ignore[arg-type]
    files.update({f".{view}.png": data for view, data in pictures.items()})
    files[".npy"] = values_npy(heatmap.values)
    if warning:  # the .npy holds one array: its warning goes beside it
        files[WARNING_SUFFIX] = f"{warning}\n".encode()
    return files
