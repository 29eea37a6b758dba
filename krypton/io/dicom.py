"""DICOM images in: modality LUT, VOI windowing, MONOCHROME1, frames, pixel spacing.

What the model sees is exactly what is displayed: the frame after the modality LUT
(rescale slope/intercept, PS3.3 C.11.1), windowed (C.11.2: the file's VOI LUT or window,
a preset, or a given centre/width), inverted for MONOCHROME1, as 8-bit gray in RGB.
Identifying tags never leave this module: :attr:`DicomImage.info` holds modality, body
part, study date and size only.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ._decoding import (
    DECODE_BUDGET,
    DECODE_BUDGET_ENV,
    DICOM_DECODE_FACTOR,
    ImageLoadError,
    plain_reason,
    reduced_to_max_side,
)

__all__ = [
    "WINDOW_PRESETS",
    "IDENTIFYING_KEYWORDS",
    "DicomImage",
    "is_dicom",
    "load_dicom",
    "parse_window",
    "decodable_transfer_syntaxes",
]

# (centre, width) in Hounsfield units, the usual CT reading windows
WINDOW_PRESETS: dict[str, tuple[float, float]] = {
    "lung": (-600.0, 1500.0),
    "mediastinum": (40.0, 400.0),
    "bone": (400.0, 1800.0),
    "brain": (40.0, 80.0),
}


# Attributes that identify a patient or a visit (after PS3.15 E.1-1's basic profile): never
# logged, never in a file name, copied into an export only when the user asks for it.
IDENTIFYING_KEYWORDS = (
    "PatientName",
    "PatientID",
    "IssuerOfPatientID",
    "OtherPatientIDs",
    "OtherPatientNames",
    "PatientBirthDate",
    "PatientBirthTime",
    "PatientSex",
    "PatientAge",
    "PatientAddress",
    "PatientTelephoneNumbers",
    "PatientMotherBirthName",
    "AccessionNumber",
    "ReferringPhysicianName",
    "PerformingPhysicianName",
    "OperatorsName",
    "InstitutionName",
    "InstitutionAddress",
    "StationName",
    "StudyID",
    "DeviceSerialNumber",
)


def decodable_transfer_syntaxes() -> list[str]:
    """Names of the transfer syntaxes this installation can decode (native ones and every
    compressed syntax pydicom has an available decoder plug-in for)."""
    import pydicom.uid as uids
    from pydicom.pixels import get_decoder

    names = []
    for value in vars(uids).values():
        if not (isinstance(value, uids.UID) and value.is_transfer_syntax):
            continue
        if value.is_compressed:
            try:
                if not get_decoder(value).is_available:
                    continue
            except NotImplementedError:
                continue
        names.append(value.name)
    return sorted(set(names))


@dataclass
class DicomImage:
    """One frame of a DICOM file as the model and the user see it."""

    picture: Image.Image  # 8-bit RGB (gray replicated for monochrome images)
    window: tuple[float, float] | None  # (centre, width) applied, None for a LUT / colour
    window_source: str  # "file", "preset lung", "given", "VOI LUT", "full range", "colour"
    frame: int
    frames: int
    pixel_spacing: tuple[float, float] | None  # mm between rows, columns (if recorded)
    info: dict = field(default_factory=dict)  # non-identifying facts only

    def window_text(self) -> str:
        """How the frame was windowed, for people: 'window C 40 / W 400 (preset ...)'."""
        if self.window is None:
            return f"the file's {self.window_source}"
        return f"window C {self.window[0]:g} / W {self.window[1]:g} ({self.window_source})"


def is_dicom(source: str | Path | bytes) -> bool:
    """True for DICOM Part 10 files (the 'DICM' marker after the 128-byte preamble)."""
    if isinstance(source, (bytes, bytearray)):
        head = bytes(source[:132])
    else:
        try:
            with open(source, "rb") as handle:
                head = handle.read(132)
        except OSError:
            return False
    return len(head) == 132 and head[128:132] == b"DICM"


def parse_window(text: str | tuple | None) -> str | tuple[float, float] | None:
    """A preset name, 'centre,width', a (centre, width) pair, or None (the file's)."""
    if text is None or isinstance(text, tuple):
        return text
    name = text.strip().lower()
    if name in WINDOW_PRESETS:
        return name
    try:
        centre, width = (float(v) for v in name.split(","))
    except ValueError:
        raise ValueError(
            f"window must be one of {', '.join(WINDOW_PRESETS)} or 'centre,width'; got {text!r}"
        ) from None
    if width < 1:
        raise ValueError(f"window width must be at least 1, got {width:g}")
    return centre, width


def linear_window(values: np.ndarray, centre: float, width: float, function: str) -> np.ndarray:
    """VOI windowing to [0, 1] (PS3.3 C.11.2.1.2: LINEAR, LINEAR_EXACT, SIGMOID)."""
    values = values.astype(np.float64)
    if function == "SIGMOID":
        return 1.0 / (1.0 + np.exp(-4.0 * (values - centre) / width))
    if function == "LINEAR_EXACT":
        return np.clip((values - centre) / width + 0.5, 0.0, 1.0)
    width = max(width, 1.0)
    if width == 1.0:
        return (values > centre - 0.5).astype(np.float64)
    return np.clip((values - (centre - 0.5)) / (width - 1.0) + 0.5, 0.0, 1.0)


def _read(source: str | Path | bytes):
    """The dataset of a DICOM file (bytes or a path) and a name for messages. Deflated
    files are inflated through a bounded inflater first: never more than the decode
    budget allows."""
    import pydicom

    name = "uploaded data" if isinstance(source, (bytes, bytearray)) else Path(source).name
    try:
        data = (
            bytes(source) if isinstance(source, (bytes, bytearray)) else Path(source).read_bytes()
        )
    except FileNotFoundError as exc:
        raise ImageLoadError(f"no such file: {source}") from exc
    except OSError as exc:
        raise ImageLoadError(f"{name} could not be read ({plain_reason(exc)})") from exc
    data = _inflated(data, name)
    try:
        return pydicom.dcmread(io.BytesIO(data)), name
    except Exception as exc:  # pydicom raises many kinds on malformed files
        raise ImageLoadError(f"{name} is not a readable DICOM file ({plain_reason(exc)})") from exc


def read_header(data: bytes, name: str):
    """The header of a DICOM file's ``data`` (pixels not read), a deflated file inflated
    through the bounded inflater first (pydicom would inflate all of it to read one tag).
    Raises :class:`ImageLoadError`: for a file that is not DICOM, or that inflates past
    the budget."""
    import pydicom

    data = _inflated(data, name)
    try:
        header = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
    except Exception as exc:  # pydicom raises many kinds on malformed files
        raise ImageLoadError(f"{name} is not a readable DICOM file ({plain_reason(exc)})") from exc
    header.buffer = None  # pydicom keeps the stream it read (the whole file) otherwise
    return header


def inflated_limit() -> int:
    """The most bytes one deflated DICOM file may inflate to: the decode budget's share
    of the decoded frame or volume (a larger one could not be decoded within it)."""
    return int(DECODE_BUDGET.limit_bytes / DICOM_DECODE_FACTOR)


def _inflated(data: bytes, name: str, limit: int | None = None) -> bytes:
    """A Deflated Explicit VR file rewritten as plain Explicit VR, inflated at most to
    ``limit`` bytes (default :func:`inflated_limit`; pydicom would inflate all of it at
    once); other files unchanged."""
    import zlib

    from pydicom.filebase import DicomBytesIO
    from pydicom.filereader import _read_file_meta_info, read_preamble
    from pydicom.filewriter import write_file_meta_info
    from pydicom.uid import DeflatedExplicitVRLittleEndian, ExplicitVRLittleEndian

    handle = io.BytesIO(data)
    try:
        read_preamble(handle, force=True)
        meta = _read_file_meta_info(handle)
        if meta.get("TransferSyntaxUID") != DeflatedExplicitVRLittleEndian:
            return data
    except Exception:  # not a readable Part 10 header: dcmread says what is wrong
        return data
    limit = inflated_limit() if limit is None else max(int(limit), 0)
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    rewritten = DicomBytesIO()
    rewritten.write(b"\0" * 128 + b"DICM")
    write_file_meta_info(rewritten, meta, enforce_standard=True)
    plain = bytearray(rewritten.getvalue())  # the body is inflated onto it: no second copy
    start, inflater = len(plain), zlib.decompressobj(-zlib.MAX_WBITS)
    pending: bytes | memoryview = memoryview(data)[handle.tell() :]
    try:
        while not inflater.eof and len(plain) - start <= limit:
            chunk = inflater.decompress(
                pending, min(_INFLATE_STEP, limit + 1 - (len(plain) - start))
            )
            pending = inflater.unconsumed_tail
            if not chunk and not pending:
                break  # the stream ended before its end marker
            plain += chunk
    except zlib.error as exc:
        raise ImageLoadError(f"{name}: its deflated data is corrupt ({plain_reason(exc)})") from exc
    if len(plain) - start > limit:
        raise ImageLoadError(
            f"{name} is deflated and inflates to more than {limit / 2**20:.0f} MB, over what "
            f"this server's decode budget of {DECODE_BUDGET.limit_bytes / 2**20:.0f} MB "
            f"({DECODE_BUDGET_ENV}) allows it"
        )
    if not inflater.eof:
        raise ImageLoadError(f"{name}: its deflated data is truncated")
    return bytes(plain)


# Inflated at a time: the bounded inflater's step (small: 16 MB steps left each of eight
# server threads holding freed steps in its own malloc arena, +342 MB for eight bombs).
_INFLATE_STEP = 1 << 20
_PIXEL_KEYWORDS = ("PixelData", "FloatPixelData", "DoubleFloatPixelData")
# More frames than any acquisition has: a header claiming them is lying.
_MAX_FRAMES = 100_000


def _header_int(dataset, keyword: str, name: str, default: int | None = None) -> int:
    value = dataset.get(keyword, default)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ImageLoadError(f"{name}: {keyword} is {value!r}, not a whole number") from None
    if number < 1:
        raise ImageLoadError(f"{name}: {keyword} is {number}; it must be at least 1")
    return number


def _frame_cost(dataset, name: str, frame: int) -> int:
    """The decode budget's verdict on one frame, from the header (and, for compressed
    frames, from the codestream's own header, which is what the decoder allocates by)."""
    rows = _header_int(dataset, "Rows", name)
    columns = _header_int(dataset, "Columns", name)
    samples = _header_int(dataset, "SamplesPerPixel", name, 1)
    frames = _header_int(dataset, "NumberOfFrames", name, 1)
    if samples > 4 or frames > _MAX_FRAMES:
        raise ImageLoadError(
            f"{name} declares {samples} samples per pixel and {frames} frames; not an image "
            f"Krypton reads"
        )
    if "FloatPixelData" in dataset or "DoubleFloatPixelData" in dataset:
        bits = 32 if "FloatPixelData" in dataset else 64
    else:
        bits = _header_int(dataset, "BitsAllocated", name)
        if bits not in (1, 8, 16, 32, 64):
            raise ImageLoadError(f"{name}: BitsAllocated is {bits}; DICOM allows 1, 8, 16, 32, 64")
    shape = (rows, columns, samples)
    what = f"{columns}x{rows} pixels of {samples} x {bits} bits per frame"
    cost = DECODE_BUDGET.cost(name, what, shape, max(bits, 8) / 8, DICOM_DECODE_FACTOR)
    syntax = getattr(getattr(dataset, "file_meta", None), "TransferSyntaxUID", None)
    if syntax is None or not syntax.is_encapsulated:
        # Native data: pydicom decodes what is there, which a lying header understates
        # (a frame's share of the data present, since only one frame is decoded).
        element = next((k for k in _PIXEL_KEYWORDS if k in dataset), None)
        present = len(dataset[element].value or b"") // frames if element else 0
        stored = DECODE_BUDGET.cost(name, what, (max(present, 1),), 1.0, DICOM_DECODE_FACTOR)
        return max(cost, stored)
    if "PixelData" in dataset:
        check_codestreams(dataset, name, (frame,))
    return cost


def check_codestreams(dataset, name: str, frames: tuple[int, ...] | None = None) -> None:
    """Refuse a compressed frame whose codestream declares another size than the header
    (the decoder allocates by the codestream, so a small header can hide a huge frame):
    the frames numbered in ``frames``, or every frame. Native data is not checked here."""
    from pydicom.encaps import generate_frames, get_frame

    syntax = getattr(getattr(dataset, "file_meta", None), "TransferSyntaxUID", None)
    if syntax is None or not syntax.is_encapsulated or "PixelData" not in dataset:
        return
    count = _header_int(dataset, "NumberOfFrames", name, 1)
    shape = (
        _header_int(dataset, "Rows", name),
        _header_int(dataset, "Columns", name),
        _header_int(dataset, "SamplesPerPixel", name, 1),
    )
    try:
        if frames is None:
            coded_frames = enumerate(generate_frames(dataset.PixelData, number_of_frames=count))
        else:
            coded_frames = (
                (f, get_frame(dataset.PixelData, f, number_of_frames=count)) for f in frames
            )
        for index, coded in coded_frames:
            found = _codestream_shape(coded)
            if found is not None and found != shape:
                raise ImageLoadError(
                    f"{name}: compressed frame {index} is {found[1]}x{found[0]} with "
                    f"{found[2]} sample(s) but the header says {shape[1]}x{shape[0]} with "
                    f"{shape[2]}"
                )
    except ImageLoadError:
        raise
    except Exception as exc:
        raise ImageLoadError(f"{name}: its frames cannot be found ({plain_reason(exc)})") from exc


def _codestream_shape(coded: bytes):
    """(rows, columns, samples) a JPEG, JPEG-LS or JPEG 2000 frame declares, or None."""
    from pydicom.pixels.utils import _get_jpg_parameters  # header only, no decoding

    start = coded.find(b"\xff\x4f\xff\x51", 0, 4096)  # JPEG 2000: SOC then SIZ
    if start >= 0 and len(coded) >= start + 42:
        size = coded[start + 8 : start + 24]
        width = int.from_bytes(size[0:4], "big") - int.from_bytes(size[8:12], "big")
        height = int.from_bytes(size[4:8], "big") - int.from_bytes(size[12:16], "big")
        return height, width, int.from_bytes(coded[start + 40 : start + 42], "big")
    try:
        found = _get_jpg_parameters(bytes(coded[:65536]))
    except Exception:
        return None
    if {"height", "width", "components"} <= set(found):
        return found["height"], found["width"], found["components"]
    return None


def load_dicom(
    source: str | Path | bytes, window: str | tuple | None = None, frame: int | None = None
) -> DicomImage:
    """The frame to explain, windowed for display and for the model alike.

    ``window``: None (the file's VOI LUT or first window; else its full range), a preset
    name (:data:`WINDOW_PRESETS`) or (centre, width) after the modality LUT. ``frame``:
    which frame of a multi-frame file (default the middle one). Only that frame is
    decoded, within :data:`krypton.io._decoding.DECODE_BUDGET`; the picture is at most
    :data:`krypton.io._decoding.MAX_SIDE` pixels a side (``info["size"]`` is the file's).
    """
    window = parse_window(window)
    name = "uploaded data" if isinstance(source, (bytes, bytearray)) else Path(source).name
    try:
        return _load_frame(source, window, frame)
    except ImageLoadError:
        raise
    except Exception as exc:  # a malformed header pydicom reads lazily, a decoder's error
        raise ImageLoadError(f"{name} is not a readable DICOM image ({plain_reason(exc)})") from exc


def _load_frame(source: str | Path | bytes, window, frame: int | None) -> DicomImage:
    dataset, name = _read(source)
    if "PixelData" not in dataset and "FloatPixelData" not in dataset:
        kind = str(dataset.get("Modality", "")) or "this object"
        raise ImageLoadError(f"{name} has no pixel data ({kind}: not an image)")
    frames = _header_int(dataset, "NumberOfFrames", name, 1)
    if frames > 1:
        frame = frames // 2 if frame is None else int(frame)
        if not 0 <= frame < frames:
            raise ImageLoadError(f"{name} has {frames} frames (0-{frames - 1}); got frame {frame}")
    elif frame not in (None, 0):
        raise ImageLoadError(f"{name} has one frame; got frame {frame}")
    else:
        frame = 0
    cost = _frame_cost(dataset, name, frame)
    with DECODE_BUDGET.reserve(cost) as record:
        pixels = _decode_frame(dataset, name, frame if frames > 1 else None)
        record.output = int(pixels.nbytes)
        samples = int(dataset.get("SamplesPerPixel", 1))
        if pixels.ndim != (3 if samples > 1 else 2):
            raise ImageLoadError(
                f"{name} holds a {pixels.ndim}-D array of shape {pixels.shape}; a 2-D image "
                f"model needs one 2-D frame"
            )
        try:
            shown, applied, source_name = _displayed(pixels, dataset, window)
        except ImageLoadError:
            raise
        except Exception as exc:  # a LUT or window the file declares wrongly
            raise ImageLoadError(
                f"{name}: its pixel values cannot be shown ({plain_reason(exc)})"
            ) from exc
        del pixels
        picture = Image.fromarray(shown, "RGB" if shown.ndim == 3 else "L")
        original_size = f"{picture.width}x{picture.height}"
        picture = reduced_to_max_side(picture).convert("RGB")
    spacing = dataset.get("PixelSpacing") or dataset.get("ImagerPixelSpacing")
    info = {
        "modality": str(dataset.get("Modality", "")),
        "body_part": str(dataset.get("BodyPartExamined", "")),
        "study_date": str(dataset.get("StudyDate", "")),
        "size": original_size,
        "frames": frames,
    }
    try:
        pixel_spacing = (float(spacing[0]), float(spacing[1])) if spacing else None
    except (TypeError, ValueError, IndexError):
        pixel_spacing = None
    return DicomImage(picture, applied, source_name, frame, frames, pixel_spacing, info)


def _check_native_length(dataset, name: str, syntax) -> None:
    """Uncompressed pixel data shorter than its header declares is refused: pydicom pads
    the missing bytes with zeros, so a truncated slice read as a picture with a black
    band (a series slice 100 bytes short loaded without a word)."""
    if syntax is None or syntax.is_encapsulated or "PixelData" not in dataset:
        return
    from pydicom.pixels.utils import get_expected_length

    try:
        expected = get_expected_length(dataset, unit="bytes")
    except (AttributeError, KeyError, TypeError, ValueError):
        return  # a header the decoder itself will refuse, with its own message
    present = len(dataset.PixelData)
    if present < expected:
        raise ImageLoadError(
            f"{name} is truncated: its pixel data holds {present:,} of the {expected:,} "
            f"bytes its header declares"
        )


def _decode_frame(dataset, name: str, index: int | None) -> np.ndarray:
    """One frame's pixel array (``index`` None: the only frame); every decoder failure
    becomes a message."""
    syntax = getattr(getattr(dataset, "file_meta", None), "TransferSyntaxUID", None)
    _check_native_length(dataset, name, syntax)
    try:
        dataset.pixel_array_options(index=index)
        return dataset.pixel_array
    except (NotImplementedError, RuntimeError, ValueError) as exc:
        if syntax is None or not syntax.is_compressed:
            raise ImageLoadError(
                f"{name} could not be decoded ({plain_reason(exc)}); it may be truncated or corrupt"
            ) from exc
        from pydicom.pixels import get_decoder

        try:
            available = get_decoder(syntax).is_available
        except NotImplementedError:
            available = False
        if available:
            raise ImageLoadError(
                f"{name} could not be decoded ({plain_reason(exc)}); it may be truncated or corrupt"
            ) from exc
        described = f"{syntax.name} ({syntax})"
        raise ImageLoadError(
            f"{name} is compressed as {described}, which this installation cannot decode "
            f"({plain_reason(exc)}). Krypton reads: {', '.join(decodable_transfer_syntaxes())}; "
            f"export the image in one of these"
        ) from exc
    except Exception as exc:  # EOFError, OSError, KeyError, struct errors from decoders
        raise ImageLoadError(
            f"{name} could not be decoded ({plain_reason(exc)}); it may be truncated or corrupt"
        ) from exc


BLOCK_VALUES = 1 << 20  # values converted at a time: float64 copies of a block, not a frame


def _blockwise(pixels: np.ndarray, convert, channels: int) -> np.ndarray:
    """``convert`` (values -> [0, 1] floats, pointwise) applied a block of rows at a time,
    written into one uint8 array: never a float copy of the whole frame."""
    rows, columns = pixels.shape[:2]
    shape = (rows, columns, channels) if channels > 1 else (rows, columns)
    out = np.empty(shape, dtype=np.uint8)
    step = max(1, BLOCK_VALUES // max(1, pixels[0].size))
    for top in range(0, rows, step):
        block = convert(pixels[top : top + step])
        out[top : top + step] = np.round(np.clip(block, 0, 1) * 255).astype(np.uint8)
    return out


def _value_range(pixels: np.ndarray, transform) -> tuple[float, float]:
    """(min, max) of ``transform(pixels)``, a block at a time."""
    step = max(1, BLOCK_VALUES // max(1, pixels[0].size))
    low, high = np.inf, -np.inf
    for top in range(0, pixels.shape[0], step):
        values = transform(pixels[top : top + step])
        low, high = min(low, float(values.min())), max(high, float(values.max()))
    return low, high


def _displayed(pixels: np.ndarray, dataset, window) -> tuple[np.ndarray, tuple | None, str]:
    """The frame as 8-bit values (gray, or RGB for colour), the window applied (None for
    a LUT or colour) and where it came from."""
    from pydicom.pixels import apply_modality_lut, apply_voi_lut

    photometric = str(dataset.get("PhotometricInterpretation", "MONOCHROME2"))
    samples = int(dataset.get("SamplesPerPixel", 1))
    if photometric == "PALETTE COLOR":  # indices into the file's colour tables
        from pydicom.pixels import apply_color_lut

        def palette(block):
            coloured = apply_color_lut(block, dataset)
            top = float(np.iinfo(coloured.dtype).max) if coloured.dtype.kind == "u" else 1.0
            return coloured / top

        return _blockwise(pixels, palette, 3), None, "colour"
    if samples > 1:  # colour: pydicom returns RGB for uncompressed and decoded data
        top = float(2 ** int(dataset.get("BitsStored", 8)) - 1)

        def colour(block):
            if photometric.startswith("YBR"):
                from pydicom.pixels import convert_color_space

                block = convert_color_space(block, photometric, "RGB")
            return block.astype(np.float64) / top

        return _blockwise(pixels, colour, 3), None, "colour"

    def modality(block):
        return apply_modality_lut(block, dataset).astype(np.float64)

    function = str(dataset.get("VOILUTFunction", "LINEAR")).upper()
    if isinstance(window, str):
        applied, source_name = WINDOW_PRESETS[window], f"preset {window}"
        shown = lambda block: linear_window(modality(block), *applied, "LINEAR")  # noqa: E731
    elif window is not None:
        applied, source_name = window, "given"
        shown = lambda block: linear_window(modality(block), *applied, "LINEAR")  # noqa: E731
    elif "VOILUTSequence" in dataset:
        table = np.asarray(dataset.VOILUTSequence[0].LUTData, dtype=np.float64)
        low, span = table.min(), max(table.max() - table.min(), 1e-12)
        applied, source_name = None, "VOI LUT"

        def shown(block):
            return (apply_voi_lut(modality(block), dataset, prefer_lut=True) - low) / span

    elif "WindowCenter" in dataset and "WindowWidth" in dataset:
        centre = dataset.WindowCenter
        width = dataset.WindowWidth
        centre = float(centre[0] if dataset["WindowCenter"].VM > 1 else centre)
        width = float(width[0] if dataset["WindowWidth"].VM > 1 else width)
        applied, source_name = (centre, width), "file"
        shown = lambda block: linear_window(modality(block), centre, width, function)  # noqa: E731
    else:
        low, high = _value_range(pixels, modality)
        applied, source_name = ((low + high) / 2, max(high - low, 1.0)), "full range"
        shown = lambda block: (modality(block) - low) / max(high - low, 1e-12)  # noqa: E731
    if photometric == "MONOCHROME1":  # 0 is white: invert after the VOI transform
        windowed = shown
        shown = lambda block: 1.0 - windowed(block)  # noqa: E731
    return _blockwise(pixels, shown, 1), applied, source_name
