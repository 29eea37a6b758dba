"""What more than one panel uses: the page's "nothing to show" figure and the inputs that
say what is on screen (a result's provenance is compared with them)."""

from __future__ import annotations

from dash import ALL, ClientsideFunction, Input, Output, State

from .. import ids
from ..panel_scope import IMAGE_PANEL, PanelScope

# What a result's provenance is compared with: the page's image, model and settings.
SCREEN_INPUTS = [
    Input(IMAGE_PANEL.store, "data"),
    Input(IMAGE_PANEL.model, "value"),
    Input(IMAGE_PANEL.region, "data"),
    Input(IMAGE_PANEL.patch, "value"),
    Input(IMAGE_PANEL.stride, "value"),
    Input(IMAGE_PANEL.mode, "value"),
    Input(ids.COLOUR, "value"),
    Input(ids.CUSTOM_COLOUR, "value"),
    Input(ids.TARGET_SSIM, "value"),
    Input(ids.DRILL_DOWN, "value"),
    Input(ids.TARGET_SPEEDUP, "value"),
]


def origin(trigger, ticket) -> str | None:
    """The request a load answers, named as the browser names it at the click
    (assets/binding.js): 'sample:NAME' for a sample's buttons, 'upload:FILENAME' for a
    file (the image and the volume panel alike); None for no request."""
    if isinstance(trigger, dict) and trigger.get("name") is not None:
        return f"sample:{trigger['name']}"
    if isinstance(trigger, str) and trigger.endswith("ticket"):
        return f"upload:{(ticket or {}).get('name') or ''}" if isinstance(ticket, dict) else None
    return None


def upload_ticket(app, kind: str, upload: str, ticket: str) -> None:
    """``upload``'s file is posted from the browser (assets/uploads.js, ``kind``: "image",
    "volume" or "model": which intake budget takes it) and named in ``ticket``: the
    server's token, or why it was refused."""
    app.clientside_callback(
        ClientsideFunction("krypton_upload", kind),
        Output(ticket, "data"),
        Input(upload, "contents"),
        State(upload, "filename"),
        State(ids.SESSION, "data"),
        prevent_initial_call=True,
    )


def register_intake(
    app, panel: PanelScope, kind: str, load, extra: tuple = (), states: tuple = ()
) -> None:
    """A panel's subject arrives: the upload posts its bytes in the browser
    (assets/uploads.js, ``kind``: "image" or "volume") and names them in the panel's
    ticket; ``load(ticket, sample clicks, Compare clicks, session, *states)`` answers the
    ticket or a sample's button with the panel's store, region and message, the ``extra``
    outputs, the Compare mark and the request answered (:func:`origin`)."""
    upload_ticket(app, kind, panel.upload, panel.ticket)
    app.callback(
        Output(panel.store, "data"),
        Output(panel.region, "data"),
        Output(panel.strip.message, "children"),
        *extra,
        Output(panel.compare_pending, "data"),
        Output(panel.answered, "data"),
        Input(panel.ticket, "data"),
        Input({"type": panel.sample, "name": ALL}, "n_clicks"),
        Input({"type": panel.compare_sample, "name": ALL}, "n_clicks"),
        State(ids.SESSION, "data"),
        *states,
        prevent_initial_call=True,
    )(load)


def hide_at_click(app, panel: PanelScope, hidden: list[str]) -> None:
    """The click decides what may sit beside a panel's picture (assets/binding.js): a
    sample's buttons, a file or another model hide ``panel``'s ``hidden`` components,
    disable its Run and name the request now wanted, in the browser at once. The rule listens
    to the user's own inputs alone, so no server callback in flight holds it back (a rule
    that also listened to the prediction waited for it: the old top 5 stayed beside a
    new picture for 5-15 s on a busy host, with Run enabled; one that also listened to
    the upload's ticket waited for the upload)."""
    outputs = [
        Output(panel.wanted, "data", allow_duplicate=True),
        *[Output(component, "style", allow_duplicate=True) for component in hidden],
        Output(panel.strip.run, "disabled", allow_duplicate=True),
    ]
    app.clientside_callback(
        ClientsideFunction("krypton_binding", "hide"),
        *outputs,
        Input({"type": panel.sample, "name": ALL}, "n_clicks"),
        Input({"type": panel.compare_sample, "name": ALL}, "n_clicks"),
        Input(panel.upload, "contents"),
        Input(panel.model, "value"),
        State(panel.upload, "filename"),
        prevent_initial_call=True,
    )
    # the ticket alone (a file refused in the browser sets it without contents): apart,
    # since Dash holds a callback until every callback feeding its inputs has answered,
    # and the ticket comes from the upload's POST; with it beside the file's contents,
    # the rule waited for the whole upload (seconds on a busy host) with Run enabled
    app.clientside_callback(
        ClientsideFunction("krypton_binding", "hideForTicket"),
        *outputs,
        Input(panel.ticket, "data"),
        prevent_initial_call=True,
    )
