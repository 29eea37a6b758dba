"""Hostile volumes, made here (seeded, a few kilobytes to a few megabytes each): files that
claim or hide sizes so that reading them as a volume would allocate gigabytes or take
minutes. Each maker returns ``(file name, bytes)``; :data:`HOSTILE_VOLUMES` names them all
for the tests and ``make bench-hostile``."""

from __future__ import annotations

import gzip
import io
import re
import zipfile
from collections.abc import Callable

import numpy as np

from bench.hostile import _deflated, deflate_bomb, shipped
from krypton.io.volumes import MAX_SLICES

ORIENTATION = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]


def ordinary_volume() -> bytes:
    """A 48³ chest CT at 5 mm as a .nii.gz, as a user would load."""
    import nibabel

    from krypton.synthetic.chestct import ChestCTGenerator

    hu = ChestCTGenerator(seed=5).sample(label=0).volume.astype(np.int16)
    image = nibabel.Nifti1Image(np.transpose(hu, (2, 1, 0)), np.diag([5.0, 5.0, 5.0, 1.0]))
    buffer = io.BytesIO()
    image.to_file_map({"image": nibabel.FileHolder(fileobj=buffer), "header": None})
    return gzip.compress(buffer.getvalue())


def _nifti(
    voxels: np.ndarray,
    zooms=(1.0, 1.0, 1.0),
    *,
    version: int = 1,
    offset: int | None = None,
    compressed: bool = True,
) -> bytes:
    """A NIfTI-1 or -2 single file of ``voxels`` with ``zooms`` written into its header
    as they are (NaN, inf and negatives included) and, if given, ``offset`` as its
    vox_offset (the voxels are not moved: the header lies)."""
    import nibabel

    kind = nibabel.Nifti1Image if version == 1 else nibabel.Nifti2Image
    image = kind(voxels, np.eye(4))
    header = image.header
    pixdim = header["pixdim"].copy()
    pixdim[1:4] = zooms
    header["pixdim"] = pixdim
    buffer = io.BytesIO()
    image.to_file_map({"image": nibabel.FileHolder(fileobj=buffer), "header": None})
    data = bytearray(buffer.getvalue())
    if offset is not None:  # vox_offset: float32 at 108 (NIfTI-1), int64 at 168 (NIfTI-2)
        if version == 1:
            data[108:112] = np.float32(offset).tobytes()
        else:
            data[168:176] = np.int64(offset).tobytes()
    return gzip.compress(bytes(data), 6) if compressed else bytes(data)


def resample_bomb(spacing: float = 312.5) -> tuple[str, bytes]:
    """16³ voxels of ``spacing`` mm: resampled to a 5 mm grid, 1000³ (+3.8 GB before)."""
    return "resample.nii.gz", _nifti(np.zeros((16, 16, 16), np.float32), (spacing,) * 3)


def resample_bomb_nifti2(spacing: float = 250.0) -> tuple[str, bytes]:
    return "resample2.nii", _nifti(
        np.zeros((16, 16, 16), np.float32), (spacing,) * 3, version=2, compressed=False
    )


def odd_spacing(value: float) -> Callable[[], tuple[str, bytes]]:
    def make() -> tuple[str, bytes]:
        return "spacing.nii.gz", _nifti(np.zeros((16, 16, 16), np.float32), (1.0, value, 1.0))

    return make


def _seeking_gzip(head: bytes, offset: int, tail: bytes) -> bytes:
    """A gzip file whose stream is ``head``, zeros up to ``offset``, then ``tail``: made
    of concatenated gzip members (which gzip readers read as one stream), so an offset
    of gigabytes costs megabytes and milliseconds to make."""
    step = 16 << 20
    zeros = offset - len(head)
    block = gzip.compress(bytes(step), 9)
    return b"".join(
        [gzip.compress(head, 9), block * (zeros // step), gzip.compress(bytes(zeros % step) + tail)]
    )


def gzip_seek(offset: int = 8 * 2**30, version: int = 2) -> tuple[str, bytes]:
    """A .nii.gz whose voxels really lie ``offset`` bytes into the gzip stream (8 GiB: a
    9 MB file that kept a thread inflating for over a minute)."""
    voxels = np.zeros((16, 16, 16), np.float32)
    plain = _nifti(voxels, version=version, offset=offset, compressed=False)
    start = 352 if version == 1 else 544
    return f"seek{version}.nii.gz", _seeking_gzip(plain[:start], offset, voxels.tobytes())


def gzip_seek_nifti1(offset: int = 2**30) -> tuple[str, bytes]:
    return gzip_seek(offset, version=1)


def offset_past_end() -> tuple[str, bytes]:
    """An uncompressed .nii whose voxels would lie 4 GiB past its end."""
    data = _nifti(np.zeros((16, 16, 16), np.float32), version=2, offset=4 * 2**30, compressed=False)
    return "past.nii", data


def rgb_nifti() -> tuple[str, bytes]:
    voxels = np.zeros((8, 8, 8), dtype=[("R", "u1"), ("G", "u1"), ("B", "u1")])
    return "rgb.nii.gz", _nifti(voxels)


def complex_nifti() -> tuple[str, bytes]:
    return "complex.nii.gz", _nifti(np.zeros((8, 8, 8), np.complex128))


def big_complex_nifti() -> tuple[str, bytes]:
    """complex128 300x320x320 (+956 MB before, against 245 MB estimated): zeros, so small."""
    return "complex-big.nii.gz", _nifti(np.zeros((300, 320, 320), np.complex128))


def truncated_nifti() -> tuple[str, bytes]:
    whole = _nifti(np.random.default_rng(0).normal(size=(32, 32, 32)).astype(np.float32))
    return "truncated.nii.gz", whole[: len(whole) // 2]


def analyze_pair() -> dict[str, bytes]:
    """An ANALYZE 7.5 pair (.hdr, .img) of 16³ voxels claiming 312.5 mm."""
    import nibabel

    image = nibabel.AnalyzeImage(np.zeros((16, 16, 16), np.float32), np.diag([312.5] * 3 + [1]))
    header, voxels = io.BytesIO(), io.BytesIO()
    image.to_file_map(
        {"header": nibabel.FileHolder(fileobj=header), "image": nibabel.FileHolder(fileobj=voxels)}
    )
    return {"pair.hdr": header.getvalue(), "pair.img": voxels.getvalue()}


def _slice(index: int, rows: int = 64, columns: int = 64, **tags):
    """A CT slice of pydicom's CT_small, placed at ``index`` * 2.5 mm along z."""
    import pydicom
    from pydicom.uid import ExplicitVRLittleEndian

    dataset = pydicom.dcmread(shipped("CT_small.dcm"))
    dataset.SeriesInstanceUID = "1.2.3.4.5.6.7"
    dataset.ImageOrientationPatient = ORIENTATION
    dataset.ImagePositionPatient = [0.0, 0.0, 2.5 * index]
    dataset.PixelSpacing = [1.0, 1.0]
    dataset.Rows, dataset.Columns = rows, columns
    dataset.BitsAllocated, dataset.BitsStored, dataset.HighBit = 16, 16, 15
    dataset.PixelRepresentation = 0
    if "PixelPaddingValue" in dataset:  # signed in CT_small; these slices are unsigned
        del dataset.PixelPaddingValue
    dataset.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    for keyword, value in tags.items():
        setattr(dataset, keyword, value)
    return dataset


def _saved(dataset) -> bytes:
    buffer = io.BytesIO()
    dataset.save_as(buffer, enforce_file_format=True)
    return buffer.getvalue()


def tiny_series(count: int = MAX_SLICES, side: int = 4) -> tuple[str, bytes]:
    """A valid series at the slice limit: ``count`` slices of ``side``² voxels, zipped (the
    load an attacker kept 32 of in flight; 24 s a read once)."""
    pixels = np.arange(side * side, dtype=np.uint16).reshape(side, side)
    slices = {}
    for index in range(count):
        dataset = _slice(index, side, side)
        dataset.PixelData = (pixels + index).tobytes()
        slices[f"slice{index:04d}.dcm"] = _saved(dataset)
    return "tiny-series.zip", zipped(slices)


def zipped(entries: dict[str, bytes]) -> bytes:
    """A zip archive (deflated) of ``entries``: name -> bytes."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def deflated_series(side: int = 16384, count: int = 2) -> tuple[str, bytes]:
    """A zip of ``count`` deflated slices that each inflate to side² 16-bit values (512 MB
    at 16384): about 0.5 MB a slice."""
    return "deflated-series.zip", zipped(
        {f"slice{i}.dcm": deflate_bomb(side, side) for i in range(count)}
    )


def deflated_multiframe(side: int = 23170) -> tuple[str, bytes]:
    """One deflated DICOM file that inflates to side² 16-bit values (1 GB at 23170)."""
    return "deflated.dcm", deflate_bomb(side, side)


def _coded_liar(index: int, syntax: str, side: int) -> bytes:
    """A 64² slice whose compressed frame is really side²."""
    from pydicom.encaps import encapsulate

    uid, stream = _codestream(syntax, side)
    dataset = _slice(index)
    dataset.file_meta.TransferSyntaxUID = uid
    dataset.PixelData = encapsulate([stream])
    dataset["PixelData"].VR = "OB"
    return _saved(dataset)


def codestream_series(syntax: str = "jpeg2000", side: int = 16384) -> tuple[str, bytes]:
    """A zip of 4 slices whose headers say 64² and whose codestreams are side²."""
    return f"coded-{syntax}.zip", zipped(
        {f"slice{i}.dcm": _coded_liar(i, syntax, side) for i in range(4)}
    )


def codestream_multiframe(syntax: str = "jpeg2000", side: int = 16384) -> tuple[str, bytes]:
    """A multi-frame file of 4 frames whose header says 32² and whose last frame's
    codestream is side² (the first three are honest)."""
    import pydicom
    from pydicom.encaps import encapsulate

    dataset = pydicom.dcmread(io.BytesIO(many_frames(4, 32)[1]))
    honest = _codestream(syntax, 32)
    dataset.file_meta.TransferSyntaxUID = honest[0]
    dataset.PixelData = encapsulate([honest[1]] * 3 + [_codestream(syntax, side)[1]])
    dataset["PixelData"].VR = "OB"
    return f"coded-{syntax}.dcm", _saved(dataset)


def _codestream(syntax: str, side: int):
    """(transfer syntax, one codestream of side² 16-bit zeros)."""
    zeros = np.zeros((side, side), np.uint16)
    if syntax == "jpeg2000":
        from openjpeg import encode
        from pydicom.uid import JPEG2000Lossless

        return JPEG2000Lossless, bytes(encode(zeros, photometric_interpretation=2))
    import jpeg_ls
    from pydicom.uid import JPEGLSLossless

    return JPEGLSLossless, bytes(jpeg_ls.encode(zeros))


def _multiframe(frames: int, rows: int = 8, columns: int = 8):
    """A Legacy Converted Enhanced CT of ``frames`` tiny frames (highdicom)."""
    import highdicom
    import pydicom
    from pydicom.uid import generate_uid

    slices = []
    for index in range(frames):
        dataset = _slice(index, rows, columns)
        dataset.SOPInstanceUID = generate_uid()
        dataset.InstanceNumber = index + 1
        dataset.PixelData = np.zeros((rows, columns), np.uint16).tobytes()
        slices.append(pydicom.dcmread(io.BytesIO(_saved(dataset))))
    return highdicom.legacy.LegacyConvertedEnhancedCTImage(
        slices, generate_uid(), 1, generate_uid(), 1
    )


def many_frames(frames: int = 20_000, side: int = 8) -> tuple[str, bytes]:
    """A multi-frame file of ``frames`` real side² frames, each placed 2.5 mm further along
    (a few MB); made from a two-frame conversion whose per-frame groups are repeated."""
    import copy

    converted = _multiframe(2, side, side)
    first = converted.PerFrameFunctionalGroupsSequence[0]
    groups = []
    for index in range(frames):
        group = copy.deepcopy(first)
        group.PlanePositionSequence[0].ImagePositionPatient = [0.0, 0.0, 2.5 * index]
        groups.append(group)
    converted.PerFrameFunctionalGroupsSequence = groups
    converted.NumberOfFrames = frames
    converted.PixelData = np.zeros((frames, side, side), np.uint16).tobytes()
    return "frames.dcm", _saved(converted)


def deflated_many_frames(frames: int = 3000) -> tuple[str, bytes]:
    """The same, deflated: the frame count is only known after inflating the header."""
    return "frames-deflated.dcm", _deflated(many_frames(frames)[1])


# name -> maker; every maker returns (file name, bytes)
HOSTILE_VOLUMES: dict[str, Callable[[], tuple[str, bytes]]] = {
    "resample 312.5 mm (NIfTI-1 .nii.gz)": resample_bomb,
    "resample 250 mm (NIfTI-2 .nii)": resample_bomb_nifti2,
    "spacing inf": odd_spacing(float("inf")),
    "spacing NaN": odd_spacing(float("nan")),
    "spacing 1e6": odd_spacing(1e6),
    "spacing 0": odd_spacing(0.0),
    "spacing -1": odd_spacing(-1.0),
    "gzip seek 8 GiB (NIfTI-2)": gzip_seek,
    "gzip seek 1 GiB (NIfTI-1)": gzip_seek_nifti1,
    "offset past the end (.nii)": offset_past_end,
    "RGB24 NIfTI": rgb_nifti,
    "complex128 NIfTI 300x320x320": big_complex_nifti,
    "truncated .nii.gz": truncated_nifti,
    "deflated series 2 x 512 MB": deflated_series,
    "deflated multi-frame 1 GB": deflated_multiframe,
    "JPEG 2000 series hiding 16384²": codestream_series,
    "JPEG-LS series hiding 16384²": lambda: codestream_series("jpeg-ls"),
    "JPEG 2000 multi-frame hiding 16384²": codestream_multiframe,
    "JPEG-LS multi-frame hiding 16384²": lambda: codestream_multiframe("jpeg-ls"),
    "multi-frame 20,000 frames": many_frames,
    "deflated multi-frame 3,000 frames": deflated_many_frames,
}


# name in HOSTILE_VOLUMES -> what its refusal must say (what was found and the limit)
REFUSALS = {
    "resample 312.5 mm (NIfTI-1 .nii.gz)": "312.5 x 312.5 x 312.5 mm.*at most 20 mm",
    "resample 250 mm (NIfTI-2 .nii)": "250 x 250 x 250 mm.*at most 20 mm",
    "spacing inf": "1 x inf x 1 mm.*at most 20 mm",
    "spacing NaN": "1 x nan x 1 mm.*at most 20 mm",
    "spacing 1e6": "1 x 1e\\+06 x 1 mm.*at most 20 mm",
    "spacing 0": "1 x 0 x 1 mm.*more than 0",
    "spacing -1": "1 x -1 x 1 mm.*more than 0",
    "gzip seek 8 GiB (NIfTI-2)": "8,192 MB into the stream.*decode budget of 256 MB",
    "gzip seek 1 GiB (NIfTI-1)": "1,024 MB into the stream.*decode budget of 256 MB",
    "offset past the end (.nii)": "truncated.*at byte 4,294,967,296.*holds 16,928 bytes",
    "RGB24 NIfTI": "one real value per voxel",
    "complex128 NIfTI 300x320x320": "complex128 voxels.*one real value per voxel",
    "truncated .nii.gz": "may be truncated",
    "deflated series 2 x 512 MB": "inflates to more than 64 MB.*decode budget of 256 MB",
    "deflated multi-frame 1 GB": "inflates to more than 64 MB.*decode budget of 256 MB",
    "JPEG 2000 series hiding 16384²": "16384x16384.*header says 64x64",
    "JPEG-LS series hiding 16384²": "16384x16384.*header says 64x64",
    "JPEG 2000 multi-frame hiding 16384²": "frame 3 is 16384x16384.*header says 32x32",
    "JPEG-LS multi-frame hiding 16384²": "frame 3 is 16384x16384.*header says 32x32",
    "multi-frame 20,000 frames": f"declares 20000 frames, over {MAX_SLICES}",
    "deflated multi-frame 3,000 frames": f"declares 3000 frames, over {MAX_SLICES}",
}
# makers too slow for a test suite: a smaller size that takes the same path
_SMALLER = {
    "multi-frame 20,000 frames": lambda: many_frames(MAX_SLICES + 1),
    "deflated multi-frame 3,000 frames": lambda: deflated_many_frames(MAX_SLICES + 1),
}


def for_tests(name: str) -> tuple[str, bytes, str]:
    """(file name, bytes, what the refusal must say) of the hostile volume ``name``, at a
    size a test suite can make in seconds (the frame counts just over the limit)."""
    expected = REFUSALS[name]
    if name in _SMALLER:
        filename, data = _SMALLER[name]()
        return filename, data, re.sub(r"declares \d+", f"declares {MAX_SLICES + 1}", expected)
    filename, data = HOSTILE_VOLUMES[name]()
    return filename, data, expected
