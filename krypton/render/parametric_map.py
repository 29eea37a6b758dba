"""A heatmap as a DICOM Parametric Map (highdicom's ``ParametricMap``): float values a
viewer overlays on the source series, placed by the source's frame of reference.

Each voxel of the explained block holds the **drop in the class's probability** when the
patch covering it is occluded (the probability without occlusion minus the heatmap's
value at the nearest cell, :func:`krypton.render.volumes.voxel_values`; 0 beyond the
cells' reach), stated by a real-world value mapping.

The map lies on the **source's own grid** where the source is a stack of single-frame
slices (every CT and MR series): one frame per source slice, with its rows, columns and
pixel spacing and a per-frame derivation reference to that slice, each pixel the drop of
the model voxel (so of the cell) it falls in, never interpolated, 0 where the explained
block does not reach. Viewers overlay a map only on that grid, and OHIF 3.13 only on a
map with a frame for every slice (one of fewer frames fails in its loader: "Invalid
typed array length"). A source of another form (one multi-frame object) keeps
the model's resampled grid, placed by the same frame of reference. Either way the frames
are stored in ascending order along the slice normal, the order OHIF fills a volume in
(highdicom writes them in the opposite order, which OHIF drew mirrored head to foot).

The series description names the mode, model, class, patch and stride within DICOM's 64
characters; an out-of-distribution verdict goes into the map's Image Comments. An
image's map (:func:`image_parametric_map`) is one frame at the source image's own
pixels, placed as the source is.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .volumes import voxel_values

__all__ = [
    "parametric_map",
    "image_parametric_map",
    "drop_values",
    "drops_on_slices",
    "frames_ascending",
    "series_description",
    "source_slices",
    "RAS_TO_LPS",
]

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
    comments: str = "",
):
    """The Parametric Map of ``heatmap`` (a volume's, over the model's input block of
    ``shape``) whose voxels map to the patient frame by ``voxel_affine`` (RAS+, the
    prepared volume's), referencing the source series' datasets ``sources`` (headers
    suffice): on the sources' grid where they are slices (module docstring), else on the
    model's. ``content_label``: what a later search recognises the map by (DICOM's CS,
    at most 16 upper-case letters, digits and underscores); ``comments``: the run's
    caveats (an out-of-distribution verdict)."""
    import highdicom as hd

    if voxel_affine is None:
        raise ValueError("the source gave no scanner frame: a Parametric Map cannot be placed")
    frame = getattr(sources[0], "FrameOfReferenceUID", None)
    if frame is None:
        raise ValueError("the source series has no frame of reference to place a map on")
    drops = drop_values(heatmap, shape)
    slices = source_slices(sources)
    if slices is not None:
        # highdicom lays out the frames' groups and references; the values are written
        # after, once: its encoder holds a map three times over (1.2 GB for 512 x 512 x 300)
        shape = (len(slices), int(slices[0].Rows), int(slices[0].Columns))
        placeholder = np.broadcast_to(np.float32(0.0), shape)  # no memory behind it
        created = _map(heatmap, placeholder, drops, slices, model_name, class_name,
                       series_number, content_label)  # fmt: skip
        _write_frames(created, drops, np.asarray(voxel_affine), slices)
    else:
        volume = hd.Volume(drops, RAS_TO_LPS @ np.asarray(voxel_affine), "PATIENT", frame)
        created = _map(heatmap, volume, drops, list(sources), model_name, class_name,
                       series_number, content_label)  # fmt: skip
        frames_ascending(created)
    if comments:
        created.ImageComments = comments[:10240]
    return created


def _normal(orientation) -> np.ndarray:
    """The slice normal (row direction x column direction) of an Image Orientation."""
    cosines = np.asarray(orientation, dtype=np.float64)
    return np.cross(cosines[:3], cosines[3:])


def source_slices(sources: Sequence) -> list | None:
    """``sources`` as slices a map can be laid on, in ascending order along the slice
    normal: single-frame, each placed (position, orientation, pixel spacing), all with
    one orientation, one size and one spacing, no two at one position. None where they
    are not (a multi-frame object, a scout among the slices)."""
    placed = ("ImagePositionPatient", "ImageOrientationPatient", "PixelSpacing")
    if not sources or not all(all(source.get(k) for k in placed) for source in sources):
        return None
    if any(int(source.get("NumberOfFrames", 1) or 1) > 1 for source in sources):
        return None
    first = sources[0]
    same = all(
        np.allclose(source.ImageOrientationPatient, first.ImageOrientationPatient, atol=1e-4)
        and np.allclose(source.PixelSpacing, first.PixelSpacing, rtol=1e-4)
        and (source.Rows, source.Columns) == (first.Rows, first.Columns)
        for source in sources
    )
    if not same:
        return None
    normal = _normal(first.ImageOrientationPatient)
    distance = [float(normal @ np.asarray(s.ImagePositionPatient, float)) for s in sources]
    order = np.argsort(distance, kind="stable")
    if len(set(np.round(distance, 4))) != len(sources):
        return None
    return [sources[i] for i in order]


def _write_frames(created, drops: np.ndarray, voxel_affine: np.ndarray, slices: Sequence) -> None:
    """The map's frames in the order of ``slices`` (ascending along the normal), each
    frame's groups moved to its place by the slice it references, and their values
    (:func:`drops_on_slices`) written once as the map's Float Pixel Data."""
    del created.FloatPixelData  # the placeholder's zeros: not held beside the values
    place = {str(source.SOPInstanceUID): number for number, source in enumerate(slices)}
    groups = list(created.PerFrameFunctionalGroupsSequence)
    referenced = [
        place[str(g.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID)]
        for g in groups
    ]
    created.PerFrameFunctionalGroupsSequence = [groups[i] for i in np.argsort(referenced)]
    frames = drops_on_slices(drops, voxel_affine, slices)
    created.FloatPixelData = frames.tobytes()


def drops_on_slices(drops: np.ndarray, voxel_affine: np.ndarray, slices: Sequence) -> np.ndarray:
    """``drops`` (the model's block, (D, H, W), placed by ``voxel_affine``, RAS+) on each
    of ``slices``' pixels: (slices, rows, columns), each pixel the value of the model
    voxel its centre falls in, 0 outside the block. A model voxel ``n`` holds the
    centres within ``[n - 0.5, n + 0.5)`` of its own index (a centre on a boundary goes
    to the higher index): the convention of :mod:`krypton.io.model_grid`, the one that
    made the block. A slice at a time, so a 512 x 512 series costs one slice's indices
    at once."""
    out = np.empty((len(slices), int(slices[0].Rows), int(slices[0].Columns)), np.float32)
    for number, frame in enumerate(_slice_drops(drops, voxel_affine, slices)):
        out[number] = frame
    return out


def _slice_drops(drops: np.ndarray, voxel_affine: np.ndarray, slices: Sequence):
    """:func:`drops_on_slices`, a slice at a time."""
    to_voxel = np.linalg.inv(voxel_affine) @ RAS_TO_LPS  # LPS mm -> model voxel index
    linear, offset = to_voxel[:3, :3], to_voxel[:3, 3]
    rows, columns = int(slices[0].Rows), int(slices[0].Columns)
    row_spacing, column_spacing = (float(v) for v in slices[0].PixelSpacing)
    cosines = np.asarray(slices[0].ImageOrientationPatient, dtype=np.float64)
    along_column = linear @ (cosines[:3] * column_spacing)  # one column to the right
    along_row = linear @ (cosines[3:] * row_spacing)  # one row down
    shape = np.asarray(drops.shape)
    j, k = np.arange(rows)[:, None, None], np.arange(columns)[None, :, None]
    corners = np.array([[0, 0], [rows - 1, 0], [0, columns - 1], [rows - 1, columns - 1]])
    span = corners[:, :1] * along_row + corners[:, 1:] * along_column  # 4 x 3
    for source in slices:
        base = linear @ np.asarray(source.ImagePositionPatient, dtype=np.float64) + offset
        reach = base + span  # the slice's corners in model voxels
        if np.any((reach.max(axis=0) < -0.5) | (reach.min(axis=0) >= shape - 0.5)):
            yield np.zeros((rows, columns), np.float32)  # wholly beyond the block
            continue
        where = base + j * along_row + k * along_column
        # half-open [n - 0.5, n + 0.5), not rint's ties to even (1e-9: float error)
        index = np.floor(where + (0.5 + 1e-9)).astype(np.int64)
        inside = np.all((index >= 0) & (index < shape), axis=-1)
        clipped = np.clip(index, 0, shape - 1)
        picked = drops[clipped[..., 0], clipped[..., 1], clipped[..., 2]]
        yield np.where(inside, picked, 0.0).astype(np.float32)


def frames_ascending(created) -> None:
    """Reorder a placed map's frames (their pixels and per-frame groups together) into
    ascending order along the slice normal; each frame keeps its own position and
    source reference."""
    groups = created.PerFrameFunctionalGroupsSequence
    shared = created.SharedFunctionalGroupsSequence[0]
    if "PlaneOrientationSequence" in shared:
        orientation = shared.PlaneOrientationSequence[0].ImageOrientationPatient
    else:
        orientation = groups[0].PlaneOrientationSequence[0].ImageOrientationPatient
    normal = _normal(orientation)
    distance = [
        float(normal @ np.asarray(g.PlanePositionSequence[0].ImagePositionPatient, float))
        for g in groups
    ]
    order = np.argsort(distance, kind="stable")
    if np.array_equal(order, np.arange(len(order))):
        return
    element = "FloatPixelData" if "FloatPixelData" in created else "DoubleFloatPixelData"
    stored = memoryview(created[element].value)  # the frames' bytes, reordered in one copy
    size = len(stored) // len(groups)
    reordered = bytearray(len(stored))
    for place, frame in enumerate(order):
        reordered[place * size : (place + 1) * size] = stored[frame * size : (frame + 1) * size]
    created.PerFrameFunctionalGroupsSequence = [groups[i] for i in order]
    del stored
    setattr(created, element, bytes(reordered))


def image_parametric_map(
    heatmap,
    input_size: tuple[int, int],
    source,
    *,
    model_name: str,
    class_name: str,
    series_number: int = 9901,
    content_label: str = "OCCLUSION",
    comments: str = "",
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
    created = _map(heatmap, pixels, pixels, [source], model_name, class_name,
                   series_number, content_label)  # fmt: skip
    if comments:
        created.ImageComments = comments[:10240]
    return created


def _map(heatmap, pixel_array, drops: np.ndarray, sources: list, model_name: str,
         class_name: str, series_number: int, content_label: str):  # fmt: skip
    """highdicom's ParametricMap of ``pixel_array`` (a placed Volume, or one frame the
    source's size) with the drop's real-world value mapping and the run in its words."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    from .._version import __version__

    low, high = float(drops.min()), float(drops.max())
    what = series_description(heatmap.mode, model_name, class_name, heatmap.patch, heatmap.stride)
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
                window_center=[max(high, 1e-6) / 2],
                window_width=[max(high, 1e-6)],
                # one window, one explanation: highdicom splits a plain string into
                # one value per character
                window_explanation=["0 to the largest drop"],
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


def series_description(mode: str, model_name: str, class_name: str, patch, stride) -> str:
    """The map's (and captures') series description: mode, model, class, patch and
    stride within DICOM's 64 characters; long model and class names are shortened, the
    numbers never."""
    tail = f", patch {_side(patch)}, stride {_side(stride)}"
    # the words give way before a name is cut, and the numbers never: "Krypton exact, " and
    # ", class " left 16 characters for chestct-slice-demo ("chestct-slice-d~")
    for head, joint in ((f"Krypton {mode}, ", ", class "), (f"{mode}, ", ", ")):
        room = 64 - len(head) - len(joint) - len(tail)
        if len(model_name) + len(class_name) <= room:
            return f"{head}{model_name}{joint}{class_name}{tail}"
    class_room = min(len(class_name), max(room // 2, room - len(model_name)))
    model_room = room - class_room
    return f"{head}{_cut(model_name, model_room)}{joint}{_cut(class_name, class_room)}{tail}"


def _cut(name: str, room: int) -> str:
    return name if len(name) <= room else name[: max(room - 1, 0)] + "~"


def _side(value) -> str:
    sides = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    return str(sides[0]) if len(set(sides)) == 1 else "x".join(map(str, sides))
