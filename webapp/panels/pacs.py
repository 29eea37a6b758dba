"""The PACS on the page (shown only when the server has one, :mod:`webapp.pacs`):
search studies, list a study's series, open one, and send the result a panel shows back
to its study (one Send for both panels, :func:`webapp.runs.send_result`). Opening names
the series in the volume panel's ticket, so it loads through the same callback, intake
and page lifecycle as an uploaded series
(:meth:`webapp.panels.volume.VolumePanel.load_volume`)."""

from __future__ import annotations

from functools import partial

from dash import Input, Output, State, no_update
from dash.exceptions import PreventUpdate

from .. import ids, pacs, runs
from ..helpers import InputError
from ..panel_scope import IMAGE_PANEL, VOLUME_PANEL
from ..services import Services

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
            Output(VOLUME_PANEL.pacs_open, "disabled"),
            Output(IMAGE_PANEL.pacs_open, "disabled"),
            Input(ids.PACS_SERIES, "value"),
        )(lambda series: (not series, not series))
        # Open, once per panel: the whole series into the volume panel, one image of it
        # (its number) into the image panel; each loads through its panel's ticket
        for scope, opened, number in (
            (VOLUME_PANEL, self.open_series, []),
            (IMAGE_PANEL, self.open_image, [State(ids.PACS_IMAGE_NUMBER, "value")]),
        ):
            app.callback(
                Output(scope.ticket, "data", allow_duplicate=True),
                Input(scope.pacs_open, "n_clicks"),
                State(ids.PACS_STUDY, "value"),
                State(ids.PACS_SERIES, "value"),
                State(ids.PACS_SERIES, "options"),
                *number,
                prevent_initial_call=True,
            )(opened)
        for scope, rank in ((IMAGE_PANEL, 2), (VOLUME_PANEL, 3)):  # one Send, two scopes
            app.callback(
                Output(scope.pacs_send, "disabled"),
                Output(scope.pacs_sent, "children"),
                Input(scope.result, "data"),
                Input(scope.store, "data"),
            )(self.sendable)
            app.callback(
                Output(scope.pacs_sent, "children", allow_duplicate=True),
                Input(scope.pacs_send, "n_clicks"),
                State(scope.result, "data"),
                State(ids.SESSION, "data"),
                prevent_initial_call=True,
            )(partial(self.send, rank))

    def search(self, clicks, patient, dates, modality, accession):
        """The studies matching the search fields."""
        if not clicks:
            raise PreventUpdate
        try:
            with self.services.pacs_call():
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
            with self.services.pacs_call():
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
        panel's handle: webapp.run_strip.result_handle). (disabled, message)."""
        if not (isinstance(handle, dict) and isinstance(record, dict)):
            return True, ""
        made_from = handle.get("provenance") or {}
        ready = bool(record.get("pacs")) and made_from.get("image") == record.get("key")
        return not ready, ""

    def send(self, rank: int, clicks, handle, session):
        """Store the result the panel of ``rank`` shows in its source's study, unless the
        study holds it already (:func:`webapp.runs.send_result`)."""
        if not clicks or not isinstance(handle, dict):
            raise PreventUpdate
        return runs.send_result(self.services, rank, handle, str(session or ""))
