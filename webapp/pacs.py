"""The app's side of the operator's PACS (:mod:`krypton.pacs.dicomweb`): what the page's
search lists, the series a tab opened from it, and the result sent back.

The page never names a PACS: the server's settings do (``KRYPTON_DICOMWEB_URL``), and
the sign-in never reaches the page. A series opened from the PACS comes in through the
volume panel's intake (one read at a time per client, the volume size limit and the
decode budget, checked from the PACS's listing before any pixel), and is kept as an
upload is: a zip of the series in the tab's store. Which study a stored series came from
is remembered here, on the server, so a result is sent only into the study of a series
this tab opened from the PACS, whatever the page says.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from krypton.pacs.dicomweb import (
    ImageNotChosen,
    PacsError,
    PacsSettings,
    action,
    connect,
    fetch_instance,
    fetch_series_zip,
    find_series,
    find_studies,
)
from krypton.pacs.results import is_explainable

from .helpers import InputError, owner_tag

__all__ = [
    "PacsSources",
    "study_options",
    "series_options",
    "fetch_series_bytes",
    "fetch_image_bytes",
]

STUDIES_LISTED = 50  # a search lists at most this many studies
# what a client is told when it asks the PACS while its previous PACS request is running
PACS_BUSY = "your other PACS request is still running; try again when it has answered"
# what a client is told when the server's PACS requests are all in flight (a slow PACS)
PACS_FULL = (
    "the PACS is slow to answer: this server has {count} PACS requests in flight already; "
    "try again in a minute"
)
SENDING = (
    "This result is being sent to the PACS right now (from this or another page); "
    "press Send again in a moment to see it there."
)


class PacsSources:
    """Stored series (or images) a tab opened from the PACS: (stored key, tab) ->
    (study, series), the most recent ``limit``; and the results each tab sent."""

    def __init__(self, limit: int = 1024):
        self._opened: OrderedDict[tuple[str, str], tuple[str, str]] = OrderedDict()
        self._sent: OrderedDict[tuple[str, str], None] = OrderedDict()  # (result, tab) sent
        self._sending: set[str] = set()  # result keys whose Send is in flight
        self._limit = limit
        self._lock = threading.Lock()

    @contextmanager
    def sending(self, key: str) -> Iterator[None]:
        """Around one Send of the result ``key`` (its check of the study and its store):
        a second Send of the same result, from any tab or address, is refused at once
        while the first runs (InputError), so concurrent first presses store one map and
        no server thread waits for another's PACS."""
        with self._lock:
            if key in self._sending:
                raise InputError(SENDING)
            self._sending.add(key)
        try:
            yield
        finally:
            with self._lock:
                self._sending.discard(key)

    def remember(self, key: str, session: str, study: str, series: str) -> None:
        with self._lock:
            self._opened[(key, owner_tag(session))] = (study, series)
            self._opened.move_to_end((key, owner_tag(session)))
            while len(self._opened) > self._limit:
                self._opened.popitem(last=False)

    def sent(self, key: str, session: str) -> None:
        """This tab stored the result ``key`` (:func:`krypton.pacs.results.result_key`) in its
        study."""
        with self._lock:
            self._sent[(key, owner_tag(session))] = None
            while len(self._sent) > self._limit:
                self._sent.popitem(last=False)

    def was_sent(self, key: str, session: str) -> bool:
        """Whether this tab stored the result ``key`` already."""
        with self._lock:
            return (key, owner_tag(session)) in self._sent

    def origin(self, key: str, session: str) -> tuple[str, str] | None:
        """(study, series) of the series this tab stored under ``key``, or None."""
        with self._lock:
            return self._opened.get((key, owner_tag(session)))


def _pacs(settings: PacsSettings | None):
    if settings is None:
        raise InputError("no PACS is configured on this server")
    return connect(settings)


def study_options(
    settings: PacsSettings | None,
    patient: str | None,
    dates: str | None,
    modality: str | None,
    accession: str | None,
) -> list[dict]:
    """The studies a search finds, as dropdown options (value: the study UID), newest
    first. The patient field is tried as a patient ID, then as part of a name."""
    low = high = None
    if dates and dates.strip():
        low, _, high = dates.strip().partition("-")
        if not (low.isdigit() and high.isdigit() and len(low) == len(high) == 8):
            raise InputError("dates are YYYYMMDD-YYYYMMDD, e.g. 20260101-20261231")
    patient = (patient or "").strip() or None
    filters = {
        "dates": (low, high) if low else None,
        "modality": (modality or "").strip().upper() or None,
        "accession": (accession or "").strip() or None,
        "limit": STUDIES_LISTED,
    }
    try:
        pacs = _pacs(settings)
        with action(pacs, "the study search"):  # by ID, then by name: one deadline
            rows = find_studies(pacs, patient_id=patient, **filters)
            if not rows and patient:
                rows = find_studies(pacs, patient_name=f"*{patient}*", **filters)
    except PacsError as exc:
        raise InputError(str(exc)) from None
    # newest first, undated last, then by patient: a PACS answers in its own order
    rows = sorted(rows, key=lambda r: (r.patient_name or "", r.patient_id or ""))
    rows = sorted(rows, key=lambda r: r.date or "", reverse=True)
    return [
        {
            "label": f"{row.date or '-'}  {row.patient_name or '-'} ({row.patient_id or '-'})  "
            f"{'/'.join(row.modalities) or '-'}  {row.description}".strip(),
            "value": row.study_uid,
        }
        for row in rows
    ]


def series_options(settings: PacsSettings | None, study: str) -> list[dict]:
    """A study's series as dropdown options (value: the series UID); series without
    images (reports, segmentations) and Krypton's own results are listed but cannot be
    chosen."""
    try:
        rows = find_series(_pacs(settings), study)
    except PacsError as exc:
        raise InputError(str(exc)) from None
    options = []
    for row in sorted(rows, key=lambda r: (r.number is None, r.number or 0)):
        count = "?" if row.instances is None else row.instances
        options.append({
            "label": f"{row.modality} {row.description or row.series_uid[-12:]} ({count} images)",
            "value": row.series_uid,
            "disabled": not is_explainable(row),
        })  # fmt: skip
    return options


def fetch_series_bytes(
    settings: PacsSettings | None, study: str, series: str, max_bytes: int
) -> bytes:
    """One series as a zip's bytes, within the volume limit ``max_bytes`` and the
    intake's limits (refused by the PACS's own listing before any pixel is fetched)."""
    try:
        return fetch_series_zip(_pacs(settings), study, series, max_bytes=max_bytes)
    except PacsError as exc:
        raise InputError(str(exc)) from None


def fetch_image_bytes(
    settings: PacsSettings | None, study: str, series: str, number: str | None, max_bytes: int
) -> bytes:
    """One image of a series (``number``: its instance number or UID; None for a series
    of one image) as a DICOM file's bytes, within the image limit ``max_bytes`` and the
    intake's limits (refused by the PACS's own listing before any pixel is fetched)."""
    import tempfile
    from pathlib import Path

    try:
        with tempfile.TemporaryDirectory(prefix="krypton-pacs-") as folder:
            path = fetch_instance(
                _pacs(settings), study, series, number, Path(folder), max_bytes=max_bytes
            )
            return path.read_bytes()
    except ImageNotChosen as exc:
        raise InputError(f"{exc}: type it in Image number") from None
    except PacsError as exc:
        raise InputError(str(exc)) from None
