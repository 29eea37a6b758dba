"""Hostile files, made here (seeded, a few kilobytes each): decode bombs in
every format Krypton reads, and the DICOM fuzz variants."""

from __future__ import annotations

import io
import zlib

import numpy as np
from PIL import Image

DICOM_SAMPLES = (
    "CT_small.dcm",
    "MR_small.dcm",
    "JPEG2000.dcm",
    "MR_small_RLE.dcm",
    "SC_rgb_rle.dcm",
    "image_dfl.dcm",
    "rtdose.dcm",
    "JPEGLSNearLossless_16.dcm",
)


def shipped(name: str) -> str:
    """A DICOM test file pydicom ships (never downloaded)."""
    from pathlib import Path

    import pydicom

    return str(Path(pydicom.__file__).parent / "data" / "test_files" / name)


def _dicom(rows: int, columns: int, syntax, pixel_data: bytes, bits: int = 16, **tags) -> bytes:
    import pydicom

    dataset = pydicom.dcmread(shipped("CT_small.dcm"))
    dataset.Rows, dataset.Columns = rows, columns
    dataset.BitsAllocated, dataset.BitsStored, dataset.HighBit = bits, bits, bits - 1
    dataset.PixelRepresentation = 0
    for keyword, value in tags.items():
        setattr(dataset, keyword, value)
    dataset.file_meta.TransferSyntaxUID = syntax
    dataset.PixelData = pixel_data
    if syntax.is_encapsulated:
        dataset["PixelData"].VR = "OB"
    buffer = io.BytesIO()
    dataset.save_as(buffer, enforce_file_format=True)
    return buffer.getvalue()


def j2k_bomb(side: int = 8192) -> bytes:
    """A JPEG 2000 DICOM of side x side 16-bit zeros: about a kilobyte."""
    from openjpeg import encode
    from pydicom.encaps import encapsulate
    from pydicom.uid import JPEG2000Lossless

    stream = encode(np.zeros((side, side), np.uint16), photometric_interpretation=2)
    return _dicom(side, side, JPEG2000Lossless, encapsulate([bytes(stream)]))


def jpeg_ls_bomb(side: int = 8192) -> bytes:
    import jpeg_ls
    from pydicom.encaps import encapsulate
    from pydicom.uid import JPEGLSLossless

    stream = bytes(jpeg_ls.encode(np.zeros((side, side), np.uint16)))
    return _dicom(side, side, JPEGLSLossless, encapsulate([stream]))


def deflate_bomb(rows: int = 8192, columns: int = 8192) -> bytes:
    """A Deflated Explicit VR DICOM of rows x columns 16-bit zeros: 8192 x 8192 (128 MB)
    deflates to about 130 KB, 23170 x 23170 (1 GB) to about 1 MB. Made as a stream: the
    zeros are never held whole."""
    import pydicom
    from pydicom.uid import ExplicitVRLittleEndian

    dataset = pydicom.dcmread(shipped("CT_small.dcm"))
    del dataset.PixelData
    dataset.Rows, dataset.Columns = rows, columns
    dataset.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    buffer = io.BytesIO()
    dataset.save_as(buffer, enforce_file_format=True)
    length = rows * columns * 2
    element = b"\xe0\x7f\x10\x00OW\x00\x00" + length.to_bytes(4, "little")
    zeros = bytes(1 << 24)
    chunks = [zeros] * (length // len(zeros)) + [bytes(length % len(zeros))]
    return _deflated(buffer.getvalue(), [element, *chunks])


def _deflated(plain: bytes, more: tuple[bytes, ...] | list[bytes] = ()) -> bytes:
    """A Part 10 file (and ``more`` bytes after it) in Deflated Explicit VR Little Endian."""
    from pydicom.filebase import DicomBytesIO
    from pydicom.filereader import _read_file_meta_info, read_preamble
    from pydicom.filewriter import write_file_meta_info
    from pydicom.uid import DeflatedExplicitVRLittleEndian

    handle = io.BytesIO(plain)
    read_preamble(handle, force=True)
    meta = _read_file_meta_info(handle)
    body = plain[handle.tell() :]
    meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
    out = DicomBytesIO()
    out.write(b"\0" * 128 + b"DICM")
    write_file_meta_info(out, meta, enforce_standard=True)
    packer = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    deflated = [packer.compress(body)] + [packer.compress(part) for part in more]
    return out.getvalue() + b"".join(deflated) + packer.flush()


def truncated_deflate() -> bytes:
    data = deflate_bomb(512, 512)
    return data[: len(data) - 200]


def rle_liar() -> bytes:
    """An RLE file claiming 65535 x 65535 x 1000 frames of 16 bits (a few hundred bytes)."""
    from pydicom.encaps import encapsulate
    from pydicom.uid import RLELossless

    header = (1).to_bytes(4, "little") + (64).to_bytes(4, "little") + bytes(56)
    return _dicom(65535, 65535, RLELossless, encapsulate([header + b"\x00\x00"]),
                  NumberOfFrames=1000)  # fmt: skip


def png16_bomb(side: int = 7000) -> bytes:
    """A 16-bit gray PNG of side x side (49 MP at 7000): about 100 KB."""
    buffer = io.BytesIO()
    Image.new("I;16", (side, side)).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def tiff_float_bomb(side: int = 7000) -> bytes:
    """A float32 TIFF of side x side, deflate-compressed: about 200 KB."""
    buffer = io.BytesIO()
    Image.new("F", (side, side)).save(buffer, format="TIFF", compression="tiff_adobe_deflate")
    return buffer.getvalue()


_SYNTAXES = (
    "1.2.840.10008.1.2", "1.2.840.10008.1.2.1", "1.2.840.10008.1.2.2", "1.2.840.10008.1.2.1.99",
    "1.2.840.10008.1.2.4.50", "1.2.840.10008.1.2.4.80", "1.2.840.10008.1.2.4.90",
    "1.2.840.10008.1.2.5", "1.2.3.4.5",
)  # fmt: skip


def _lying(data: bytes, rng: np.random.Generator) -> bytes:
    """The file with one header tag changed to a lie (or the wrong transfer syntax)."""
    import pydicom

    dataset = pydicom.dcmread(io.BytesIO(data))
    choice = int(rng.integers(6))
    if choice == 0:
        dataset.Rows = int(rng.choice([1, 2, 255, 4096, 30000, 65535]))
    elif choice == 1:
        dataset.Columns = int(rng.choice([1, 3, 511, 8192, 40000, 65535]))
    elif choice == 2:
        dataset.NumberOfFrames = int(rng.choice([0, 2, 7, 1000, 99999, 2**31 - 1]))
    elif choice == 3:
        dataset.BitsAllocated = int(rng.choice([0, 1, 7, 12, 32, 64, 255]))
    elif choice == 4:
        dataset.SamplesPerPixel = int(rng.choice([0, 2, 3, 4, 5, 200]))
    else:
        dataset.file_meta.TransferSyntaxUID = str(rng.choice(_SYNTAXES))
    buffer = io.BytesIO()
    try:
        dataset.save_as(buffer, enforce_file_format=False)
    except Exception:  # pydicom refuses to write some lies: fall back to a bit flip
        return _flipped(data, rng)
    return buffer.getvalue()


def _flipped(data: bytes, rng: np.random.Generator) -> bytes:
    """1-8 bit flips in the first kilobyte after the preamble (the headers)."""
    mutable = bytearray(data)
    for _ in range(int(rng.integers(1, 9))):
        position = int(rng.integers(128, min(len(mutable), 1152)))
        mutable[position] ^= 1 << int(rng.integers(8))
    return bytes(mutable)


def dicom_fuzz_variants(count: int = 400, seed: int = 0):
    """``count`` seeded variants of the shipped samples (and a deflated one): truncations,
    header bit flips, lying Rows/Columns/NumberOfFrames/BitsAllocated/SamplesPerPixel and
    wrong transfer syntaxes. Yields (description, bytes)."""
    rng = np.random.default_rng(seed)
    sources = {name: open(shipped(name), "rb").read() for name in DICOM_SAMPLES}
    sources["deflated CT"] = _deflated(sources["CT_small.dcm"])
    names = sorted(sources)
    for index in range(count):
        name = names[index % len(names)]
        data = sources[name]
        kind = ("truncated", "flipped", "lying")[index // len(names) % 3]
        if kind == "truncated":
            variant = data[: int(rng.integers(1, len(data)))]
        elif kind == "flipped":
            variant = _flipped(data, rng)
        else:
            variant = _lying(data, rng)
        yield f"{kind} {name} #{index}", variant
