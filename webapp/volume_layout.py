"""The volume panel's layout: a CT or MR volume in three linked orthogonal views (axial,
coronal, sagittal) with a slice slider under each and a crosshair, a 3-D region drawn
on two views, the run with its progress and live picture, the summary and the exports."""

from __future__ import annotations

from dash import dcc, html

from krypton.io.dicom import WINDOW_PRESETS
from krypton.registry.models import DEFAULT_VOLUME_STRIDE

from . import ids
from .glossary import term_label

VOLUME_EXPORTS = (
    ("NIfTI", "nifti", "the heatmap's cells in the scanner's frame (.nii.gz), one value per "
     "position of the cube"),
    ("JSON", "json", "settings and result (with Compare: the three maps and their agreement)"),
    ("Compare (PNG)", "compare", "occlusion, Grad-CAM and Integrated Gradients, each in the "
     "three views through its strongest cell on its own colour scale (runs with Compare "
     "ticked)"),
    ("DICOM series", "dicom", "the overlay as a DICOM Secondary Capture per axial slice of "
     "the model's block, in the source's study, referencing the source series (DICOM input "
     "only)"),
)  # fmt: skip


def volume_section(models: list[dict], default_model: str | None, max_bytes: int) -> html.Section:
    """The volume panel (see the module docstring); ``models``: the volume models' options."""
    views = [
        html.Div(
            [
                dcc.Graph(
                    id=graph,
                    config={"displaylogo": False, "modeBarButtonsToRemove": ["lasso2d"]},
                    figure=_empty(view),
                ),
                dcc.Slider(
                    id=slider, min=0, max=1, step=1, value=0,
                    marks=None,
                    updatemode="drag",
                ),
            ],
            className="volume-view",
        )
        for view, graph, slider in ids.VOLUME_GRAPHS
    ]  # fmt: skip
    controls = _controls(models, default_model)
    return html.Section(
        [
            html.H2("Volume (CT, MR)"),
            dcc.Store(id=ids.VOLUME_TICKET),
            dcc.Store(id=ids.VOLUME_STORE),
            dcc.Store(id=ids.VOLUME_REGION),
            dcc.Store(id=ids.VOLUME_RESULT),
            dcc.Download(id=ids.VOLUME_DOWNLOAD),
            html.Div(
                dcc.Upload(
                    html.Div(
                        [
                            "Drop a volume here or ",
                            html.A("choose a file"),
                            html.Small(
                                f" (NIfTI .nii/.nii.gz, a zip of one DICOM series, or "
                                f"multi-frame DICOM; up to {max_bytes / 2**20:g} MB)"
                            ),
                        ]
                    ),
                    id=ids.VOLUME_UPLOAD,
                    className="upload",
                    max_size=max_bytes,
                ),
                **{"data-max-bytes": str(max_bytes), "data-ticket": ids.VOLUME_TICKET},
            ),  # fmt: skip
            controls,
            html.Div(id=ids.VOLUME_INFO, className="help"),
            html.Div(id=ids.VOLUME_MESSAGE, className="message", role="alert"),
            html.Div(views, className="volume-views"),
            html.Div(
                [
                    html.Span(id=ids.VOLUME_REGION_TEXT, className="region-text"),
                    html.Button("Whole block", id=ids.VOLUME_RESET_REGION, n_clicks=0),
                ],
                className="row",
            ),
            html.Small(
                "The display window changes the views only; the model always sees its own "
                "window. Move the sliders, or click a view to move the crosshair there. Drag a box "
                "on one view and then on another to explain only that 3-D region (each box "
                "sets the two axes its view shows).",
                className="help",
            ),
            html.Div(id=ids.VOLUME_ESTIMATE, className="help"),
            html.Div(
                [
                    html.Button("Run", id=ids.VOLUME_RUN, n_clicks=0, className="primary"),
                    html.Button("Cancel", id=ids.VOLUME_CANCEL, n_clicks=0, disabled=True),
                    html.Progress(id=ids.VOLUME_PROGRESS, value="0", max="1"),
                ],
                className="row",
            ),
            html.Div(
                [
                    dcc.Graph(id=ids.VOLUME_LIVE_GRAPH, config={"displaylogo": False}),
                    html.Div(id=ids.VOLUME_LIVE_STATUS, className="status"),
                ],
                id=ids.VOLUME_LIVE_PANEL,
                style={"display": "none"},
            ),  # fmt: skip
            html.Div(id=ids.VOLUME_SUMMARY, className="summary"),
            html.Div(id=ids.VOLUME_COMPARE_PANEL, className="compare"),
            html.Div(
                [
                    html.Span("Download: "),
                    *[
                        html.Button(
                            text,
                            id={"type": ids.VOLUME_EXPORT, "format": fmt},
                            disabled=True,
                            title=title,
                        )
                        for text, fmt, title in VOLUME_EXPORTS
                    ],
                ],
                className="row exports",
            ),  # fmt: skip
        ],
        className="panel volume-panel",
    )


def _controls(models: list[dict], default_model: str | None) -> html.Div:
    """The model, mode, cube, stride, display window, class and Compare."""
    return html.Div(
        [
            term_label("Volume model"),
            dcc.Dropdown(id=ids.VOLUME_MODEL, options=models, value=default_model,
                         clearable=False, style={"minWidth": "14em"}),
            term_label("Mode"),
            dcc.RadioItems(
                id=ids.VOLUME_MODE, value="exact", inline=True,
                options=[{"label": f" {m.capitalize()} ", "value": m}
                         for m in ("naive", "exact", "approximate")],
            ),
            term_label("Cube (voxels)"),
            dcc.Input(id=ids.VOLUME_PATCH, type="number", min=1, step=1, value=8,
                      style={"width": "5em"}),
            term_label("Stride"),
            dcc.Input(id=ids.VOLUME_STRIDE, type="number", min=1, step=1,
                      value=DEFAULT_VOLUME_STRIDE, style={"width": "5em"}),
            term_label("Display window"),
            dcc.Dropdown(
                id=ids.VOLUME_WINDOW, value="model", clearable=False,
                options=[{"label": "The model's", "value": "model"}] + [
                    {"label": f"{name.capitalize()} (C {c:g}, W {w:g})", "value": name}
                    for name, (c, w) in WINDOW_PRESETS.items()
                ],
                style={"minWidth": "13em"},
            ),
            term_label("Class"),
            dcc.Dropdown(id=ids.VOLUME_LABEL, options=[], value=None,
                         placeholder="predicted class", style={"minWidth": "12em"}),
            dcc.Checklist(
                id=ids.VOLUME_COMPARE, value=[], className="help",
                options=[{"label": " compare with Grad-CAM and Integrated Gradients",
                          "value": "compare"}],
            ),
        ],
        className="row volume-controls",
    )  # fmt: skip


def _empty(view: str) -> dict:
    return {
        "data": [],
        "layout": {
            "height": 300,
            "xaxis": {"visible": False},
            "yaxis": {"visible": False},
            "margin": {"l": 0, "r": 0, "t": 30, "b": 0},
            "title": {"text": view, "font": {"size": 12}},
            "annotations": [
                {"text": "Load a volume", "showarrow": False, "xref": "paper",
                 "yref": "paper", "x": 0.5, "y": 0.5, "font": {"color": "#777"}}
            ],
        },
    }  # fmt: skip
