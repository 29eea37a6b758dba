"""One Send for both subjects: the result a panel shows, stored in the study of the input
it was opened from (krypton.pacs.results), once per result key whoever presses it.

The only things an image and a volume do differently are what they hand the library:
:func:`_volume_send` (the prepared block, the series' headers) and :func:`_image_send`
(the DICOM file, its window and frame). Everything else — which result, whether the
panel's input came from the PACS, the key, the study asked first, one Send of a key at a
time, the words — is :func:`send_result`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from krypton.pacs.dicomweb import PacsError, action, connect
from krypton.pacs.results import (
    SentResult,
    in_study,
    result_key,
    send_image_result,
    send_volume_result,
)
from krypton.pacs.results import source_instance as pacs_source_instance
from krypton.render.dicom_series import dicom_headers

from ..helpers import InputError
from .records import NOT_KEPT, kept_result, refuse_partial, result_heatmap
from .subjects import results_key

__all__ = ["ALREADY_SENT", "send_result"]

logger = logging.getLogger("krypton.app")

ALREADY_SENT = (
    "Already in the PACS: this result ({key}) was sent to the study before; nothing new was stored."
)
NOT_FROM_PACS = "This {what} was not opened from the PACS; only those are sent back."


@dataclass(frozen=True)
class _Send:
    """What one subject hands the common Send: the settings that name its result beyond
    the run's, and what stores it."""

    key_settings: dict
    store: Callable[[object, str, str], SentResult]  # (client, study, key) -> what was sent


def send_result(services, rank: int, handle, session: str) -> str:
    """Store the result ``handle`` names (the panel of ``rank``'s) in the study of the
    input it was made from, unless the study holds it already; the sentence the page
    shows."""
    result, why = kept_result(services.results, results_key(session, rank), handle)
    if result is None:
        return why or NOT_KEPT
    source = result["source_key"] if rank == 3 else (result.get("dicom") or {}).get("source")
    opened = services.pacs_sources.origin(str(source or ""), session)
    if opened is None:
        return NOT_FROM_PACS.format(what="volume" if rank == 3 else "image")
    study, series = opened
    try:
        refuse_partial(result, "the PACS")
        with services.pacs_call():
            model = services.model(result["model"], rank=rank)
            subject = (_volume_send if rank == 3 else _image_send)(services, result, session, model)
            settings = {key: result.get(key) for key in ("mode", "patch", "stride", "region")}
            key = result_key(series, model, {**settings, "label": result["label"],
                                             **subject.key_settings})  # fmt: skip
            with services.pacs_sources.sending(key):
                client = connect(services.settings.pacs)
                with action(client, f"sending the result to study {study}"):
                    if services.pacs_sources.was_sent(key, session) or in_study(client, study, key):
                        return ALREADY_SENT.format(key=key)
                    sent = subject.store(client, study, key)
    except (InputError, PacsError, ValueError) as exc:
        return f"Not sent: {exc}"
    services.pacs_sources.sent(key, session)
    logger.info("sent a result to a PACS study (%d captures)", sent.captures)
    placed = f"a Parametric Map of {result['label_name']} (series {sent.map_series})"
    if rank == 3:
        return (f"Sent to the PACS: {placed} and {sent.captures} Secondary Captures, in the "
                "source's study.")  # fmt: skip
    placed = f"a Parametric Map (series {sent.map_series}) and " if sent.map_series else ""
    return (f"Sent to the PACS: {placed}a Secondary Capture of {result['label_name']}, in the "
            "source's study.")  # fmt: skip


def _volume_send(services, result, session: str, model) -> _Send:
    """A volume's map over its series (the prepared block, the series' headers)."""
    source = services.images.source(result["source_key"], session)
    prepared = services.prepared_volume(result["source_key"], session, result["model"],
                                        result["image"])  # fmt: skip
    heatmap = result_heatmap(result)

    def store(client, study: str, key: str) -> SentResult:
        return send_volume_result(client, study, model, prepared.model_input, heatmap,
                                  dicom_headers(source), key)  # fmt: skip

    return _Send({}, store)


def _image_send(services, result, session: str, model) -> _Send:
    """An image's map over its DICOM file (with the window and frame it was read in)."""
    record = result.get("dicom") or {}
    source = services.images.source(record["source"], session)
    window = record.get("requested")
    window = tuple(window) if isinstance(window, list) else window
    heatmap = result_heatmap(result)

    def store(client, study: str, key: str) -> SentResult:
        return send_image_result(client, study, model, heatmap, source, key, window=window,
                                 frame=record["frame"])  # fmt: skip

    settings = {"instance": pacs_source_instance(source), "frame": record["frame"],
                "window": record.get("requested")}  # fmt: skip
    return _Send(settings, store)
