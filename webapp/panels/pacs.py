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
from krypton.pacs import result_key, send_volume_result
from krypton.render.dicom_series import dicom_headers

from .. import ids, pacs, volume_runs
from ..helpers import InputError
from ..services import Services

logger = logging.getLogger("krypton.app")

__all__ = ["PacsPanel"]


class PacsPanel:
    """Callbacks of the PACS search and the Send button (registered only with a PACS)."""

    def __init__(self, services: Services):
        self.services = services

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
            Input(ids.PACS_SERIES, "value"),
        )(lambda series: not series)
        app.callback(
            Output(ids.VOLUME_TICKET, "data", allow_duplicate=True),
            Input(ids.PACS_OPEN, "n_clicks"),
            State(ids.PACS_STUDY, "value"),
            State(ids.PACS_SERIES, "value"),
            State(ids.PACS_SERIES, "options"),
            prevent_initial_call=True,
        )(self.open_series)
        app.callback(
            Output(ids.PACS_SEND, "disabled"),
            Output(ids.PACS_SENT, "children"),
            Input(ids.VOLUME_RESULT, "data"),
            Input(ids.VOLUME_STORE, "data"),
        )(self.sendable)
        app.callback(
            Output(ids.PACS_SENT, "children", allow_duplicate=True),
            Input(ids.PACS_SEND, "n_clicks"),
            State(ids.VOLUME_RESULT, "data"),
            State(ids.SESSION, "data"),
            prevent_initial_call=True,
        )(self.send)

    def search(self, clicks, patient, dates, modality, accession):
        """The studies matching the search fields."""
        if not clicks:
            raise PreventUpdate
        try:
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

    def sendable(self, handle, record):
        """Send is offered for a result on a series this panel opened from the PACS."""
        shown = isinstance(handle, dict) and isinstance(record, dict)
        ready = shown and bool(record.get("pacs")) and handle.get("source_key") == record.get("key")
        return not ready, ""

    def send(self, clicks, handle, session):
        """Store the result shown in its source's study
        (:func:`krypton.pacs.send_volume_result`)."""
        if not clicks or not isinstance(handle, dict):
            raise PreventUpdate
        session = str(session or "")
        result = self.services.results.get(volume_runs.volume_session(session))
        if result is None or result.get("id") != handle.get("id"):
            return "The heatmap is no longer on the server; press Run again."
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
                model = self.services.volume_model(result["model"])
                settings = {key: result.get(key) for key in ("mode", "patch", "stride", "region")}
                key = result_key(series, model, {**settings, "label": result["label"]})
                sent = send_volume_result(
                    connect(self.services.settings.pacs), study, model, prepared.model_input,
                    volume_runs.volume_heatmap(result), dicom_headers(source), key,
                )  # fmt: skip
        except (InputError, PacsError, ValueError) as exc:
            return f"Not sent: {exc}"
        logger.info("sent a parametric map to a PACS study (%d captures)", sent.captures)
        return (
            f"Sent to the PACS: a Parametric Map of {result['label_name']} (series "
            f"{sent.map_series}) and {sent.captures} Secondary Captures, in the source's study."
        )
