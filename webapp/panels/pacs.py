"""The volume panel's PACS (shown only when the server has one, :mod:`webapp.pacs`):
search studies, list a study's series, open one, and send the result shown back to its
study. Opening names the series in the volume panel's ticket, so it loads through the
same callback, intake and page lifecycle as an uploaded series
(:meth:`webapp.panels.volume.VolumePanel.load_volume`)."""

from __future__ import annotations

import logging

from dash import Input, Output, State, no_update
from dash.exceptions import PreventUpdate

from krypton.io.dicomweb import PacsError, connect
from krypton.pacs import (
    in_study,
    result_key,
    send_image_result,
    send_volume_result,
    source_instance,
)
from krypton.render.dicom_series import dicom_headers

from .. import ids, pacs, runs
from ..helpers import InputError
from ..panel_scope import IMAGE_PANEL, VOLUME_PANEL
from ..services import Services

logger = logging.getLogger("krypton.app")

__all__ = ["PacsPanel"]

ALREADY_SENT = (
    "Already in the PACS: this result ({key}) was sent to the study before; nothing new was stored."
)


class PacsPanel:
    """Callbacks of the PACS search and the Send button (registered only with a PACS)."""

    def __init__(self, services: Services):
        self.services = services

    def _sent_before(self, client, study: str, key: str, session: str) -> bool:
        """Whether the result ``key`` is in the study already: a Parametric Map labelled
        with it there (as the study batch checks), or sent by this tab (a photograph's
        result is a Secondary Capture alone, which has no label)."""
        if self.services.pacs_sources.was_sent(key, session):
            return True
        return in_study(client, study, key)

    def register(self, app) -> None:
        """Attach the callbacks to ``app`` (nothing without a configured PACS)."""
        if self.services.settings.pacs is None:
            return
        app.callback(
            Output(ids.PACS_STUDY, "options"),
            Output(ids.PACS_STUDY, "value"),
            Output(ids.PACS_MESSAGE, "children"),
            Input(ids.PACS_SEARCH, "n_clicks"),
            State(ids.PACS_PATIENT, "value"),
            State(ids.PACS_DATES, "value"),
            State(ids.PACS_MODALITY, "value"),
            State(ids.PACS_ACCESSION, "value"),
            prevent_initial_call=True,
        )(self.search)
        app.callback(
            Output(ids.PACS_SERIES, "options"),
            Output(ids.PACS_SERIES, "value"),
            Output(ids.PACS_MESSAGE, "children", allow_duplicate=True),
            Input(ids.PACS_STUDY, "value"),
            prevent_initial_call=True,
        )(self.list_series)
        app.callback(
            Output(ids.PACS_OPEN, "disabled"),
            Output(ids.PACS_OPEN_IMAGE, "disabled"),
            Input(ids.PACS_SERIES, "value"),
        )(lambda series: (not series, not series))
        app.callback(
            Output(VOLUME_PANEL.ticket, "data", allow_duplicate=True),
            Input(ids.PACS_OPEN, "n_clicks"),
            State(ids.PACS_STUDY, "value"),
            State(ids.PACS_SERIES, "value"),
            State(ids.PACS_SERIES, "options"),
            prevent_initial_call=True,
        )(self.open_series)
        app.callback(
            Output(IMAGE_PANEL.ticket, "data", allow_duplicate=True),
            Input(ids.PACS_OPEN_IMAGE, "n_clicks"),
            State(ids.PACS_STUDY, "value"),
            State(ids.PACS_SERIES, "value"),
            State(ids.PACS_SERIES, "options"),
            State(ids.PACS_IMAGE_NUMBER, "value"),
            prevent_initial_call=True,
        )(self.open_image)
        app.callback(
            Output(ids.PACS_IMAGE_SEND, "disabled"),
            Output(ids.PACS_IMAGE_SENT, "children"),
            Input(IMAGE_PANEL.result, "data"),
            Input(IMAGE_PANEL.store, "data"),
        )(self.sendable)
        app.callback(
            Output(ids.PACS_IMAGE_SENT, "children", allow_duplicate=True),
            Input(ids.PACS_IMAGE_SEND, "n_clicks"),
            State(IMAGE_PANEL.result, "data"),
            State(ids.SESSION, "data"),
            prevent_initial_call=True,
        )(self.send_image)
        app.callback(
            Output(ids.PACS_SEND, "disabled"),
            Output(ids.PACS_SENT, "children"),
            Input(VOLUME_PANEL.result, "data"),
            Input(VOLUME_PANEL.store, "data"),
        )(self.sendable)
        app.callback(
            Output(ids.PACS_SENT, "children", allow_duplicate=True),
            Input(ids.PACS_SEND, "n_clicks"),
            State(VOLUME_PANEL.result, "data"),
            State(ids.SESSION, "data"),
            prevent_initial_call=True,
        )(self.send)

    def search(self, clicks, patient, dates, modality, accession):
        """The studies matching the search fields."""
        if not clicks:
            raise PreventUpdate
        try:
            with self.services.intake(pacs.PACS_BUSY):
                options = pacs.study_options(
                    self.services.settings.pacs, patient, dates, modality, accession
                )
        except InputError as exc:
            return [], None, str(exc)
        found = f"{len(options)} stud{'y' if len(options) == 1 else 'ies'} found"
        if len(options) == pacs.STUDIES_LISTED:
            found += f" (the first {pacs.STUDIES_LISTED}; narrow the search)"
        return options, options[0]["value"] if len(options) == 1 else None, found

    def list_series(self, study):
        """The chosen study's series (the search's message stays)."""
        if not study:
            return [], None, no_update
        try:
            with self.services.intake(pacs.PACS_BUSY):
                options = pacs.series_options(self.services.settings.pacs, str(study))
        except InputError as exc:
            return [], None, str(exc)
        images = [option for option in options if not option["disabled"]]
        return options, images[0]["value"] if len(images) == 1 else None, no_update

    def open_series(self, clicks, study, series, options):
        """Name the chosen series in the volume panel's ticket: it loads as an upload."""
        if not clicks or not study or not series:
            raise PreventUpdate
        label = next((o["label"] for o in options or () if o.get("value") == series), str(series))
        return {"name": f"PACS {label}", "pacs": {"study": str(study), "series": str(series)},
                "opened": clicks}  # fmt: skip

    def open_image(self, clicks, study, series, options, number):
        """Name one image of the chosen series in the image panel's ticket: it loads as
        an uploaded DICOM file (:meth:`webapp.panels.image.ImagePanel.pacs_image`)."""
        if not clicks or not study or not series:
            raise PreventUpdate
        label = next((o["label"] for o in options or () if o.get("value") == series), str(series))
        number = str(number or "").strip()
        return {
            "name": f"PACS {label}" + (f" image {number}" if number else ""),
            "pacs": {"study": str(study), "series": str(series), "image": number},
            "opened": clicks,
        }

    def sendable(self, handle, record):
        """Send is offered for a result on what a panel opened from the PACS (an image or
        a series): the result's provenance names the input the panel holds (either
        panel's handle: webapp.panels.run_strip.result_handle). (disabled, message)."""
        if not (isinstance(handle, dict) and isinstance(record, dict)):
            return True, ""
        made_from = handle.get("provenance") or {}
        ready = bool(record.get("pacs")) and made_from.get("image") == record.get("key")
        return not ready, ""

    def send(self, clicks, handle, session):
        """Store the result shown in its source's study
        (:func:`krypton.pacs.send_volume_result`), unless the study holds it already
        (its Content Label, :func:`krypton.pacs.result_key`, as the study batch checks)."""
        if not clicks or not isinstance(handle, dict):
            raise PreventUpdate
        session = str(session or "")
        result, why = runs.kept_result(self.services.results, runs.results_key(session, 3), handle)
        if result is None:
            return why or runs.NOT_KEPT
        opened = self.services.pacs_sources.origin(str(result["source_key"]), session)
        if opened is None:
            return "This volume was not opened from the PACS; only those are sent back."
        study, series = opened
        try:
            with self.services.intake():
                source = self.services.images.source(result["source_key"], session)
                prepared = self.services.prepared_volume(
                    result["source_key"], session, result["model"], result["image"]
                )
                model = self.services.model(result["model"], rank=3)
                settings = {key: result.get(key) for key in ("mode", "patch", "stride", "region")}
                key = result_key(series, model, {**settings, "label": result["label"]})
                with self.services.pacs_sources.sending(key):
                    client = connect(self.services.settings.pacs)
                    if self._sent_before(client, study, key, session):
                        return ALREADY_SENT.format(key=key)
                    sent = send_volume_result(
                        client, study, model, prepared.model_input,
                        runs.result_heatmap(result), dicom_headers(source), key,
                    )  # fmt: skip
        except (InputError, PacsError, ValueError) as exc:
            return f"Not sent: {exc}"
        self.services.pacs_sources.sent(key, session)
        logger.info("sent a parametric map to a PACS study (%d captures)", sent.captures)
        return (
            f"Sent to the PACS: a Parametric Map of {result['label_name']} (series "
            f"{sent.map_series}) and {sent.captures} Secondary Captures, in the source's study."
        )

    def send_image(self, clicks, handle, session):
        """Store the image result shown in its source's study
        (:func:`krypton.pacs.send_image_result`): a Parametric Map over the source image
        where it has a frame of reference, and the Secondary Capture; unless the study
        holds this result already."""
        if not clicks or not isinstance(handle, dict):
            raise PreventUpdate
        session = str(session or "")
        result, why = runs.kept_result(self.services.results, session, handle)
        if result is None:
            return why or runs.NOT_KEPT
        record = result.get("dicom") or {}
        opened = self.services.pacs_sources.origin(str(record.get("source", "")), session)
        if opened is None:
            return "This image was not opened from the PACS; only those are sent back."
        study, series = opened
        try:
            with self.services.intake():
                source = self.services.images.source(record["source"], session)
                model = self.services.model(result["model"])
                settings = {key: result.get(key) for key in ("mode", "patch", "stride", "region")}
                key = result_key(series, model, {
                    **settings, "label": result["label"], "instance": source_instance(source),
                    "frame": record["frame"], "window": record.get("requested"),
                })  # fmt: skip
                with self.services.pacs_sources.sending(key):
                    client = connect(self.services.settings.pacs)
                    if self._sent_before(client, study, key, session):
                        return ALREADY_SENT.format(key=key)
                    window = record.get("requested")
                    sent = send_image_result(
                        client, study, model, runs.result_heatmap(result), source, key,
                        window=tuple(window) if isinstance(window, list) else window,
                        frame=record["frame"],
                    )  # fmt: skip
        except (InputError, PacsError, ValueError) as exc:
            return f"Not sent: {exc}"
        self.services.pacs_sources.sent(key, session)
        logger.info("sent an image result to a PACS study")
        placed = f"a Parametric Map (series {sent.map_series}) and " if sent.map_series else ""
        return (
            f"Sent to the PACS: {placed}a Secondary Capture of {result['label_name']}, in the "
            "source's study."
        )
