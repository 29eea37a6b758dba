"""The page's PACS (only when the operator configured one): one search for both panels
(a series opens in the volume panel, one of its images in the image panel) and a Send
button under each panel's result."""

from __future__ import annotations

from dash import dcc, html

from . import ids
from .panel_scope import IMAGE_PANEL, VOLUME_PANEL

__all__ = ["pacs_search", "pacs_send"]


def pacs_search() -> html.Section:
    """Search studies, pick one of a study's series, open it as a volume or one of its
    images as a 2-D image."""
    field = {"type": "text", "debounce": True, "style": {"width": "11em"}}
    return html.Section(
        html.Details(
            [
                html.Summary("From the PACS"),
                html.Div(
                    [
                        dcc.Input(id=ids.PACS_PATIENT, placeholder="patient ID or name", **field),
                        dcc.Input(id=ids.PACS_DATES, placeholder="YYYYMMDD-YYYYMMDD", **field),
                        dcc.Input(id=ids.PACS_MODALITY, placeholder="modality (CT, MR)", **field),
                        dcc.Input(id=ids.PACS_ACCESSION, placeholder="accession number", **field),
                        html.Button("Search", id=ids.PACS_SEARCH, n_clicks=0),
                    ],
                    className="row",
                ),
                html.Div(
                    [
                        dcc.Dropdown(
                            id=ids.PACS_STUDY,
                            options=[],
                            placeholder="a study",
                            style={"minWidth": "24em"},
                        ),
                        dcc.Dropdown(
                            id=ids.PACS_SERIES,
                            options=[],
                            placeholder="a series",
                            style={"minWidth": "20em"},
                        ),
                        html.Button(
                            "Open series",
                            id=VOLUME_PANEL.pacs_open,
                            n_clicks=0,
                            disabled=True,
                            title="the whole series as a volume, in the volume panel",
                        ),
                        dcc.Input(
                            id=ids.PACS_IMAGE_NUMBER,
                            placeholder="image number",
                            type="text",
                            debounce=False,
                            style={"width": "8em"},
                        ),
                        html.Button(
                            "Open image",
                            id=IMAGE_PANEL.pacs_open,
                            n_clicks=0,
                            disabled=True,
                            title="one image of the series (its instance number; none for a "
                            "series of one image), in the image panel, for a 2-D model",
                        ),
                    ],
                    className="row",
                ),  # fmt: skip
                html.Div(id=ids.PACS_MESSAGE, className="message", role="status"),
            ],
            className="pacs-search",
        ),
        className="panel pacs",
    )


def pacs_send(scope) -> html.Div:
    """Send the result shown to the source's study (a series or image opened from the
    PACS): one button and its message, in the panel of ``scope`` (a PanelScope)."""
    button, sent = scope.pacs_send, scope.pacs_sent
    return html.Div(
        [
            html.Button(
                "Send to PACS", id=button, n_clicks=0, disabled=True,
                title="store the heatmap in the source's study as a DICOM Parametric Map "
                "(where the source has a frame of reference) and a Secondary Capture "
                "(opened from the PACS only)",
            ),
            html.Span(id=sent, className="help", role="status"),
        ],
        className="row",
    )  # fmt: skip
