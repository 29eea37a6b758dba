"""How a volume reaches the volume panel: an upload, a shipped sample (a sample's Compare
button marks it pending) or a series of the operator's PACS, each read once within this
client's intake (webapp.services.Services.intake) and kept for the tab."""

from __future__ import annotations

from dash import ClientsideFunction, Input, Output, ctx, no_update
from dash.exceptions import PreventUpdate

from ... import ids, pacs
from ...helpers import InputError, owner_tag
from ...panel_scope import VOLUME_PANEL
from ...runs import volumes
from ...services import Services
from ...volume_layout import volume_sample_path
from ..common import hide_at_click, origin, register_intake

__all__ = ["VolumeIntake"]


class VolumeIntake:
    """The volume panel's reading of a volume (a part of :class:`webapp.panels.volume.VolumePanel`):
    each returns (the page's record, no region, a message, what is pending)."""

    services: Services

    def register_intake_callbacks(self, app) -> None:
        """Attach the intake's callbacks to ``app``: an upload or a sample read, and the
        panel's binding to what was read."""
        register_intake(app, VOLUME_PANEL, "volume", self.load_volume)
        self._register_binding(app)

    def _register_binding(self, app) -> None:
        """The image panel's binding for volumes (assets/binding.js): a sample's button, a
        file or another model hides the description, the class box, the estimate and the
        summary and disables Run at the click; they come back once the volume answered is
        the one wanted and the panel has described it."""
        hidden = [ids.VOLUME_INFO, VOLUME_PANEL.label, VOLUME_PANEL.strip.estimate,
                  VOLUME_PANEL.summary, VOLUME_PANEL.result_area]  # fmt: skip
        hide_at_click(app, VOLUME_PANEL, hidden)
        app.clientside_callback(
            ClientsideFunction("krypton_binding", "showVolume"),
            Output(ids.VOLUME_INFO, "style"),
            Output(VOLUME_PANEL.label, "style"),
            Output(VOLUME_PANEL.strip.estimate, "style"),
            Output(VOLUME_PANEL.summary, "style"),
            Output(VOLUME_PANEL.strip.run, "disabled"),
            Input(ids.VOLUME_INFO, "children"),
            Input(VOLUME_PANEL.store, "data"),
            Input(VOLUME_PANEL.strip.busy, "data"),
            Input(VOLUME_PANEL.wanted, "data"),
            Input(VOLUME_PANEL.answered, "data"),
            Input(VOLUME_PANEL.strip.estimate, "children"),
            Input(VOLUME_PANEL.summary, "children"),
        )

    def load_volume(self, ticket, sample_clicks, compare_clicks, session):
        """An uploaded volume or a sample (:meth:`upload_volume`, :meth:`sample_volume`)."""
        trigger = ctx.triggered_id
        answered = origin(trigger, ticket)
        if answered is None:
            raise PreventUpdate
        if not isinstance(trigger, dict):
            return (*self.upload_volume(ticket, session), answered)
        if not any(sample_clicks + compare_clicks):
            raise PreventUpdate
        compare = trigger.get("type") == VOLUME_PANEL.compare_sample
        return (*self.sample_volume(str(trigger["name"]), session, compare), answered)

    def upload_volume(self, ticket, session):
        """An uploaded volume, read as :meth:`open_volume` reads every volume."""
        session = str(session or "")
        ticket = ticket if isinstance(ticket, dict) else {}
        name = str(ticket.get("name") or "the volume")
        if isinstance(ticket.get("pacs"), dict):
            return self.pacs_volume(ticket["pacs"], name, session)
        try:
            if ticket.get("error"):
                raise InputError(str(ticket["error"]))
            token = str(ticket.get("token", ""))
            with self.services.uploads.take(token, "volume", session) as (path, _):
                data = path.read_bytes()
        except InputError as exc:
            return no_update, no_update, str(exc), None
        return self.open_volume(data, name, session)

    def pacs_volume(self, chosen: dict, name: str, session: str):
        """A series of the operator's PACS (webapp.panels.pacs names it): fetched within
        the volume limit by this client's one intake, then read as an upload is; the
        server remembers its study, where Send stores the result."""
        study, series = str(chosen.get("study", "")), str(chosen.get("series", ""))
        try:
            with self.services.pacs_call():
                data = pacs.fetch_series_bytes(
                    self.services.settings.pacs, study, series,
                    self.services.settings.max_volume_bytes,
                )  # fmt: skip
        except InputError as exc:
            return no_update, no_update, str(exc), None
        record, region, message, pending = self.open_volume(data, name, session)
        if not message:
            self.services.pacs_sources.remember(record["key"], session, study, series)
            record["pacs"] = True
        return record, region, message, pending

    def sample_volume(self, name: str, session, compare: bool = False):
        """A shipped sample, read as an upload is; with ``compare`` its record is also
        pending, so the page presses Run with Compare once the panel shows it."""
        try:
            data = volume_sample_path(name).read_bytes()
        except (KeyError, OSError):
            return no_update, no_update, f"the sample {name!r} is not available", None
        record, region, message, _ = self.open_volume(data, name, str(session or ""))
        pending = {"key": record["key"], "name": name} if compare and not message else None
        return record, region, message, pending

    def open_volume(self, data: bytes, name: str, session: str):
        """Read a volume's bytes once (a bad file is refused here, by name, within the
        decode budget), keep them for this tab: (the page's record, no region, message,
        nothing pending)."""
        try:
            with self.services.intake() as client:
                volume = volumes.read_uploaded_source(data, name)
                key = self.services.images.put_source(data, session, client)
            owner = (key, owner_tag(session))
            self.services.volume_sources.get(owner, lambda: volume)  # read once, not twice
        except InputError as exc:
            return no_update, no_update, str(exc), None
        record = {
            "key": key,
            "name": name,
            "shape": list(volume.shape),
            "spacing": list(volume.geometry.spacing),
            "modality": volume.geometry.modality,
            "frame": volume.geometry.affine is not None,
        }
        return record, None, "", None
