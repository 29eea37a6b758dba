"""The "Add your own model" panel: the model list's options, the weights file's upload
state, registering a model from an uploaded state_dict and removing a user's model."""

from __future__ import annotations

import re
from pathlib import Path

from dash import Input, Output, State, ctx, html, no_update
from dash.exceptions import PreventUpdate

from krypton.registry import (
    CheckpointError,
    RegistryError,
    available_models,
    default_model_name,
    register_model,
    remove_model,
)

from .. import ids
from ..helpers import VOLUME_MODEL_REASON, InputError
from ..panel_scope import IMAGE_PANEL
from ..services import Services
from .common import upload_ticket

__all__ = ["ModelsPanel", "model_options"]


def model_options() -> list[dict]:
    """The model list: every registered model; unavailable ones, and volume models (the
    page explains 2-D images), disabled with why."""
    options = []
    for info in available_models():
        if info.is_volume:
            label, title = f"{info.name} (volumes: Volume panel)", VOLUME_MODEL_REASON
        elif info.available:
            label, title = info.name, info.description
        else:
            label, title = f"{info.name} (unavailable)", f"{info.reason}; fix: {info.fix}"
        options.append(
            {
                "label": label,
                "value": info.name,
                "disabled": info.is_volume or not info.available,
                "title": title,
            }
        )
    return options


class ModelsPanel:
    """Callbacks of the "Add your own model" panel."""

    def __init__(self, services: Services):
        self.services = services

    def register(self, app) -> None:
        """Attach the panel's callbacks to ``app``."""
        upload_ticket(app, "model", ids.MODEL_UPLOAD, ids.MODEL_UPLOAD_TICKET)
        app.callback(
            Output(ids.MODEL_UPLOAD_NAME, "children"),
            Input(ids.MODEL_UPLOAD, "filename"),
            Input(ids.MODEL_UPLOAD_TICKET, "data"),
        )(show_model_file)
        app.callback(
            Output(IMAGE_PANEL.model, "options"),
            Output(IMAGE_PANEL.model, "value"),
            Output(ids.MODEL_REGISTER_MESSAGE, "children"),
            Input(ids.MODEL_REGISTER, "n_clicks"),
            State(ids.MODEL_UPLOAD_TICKET, "data"),
            State(ids.MODEL_UPLOAD, "filename"),
            State(ids.SESSION, "data"),
            State(ids.MODEL_NAME, "value"),
            State(ids.MODEL_ARCHITECTURE, "value"),
            State(ids.MODEL_CLASSES, "value"),
            State(ids.MODEL_SIZE, "value"),
            prevent_initial_call=True,
        )(self.register_model)
        app.callback(
            Output(IMAGE_PANEL.model, "options", allow_duplicate=True),
            Output(IMAGE_PANEL.model, "value", allow_duplicate=True),
            Output(ids.MODEL_REGISTER_MESSAGE, "children", allow_duplicate=True),
            Input(ids.MODEL_REMOVE, "n_clicks"),
            State(IMAGE_PANEL.model, "value"),
            prevent_initial_call=True,
        )(self.remove_model)

    def register_model(
        self, n_clicks, ticket, filename, session, name, architecture, classes, size
    ):
        """Register the uploaded weights under ``name``; errors name the user's file."""
        ticket = ticket if isinstance(ticket, dict) else {}
        try:
            if not filename:
                raise InputError("choose a weights file first")
            if not ticket or ticket.get("name") != filename:
                raise InputError(
                    f"{filename} is still uploading; press Register again once it is uploaded"
                )
            if ticket.get("error"):
                raise InputError(str(ticket["error"]))
            names = self.checked_entry(name, architecture, classes)
            side = checked_side(size)
            token = str(ticket.get("token", ""))
            # The upload's path is the server's choice: the client's file name never is one.
            with self.services.uploads.take(token, "model", str(session or "")) as (path, _):
                try:
                    name = register_model(
                        name,
                        path,
                        names,
                        architecture=None if architecture == "torchscript" else architecture,
                        format="torchscript" if architecture == "torchscript" else "state_dict",
                        input_size=(side, side),
                    ).name
                except (CheckpointError, RegistryError) as exc:
                    raise InputError(users_words(str(exc), path, filename)) from exc
        except (InputError, RegistryError, CheckpointError) as exc:
            return no_update, no_update, html.Span(str(exc), className="warning")
        return (
            model_options(),
            name,
            f"registered '{name}' from {filename} with {len(names)} classes",
        )

    def checked_entry(self, name, architecture, classes) -> list[str]:
        """The class names, once the name, architecture and upload kind are allowed."""
        if architecture == "torchscript" and not self.services.settings.trusted_uploads:
            raise InputError(
                "TorchScript uploads are turned off on this server: a "
                "TorchScript file runs its author's code. Upload a "
                "state_dict instead (the operator can allow TorchScript "
                "with KRYPTON_TRUSTED_UPLOADS=1, for trusted uploaders "
                "only)."
            )
        if not name:
            raise InputError("give the model a name")
        if not architecture:
            raise InputError("choose the architecture (or TorchScript)")
        names = [c.strip() for c in (classes or "").replace(",", "\n").splitlines() if c.strip()]
        if len(names) < 2:
            raise InputError("give at least two class names")
        return names

    def remove_model(self, n_clicks, name):
        """Remove a model the user added (shipped models stay)."""
        if not n_clicks or not name:
            raise PreventUpdate
        try:
            remove_model(name)
        except RegistryError as exc:
            return no_update, no_update, html.Span(str(exc), className="warning")
        self.services.forget(name)
        return model_options(), default_model_name(), f"removed '{name}'"


def show_model_file(filename, ticket):
    """Where the chosen weights file is: on its way, on the server, or refused."""
    ticket = ticket if isinstance(ticket, dict) else {}
    if ticket.get("error") and (ctx.triggered_id == ids.MODEL_UPLOAD_TICKET or not filename):
        # refused (too large: the page never read it, so ``filename`` is the last one's)
        error, name = str(ticket["error"]), str(ticket.get("name") or "")
        return html.Span(error if name in error else f"{name}: {error}", className="warning")
    if not filename:
        return ""
    if not ticket or ticket.get("name") != filename:
        return f"uploading {filename}…"
    if ticket.get("error"):
        return html.Span(f"{filename}: {ticket['error']}", className="warning")
    return f"uploaded: {filename} ({float(ticket.get('bytes') or 0) / 2**20:.1f} MB)"


def checked_side(size) -> int:
    """The model's square input size in pixels (default 224)."""
    try:
        return int(size or 224)
    except (TypeError, ValueError):
        raise InputError("the input size must be a whole number of pixels") from None


def users_words(message: str, path: Path, filename: str | None) -> str:
    """A registry or checkpoint message about the server's copy of an upload, naming the
    user's file instead (the server's folders are nobody's business)."""
    shown = filename or "the file"
    for server_name in (str(path.resolve()), str(path), path.name):
        message = message.replace(server_name, shown)
    return SERVER_PATH.sub(r"\1", message)  # any other server path: its last part only


SERVER_PATH = re.compile(r"(?<![\w.])/(?:[^\s/'\"]+/)+([^\s/'\"]+)")
