"""Studies from a PACS over DICOMweb: QIDO-RS to search, WADO-RS to fetch a series,
STOW-RS to store results, through dicomweb-client.

The PACS is configured by whoever runs Krypton, never by a page or a caller's URL:
``KRYPTON_DICOMWEB_URL`` and either ``KRYPTON_DICOMWEB_USER`` with
``KRYPTON_DICOMWEB_PASSWORD`` or ``KRYPTON_DICOMWEB_TOKEN`` (a bearer token); each secret
may instead be read from the file ``KRYPTON_DICOMWEB_PASSWORD_FILE`` /
``KRYPTON_DICOMWEB_TOKEN_FILE``. An https URL is verified against the system's
certificates. Secrets never appear in a message, a repr or a log line. A response that
sends nothing for ``KRYPTON_DICOMWEB_TIMEOUT_SECONDS`` (default 10) is refused.

A series comes in through the same limits as a series read from disk: its instances are
listed first (QIDO, with their rows, columns, samples, bits and frames), and the listing
is held to :data:`krypton.io.volumes.MAX_SLICES` and the decode budget before any pixel
is fetched; each download is counted as it arrives and stopped where it passes what the
listing declared (a PACS that lies about an instance's size, or sends instances it did
not list, is refused by name), and a response that stalls ends at the timeout. The
fetched files are then read by :func:`krypton.io.volumes.read_dicom_series`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import requests
from requests.adapters import HTTPAdapter

from .._environment import SettingError, library_setting
from ._decoding import ImageLoadError
from .volumes import MAX_SLICES, Volume, check_files_size, read_dicom_series

__all__ = [
    "PacsError",
    "ImageNotChosen",
    "PacsSettings",
    "StudyRow",
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

HEADER_SLACK = 64 * 1024  # an instance's bytes beyond its pixels: its header, multipart framing
_INSTANCE_FIELDS = (
    "Rows", "Columns", "SamplesPerPixel", "BitsAllocated", "NumberOfFrames", "InstanceNumber"
)  # fmt: skip


class PacsError(ImageLoadError):
    """The PACS could not be reached, refused a request or sent what it did not declare."""


class ImageNotChosen(PacsError):
    """A series of several images where one image was asked for without naming which."""


@dataclass(frozen=True)
class PacsSettings:
    """Where the PACS is and how to sign in (secrets kept out of repr)."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    timeout: float = 10.0  # seconds without a byte: KRYPTON_DICOMWEB_TIMEOUT_SECONDS

    @classmethod
    def from_environment(cls, environ: dict | None = None) -> PacsSettings | None:
        """The operator's PACS (module docstring), or None where none is configured."""
        environ = dict(os.environ if environ is None else environ)
        url = environ.get("KRYPTON_DICOMWEB_URL", "").strip()
        if not url:
            return None
        if not url.startswith(("http://", "https://")):
            raise PacsError("KRYPTON_DICOMWEB_URL must start with http:// or https://")
        password = _secret(environ, "KRYPTON_DICOMWEB_PASSWORD")
        token = _secret(environ, "KRYPTON_DICOMWEB_TOKEN")
        user = environ.get("KRYPTON_DICOMWEB_USER") or None
        if (user is None) != (password is None):
            raise PacsError(
                "set both KRYPTON_DICOMWEB_USER and KRYPTON_DICOMWEB_PASSWORD, or neither"
            )
        if token and user:
            raise PacsError("set a user and password or a token for the PACS, not both")
        try:
            timeout = library_setting("KRYPTON_DICOMWEB_TIMEOUT_SECONDS")
        except SettingError as exc:
            raise PacsError(str(exc)) from None
        return cls(url.rstrip("/"), user, password, token, timeout)


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


class _CountingAdapter(HTTPAdapter):
    """Every request with the PACS's timeout, and a response's body counted as it
    arrives: past the session's ``byte_limit`` (when set) the read stops and a
    :class:`PacsError` names what was declared."""

    def __init__(self, timeout: float):
        super().__init__()
        self.timeout = timeout
        self.byte_limit: int | None = None
        self.limit_reason = ""

    def send(self, request, **kwargs):  # type: ignore[override]
        kwargs["timeout"] = kwargs.get("timeout") or self.timeout
        return super().send(request, **kwargs)

    def build_response(self, req, resp):  # type: ignore[override]
        response = super().build_response(req, resp)
        if self.byte_limit is not None:
            _count_reads(response, self.byte_limit, self.limit_reason)
        return response


def _count_reads(response, limit: int, reason: str) -> None:
    """Wrap the raw reads of ``response`` (plain and chunked) so that passing ``limit``
    bytes stops the download."""
    raw, counted = response.raw, [0]

    def count(chunk):
        counted[0] += len(chunk)
        if counted[0] > limit:
            response.close()
            raise PacsError(f"the PACS sent more than {reason}")
        return chunk

    def counting(read):
        def wrapped(*args, **kwargs):
            result = read(*args, **kwargs)
            if isinstance(result, (bytes, bytearray)):
                return count(result)
            return (count(chunk) for chunk in result)  # read_chunked yields chunks

        return wrapped

    raw.read = counting(raw.read)
    raw.read_chunked = counting(raw.read_chunked)


@dataclass
class Pacs:
    """A connected PACS: dicomweb-client's client over a counting session."""

    settings: PacsSettings
    client: object
    adapter: _CountingAdapter

    @contextmanager
    def limited(self, limit: int, reason: str) -> Iterator[None]:
        """Responses inside hold at most ``limit`` bytes (``reason``: what was declared)."""
        self.adapter.byte_limit, self.adapter.limit_reason = limit, reason
        try:
            yield
        finally:
            self.adapter.byte_limit, self.adapter.limit_reason = None, ""


def connect(settings: PacsSettings) -> Pacs:
    """A client for ``settings``' PACS (nothing is sent until a search or fetch)."""
    from dicomweb_client.api import DICOMwebClient

    session = requests.Session()
    adapter = _CountingAdapter(settings.timeout)
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
    return Pacs(settings, client, adapter)


@contextmanager
def _answers(what: str) -> Iterator[None]:
    """requests' and dicomweb-client's failures as one line naming ``what`` failed,
    without the URL's credentials or the response body."""
    try:
        yield
    except PacsError:
        raise
    except requests.HTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = " (check the PACS user and password or token)" if status in (401, 403) else ""
        raise PacsError(f"the PACS refused {what}: HTTP {status}{hint}") from None
    except requests.Timeout:
        raise PacsError(f"the PACS did not answer {what} in time") from None
    except requests.ConnectionError:
        raise PacsError(f"the PACS cannot be reached for {what}") from None
    except (requests.RequestException, ValueError, KeyError) as exc:
        media = re.search(r'media type: "([\w.+/-]{1,64})"', str(exc))
        reason = f"it sent {media.group(1)}, not DICOM" if media else type(exc).__name__
        raise PacsError(f"the PACS's answer to {what} cannot be read ({reason})") from None


def _value(row: dict, tag: str, default=""):
    values = row.get(tag, {}).get("Value") or [default]
    value = values[0]
    if isinstance(value, dict):  # a person name
        return value.get("Alphabetic", default)
    return value


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
    ``*`` wildcards), at most ``limit``."""
    filters: dict[str, str] = {}
    for keyword, value in (
        ("PatientID", patient_id), ("PatientName", patient_name),
        ("ModalitiesInStudy", modality), ("AccessionNumber", accession),
    ):  # fmt: skip
        if value:
            filters[keyword] = value
    if dates:
        filters["StudyDate"] = f"{dates[0]}-{dates[1]}"
    with _answers("the study search"):
        rows = pacs.client.search_for_studies(  # type: ignore[attr-defined]
            limit=limit, search_filters=filters, fields=["ModalitiesInStudy", "StudyDescription"]
        )
    return [
        StudyRow(
            _value(row, "0020000D"),
            str(_value(row, "00100020")),
            str(_value(row, "00100010")),
            str(_value(row, "00080020")),
            str(_value(row, "00080050")),
            str(_value(row, "00081030")),
            tuple(str(v) for v in row.get("00080061", {}).get("Value", [])),
        )  # fmt: skip
        for row in rows
    ]


def find_series(pacs: Pacs, study_uid: str) -> list[SeriesRow]:
    """The series of one study, with their instance counts."""
    with _answers("the series search"):
        rows = pacs.client.search_for_series(  # type: ignore[attr-defined]
            study_uid,
            fields=["NumberOfSeriesRelatedInstances", "SeriesDescription", "Manufacturer"],
        )
    found = []
    for row in rows:
        number, count = _value(row, "00200011", None), _value(row, "00201209", None)
        found.append(
            SeriesRow(
                _value(row, "0020000E"),
                str(_value(row, "00080060")),
                str(_value(row, "0008103E")),
                None if number is None else int(number),
                None if count is None else int(count),
                str(_value(row, "00080070")),
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
    :data:`MAX_SLICES`."""
    with _answers("the instance listing"):
        listing = pacs.client.search_for_instances(  # type: ignore[attr-defined]
            study_uid, series_uid, fields=list(_INSTANCE_FIELDS), get_remaining=True
        )
    if not listing:
        raise PacsError(f"the PACS lists no instances in series {series_uid}")
    if len(listing) > MAX_SLICES:
        raise PacsError(f"series {series_uid} has {len(listing)} instances, over {MAX_SLICES}")
    return {str(_value(row, "00080018")): row for row in listing}


def _fetch(
    pacs: Pacs, study_uid: str, series_uid: str, declared: dict[str, dict], folder: Path,
    max_bytes: int | None, what: str = "a volume",
) -> list[Path]:  # fmt: skip
    """Fetch the ``declared`` instances into ``folder`` once their declared sizes pass
    the decode budget and ``max_bytes`` (the limit on ``what``: a volume, an image), each
    download held to its declared size."""
    sizes = {uid: _declared_bytes(row, uid) for uid, row in declared.items()}
    try:  # the series reader's own budget, asked of the PACS's listing
        check_files_size(f"series {series_uid}", len(sizes), sum(sizes.values()))
    except PacsError:
        raise
    except ImageLoadError as exc:
        raise PacsError(str(exc)) from None
    if max_bytes is not None and sum(sizes.values()) > max_bytes:
        raise PacsError(
            f"{'the image of ' if what == 'an image' else ''}series {series_uid} holds "
            f"{sum(sizes.values()) / 2**20:.3g} MB of pixels, over "
            f"the {max_bytes / 2**20:.3g} MB {what} may have here"
        )
    written = []
    for number, (uid, size) in enumerate(sizes.items()):
        limit = size + HEADER_SLACK
        reason = f"the {size:,} pixel bytes it declared for instance {uid}"
        with pacs.limited(limit, reason), _answers(f"instance {uid}"):
            dataset = pacs.client.retrieve_instance(study_uid, series_uid, uid)  # type: ignore[attr-defined]
        if str(getattr(dataset, "SOPInstanceUID", "")) != uid:
            raise PacsError(f"the PACS sent another instance than {uid}, which it listed")
        path = folder / f"{number:05d}.dcm"
        dataset.save_as(path, enforce_file_format=True)
        written.append(path)
    return written


def fetch_series(
    pacs: Pacs, study_uid: str, series_uid: str, folder: Path, max_bytes: int | None = None
) -> list[Path]:
    """Fetch one series' instances into ``folder``, within the limits in the module
    docstring and, where given, ``max_bytes`` of declared pixels (the app's volume
    limit); the files written."""
    declared = _listing(pacs, study_uid, series_uid)
    return _fetch(pacs, study_uid, series_uid, declared, folder, max_bytes)


def fetch_instance(
    pacs: Pacs, study_uid: str, series_uid: str, which: str | None, folder: Path,
    max_bytes: int | None = None,
) -> Path:  # fmt: skip
    """Fetch one image of a series into ``folder`` (a 2-D model's input), within the
    same limits and, where given, ``max_bytes`` of declared pixels (the app's image
    limit): ``which`` is its SOP Instance UID or its instance number; None takes a
    series' only image."""
    declared = _listing(pacs, study_uid, series_uid)
    if which:
        chosen = {
            uid: row for uid, row in declared.items()
            if which in (uid, str(_value(row, "00200013", "")))
        }  # fmt: skip
        if len(chosen) != 1:
            raise PacsError(f"series {series_uid} has no single image {which!r}")
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
    pacs: Pacs, study_uid: str, series_uid: str, max_bytes: int | None = None
) -> bytes:
    """One series' instances (:func:`fetch_series`, within its limits) as the bytes of a
    zip, as a user uploads a series: what the app keeps and reads."""
    import io
    import zipfile

    buffer = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="krypton-pacs-") as folder:
        files = fetch_series(pacs, study_uid, series_uid, Path(folder), max_bytes)
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
            for path in files:
                archive.write(path, path.name)
    return buffer.getvalue()


def load_series(pacs: Pacs, study_uid: str, series_uid: str) -> tuple[Volume, list]:
    """One series as a volume (:func:`fetch_series`, then the series reader), and its
    datasets without pixel data (what a result stored back references)."""
    with tempfile.TemporaryDirectory(prefix="krypton-pacs-") as folder:
        files = fetch_series(pacs, study_uid, series_uid, Path(folder))
        volume = read_dicom_series(folder)
        headers = fetched_headers(files)
    return volume, headers


def fetched_headers(files: list[Path]) -> list:
    """The fetched instances' headers without their pixels: what a result stored back
    into the study references."""
    import pydicom

    return [pydicom.dcmread(path, stop_before_pixels=True) for path in files]


def store(pacs: Pacs, datasets: list, study_uid: str) -> None:
    """Store ``datasets`` in the study ``study_uid`` (STOW-RS). A PACS that takes some
    and refuses others (HTTP 409, or 202 with failures) raises PacsError saying how many
    of each, why, and which series now hold part of the result."""
    with _answers("storing the result"):
        try:
            answer = pacs.client.store_instances(datasets, study_uid)  # type: ignore[attr-defined]
        except requests.HTTPError as exc:
            body = exc.response.text if exc.response is not None else ""
            partly = _partly_stored(_stow_answer(body), len(datasets))
            if partly:
                raise PacsError(partly) from None
            raise
    if answer is not None and answer.get("FailedSOPSequence"):  # 202: some were refused
        raise PacsError(_partly_stored(answer.to_json_dict(), len(datasets)))


def _stow_answer(body: str) -> dict:
    """A STOW-RS answer's DICOM JSON, or {} where it has none."""
    try:
        answer = json.loads(body)
    except ValueError:
        return {}
    return answer if isinstance(answer, dict) else {}


def _partly_stored(answer: dict, total: int) -> str:
    """What a STOW-RS answer says was refused and what was kept (''  if nothing was)."""
    failed = answer.get("00081198", {}).get("Value") or []
    if not failed:
        return ""
    kept = answer.get("00081199", {}).get("Value") or []
    reasons = sorted({f"0x{int(_value(item, '00081197', 0)):04X}" for item in failed})
    kept_series = sorted({
        str(_value(item, "00081190")).split("/series/")[1].split("/")[0]
        for item in kept if "/series/" in str(_value(item, "00081190"))
    })  # fmt: skip
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


def content_labels(pacs: Pacs, study_uid: str, sop_class_uid: str) -> set[str]:
    """The Content Labels of the study's instances of one SOP class (QIDO-RS): how a
    stored result is recognised again."""
    with _answers("the result search"):
        rows = pacs.client.search_for_instances(  # type: ignore[attr-defined]
            study_uid, search_filters={"SOPClassUID": sop_class_uid}, fields=["00700080"],
            get_remaining=True,
        )  # fmt: skip
    return {str(_value(row, "00700080")) for row in rows if _value(row, "00700080")}
