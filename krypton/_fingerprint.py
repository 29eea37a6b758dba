"""What identifies a model and an image across calls (checksums of weights and
settings), the MACs of one inference, and how large a batch memory allows."""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import zlib

import torch
from torch import nn

from ._environment import library_setting
from .engine.capture_lock import CAPTURE_LOCK

_PLAIN_ATTRIBUTES = (bool, int, float, str, type(None))


def _module_settings(module: nn.Module) -> tuple:
    """A module's plain settings (eps, momentum, stride, inplace, ...), sorted by name."""
    settings = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") and key != "_version":
            continue
        if isinstance(value, _PLAIN_ATTRIBUTES):
            settings.append((key, value))
        elif isinstance(value, tuple) and all(isinstance(v, _PLAIN_ATTRIBUTES) for v in value):
            settings.append((key, value))
    return tuple(settings)


def _host_checksum(tensor: torch.Tensor) -> bytes | None:
    """CRC-32 of a dense CPU tensor's bytes, read where they lie: no operator dispatched,
    no copy (None where the bytes are not one contiguous block)."""
    if tensor.device.type != "cpu" or tensor.layout != torch.strided or not tensor.is_contiguous():
        return None
    size = tensor.numel() * tensor.element_size()
    if size == 0:
        return b""
    block = (ctypes.c_char * size).from_address(tensor.data_ptr())
    # CRC-32 (zlib's): 4-5x faster than a cryptographic hash and catches every edit short
    # of a deliberate collision — it guards against stale caches, not attacks.
    return zlib.crc32(memoryview(block).cast("B")).to_bytes(4, "little")


def _device_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """(sum, position-weighted sum) of a tensor's words, on its own device, not read
    back: the caller reads every tensor's at once (one host round trip)."""
    tensor = tensor.detach().contiguous().reshape(-1)
    if tensor.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=tensor.device)
    wide = tensor.element_size() * tensor.numel() % 4 == 0
    words = tensor.view(torch.int32 if wide else torch.uint8).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64)
    return torch.stack([words.sum(), (words * weights).sum()])


def _tensor_checksums(tensors: list[torch.Tensor]) -> list[bytes]:
    """A digest of each tensor's bytes: edits through ``.data`` or ``copy_`` change it too.
    CPU tensors are read in place; the others are checksummed where they live and read
    back together."""
    digests: list[bytes | None] = [_host_checksum(tensor) for tensor in tensors]
    pending = [i for i, digest in enumerate(digests) if digest is None]
    if pending:
        sums = [_device_checksum(tensors[i]) for i in pending]
        by_device: dict[torch.device, list[int]] = {}
        for position, pair in enumerate(sums):
            by_device.setdefault(pair.device, []).append(position)
        for positions in by_device.values():
            values = torch.stack([sums[p] for p in positions]).cpu().tolist()
            for p, pair in zip(positions, values):
                digests[pending[p]] = repr(tuple(pair)).encode()
    return [digest or b"" for digest in digests]


def model_fingerprint(model: nn.Module) -> tuple:
    """Identity of a model's structure, settings and weights, for cache invalidation.

    Covers the module tree (a replaced layer), every module's mode and plain settings
    (``bn.eps = 10``) and a content checksum of every parameter and buffer, so edits that
    bypass PyTorch's version counter (``param.data.copy_(...)``) are caught as well. The
    checksum reads each weight once, in place on a CPU (no tensor operator, so none in a
    run's count) and with one host round trip per device on a card: about 10 ms for
    ResNet18 and 0.1 s for VGG16 on two CPU cores (``make bench`` prints it next to the
    runs).
    """
    modules = tuple(
        (name, id(module), type(module).__qualname__, module.training, _module_settings(module))
        for name, module in model.named_modules()
    )
    digest = hashlib.blake2b(digest_size=16)
    named = list(model.named_parameters()) + list(model.named_buffers())
    for (name, tensor), checksum in zip(named, _tensor_checksums([t for _, t in named])):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(checksum)
    return modules, digest.hexdigest()


def _count_macs_with_hooks(model: nn.Module, image: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Run one image with forward hooks: (logits, conv/linear multiply-accumulates (eq 9),
    bytes of the largest activation a leaf module produced)."""
    total = 0
    largest = image.numel() * image.element_size()

    def hook(module, inputs, output):
        nonlocal total, largest
        if isinstance(output, torch.Tensor):
            largest = max(largest, output.numel() * output.element_size())
        if isinstance(module, (nn.Conv2d, nn.Conv3d)) and output.dim() == module.weight.dim():
            kernel = math.prod(module.kernel_size)
            total += (module.in_channels // module.groups) * kernel * output[0].numel()
        elif isinstance(module, nn.Linear):
            total += module.in_features * module.out_features

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if not any(True for _ in m.children()) and not isinstance(m, torch.jit.ScriptModule)
    ]  # scripted: no hooks
    try:
        with CAPTURE_LOCK.shared():
            # a copy: a model may write its input in place (``x.sub_(mean)``, an
            # activation with inplace=True first), and the image is used again
            logits = model(image.unsqueeze(0).clone())
    finally:
        for handle in handles:
            handle.remove()
    return logits, total, largest


# A run on a card may use this share of the card's free memory at its start, unless
# $KRYPTON_MEMORY_BUDGET_MB says otherwise: two runs at once (the app's default) each
# find room, and whatever else holds memory on the card is left alone.
CARD_SHARE = 0.5


def memory_budget_bytes(device: torch.device | None = None) -> int:
    """Memory one run may use for its batches: $KRYPTON_MEMORY_BUDGET_MB, default 2048 MB
    on the CPU and half the card's free memory on a CUDA ``device``."""
    text = os.environ.get("KRYPTON_MEMORY_BUDGET_MB")
    if not text and device is not None and torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return max(1, int(free * CARD_SHARE))
    megabytes = library_setting("KRYPTON_MEMORY_BUDGET_MB")
    return int(megabytes * 2**20)


# Live activations at once, as a multiple of the largest one (input, output, a residual
# branch and a workspace): a deliberately generous bound for the batch size cap.
LIVE_ACTIVATION_FACTOR = 4


class MemoryBudgetError(ValueError):
    """A volume's run would not fit the memory budget even one occluded volume at a time."""


def capped_batch_size(
    requested: int,
    largest_activation_bytes: int,
    reserved_bytes: int = 0,
    strict: bool = False,
    device: torch.device | None = None,
) -> int:
    """The batch size that keeps one batch's activations, beside ``reserved_bytes`` (the
    materialised views a run holds), inside the memory budget.

    An image's run always gets a batch of at least one. With ``strict`` (volumes, where
    3-D activations and views are what binds) a run that cannot fit even one occluded
    input is refused with :class:`MemoryBudgetError` instead. ``device``: where the run
    computes (a card's budget is a share of its free memory)."""
    per_image = max(1, LIVE_ACTIVATION_FACTOR * largest_activation_bytes)
    budget = memory_budget_bytes(device)
    available = budget - reserved_bytes
    if strict and available < per_image:
        raise MemoryBudgetError(
            f"this run needs about {(reserved_bytes + per_image) / 2**20:.0f} MB "
            f"({reserved_bytes / 2**20:.0f} MB of materialised views and "
            f"{per_image / 2**20:.0f} MB per occluded volume), over the memory budget of "
            f"{budget / 2**20:.0f} MB (KRYPTON_MEMORY_BUDGET_MB): raise the budget, or "
            f"explain a smaller region or a downsampled volume"
        )
    return max(1, min(requested, max(available, 0) // per_image))


def _image_key(image: torch.Tensor) -> str:
    data = image.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return f"{tuple(image.shape)}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"


# ---------------------------------------------------------------------------------------
# The explainer
# ---------------------------------------------------------------------------------------
