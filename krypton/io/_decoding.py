"""The decode budget: what one image decode may cost in memory, decided from the file's
header before any pixel is decoded.

A few kilobytes of PNG, TIFF, JPEG 2000, JPEG-LS, RLE or deflated DICOM can declare an
8192 x 8192 image; decoding it costs gigabytes. Every reader (:mod:`krypton.io.images` for
Pillow's formats, :mod:`krypton.io.dicom` for every transfer syntax) asks the process-wide
:data:`DECODE_BUDGET` first: the declared rows x columns x samples x bytes, times what the
decoder is measured to allocate beside its output (:data:`DICOM_DECODE_FACTOR`,
:data:`PILLOW_DECODE_FACTOR`), must fit ``KRYPTON_DECODE_BUDGET_MB`` (default
:data:`DEFAULT_DECODE_BUDGET_MB`). The same budget is a pool shared by concurrent
decodes, so two large files at once wait for each other instead of adding up.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from PIL import Image

from .._environment import SettingError, library_setting

__all__ = [
    "ImageLoadError",
    "DecodeBudget",
    "DECODE_BUDGET",
    "DEFAULT_DECODE_BUDGET_MB",
    "DICOM_DECODE_FACTOR",
    "PILLOW_DECODE_FACTOR",
    "DECODE_BUDGET_ENV",
    "MAX_SIDE",
    "MIN_SIDE",
    "reduced_to_max_side",
    "megabytes",
    "plain_reason",
]

DECODE_BUDGET_ENV = "KRYPTON_DECODE_BUDGET_MB"
# 256 MB holds a 64 MB frame (a 5792 x 5792 16-bit CT, an 8192 x 8192 8-bit radiograph,
# a 4096 x 3328 16-bit mammogram four times over) with its decoder's working copies.
DEFAULT_DECODE_BUDGET_MB = 256.0
# Peak memory of a DICOM decode over its output frame, measured here on 4096 x 4096
# 16-bit frames: JPEG 2000 2.6x, JPEG-LS 3.5x, deflated 3.0x (pydicom's decoders keep the
# codec's buffer and the array), plus the 8-bit picture made from it.
DICOM_DECODE_FACTOR = 4.0
# Pillow decodes into its own buffer; the reduced copy and the RGB picture add little.
PILLOW_DECODE_FACTOR = 1.25
# The smallest side accepted: smaller images hold too little for a model to classify, and
# upscaling them to the model's input size would explain interpolation, not content.
MIN_SIDE = 16
# The largest side kept: no model takes more than 1024 pixels (the registry's limit), so
# larger images are reduced on load (aspect kept), identically in the CLI and the app.
MAX_SIDE = 1024
# How long a decode waits for others to release their share of the pool.
WAIT_SECONDS = 30.0


class ImageLoadError(ValueError):
    """The file is not an image we can read (or not within the limits)."""


# a sentence of advice meant for a programmer ("Use force=True to force reading.")
_ADVICE = re.compile(
    r"[^.;]*(?:\b\w+=(?:True|False|None|'[^']*'|\"[^\"]*\")|pip install)[^.;]*[.;]?\s*"
)
_CLASS_NAME = re.compile(r"\b[A-Z]\w*(?:Error|Exception|Warning)\b:?\s*")
_LIBRARY_NAMES = (
    (re.compile(r"\b(?:as )?a torch\.fx graph\b"), "layer by layer"),
    (re.compile(r"\btorch\.fx\b"), "the tracer"),
    (re.compile(r"\bpydicom\b"), "the DICOM reader"),
    (re.compile(r"\bnibabel\b"), "the NIfTI reader"),
    (re.compile(r"\b(?:Pillow|PIL)\b"), "the image reader"),
)


def plain_reason(exc: BaseException | str, limit: int = 200) -> str:
    """An error's message in words a user reads: no Python class name, no advice meant
    for a programmer (pydicom's "Use force=True to force reading."), no library's name;
    at most ``limit`` characters. A corrupt .dcm's message had carried all three."""
    text = _ADVICE.sub("", str(exc))
    text = _CLASS_NAME.sub("", text)
    for name, words in _LIBRARY_NAMES:
        text = name.sub(words, text)
    text = " ".join(text.split()).strip(" ;,")
    if len(text) > limit:
        text = text[: limit - 1].rstrip() + "…"
    return text or "its contents are malformed"


def megabytes(count: float) -> str:
    """``count`` bytes for people: '256 MB' ('0.4 MB' under one)."""
    return f"{count / 2**20:,.0f} MB" if count >= 2**20 else f"{count / 2**20:.1f} MB"


@dataclass
class DecodeRecord:
    """One admitted decode: what it was allowed (cost) and what its output took."""

    cost: int
    output: int = 0


class DecodeBudget:
    """A byte budget for one decode and a pool of the same size for concurrent ones."""

    def __init__(self, limit_bytes: int, wait_seconds: float = WAIT_SECONDS):
        self.limit_bytes = int(limit_bytes)
        self.wait_seconds = wait_seconds
        self._condition = threading.Condition()
        self._in_use = 0
        self.records: list[DecodeRecord] = []  # the latest admitted decodes (for tests)

    @classmethod
    def from_environment(cls) -> DecodeBudget:
        """The budget $KRYPTON_DECODE_BUDGET_MB sets (krypton._environment decides its
        range); at import a bad value falls back to the default, and the app and the CLI
        refuse it at start with its one line (check_library_settings)."""
        try:
            megabytes = library_setting(DECODE_BUDGET_ENV)
        except SettingError:
            megabytes = DEFAULT_DECODE_BUDGET_MB
        return cls(int(megabytes * 2**20))

    def cost(
        self, name: str, what: str, shape: tuple[int, ...], bytes_per_value: float, factor: float
    ) -> int:
        """The bytes a decode of ``shape`` values is allowed to cost; refuses, naming the
        size and the limit, when it is over the budget. ``what`` describes the image
        ("a 8192x8192 16-bit DICOM frame")."""
        values = 1
        for side in shape:
            if side <= 0:
                raise ImageLoadError(f"{name} declares an empty image ({what})")
            values *= int(side)
        cost = int(values * bytes_per_value * factor)
        if cost > self.limit_bytes:
            raise ImageLoadError(
                f"{name} is {what}: decoding it needs about {megabytes(cost)}, over this "
                f"server's decode budget of {megabytes(self.limit_bytes)} "
                f"({DECODE_BUDGET_ENV}); reduce the image before loading it"
            )
        return cost

    @contextmanager
    def reserve(self, cost: int) -> Iterator[DecodeRecord]:
        """Hold ``cost`` bytes of the pool while the block decodes (waiting for other
        decodes to finish, at most ``wait_seconds``)."""
        cost = min(int(cost), self.limit_bytes)
        deadline = time.monotonic() + self.wait_seconds
        with self._condition:
            while self._in_use + cost > self.limit_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ImageLoadError(
                        "the server is decoding other large images; try again in a moment"
                    )
                self._condition.wait(timeout=left)
            self._in_use += cost
        record = DecodeRecord(cost)
        try:
            yield record
        finally:
            with self._condition:
                self._in_use -= record.cost
                self._condition.notify_all()
                self.records = [*self.records[-999:], record]

    def grow(self, record: DecodeRecord, cost: int) -> None:
        """Hold ``cost`` bytes for ``record``'s reservation from now on (a read that learns
        its decode's cost only after reading a header it held less for), waiting for other
        decodes as :meth:`reserve` does; never less than it holds already."""
        cost = min(int(cost), self.limit_bytes)
        deadline = time.monotonic() + self.wait_seconds
        with self._condition:
            while cost > record.cost and self._in_use - record.cost + cost > self.limit_bytes:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ImageLoadError(
                        "the server is decoding other large images; try again in a moment"
                    )
                self._condition.wait(timeout=left)
            if cost > record.cost:
                self._in_use += cost - record.cost
                record.cost = cost


DECODE_BUDGET = DecodeBudget.from_environment()


def reduced_to_max_side(image: Image.Image) -> Image.Image:
    """``image`` reduced (aspect kept, Lanczos) to at most :data:`MAX_SIDE` a side."""
    if max(image.size) > MAX_SIDE:
        image.thumbnail((MAX_SIDE, MAX_SIDE), Image.LANCZOS)
    return image
