"""Compare's gradient maps kept per pixel for re-runs: what determines one
(:func:`attribution_key`) and the bounded store (:class:`KeptAttributions`, one per
process: Services.gradients)."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from krypton import methods as krypton_methods
from krypton.methods import PixelAttribution

__all__ = ["KeptAttributions", "attribution_key"]


class KeptAttributions:
    """Gradient maps per pixel or voxel, kept per input, model, method, class and setting
    (:func:`attribution_key`) so that a re-run of the same input, on any grid, computes
    none again; bounded by bytes (least recently used first out). In team mode each
    worker keeps its own."""

    def __init__(self, max_bytes: int = 256 * 2**20):
        self.max_bytes = max_bytes
        self._kept: OrderedDict[tuple, PixelAttribution] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple, budget: int | None = None) -> PixelAttribution | None:
        """The map kept under ``key``; for Integrated Gradients allowed ``budget``
        gradient evaluations, only one as good as that budget makes it: one that reached
        completeness, or one run with at least that budget (a path stopped short at 256
        is computed again when 1,024 are allowed)."""
        with self._lock:
            found = self._kept.get(key)
            if found is None:
                return None
            if budget is not None and not found.converged and (found.budget or 0) < budget:
                return None
            self._kept.move_to_end(key)
            return found

    def put(self, key: tuple, attribution: PixelAttribution) -> None:
        if not key[0]:  # no source: nothing names the input, so nothing can find it again
            return
        with self._lock:
            self._kept[key] = attribution
            self._kept.move_to_end(key)
            while len(self._kept) > 1 and self.nbytes > self.max_bytes:
                self._kept.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(int(k.values.nbytes) for k in self._kept.values())

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()


def attribution_key(source: tuple, method: str, label: int, layer: str, fill) -> tuple:
    """What determines a kept gradient map: the input and model (``source``), the method
    and class, Grad-CAM's layer, Integrated Gradients' baseline (``fill``) and its
    path policy (krypton.methods.IG_STEPS, IG_GAP). Its budget of gradient evaluations
    is not in the key: :meth:`KeptAttributions.get` asks for it."""
    if method == "gradcam":
        return (source, method, int(label), layer)
    baseline = tuple(np.round(np.asarray(fill, np.float64).ravel(), 6).tolist())
    policy = (krypton_methods.IG_STEPS, krypton_methods.IG_GAP)
    return (source, method, int(label), baseline, policy)
