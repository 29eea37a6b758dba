"""The "Add your own model" panel: the model list's options, the weights file's upload
state, registering a model from an uploaded state_dict and removing a user's model."""

from __future__ import annotations

from dash import ClientsideFunction, Input, Output, State, html, no_update
from dash.exceptions import PreventUpdate

from krypton.registry import (
    CheckpointError,
    RegistryError,
    available_models,
    default_model_name,
    register_model,
    remove_model,
)

from .helpers import InputError

__all__ = ["model_options", "register_model_panel"]


def model_options() -> list[dict]:
    """The model list: every registered model, unavailable ones disabled with why."""
    options = []
    for info in available_models():
        label = info.name if info.available else f"{info.name} (unavailable)"
        options.append(
            {
                "label": label,
                "value": info.name,
                "disabled": not info.available,
                "title": info.description if info.available else f"{info.reason}; fix: {info.fix}",
            }
        )
    return options


def register_model_panel(app, services) -> None:
    """Attach the panel's callbacks to ``app`` (``services``: webapp.callbacks.Services)."""
    app.clientside_callback(
        ClientsideFunction("krypton_upload", "model"),
        Output("model-upload-ticket", "data"),
        Input("model-upload", "contents"),
        State("model-upload", "filename"),
        State("session", "data"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output("model-upload-name", "children"),
        Input("model-upload", "filename"),
        Input("model-upload-ticket", "data"),
    )
    def show_model_file(filename, ticket):
        """Where the chosen weights file is: on its way, on the server, or refused."""
        ticket = ticket if isinstance(ticket, dict) else {}
        if not filename:
            return ""
        if not ticket or ticket.get("name") != filename:
            return f"uploading {filename}…"
        if ticket.get("error"):
            return html.Span(f"{filename}: {ticket['error']}", className="warning")
        return f"uploaded: {filename} ({float(ticket.get('bytes') or 0) / 2**20:.1f} MB)"

    @app.callback(
        Output("model", "options"),
        Output("model", "value"),
        Output("model-register-message", "children"),
        Input("model-register", "n_clicks"),
        State("model-upload-ticket", "data"),
        State("model-upload", "filename"),
        State("session", "data"),
        State("model-name", "value"),
        State("model-architecture", "value"),
        State("model-classes", "value"),
        State("model-size", "value"),
        prevent_initial_call=True,
    )
    def register(n_clicks, ticket, filename, session, name, architecture, classes, size):
        settings = services.settings
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
            if architecture == "torchscript" and not settings.trusted_uploads:
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
            names = [
                c.strip() for c in (classes or "").replace(",", "\n").splitlines() if c.strip()
            ]
            if len(names) < 2:
                raise InputError("give at least two class names")
            try:
                side = int(size or 224)
            except (TypeError, ValueError):
                raise InputError("the input size must be a whole number of pixels") from None
            token = str(ticket.get("token", ""))
            # The upload's path is the server's choice: the client's file name never is one.
            with services.uploads.take(token, "model", str(session or "")) as (path, filename):
                try:
                    name = register_model(
                        name,
                        path,
                        names,
                        architecture=None if architecture == "torchscript" else architecture,
                        format="torchscript" if architecture == "torchscript" else "state_dict",
                        input_size=(side, side),
                    ).name
                except CheckpointError as exc:  # name the user's file, not the server's copy
                    raise InputError(str(exc).replace(path.name, filename or "the file")) from exc
        except (InputError, RegistryError, CheckpointError) as exc:
            return no_update, no_update, html.Span(str(exc), className="warning")
        return model_options(), name, f"registered '{name}' with {len(names)} classes"

    @app.callback(
        Output("model", "options", allow_duplicate=True),
        Output("model", "value", allow_duplicate=True),
        Output("model-register-message", "children", allow_duplicate=True),
        Input("model-remove", "n_clicks"),
        State("model", "value"),
        prevent_initial_call=True,
    )
    def remove(n_clicks, name):
        if not n_clicks or not name:
            raise PreventUpdate
        try:
            remove_model(name)
        except RegistryError as exc:
            return no_update, no_update, html.Span(str(exc), className="warning")
        services.forget(name)
        return model_options(), default_model_name(), f"removed '{name}'"
