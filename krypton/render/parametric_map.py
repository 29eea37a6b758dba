"""A heatmap as a DICOM Parametric Map (highdicom's ``ParametricMap``): float values a
viewer overlays on the source series, placed by the source's frame of reference.

Each voxel of the explained block holds the **drop in the class's probability** when the
patch covering it is occluded (the probability without occlusion minus the heatmap's
value at the nearest cell, :func:`krypton.render.volumes.voxel_values`; 0 beyond the
cells' reach), stated by a real-world value mapping. The frames are the model's resampled
voxels (its spacing and block), positioned in the patient frame from the source's
geometry, so a viewer places them over the source image; the series description names
the model, class, patch, stride and mode. An image's map (:func:`image_parametric_map`)
is one frame at the source image's own pixels, placed as the source is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .volumes import voxel_values

__all__ = ["parametric_map", "image_parametric_map", "drop_values", "RAS_TO_LPS"]

RAS_TO_LPS = np.diag([-1.0, -1.0, 1.0, 1.0])  # NIfTI's (and Volume.affine's) frame to DICOM's


def drop_values(heatmap, shape: tuple[int, ...]) -> np.ndarray:
    """The drop in the class's probability at every voxel (pixel) of the model's input,
    ``shape`` (D, H, W) or (H, W); 0 beyond the cells' reach."""
    values = voxel_values(heatmap, shape)
    return np.nan_to_num(float(heatmap.prob) - values, nan=0.0).astype(np.float32)


def parametric_map(
    heatmap,
    shape: tuple[int, int, int],
    voxel_affine: np.ndarray,
    sources: Sequence,
    *,
    model_name: str,
    class_name: str,
    series_number: int = 9901,
    content_label: str = "OCCLUSION",
):
    """The Parametric Map of ``heatmap`` (a volume's, over the model's input block of
    ``shape``) whose voxels map to the patient frame by ``voxel_affine`` (RAS+, the
    prepared volume's),
    referencing the source series' datasets ``sources`` (headers suffice).
    ``content_label``: what a later search recognises the map by (DICOM's CS, at most 16
    upper-case letters, digits and underscores)."""
    import highdicom as hd

    if voxel_affine is None:
        raise ValueError("the source gave no scanner frame: a Parametric Map cannot be placed")
    frame = getattr(sources[0], "FrameOfReferenceUID", None)
    if frame is None:
        raise ValueError("the source series has no frame of reference to place a map on")
    drops = drop_values(heatmap, shape)
    volume = hd.Volume(drops, RAS_TO_LPS @ np.asarray(voxel_affine), "PATIENT", frame)
    return _map(heatmap, volume, drops, list(sources), model_name, class_name,
                series_number, content_label)  # fmt: skip


def image_parametric_map(
    heatmap,
    input_size: tuple[int, int],
    source,
    *,
    model_name: str,
    class_name: str,
    series_number: int = 9901,
    content_label: str = "OCCLUSION",
):
    """The Parametric Map of an image's ``heatmap`` over its single-frame DICOM
    ``source`` (a header suffices): one frame at the source's own rows and columns, each
    pixel the drop of the cell over the model-input pixel it was resized to (the model
    sees the whole image resized to ``input_size``, (H, W)), placed as the source is. A
    source without a frame of reference (a photograph, a secondary capture) or with
    several frames gets none: ValueError."""
    if getattr(source, "FrameOfReferenceUID", None) is None:
        raise ValueError(
            "the source image has no frame of reference (a photograph or capture): no "
            "Parametric Map can be placed on it"
        )
    placed = ("ImagePositionPatient", "ImageOrientationPatient", "PixelSpacing")
    if not all(source.get(keyword) for keyword in placed):
        raise ValueError("the source image has no position, orientation or pixel spacing")
    if int(source.get("NumberOfFrames", 1) or 1) > 1:
        raise ValueError("the source has several frames: a Parametric Map is made of one")
    height, width = input_size
    drops = drop_values(heatmap, (height, width))
    rows, columns = int(source.Rows), int(source.Columns)
    picks = [
        np.minimum(((np.arange(n) + 0.5) * size / n).astype(int), size - 1)
        for n, size in ((rows, height), (columns, width))
    ]
    pixels = drops[np.ix_(*picks)]
    return _map(heatmap, pixels, pixels, [source], model_name, class_name,
                series_number, content_label)  # fmt: skip


def _map(heatmap, pixel_array, drops: np.ndarray, sources: list, model_name: str,
         class_name: str, series_number: int, content_label: str):  # fmt: skip
    """highdicom's ParametricMap of ``pixel_array`` (a placed Volume, or one frame the
    source's size) with the drop's real-world value mapping and the run in its words."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    from .. import __version__

    low, high = float(drops.min()), float(drops.max())
    what = (
        f"Krypton occlusion {heatmap.mode}, {model_name}, class {class_name}, "
        f"patch {_side(heatmap.patch)}, stride {_side(heatmap.stride)}"
    )
    mapping = hd.pm.RealWorldValueMapping(
        lut_label="DROP",
        lut_explanation=f"drop in P({class_name}) with the patch occluding this voxel"[:64],
        unit=codes.UCUM.NoUnits,
        value_range=(min(low, 0.0), max(high, 1e-6)),
        slope=1.0,
        intercept=0.0,
    )
    created = hd.pm.ParametricMap(
        source_images=sources,
        pixel_array=pixel_array,
        series_instance_uid=hd.UID(),
        series_number=series_number,
        sop_instance_uid=hd.UID(),
        instance_number=1,
        manufacturer="Krypton",
        manufacturer_model_name=model_name[:64],
        software_versions=str(__version__),
        device_serial_number="none",
        contains_recognizable_visual_features=False,
        real_world_value_mappings=[mapping],
        # drops are fractions of a probability: a window under 1 wide, which DICOM allows
        # only with the LINEAR_EXACT function (dciodvfy refuses plain LINEAR)
        voi_lut_transformations=[
            hd.VOILUTTransformation(
                window_center=max(high, 1e-6) / 2,
                window_width=max(high, 1e-6),
                window_explanation="0 to the largest drop",
                voi_lut_function=hd.VOILUTFunctionValues.LINEAR_EXACT,
            )
        ],
        content_label=content_label,
        content_description=what[:64],
    )
    created.SeriesDescription = what[:64]
    # General Series' Laterality is Type 2C (paired body parts): the source's, else empty
    created.Laterality = sources[0].get("Laterality") or ""
    return created


def _side(value) -> str:
    sides = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    return str(sides[0]) if len(set(sides)) == 1 else "x".join(map(str, sides))
