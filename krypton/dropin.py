"""What the drop-ins (krypton.captum, krypton.monai) share: run incrementally where the
engine applies, else hand the call to the library itself, saying why once per reason."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

from .engine import UnsupportedModelError

__all__ = ["DropIn"]

Result = TypeVar("Result")


class DropIn:
    """Base of a drop-in replacement for another library's occlusion class."""

    name = ""  # e.g. "krypton.captum.Occlusion"
    library = ""  # e.g. "Captum's own Occlusion"
    library_key = ""  # what ``last_engine`` says when the library ran

    def __init__(self) -> None:
        self._warned: set[str] = set()
        self.last_engine: str | None = None  # "krypton" or library_key: what ran last

    def _run(
        self, reason: str | None, incremental: Callable[[], Result], delegate: Callable[[], Result]
    ) -> Result:
        """``incremental()`` when ``reason`` is None and the model can be captured; else
        ``delegate()`` after one warning per reason (the results are the same)."""
        if reason is None:
            try:
                result = incremental()
                self.last_engine = "krypton"
                return result
            except UnsupportedModelError as exc:
                reason = f"the model cannot be captured as a graph ({exc})"
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(
                f"{self.name}: {reason}; using {self.library} (same results, no "
                f"incremental speedup)",
                stacklevel=3,
            )
        self.last_engine = self.library_key
        return delegate()
