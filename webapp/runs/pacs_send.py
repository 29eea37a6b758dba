"""One Send for both subjects: the result a panel shows, stored in the study of the input
it was opened from (krypton.pacs.results), once per result key whoever presses it.

What an image and a volume do differently is one :class:`SendKind` each, chosen by the
panel's rank (:data:`KINDS`): what it is called and the source the library places the
result on (the prepared block and the series' headers; the DICOM file, its window and
frame). Everything else — which result, whether the panel's input came from the PACS
(the record's DICOM source, either kind's), the key, the study asked first, one Send of
a key at a time, the words — is :func:`send_result`, and the one sender of the library
(krypton.pacs.results.send_result) stores it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from krypton.pacs.dicomweb import PacsError, action, connect
from krypton.pacs.results import ImageSource, VolumeSource, in_study, result_key
from krypton.pacs.results import send_result as store_result
from krypton.pacs.results import source_instance as pacs_source_instance
from krypton.render.dicom_series import dicom_headers

from ..helpers import InputError
from .records import NOT_KEPT, kept_result, refuse_partial, result_heatmap
from .subjects import results_key

__all__ = ["ALREADY_SENT", "KINDS", "SendKind", "send_result"]

logger = logging.getLogger("krypton.app")

ALREADY_SENT = (
    "Already in the PACS: this result ({key}) was sent to the study before; nothing new was stored."
)
NOT_FROM_PACS = "This {what} was not opened from the PACS; only those are sent back."


@dataclass(frozen=True)
class SendKind:
    """What a subject's Send needs of its kind: ``what`` the panel's input is called and
    ``source(services, result, session)`` the settings that name its result beyond the
    run's with the source the library places the result on."""

    what: str
    source: Callable[..., tuple[dict, ImageSource | VolumeSource]]


def send_result(services, rank: int, handle, session: str) -> str:
    """Store the result ``handle`` names (the panel of ``rank``'s) in the study of the
    input it was made from, unless the study holds it already; the sentence the page
    shows."""
    kind = KINDS[rank]
    result, why = kept_result(services.results, results_key(session, rank), handle)
    if result is None:
        return why or NOT_KEPT
    source_key = (result.get("dicom") or {}).get("source") or ""  # no DICOM source: none
    opened = services.pacs_sources.origin(str(source_key), session)
    if opened is None:
        return NOT_FROM_PACS.format(what=kind.what)
    study, series = opened
    try:
        refuse_partial(result, "the PACS")
        with services.pacs_call():
            model = services.model(result["model"], rank=rank)
            key_settings, source = kind.source(services, result, session)
            settings = {key: result.get(key) for key in ("mode", "patch", "stride", "region")}
            settings.update(label=result["label"], **key_settings)
            key = result_key(series, model, settings)
            with services.pacs_sources.sending(key):
                client = connect(services.settings.pacs)
                with action(client, f"sending the result to study {study}"):
                    if services.pacs_sources.was_sent(key, session) or in_study(client, study, key):
                        return ALREADY_SENT.format(key=key)
                    heatmap = result_heatmap(result)
                    sent = store_result(client, study, model, heatmap, source, key, settings)
    except (InputError, PacsError, ValueError) as exc:
        return f"Not sent: {exc}"
    services.pacs_sources.sent(key, session)
    logger.info("sent a result to a PACS study (%d captures)", sent.captures)
    return f"Sent to the PACS: {sent.words(result['label_name'])}, in the source's study."


def _volume_source(services, result, session: str) -> tuple[dict, VolumeSource]:
    """A volume's map over its series (the prepared block, the series' headers)."""
    source = services.images.source(result["source_key"], session)
    prepared = services.prepared_volume(result["source_key"], session, result["model"],
                                        result["image"])  # fmt: skip
    return {}, VolumeSource(prepared.model_input, dicom_headers(source))


def _image_source(services, result, session: str) -> tuple[dict, ImageSource]:
    """An image's map over its DICOM file (with the window and frame it was read in)."""
    record = result.get("dicom") or {}
    source = services.images.source(record["source"], session)
    window = record.get("requested")
    settings = {"instance": pacs_source_instance(source), "frame": record["frame"],
                "window": window}  # fmt: skip
    window = tuple(window) if isinstance(window, list) else window
    return settings, ImageSource(source, window, record["frame"])


# the panel's rank: its kind
KINDS: dict[int, SendKind] = {
    2: SendKind("image", _image_source),
    3: SendKind("volume", _volume_source),
}  # fmt: skip
