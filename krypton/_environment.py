"""Every numeric setting read from the environment goes through :func:`number_setting`:
finite, a whole number where it counts things, inside its range, or refused with one line
that names the variable, what it must be and what it holds (``nan``, ``inf``, ``abc``,
``1e30`` and a budget too small to run anything alike)."""

from __future__ import annotations

import math
import os

__all__ = ["SettingError", "number_setting"]


class SettingError(ValueError):
    """An environment variable holds a value Krypton cannot use (one line, naming it)."""


def _shown(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def number_setting(
    name: str,
    default: float,
    *,
    minimum: float,
    maximum: float,
    integer: bool = False,
    unit: str = "",
) -> float:
    """$``name`` as a number in [``minimum``, ``maximum``] (a whole number with
    ``integer``); ``default`` when unset or blank. Raises :class:`SettingError`."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    what = f"a whole number{unit}" if integer else f"a number{unit}"
    bounds = f"from {_shown(minimum)} to {_shown(maximum)}"
    try:
        value = float(text.strip())
    except ValueError:
        raise SettingError(f"{name} must be {what} {bounds}, got {text!r}") from None
    if not math.isfinite(value) or not minimum <= value <= maximum:
        raise SettingError(f"{name} must be {what} {bounds}, got {text!r}")
    if integer and not value.is_integer():
        raise SettingError(f"{name} must be {what} {bounds}, got {text!r}")
    return int(value) if integer else value


MAX_MB = 1024.0 * 1024.0  # 1 TB: above any real budget, below what overflows
MAX_SECONDS = 7 * 24 * 3600.0

# The library's numeric settings, each decided here: (default, minimum, maximum, whole).
# The memory budget's floor is 1 MB: 0.0001 MB (104 bytes) gave a run that never ended.
LIBRARY_SETTINGS: dict[str, tuple[float, float, float, bool]] = {
    "KRYPTON_MEMORY_BUDGET_MB": (2048.0, 1.0, MAX_MB, False),
    "KRYPTON_DECODE_BUDGET_MB": (256.0, 1.0, MAX_MB, False),
    "KRYPTON_VISIBILITY_TIMEOUT": (20.0, 5.0, MAX_SECONDS, False),
    "KRYPTON_TORCH_THREADS": (0, 0, 4096, True),
    # a PACS response that sends nothing for this long is refused (krypton.pacs.dicomweb)
    "KRYPTON_DICOMWEB_TIMEOUT_SECONDS": (10.0, 1.0, 600.0, False),
    # every PACS request ends within this many seconds, whatever the PACS sends (a store
    # gets a second more per 10 MB it sends): krypton.pacs.transport
    "KRYPTON_DICOMWEB_DEADLINE_SECONDS": (20.0, 1.0, 3600.0, False),
    # the bytes of one search's, listing page's or store's answer from the PACS
    "KRYPTON_DICOMWEB_ANSWER_MB": (4.0, 0.01, 1024.0, False),
    # the pages one listing may take (each at most 500 rows; a series at most 2,048)
    "KRYPTON_DICOMWEB_PAGES": (20, 1, 10_000, True),
    # every PACS action a user asks for (a search, a listing, an open, a send) ends within
    # this many seconds across all the requests it makes; a series' download gets a
    # second more per 4 MB its listing declares: krypton.pacs.transport
    "KRYPTON_DICOMWEB_ACTION_SECONDS": (45.0, 1.0, 3600.0, False),
    # the bytes of all the answers one action reads, beyond a series' declared pixels
    "KRYPTON_DICOMWEB_ACTION_MB": (16.0, 0.01, 4096.0, False),
}


def library_setting(name: str) -> float:
    """One of :data:`LIBRARY_SETTINGS`, parsed by :func:`number_setting`."""
    default, minimum, maximum, integer = LIBRARY_SETTINGS[name]
    return number_setting(name, default, minimum=minimum, maximum=maximum, integer=integer)


def check_library_settings() -> None:
    """Parse every library setting now (the app, the CLI and a worker call this as they
    start): a bad one stops them with its one line, not a traceback mid-run."""
    for name in LIBRARY_SETTINGS:
        library_setting(name)
