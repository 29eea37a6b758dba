"""Studies from a PACS over DICOMweb: QIDO-RS to search, WADO-RS to fetch a series,
STOW-RS to store results, through dicomweb-client.

The PACS is configured by whoever runs Krypton, never by a page or a caller's URL:
``KRYPTON_DICOMWEB_URL`` and either ``KRYPTON_DICOMWEB_USER`` with
``KRYPTON_DICOMWEB_PASSWORD`` or ``KRYPTON_DICOMWEB_TOKEN`` (a bearer token); each secret
may instead be read from the file ``KRYPTON_DICOMWEB_PASSWORD_FILE`` /
``KRYPTON_DICOMWEB_TOKEN_FILE``. An https URL is verified against the system's
certificates. Secrets never appear in a message, a repr or a log line, and a URL that
holds them (``https://user:password@…``) is refused: they would travel wherever the URL
does (a worker's task, a batch's summary).

Every request is bounded (:mod:`krypton.pacs.transport`): a total deadline, its
answer's bytes counted as they arrive, no redirects, nothing outside the configured
root. Every UID from a caller or from the PACS's own answers is checked
(:func:`check_uid`: digits and dots, at most 64) before a URL is built from it. A listing
is read a page at a time, at most :data:`LISTING_PAGE` rows a page and
``KRYPTON_DICOMWEB_PAGES`` pages, and stops one row past its cap.

A series comes in through the same limits as a series read from disk: its instances are
listed first (QIDO, with their rows, columns, samples, bits and frames), and the listing
is held to :data:`krypton.io.volumes.MAX_SLICES` and the decode budget before any pixel
is fetched; each download is counted as it arrives and stopped where it passes what the
listing declared (a PACS that lies about an instance's size, or sends instances it did
not list, is refused by name), and a response that stalls ends at the timeout. The
fetched files are then read by :func:`krypton.io.volumes.read_dicom_series`.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import requests

from ..io._decoding import DECODE_BUDGET, ImageLoadError
from ..io.series_intake import ModelTarget, VolumeGeometry, read_for_model, streamed_cost
from ..io.volumes import MAX_SLICES, ModelVolume, check_files_size
from .transport import (
    PACE_BYTES_PER_SECOND,
    ActionBudget,
    BoundedAdapter,
    PacsBudgets,
    PacsError,
    RequestBudget,
    bounded,
    joined,
)
from .transport import action as _action

logger = logging.getLogger("krypton.pacs.results")
# dicomweb-client logs a QIDO answer's Warning header, the PACS's own text: without a
# handler Python's last resort printed it on the command line's terminal, a line per page
logging.getLogger("dicomweb_client").addHandler(logging.NullHandler())

__all__ = [
    "PacsError",
    "PacsBudgets",
    "check_uid",
    "ImageNotChosen",
    "PacsSettings",
    "StudyRow",
    "action",
    "SeriesRow",
    "connect",
    "find_studies",
    "find_series",
    "fetch_instance",
    "fetch_series",
    "fetch_series_zip",
    "load_series",
    "fetched_headers",
    "content_labels",
    "store",
]

IN_FLIGHT = 4  # instances of a series downloaded at once (and held before they are saved)
HEADER_SLACK = 64 * 1024  # an instance's bytes beyond its pixels: its header, multipart framing
LISTING_PAGE = 500  # rows asked of the PACS per listing page
MAX_SERIES = 1000  # a study's series listed at most (more: refused, naming the cap)
MAX_STUDIES = 1000  # a study search's limit at most
MAX_RESULTS = 5000  # Krypton's results in one study, listed to recognise one sent before
_UID = re.compile(r"[0-9]+(\.[0-9]+)*")
_INSTANCE_FIELDS = (
    "Rows", "Columns", "SamplesPerPixel", "BitsAllocated", "NumberOfFrames", "InstanceNumber"
)  # fmt: skip


class ImageNotChosen(PacsError):
    """A series of several images where one image was asked for without naming which."""


@dataclass(frozen=True)
class PacsSettings:
    """Where the PACS is, how to sign in (secrets kept out of repr) and what each request
    may cost."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    timeout: float = 10.0  # seconds without a byte: KRYPTON_DICOMWEB_TIMEOUT_SECONDS
    budgets: PacsBudgets | None = None  # None: the environment's (PacsBudgets.from_environment)

    @classmethod
    def from_environment(cls, environ: dict | None = None) -> PacsSettings | None:
        """The operator's PACS (module docstring), or None where none is configured."""
        environ = dict(os.environ if environ is None else environ)
        url = environ.get("KRYPTON_DICOMWEB_URL", "").strip()
        if not url:
            return None
        check_root(url)
        password = _secret(environ, "KRYPTON_DICOMWEB_PASSWORD")
        token = _secret(environ, "KRYPTON_DICOMWEB_TOKEN")
        user = environ.get("KRYPTON_DICOMWEB_USER") or None
        if (user is None) != (password is None):
            raise PacsError(
                "set both KRYPTON_DICOMWEB_USER and KRYPTON_DICOMWEB_PASSWORD, or neither"
            )
        if token and user:
            raise PacsError("set a user and password or a token for the PACS, not both")
        budgets = PacsBudgets.from_environment()
        return cls(url.rstrip("/"), user, password, token, budgets.read_timeout, budgets)


def check_root(url: str) -> None:
    """Refuse a DICOMweb root that is not a plain http(s) address: one holding a user or
    password (it would travel wherever the URL goes: a worker's task message, a batch's
    summary, an error), a query or a fragment."""
    if not url.startswith(("http://", "https://")):
        raise PacsError("KRYPTON_DICOMWEB_URL must start with http:// or https://")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        raise PacsError("KRYPTON_DICOMWEB_URL is not a valid address") from None
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise PacsError(
            "KRYPTON_DICOMWEB_URL must not hold a user or password: set "
            "KRYPTON_DICOMWEB_USER and KRYPTON_DICOMWEB_PASSWORD (or _PASSWORD_FILE) instead"
        )
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise PacsError("KRYPTON_DICOMWEB_URL is the DICOMweb root: no ? or # in it")
    if not parts.hostname:
        raise PacsError("KRYPTON_DICOMWEB_URL names no host")


def check_uid(value: object, what: str) -> str:
    """``value`` as a DICOM UID (digits and dots, at most 64 characters), or PacsError
    naming ``what`` (a study, a series, an instance): checked before any URL holds it."""
    text = str(value or "").strip()
    if not _is_uid(text):
        shown = text[:40] + ("…" if len(text) > 40 else "")
        raise PacsError(f"{what} UID {shown!r} is not a DICOM UID (digits and dots, at most 64)")
    return text


def _secret(environ: dict, name: str) -> str | None:
    """``name``'s value, or the first line of the file ``name``_FILE names."""
    if environ.get(name):
        return environ[name]
    path = environ.get(f"{name}_FILE")
    if not path:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError as exc:
        raise PacsError(f"{name}_FILE cannot be read ({exc.strerror})") from None


@dataclass(frozen=True)
class StudyRow:
    """One study as QIDO-RS lists it."""

    study_uid: str
    patient_id: str
    patient_name: str
    date: str
    accession: str
    description: str
    modalities: tuple[str, ...]


@dataclass(frozen=True)
class SeriesRow:
    """One series of a study as QIDO-RS lists it."""

    series_uid: str
    modality: str
    description: str
    number: int | None
    instances: int | None
    manufacturer: str = ""


@dataclass
class Pacs:
    """A connected PACS: dicomweb-client's client over a bounded session."""

    settings: PacsSettings
    client: object
    budgets: PacsBudgets
    session: requests.Session


def connect(settings: PacsSettings) -> Pacs:
    """A client for ``settings``' PACS (nothing is sent until a search or fetch)."""
    from dicomweb_client.api import DICOMwebClient

    check_root(settings.url)
    budgets = settings.budgets or PacsBudgets.from_environment()
    session = requests.Session()
    session.max_redirects = 0  # the adapter refuses a 3xx answer before requests sees it
    session.headers["Accept-Encoding"] = "identity"  # one gzip/deflate layer at most is read
    adapter = BoundedAdapter(settings.url, settings.timeout)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    if settings.user is not None:
        session.auth = (settings.user, settings.password or "")
    elif settings.token:
        session.headers["Authorization"] = f"Bearer {settings.token}"
    client = DICOMwebClient(url=settings.url, session=session, timeout=settings.timeout)
    # no retries: dicomweb-client retries a failed request (a refused download, a stall)
    # five times with growing waits, 30 s before the user hears of it
    client.set_http_retry_params(retry=False)
    return Pacs(settings, client, budgets, session)


@contextmanager
def action(pacs: Pacs, what: str) -> Iterator[ActionBudget]:
    """Around one user action on ``pacs`` (a search, a listing, an open, a send; ``what``
    names it in messages): one deadline and one byte budget for all the requests it
    makes (:func:`krypton.pacs.transport.action`). Each function here is one action
    unless it runs inside another, which it then joins."""
    with _action(pacs.budgets, what) as budget:
        yield budget


@contextmanager
def _answers(pacs: Pacs, what: str, **limits) -> Iterator[RequestBudget]:
    """One PACS request, bounded (:func:`krypton.pacs.transport.bounded` with
    ``limits``), its failures as one line naming ``what`` failed, without the URL's
    credentials, the response body or a Python class name."""
    try:
        with bounded(pacs.budgets, what, **limits) as budget:
            yield budget
    except PacsError:
        raise
    except requests.HTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = " (check the PACS user and password or token)" if status in (401, 403) else ""
        raise PacsError(f"the PACS refused {what}: HTTP {status}{hint}") from None
    except requests.Timeout:
        raise PacsError(
            f"the PACS did not answer {what} in time (nothing for {pacs.settings.timeout:g} s, "
            "KRYPTON_DICOMWEB_TIMEOUT_SECONDS)"
        ) from None
    except requests.ConnectionError as exc:
        if _never_connected(exc):
            raise PacsError(f"the PACS cannot be reached for {what}") from None
        raise PacsError(
            f"the PACS closed the connection before it finished answering {what}"
        ) from None
    except (requests.RequestException, ValueError, KeyError, TypeError, AttributeError) as exc:
        media = re.search(r'media type: "([\w.+/-]{1,64})"', str(exc))
        reason = f"it sent {media.group(1)}, not DICOM" if media else "it is not a DICOMweb answer"
        raise PacsError(f"the PACS's answer to {what} cannot be read ({reason})") from None


def _never_connected(exc: requests.ConnectionError) -> bool:
    """Whether a connection error came before any connection (a refused or unknown
    address: urllib3's NewConnectionError behind its retry error), not from a PACS that
    hung up mid-answer."""
    from urllib3.exceptions import NewConnectionError

    cause = exc.args[0] if exc.args else None
    return isinstance(getattr(cause, "reason", None), NewConnectionError)


def _rows(answer: object, what: str) -> list[dict]:
    """A QIDO answer as its rows: a list of DICOM JSON objects, or PacsError."""
    if answer is None:
        return []
    if not isinstance(answer, list) or not all(isinstance(row, dict) for row in answer):
        raise PacsError(f"the PACS's answer to {what} is not a list of DICOM JSON objects")
    return answer


def _pages(
    pacs: Pacs, what: str, search: Callable[[int, int], object], cap: int, over: str
) -> list[dict]:
    """A QIDO listing read a page at a time (``search(offset, limit)``): at most
    :data:`LISTING_PAGE` rows a page and the budget's pages; a page shorter than asked
    ends it unless the PACS warns that it cut it; past ``cap`` rows PacsError(``over``)."""
    rows: list[dict] = []
    previous: list[dict] | None = None
    for _page in range(pacs.budgets.pages):
        asked = min(LISTING_PAGE, cap + 1 - len(rows))
        with _answers(pacs, what) as request:
            found = _rows(search(len(rows), asked), what)[:asked]  # held to the limit asked
        if found and found == previous:
            raise PacsError(f"the PACS sent the same page of {what} twice (it ignores offset)")
        rows.extend(found)
        if len(rows) > cap:
            raise PacsError(over)
        if not found or (len(found) < asked and not request.warning):  # the end: not cut
            return rows
        previous = found
    raise PacsError(
        f"the PACS's answer to {what} did not end within {pacs.budgets.pages} pages "
        "(KRYPTON_DICOMWEB_PAGES)"
    )


def _value(row: dict, tag: str, default=""):
    """The first value of ``tag`` in a DICOM JSON row (a person name's alphabetic form),
    or ``default`` where the row holds none or holds it malformed."""
    element = row.get(tag)
    values = element.get("Value") if isinstance(element, dict) else None
    if not isinstance(values, list) or not values:
        return default
    value = values[0]
    if isinstance(value, dict):  # a person name
        value = value.get("Alphabetic", default)
    if value is None or isinstance(value, (dict, list)):
        return default
    return value


def _integer(row: dict, tag: str) -> int | None:
    """``tag``'s value as a whole number, or None where it is missing or not one (a PACS
    that lists a series number as "abc")."""
    value = _value(row, tag, None)
    try:
        return int(str(value).strip()) if value is not None else None
    except ValueError:
        return None


def _text(row: dict, tag: str) -> str:
    return str(_value(row, tag))[:256]


def _valid(rows: list[dict], tag: str, what: str) -> list[dict]:
    """The rows whose ``tag`` is a valid UID (the others cannot be opened: left out, and
    the log says how many)."""
    kept = [row for row in rows if _is_uid(_value(row, tag))]
    if len(kept) < len(rows):
        logger.warning(
            "the PACS listed %d %s rows without a valid UID; left out", len(rows) - len(kept), what
        )
    return kept


def _is_uid(value: object) -> bool:
    text = str(value)
    return len(text) <= 64 and _UID.fullmatch(text) is not None


def find_studies(
    pacs: Pacs,
    *,
    patient_id: str | None = None,
    patient_name: str | None = None,
    dates: tuple[str, str] | None = None,
    modality: str | None = None,
    accession: str | None = None,
    limit: int = 50,
) -> list[StudyRow]:
    """Studies matching the filters (``dates``: YYYYMMDD from and to; a name may hold
    ``*`` wildcards), at most ``limit`` (1 to :data:`MAX_STUDIES`) whatever the PACS
    sends; rows without a valid study UID are left out (they cannot be opened)."""
    if not 1 <= int(limit) <= MAX_STUDIES:
        raise PacsError(f"a study search lists 1 to {MAX_STUDIES} studies, not {limit}")
    filters: dict[str, str] = {}
    for keyword, value in (
        ("PatientID", patient_id), ("PatientName", patient_name),
        ("ModalitiesInStudy", modality), ("AccessionNumber", accession),
    ):  # fmt: skip
        if value:
            filters[keyword] = value
    if dates:
        filters["StudyDate"] = f"{dates[0]}-{dates[1]}"
    with action(pacs, "the study search"), _answers(pacs, "the study search"):
        answer = pacs.client.search_for_studies(  # type: ignore[attr-defined]
            limit=limit, search_filters=filters, fields=["ModalitiesInStudy", "StudyDescription"]
        )
    studies = []
    rows = _rows(answer, "the study search")[:limit]
    for row in _valid(rows, "0020000D", "study"):
        element = row.get("00080061")
        modalities = element.get("Value") if isinstance(element, dict) else None
        studies.append(
            StudyRow(
                str(_value(row, "0020000D")),
                _text(row, "00100020"),
                _text(row, "00100010"),
                _text(row, "00080020"),
                _text(row, "00080050"),
                _text(row, "00081030"),
                tuple(
                    str(v)[:16]
                    for v in (modalities if isinstance(modalities, list) else [])
                    if isinstance(v, str)
                ),
            )  # fmt: skip
        )
    return studies


def find_series(pacs: Pacs, study_uid: str) -> list[SeriesRow]:
    """The series of one study, with their instance counts (at most
    :data:`MAX_SERIES`); rows without a valid series UID are left out."""
    study_uid = check_uid(study_uid, "the study")
    what = f"the series listing of study {study_uid}"

    def search(offset: int, limit: int) -> object:
        return pacs.client.search_for_series(  # type: ignore[attr-defined]
            study_uid, offset=offset, limit=limit,
            fields=["NumberOfSeriesRelatedInstances", "SeriesDescription", "Manufacturer"],
        )  # fmt: skip

    over = f"study {study_uid} lists more than {MAX_SERIES} series"
    with action(pacs, what):
        rows = _pages(pacs, what, search, MAX_SERIES, over)
    found = []
    for row in _valid(rows, "0020000E", "series"):
        uid = str(_value(row, "0020000E"))
        found.append(
            SeriesRow(
                uid,
                _text(row, "00080060"),
                _text(row, "0008103E"),
                _integer(row, "00200011"),
                _integer(row, "00201209"),
                _text(row, "00080070"),
            )  # fmt: skip
        )
    return found


def _declared_bytes(row: dict, uid: str) -> int:
    """An instance's pixel bytes as its QIDO attributes declare them."""
    try:
        rows, columns = int(_value(row, "00280010")), int(_value(row, "00280011"))
        samples = int(_value(row, "00280002", 1) or 1)
        bits = int(_value(row, "00280100", 16) or 16)
        frames = int(_value(row, "00280008", 1) or 1)
    except (TypeError, ValueError):
        raise PacsError(f"the PACS lists instance {uid} without its rows and columns") from None
    if min(rows, columns, samples, bits, frames) < 1:
        raise PacsError(f"the PACS lists instance {uid} with an empty size")
    return rows * columns * samples * frames * max(bits, 8) // 8


def _listing(pacs: Pacs, study_uid: str, series_uid: str) -> dict[str, dict]:
    """The series' instances as QIDO-RS lists them (UID -> attributes), at most
    :data:`MAX_SLICES`, each UID checked before it is ever asked for."""
    study_uid, series_uid = check_uid(study_uid, "the study"), check_uid(series_uid, "the series")

    def search(offset: int, limit: int) -> object:
        return pacs.client.search_for_instances(  # type: ignore[attr-defined]
            study_uid, series_uid, fields=list(_INSTANCE_FIELDS), offset=offset, limit=limit
        )

    over = f"series {series_uid} lists more than {MAX_SLICES} instances, over the slice limit"
    what = f"the instance listing of series {series_uid}"
    with action(pacs, what):
        listing = _pages(pacs, what, search, MAX_SLICES, over)
    if not listing:
        raise PacsError(f"the PACS lists no instances in series {series_uid}")
    declared: dict[str, dict] = {}
    for row in listing:
        uid = check_uid(_value(row, "00080018"), "the PACS lists an instance whose")
        if uid in declared:
            raise PacsError(f"the PACS lists instance {uid} of series {series_uid} twice")
        declared[uid] = row
    return declared


def _retrieve(pacs: Pacs, study_uid: str, series_uid: str, uid: str, size: int):
    """One instance (WADO-RS), its answer held to ``size`` pixel bytes and a header, read
    whether or not the PACS sends it with the Part-10 preamble (what a dataset stored
    from memory becomes, and what several archives serve)."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    client = pacs.client
    reason = f"the {size:,} pixel bytes it declared for instance {uid}"
    what = f"instance {uid}"
    url = f"{pacs.settings.url}/studies/{study_uid}/series/{series_uid}/instances/{uid}"
    with _answers(pacs, what, max_bytes=size + HEADER_SLACK, bytes_reason=reason):
        response = pacs.session.get(
            url, headers={"Accept": 'multipart/related; type="application/dicom"'}
        )
        response.raise_for_status()
        media = response.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if media == "application/dicom":  # one part sent bare, as some servers do
            parts = [response.content]
        else:  # dicomweb-client's multipart decoder (it refuses another media type)
            parts = list(client._decode_multipart_message(response, stream=False))  # type: ignore[attr-defined]
    if len(parts) != 1:
        raise PacsError(f"the PACS sent {len(parts)} objects for {what}, which it listed as one")
    try:
        dataset = pydicom.dcmread(io.BytesIO(parts[0]), force=True)
    except (InvalidDicomError, ValueError, EOFError, KeyError, TypeError, OverflowError):
        raise PacsError(f"the PACS sent {what} as something that is not DICOM") from None
    if "PixelData" not in dataset and "FloatPixelData" not in dataset:
        raise PacsError(f"the PACS sent {what} without pixels (it may not be DICOM)")
    if not hasattr(dataset, "file_meta") or "TransferSyntaxUID" not in dataset.file_meta:
        _add_file_meta(dataset)
    return dataset


def _add_file_meta(dataset) -> None:  # type: ignore[no-untyped-def]
    """The Part-10 header a dataset sent without one needs to be saved as a file: its
    encoding as pydicom read it (force reads an implicit little-endian stream)."""
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian

    meta = FileMetaDataset()
    implicit = getattr(dataset, "is_implicit_VR", True) is not False
    meta.TransferSyntaxUID = ImplicitVRLittleEndian if implicit else ExplicitVRLittleEndian
    meta.MediaStorageSOPClassUID = dataset.get("SOPClassUID", "1.2.840.10008.5.1.4.1.1.7")
    meta.MediaStorageSOPInstanceUID = dataset.get("SOPInstanceUID", "")
    dataset.file_meta = meta


# Progress of a download: (instances fetched, instances in all)
Progress = Callable[[int, int], None]


def _fetch(
    pacs: Pacs, study_uid: str, series_uid: str, declared: dict[str, dict], folder: Path,
    max_bytes: int | None, what: str = "a volume", progress: Progress | None = None,
) -> list[Path]:  # fmt: skip
    """Fetch the ``declared`` instances into ``folder`` once their declared sizes pass
    the decode budget and ``max_bytes`` (the limit on ``what``: a volume, an image), each
    download held to its declared size."""
    sizes = {uid: _declared_bytes(row, uid) for uid, row in declared.items()}
    total = sum(sizes.values())
    try:  # the reader's own budget, asked of the PACS's listing before any fetch
        if what == "a volume":
            _check_streamed(series_uid, declared, sizes)
        else:
            check_files_size(f"series {series_uid}", len(sizes), total)
    except ImageLoadError as exc:
        raise PacsError(str(exc)) from None
    if max_bytes is not None and total > max_bytes:
        raise PacsError(
            f"{'the image of ' if what == 'an image' else ''}series {series_uid} holds "
            f"{total / 2**20:.3g} MB of pixels, over "
            f"the {max_bytes / 2**20:.3g} MB {what} may have here"
        )
    # the action's time and bytes grow with what the listing declares
    with action(pacs, f"the download of series {series_uid}") as bounds:
        bounds.extend(total / PACE_BYTES_PER_SECOND, total + len(sizes) * HEADER_SLACK)
        order = sorted(sizes, key=lambda uid: _integer(declared[uid], "00200013") or 0)
        in_order = {uid: sizes[uid] for uid in order}
        return _retrieve_all(pacs, study_uid, series_uid, in_order, folder, bounds, progress)


def _check_streamed(series_uid: str, declared: dict[str, dict], sizes: dict[str, int]) -> None:
    """A series' listing against what reading it slice by slice holds (its largest
    instance's rows, columns and bits, :data:`IN_FLIGHT` downloads of it and the
    headers), before any instance is fetched; the model's block is checked by the
    reader."""
    largest = max(sizes, key=lambda uid: sizes[uid])
    row = declared[largest]
    rows, columns = _integer(row, "00280010") or 1, _integer(row, "00280011") or 1
    bits = _integer(row, "00280100") or 16
    frames = _integer(row, "00280008") or 1
    if frames > 1 and len(sizes) > 1:
        raise ImageLoadError(
            f"series {series_uid} mixes {len(sizes)} instances with a {frames}-frame one: "
            f"a volume is one series of slices or one multi-frame object"
        )
    held = sizes[largest] + HEADER_SLACK
    cost = streamed_cost(len(sizes), rows, columns * frames, bits, (0,), held)
    cost += IN_FLIGHT * held
    DECODE_BUDGET.cost(
        f"series {series_uid}", f"{len(sizes)} instance{'s' if len(sizes) != 1 else ''} of "
        f"{rows}x{columns}{f'x{frames}' if frames > 1 else ''} {bits}-bit pixels as the PACS "
        f"lists them", (max(cost, 1),), 1, 1,
    )  # fmt: skip


def _retrieve_all(
    pacs: Pacs, study_uid: str, series_uid: str, sizes: dict[str, int], folder: Path,
    owner: ActionBudget, progress: Progress | None = None,
) -> list[Path]:  # fmt: skip
    """Each instance of ``sizes`` (UID -> declared pixel bytes) into ``folder``,
    :data:`IN_FLIGHT` at a time in the order given, each download held to its declared
    size, all within the action ``owner``; ``progress`` hears each one saved. The first
    failure stops the rest (the downloads in flight end, none more starts)."""
    from concurrent.futures import ThreadPoolExecutor

    stop = threading.Event()

    def one(number: int, uid: str) -> Path:
        if stop.is_set():
            raise PacsError(f"the download of series {series_uid} was stopped")
        with joined(owner):
            dataset = _retrieve(pacs, study_uid, series_uid, uid, sizes[uid])
        if str(getattr(dataset, "SOPInstanceUID", "")) != uid:
            raise PacsError(f"the PACS sent another instance than {uid}, which it listed")
        path = folder / f"{number:05d}.dcm"
        try:
            dataset.save_as(path, enforce_file_format=True)
        except (ValueError, TypeError, AttributeError, KeyError):
            raise PacsError(f"the PACS sent instance {uid} in a form that cannot be kept") from None
        return path

    written: list[Path] = []
    with ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="krypton-pacs-fetch") as pool:
        futures = [pool.submit(one, number, uid) for number, uid in enumerate(sizes)]
        try:
            for future in futures:
                written.append(future.result())
                if progress is not None:
                    progress(len(written), len(futures))
        except BaseException:
            stop.set()
            for future in futures:
                future.cancel()
            raise
    return written


def fetch_series(
    pacs: Pacs, study_uid: str, series_uid: str, folder: Path, max_bytes: int | None = None,
    progress: Progress | None = None,
) -> list[Path]:  # fmt: skip
    """Fetch one series' instances into ``folder``, within the limits in the module
    docstring and, where given, ``max_bytes`` of declared pixels (the app's volume
    limit); the files written, in instance-number order. ``progress(n, N)`` hears each
    instance saved."""
    with action(pacs, f"the download of series {series_uid}"):
        declared = _listing(pacs, study_uid, series_uid)
        return _fetch(pacs, study_uid, series_uid, declared, folder, max_bytes,
                      progress=progress)  # fmt: skip


def fetch_instance(
    pacs: Pacs, study_uid: str, series_uid: str, which: str | None, folder: Path,
    max_bytes: int | None = None,
) -> Path:  # fmt: skip
    """Fetch one image of a series into ``folder`` (a 2-D model's input), within the
    same limits and, where given, ``max_bytes`` of declared pixels (the app's image
    limit): ``which`` is its SOP Instance UID or its instance number; None takes a
    series' only image."""
    with action(pacs, f"the image of series {series_uid}"):
        return _fetch_one(pacs, study_uid, series_uid, which, folder, max_bytes)


def _fetch_one(
    pacs: Pacs, study_uid: str, series_uid: str, which: str | None, folder: Path,
    max_bytes: int | None,
) -> Path:  # fmt: skip
    """:func:`fetch_instance` inside its action."""
    declared = _listing(pacs, study_uid, series_uid)
    if which:
        chosen = {
            uid: row for uid, row in declared.items()
            if which in (uid, str(_value(row, "00200013", "")))
        }  # fmt: skip
        if len(chosen) != 1:
            raise PacsError(f"series {series_uid} has no single image {str(which)[:64]!r}")
    elif len(declared) == 1:
        chosen = declared
    else:
        numbers = sorted(int(n) for n in (_value(r, "00200013", None) for r in declared.values())
                         if str(n or "").isdigit())  # fmt: skip
        listed = f" (instance numbers {numbers[0]}-{numbers[-1]})" if numbers else ""
        raise ImageNotChosen(
            f"series {series_uid} has {len(declared)} images: name one by its UID or "
            f"instance number{listed}"
        )
    return _fetch(pacs, study_uid, series_uid, chosen, folder, max_bytes, "an image")[0]


def fetch_series_zip(
    pacs: Pacs, study_uid: str, series_uid: str, max_bytes: int | None = None,
    progress: Progress | None = None,
) -> bytes:  # fmt: skip
    """One series' instances (:func:`fetch_series`, within its limits) as the bytes of a
    zip, as a user uploads a series: what the app keeps and reads."""
    import io
    import zipfile

    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="krypton-pacs-") as folder:
        files = fetch_series(pacs, study_uid, series_uid, Path(folder), max_bytes, progress)
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
            for path in files:
                archive.write(path, path.name)
    return buffer.getvalue()


def load_series(
    pacs: Pacs, study_uid: str, series_uid: str, target: ModelTarget,
    progress: Progress | None = None,
) -> tuple[ModelVolume, VolumeGeometry]:  # fmt: skip
    """One series as the model of ``target`` takes it (:func:`fetch_series`, then read
    slice by slice), and what it was: its geometry with its slices' headers, without
    pixel data (what a result stored back references)."""
    with tempfile.TemporaryDirectory(prefix="krypton-pacs-") as folder:
        fetch_series(pacs, study_uid, series_uid, Path(folder), progress=progress)
        return read_for_model(folder, target)


def fetched_headers(files: list[Path]) -> list:
    """The fetched instances' headers without their pixels: what a result stored back
    into the study references."""
    import pydicom

    return [pydicom.dcmread(path, stop_before_pixels=True) for path in files]


def store(pacs: Pacs, datasets: list, study_uid: str) -> None:
    """Store ``datasets`` in the study ``study_uid`` (STOW-RS). A PACS that takes some
    and refuses others (HTTP 409, or 202 with failures) raises PacsError saying how many
    of each, why, and which series now hold part of the result. The request's deadline
    (and its action's) grows by a second per 4 MB sent; its answer is held to the answer
    budget."""
    study_uid = check_uid(study_uid, "the study")
    sent = sum(
        len(getattr(dataset, keyword, b"") or b"")
        for dataset in datasets
        for keyword in ("PixelData", "FloatPixelData", "DoubleFloatPixelData")
    )  # a Parametric Map's values are float pixel data: they are sent too
    sending = sent / PACE_BYTES_PER_SECOND  # seconds more, for the request and its action
    what = f"storing the result in study {study_uid}"
    try:
        with action(pacs, what) as bounds:
            bounds.extend(sending, 0)  # before the request: its deadline is held to the action's
            with _answers(pacs, what, extra_seconds=sending):
                boundary = f"krypton-{uuid.uuid4().hex}"
                response = pacs.session.post(
                    f"{pacs.settings.url}/studies/{study_uid}",
                    data=_stow_body(datasets, boundary),
                    headers={
                        "Content-Type": f'multipart/related; type="application/dicom"; '
                        f"boundary={boundary}",
                        "Accept": "application/dicom+json",
                    },
                )
                try:
                    response.raise_for_status()
                except requests.HTTPError:
                    partly = _partly_stored(_stow_answer(response.text), len(datasets))
                    if partly:
                        raise PacsError(partly) from None
                    raise
                answer = _stow_answer(response.text)
    except PacsError as exc:
        if any(words in str(exc) for words in ("sent more than", "did not finish", "closed the")):
            raise PacsError(
                f"{exc}; it may have stored the result: look in the study before sending again"
            ) from None
        raise
    if _sequence(answer, "00081198"):  # 202: some were refused
        raise PacsError(_partly_stored(answer, len(datasets)))


# A part's bytes sent at a time from its pixel data (a map's values are never copied whole)
STOW_CHUNK = 1 << 20
_FLOAT_PIXELS = ((0x7FE0, 0x0008, b"OF", "FloatPixelData"),
                 (0x7FE0, 0x0009, b"OD", "DoubleFloatPixelData"))  # fmt: skip


def _stow_body(datasets: list, boundary: str) -> Iterator[bytes]:
    """A STOW-RS request's multipart body, produced as it is sent: each dataset as a
    Part-10 file, a Parametric Map's float pixel data (its last element) passed on from
    the dataset's own bytes a megabyte at a time. dicomweb-client's encoder held a map
    four times over (the dataset, its file, the body and the body's copy: 1.2 GB for a
    512 x 512 x 300 CT's map)."""
    import struct

    import pydicom
    from pydicom.uid import ExplicitVRLittleEndian

    for dataset in datasets:
        yield (f"\r\n--{boundary}\r\nContent-Type: application/dicom\r\n\r\n").encode()
        syntax = getattr(getattr(dataset, "file_meta", None), "TransferSyntaxUID", None)
        found = [spec for spec in _FLOAT_PIXELS if spec[3] in dataset]
        if syntax != ExplicitVRLittleEndian or not found:
            with io.BytesIO() as buffer:
                pydicom.dcmwrite(buffer, dataset, enforce_file_format=True)
                yield buffer.getvalue()
            continue
        group, element, vr, keyword = found[0]
        pixels = dataset[keyword]
        del dataset[keyword]  # the file written without it (a copy of a dataset shares it)
        try:
            with io.BytesIO() as buffer:
                pydicom.dcmwrite(buffer, dataset, enforce_file_format=True)
                written = buffer.getvalue()
        finally:
            dataset.add(pixels)
        yield written
        values = memoryview(pixels.value)
        yield struct.pack("<HH2sHI", group, element, vr, 0, len(values))
        for start in range(0, len(values), STOW_CHUNK):
            yield bytes(values[start : start + STOW_CHUNK])
    yield f"\r\n--{boundary}--".encode()


def _stow_answer(body: str) -> dict:
    """A STOW-RS answer's DICOM JSON, or {} where it has none."""
    try:
        answer = json.loads(body)
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _partly_stored(answer: dict, total: int) -> str:
    """What a STOW-RS answer says was refused and what was kept (''  if nothing was)."""
    failed, kept = _sequence(answer, "00081198"), _sequence(answer, "00081199")
    if not failed:
        return ""
    reasons = sorted({f"0x{(_integer(item, '00081197') or 0):04X}" for item in failed})
    addresses = (str(_value(item, "00081190")) for item in kept)
    named = (address.split("/series/")[1].split("/")[0] for address in addresses
             if "/series/" in address)  # fmt: skip
    kept_series = sorted({uid for uid in named if _is_uid(uid)})
    held = (
        f"; it stored {len(kept)} (series {', '.join(kept_series)}): remove those there "
        "before sending again"
        if kept
        else "; it stored none"
    )
    return (
        f"the PACS refused {len(failed)} of the result's {total} instances (failure "
        f"reason {', '.join(reasons)}){held}"
    )


def _sequence(answer: dict, tag: str) -> list[dict]:
    """The items of a sequence in a DICOM JSON answer (malformed: none)."""
    element = answer.get(tag)
    items = element.get("Value") if isinstance(element, dict) else None
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def content_labels(pacs: Pacs, study_uid: str, sop_class_uid: str) -> set[str]:
    """The Content Labels of the study's instances of one SOP class (QIDO-RS): how a
    stored result is recognised again."""
    study_uid = check_uid(study_uid, "the study")
    sop_class_uid = check_uid(sop_class_uid, "the SOP class")

    def search(offset: int, limit: int) -> object:
        return pacs.client.search_for_instances(  # type: ignore[attr-defined]
            study_uid, search_filters={"SOPClassUID": sop_class_uid}, fields=["00700080"],
            offset=offset, limit=limit,
        )  # fmt: skip

    over = f"study {study_uid} holds more than {MAX_RESULTS} results"
    what = f"the result search of study {study_uid}"
    with action(pacs, what):
        rows = _pages(pacs, what, search, MAX_RESULTS, over)
    return {str(_value(row, "00700080")) for row in rows if _value(row, "00700080")}
