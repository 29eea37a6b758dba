"""Where and at what precision a run computes: the one place that decides both.

``resolve_device`` turns a setting (``--device``, ``KRYPTON_DEVICE``; ``auto`` by
default) into a ``torch.device``. ``run_precision`` is the context a run computes in:
``fp32`` (the default) switches TF32 off for cuDNN convolutions and CUDA matmuls — PyTorch
runs cuDNN convolutions in TF32 unless told otherwise, which on one H200 made exact
differ from naive by up to 1.4e-3 in probability (ResNet50) while both claimed fp32 —
and ``tf32``, ``bf16`` and ``fp16`` are opt-in speed for exact and naive alike. The
caller's global flags come back after the run; runs that need other flags wait for the
card instead of changing them under each other.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

__all__ = [
    "DEVICE_ENVIRONMENT",
    "EXACT_TOLERANCE",
    "PRECISIONS",
    "check_precision",
    "describe",
    "resolve_device",
    "run_precision",
]

DEVICE_ENVIRONMENT = "KRYPTON_DEVICE"
# precision -> the dtype autocast computes in (None: the model's own dtype)
PRECISIONS: dict[str, torch.dtype | None] = {
    "fp32": None,
    "tf32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


# Largest |exact - naive| in probability, both at the same precision, that a run of
# each precision is held to (tests/test_devices.py). fp32: what rounding in a different
# order leaves (measured <= 8.3e-7 on an H200 with TF32 off, <= 3.3e-7 on CPUs). bf16 and
# fp16 keep 8 and 11 bits of mantissa: ResNet18 (random weights, 5 classes, 64²) read
# 3.4e-3 and 3.7e-4 on two CPU cores; make bench-gpu prints the card's figures.
EXACT_TOLERANCE: dict[str, float] = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 2e-2, "fp16": 5e-3}


def resolve_device(setting: str | torch.device | None = None) -> torch.device:
    """The device a setting names. ``auto`` (the default, or ``$KRYPTON_DEVICE``) is the
    first CUDA device when PyTorch sees one, else the CPU; ``cuda`` without one is refused
    with a message rather than failing later inside a run."""
    if isinstance(setting, torch.device):
        text = str(setting)
    else:
        text = (setting or os.environ.get(DEVICE_ENVIRONMENT) or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {text!r} was asked for, but PyTorch sees no CUDA device "
                f"(torch.cuda.is_available() is False): use auto or cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {text!r} was asked for, but there are "
                f"{torch.cuda.device_count()} CUDA devices"
            )
    return device


def check_precision(precision: str) -> str:
    """``precision`` if it is one of fp32, tf32, bf16 and fp16; else a ValueError."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def describe(device: torch.device, precision: str) -> str:
    """How the page, the plan line and the exports name them: "cuda:0 (NVIDIA H200), fp32"."""
    name = str(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return f"{name}, {precision}"


class _MathFlags:
    """TF32 on or off for every run inside, process-wide: the first run in saves the
    caller's flags and sets its own, the last one out restores them, and a run that needs
    the other setting waits until the card is free of runs that need this one."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._allowed: bool | None = None
        self._runs = 0
        self._saved: tuple[bool, bool] = (False, False)

    @contextmanager
    def holding(self, allow_tf32: bool) -> Iterator[None]:
        with self._changed:
            while self._runs and self._allowed != allow_tf32:
                self._changed.wait()
            if self._runs == 0:
                self._saved = (
                    torch.backends.cudnn.allow_tf32,
                    torch.backends.cuda.matmul.allow_tf32,
                )
                torch.backends.cudnn.allow_tf32 = allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = allow_tf32
                self._allowed = allow_tf32
            self._runs += 1
        try:
            yield
        finally:
            with self._changed:
                self._runs -= 1
                if self._runs == 0:
                    (
                        torch.backends.cudnn.allow_tf32,
                        torch.backends.cuda.matmul.allow_tf32,
                    ) = self._saved
                    self._allowed = None
                    self._changed.notify_all()


_MATH_FLAGS = _MathFlags()


@contextmanager
def run_precision(device: torch.device, precision: str = "fp32") -> Iterator[None]:
    """The numerics one run computes in (naive and exact alike, so they compare): TF32
    off for ``fp32``, on for ``tf32``; autocast to bfloat16 or float16 for ``bf16`` and
    ``fp16``. The caller's flags are restored after."""
    dtype = PRECISIONS[check_precision(precision)]
    autocast = (
        torch.autocast(device_type=device.type, dtype=dtype) if dtype is not None else nullcontext()
    )
    with _MATH_FLAGS.holding(precision == "tf32"), autocast:
        yield
