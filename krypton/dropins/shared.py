"""What the drop-ins (krypton.captum, krypton.monai) share: one captured engine per model
for every instance and call, the model's training mode left as the caller set it, and
one warning per reason when the library's own code has to run instead of the engine."""

from __future__ import annotations

import inspect
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from .._inputs import _model_device
from ..explainer import OcclusionExplainer

__all__ = [
    "ENGINE_BATCH",
    "LastCall",
    "LibraryDefault",
    "explainer_for",
    "evaluated",
    "mode_dependent_modules",
    "warn_once",
]

# Occluded positions the drop-ins ask the engine for per batch, whatever the
# caller's perturbations_per_eval or n_batch: the engine's memory budget caps it
# (capped_batch_size). On two CPU cores ResNet18 112² ran 625 windows in 3.6 s at 16 a
# batch and 2.3 s at 128 (naive: 4.1 s at 16 or 64); fewer, larger whole-image batches
# also save the per-forward overhead of deep nets on small inputs (DenseNet121 2-D 64²).
ENGINE_BATCH = 128

_EXPLAINERS: weakref.WeakKeyDictionary[nn.Module, OcclusionExplainer] = weakref.WeakKeyDictionary()
_EXPLAINERS_LOCK = threading.Lock()

# torch.nn layers whose forward reads ``self.training``
_MODE_DEPENDENT = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.dropout._DropoutNd,
    nn.RNNBase,
    nn.MultiheadAttention,
)


class LastCall:
    """What a drop-in's last call in this thread ran (one instance may serve a server's
    threads at once): ``last_engine`` — "krypton", or the library whose own code ran it —
    and ``last_host``, the host share the engine took (its torch threads, who chose them,
    the load: krypton.host.HostShare.as_dict; None where the library ran it). The
    drop-in keeps them in ``self._local`` (a threading.local)."""

    _local: threading.local

    @property
    def last_engine(self) -> str | None:
        """Who evaluated this thread's last call."""
        return getattr(self._local, "engine", None)

    @property
    def last_host(self) -> dict | None:
        """The engine's host share in this thread's last call (None: the library ran it)."""
        return getattr(self._local, "host", None)


class LibraryDefault(int):
    """A library's default count of windows per forward as a drop-in's signature carries
    it (Captum's ``perturbations_per_eval=1``, MONAI's ``n_batch=16``): the same number,
    told apart from the same number passed by the caller, which is heard."""

    def __repr__(self) -> str:
        return int.__repr__(self)


def windows_per_forward(requested: int) -> int:
    """Occluded windows per engine forward: ENGINE_BATCH where the caller left the
    library's default (:class:`LibraryDefault`); else the count the caller passed
    (Captum's ``perturbations_per_eval`` or MONAI's ``n_batch``, 1 included: a caller
    who bounds a forward to fit a card's memory is heard), at most ENGINE_BATCH. The
    engine's memory budget may lower either (capped_batch_size)."""
    if isinstance(requested, LibraryDefault) or requested < 1:
        return ENGINE_BATCH
    return min(int(requested), ENGINE_BATCH)


def explainer_for(model: nn.Module) -> OcclusionExplainer:
    """The engine for ``model``, shared by every drop-in instance and call: a fresh
    ``Occlusion(model)`` per call (as tutorials write it) does not capture the graph
    again. The explainer itself recaptures when the weights, settings or layers change
    (its fingerprint); a model moved to another device gets a new one."""
    with _EXPLAINERS_LOCK:
        explainer = _EXPLAINERS.get(model)
        if explainer is None or explainer.device != _model_device(model):
            with evaluated(model):  # it refuses a training model; each call runs in eval
                explainer = _EXPLAINERS[model] = OcclusionExplainer(model)
        return explainer


def mode_dependent_modules(model: nn.Module) -> list[str]:
    """Submodules in training mode whose output depends on it (dropout, batch norm and
    custom code that reads ``self.training``): running them in eval mode would change
    the numbers, so the engine does not."""
    found = []
    for name, module in model.named_modules():
        if not module.training:
            continue
        if isinstance(module, _MODE_DEPENDENT):
            found.append(name or type(module).__name__)
        elif not type(module).__module__.startswith("torch.nn") and _reads_training(module):
            found.append(name or type(module).__name__)
    return found


def _reads_training(module: nn.Module) -> bool:
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # no source to read: assume it may
        return True
    return "training" in source


@contextmanager
def evaluated(model: nn.Module) -> Iterator[None]:
    """Every submodule in eval mode for the computation, each one's own mode restored
    after (as MONAI's ``eval_mode`` does), even when the computation raises."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        for module, _ in modes:
            module.training = False
        yield
    finally:
        for module, training in modes:
            module.training = training


def warn_once(warned: set[str], message: str, stacklevel: int = 3) -> None:
    """``warnings.warn(message)`` unless this instance has said it already."""
    if message not in warned:
        warned.add(message)
        warnings.warn(message, stacklevel=stacklevel + 1)
