"""Page layout of the Krypton app (thesis §7.1, Fig 7.1, and past it)."""

from __future__ import annotations

import uuid

from dash import dcc, html

from krypton.approximate.settings import DEFAULTS
from krypton.approximate.tuning import DEFAULT_TARGET_SSIM
from krypton.io.dicom import WINDOW_PRESETS
from krypton.registry.models import CALIBRATION_PATCHES, DEFAULT_PATCH, DEFAULT_STRIDE

from . import ids
from .figures import placeholder_figure
from .glossary import term_label
from .model_upload_layout import model_upload
from .pacs_layout import pacs_search, pacs_send
from .panel_scope import IMAGE_PANEL, tick
from .samples import gallery
from .volume_layout import volume_section

PATCH_SIZES = CALIBRATION_PATCHES  # the sizes the runtime estimator is calibrated for
EXPORTS = (
    ("PNG", "png", "heatmap over the image, with colour bar and title"),
    (".npy", "npy", "the explained class's probabilities (rows x cols)"),
    ("All classes (.npz)", "npz", "every class's probabilities, positions, names"),
    ("CSV", "csv", "x, y, probability per position"),
    ("JSON", "json", "settings and result (with Compare: the three maps and their agreement)"),
    (
        "Compare (PNG)",
        "compare",
        "occlusion, Grad-CAM and Integrated Gradients side by side, each with its own "
        "colour scale (runs with Compare ticked)",
    ),
    (
        "DICOM",
        "dicom",
        "the overlay as a DICOM Secondary Capture in the source's study, referencing the "
        "source image (DICOM input only)",
    ),
)
STRIDES = (2, 4, 8, 16)
WINDOW_LABELS = {
    "file": "From the file",
    **{
        name: f"{name.capitalize()} (C {centre:g}, W {width:g})"
        for name, (centre, width) in WINDOW_PRESETS.items()
    },
    "manual": "Manual…",
}


def patch_options(model_patch: int = DEFAULT_PATCH) -> list[dict]:
    """The calibrated patch sizes, plus the model's own default when its registry entry
    names another size (the menu would otherwise show that default as blank)."""
    return [{"label": f"{p}x{p}", "value": p} for p in sorted({*PATCH_SIZES, model_patch})]


def _labelled(label: str, control, help_text: str | None = None) -> html.Div:
    children = [term_label(label), control]
    if help_text:
        children.append(html.Small(help_text, className="help"))
    return html.Div(children, className="control")


def _dicom_panel() -> html.Div:
    """Window/level and frame for a DICOM image (hidden for other images)."""
    return html.Div(
        [
            html.Div(id=ids.DICOM_INFO, className="help"),
            html.Div(
                [
                    _labelled(
                        "Window",
                        dcc.Dropdown(
                            id=ids.WINDOW_PRESET,
                            options=[{"label": v, "value": k} for k, v in WINDOW_LABELS.items()],
                            value="file",
                            clearable=False,
                        ),
                        "what the model sees is the windowed image shown",
                    ),
                    html.Div(
                        [
                            _labelled(
                                "Centre",
                                dcc.Input(
                                    id=ids.WINDOW_CENTRE, type="number", debounce=True, step="any"
                                ),
                            ),
                            _labelled(
                                "Width",
                                dcc.Input(
                                    id=ids.WINDOW_WIDTH,
                                    type="number",
                                    debounce=True,
                                    min=1,
                                    step="any",
                                ),
                            ),
                        ],
                        id=ids.MANUAL_WINDOW,
                        className="row two",
                        style={"display": "none"},
                    ),
                ],
                className="row two",
            ),
            html.Div(
                _labelled(
                    "Frame",
                    dcc.Slider(
                        id=ids.DICOM_FRAME,
                        min=1,
                        max=1,
                        step=1,
                        value=1,
                        marks=None,
                        tooltip={"placement": "bottom", "always_visible": True},
                    ),
                ),
                id=ids.FRAME_PICKER,
                style={"display": "none"},
            ),
        ],
        id=ids.DICOM_PANEL,
        className="dicom-panel",
        style={"display": "none"},
    )


def _overlay_controls() -> html.Div:
    """Opacity, show/hide, threshold, view and colour scale of the heatmap."""
    return html.Div(
        [
            html.Div(
                [
                    dcc.Checklist(
                        id=ids.OVERLAY_SHOW,
                        options=[{"label": " show heatmap", "value": "show"}],
                        value=["show"],
                        inline=True,
                    ),
                    dcc.RadioItems(
                        id=ids.OVERLAY_VIEW,
                        options=[
                            {"label": "Overlay", "value": "overlay"},
                            {"label": "Side by side", "value": "side"},
                        ],
                        value="overlay",
                        inline=True,
                    ),
                    dcc.RadioItems(
                        id=ids.OVERLAY_SCALE,
                        options=[
                            {"label": "Relative to the prediction", "value": "relative"},
                            {"label": "Absolute drop", "value": "absolute"},
                        ],
                        value="relative",
                        inline=True,
                    ),
                ],
                className="row",
            ),
            html.Div(
                [
                    _labelled(
                        "Opacity",
                        dcc.Slider(
                            id=ids.OVERLAY_OPACITY,
                            min=0,
                            max=1,
                            step=0.05,
                            value=0.55,
                            marks={0: "0", 0.5: "0.5", 1: "1"},
                        ),
                    ),
                    _labelled(
                        "Threshold",
                        dcc.Slider(
                            id=ids.OVERLAY_THRESHOLD,
                            min=0,
                            max=1,
                            step=0.01,
                            value=0,
                            marks={0: "0", 0.25: "0.25", 0.5: "0.5", 1: "1"},
                        ),
                        "show only cells whose probability drop exceeds this",
                    ),
                ],
                className="row two",
            ),
        ],
        className="overlay-controls",
    )


def _image_section(max_image_bytes: int) -> html.Section:
    """The image panel: upload, samples, DICOM controls, the picture and its region."""
    return html.Section(
        [
            html.H2("Image"),
            IMAGE_PANEL.upload_zone("an image", "PNG, JPEG, TIFF, BMP, DICOM", max_image_bytes),
            gallery(),
            _dicom_panel(),
            dcc.Graph(
                id=ids.IMAGE_GRAPH,
                config={
                    "displaylogo": False,
                    "modeBarButtonsToRemove": ["lasso2d"],
                },
            ),
            IMAGE_PANEL.region_line("Whole image"),
            html.Small(
                "Drag a rectangle on the image to explain only that region.",
                className="help",
            ),
        ],
        className="panel image-panel",
    )


def _settings_section(
    models: list[dict], default_model: str | None, max_model_bytes: int, trusted_uploads: bool
) -> html.Section:
    """The settings panel: model, patch, stride, mode, colour, class, Run, progress."""
    return html.Section(
        [
            html.H2("Settings"),
            _labelled(
                "Model",
                dcc.Dropdown(
                    id=IMAGE_PANEL.model,
                    options=models,
                    value=default_model,
                    clearable=False,
                ),
            ),
            html.Div(id=ids.MODEL_CARD, className="model-card"),
            # the prediction high, beside the picture: on a 768-pixel screen both show
            html.Div(id=ids.TOP5, className="top5"),
            # Run, its estimate and the progress next: above the fold on a 1366x768
            # laptop (at the column's foot Run sat at y 814-843)
            IMAGE_PANEL.strip.estimate_line(),
            html.Div(IMAGE_PANEL.strip.buttons(), className="row"),
            IMAGE_PANEL.strip.progress_bar(),
            html.Div(
                [
                    _labelled(
                        "Patch size",
                        dcc.Dropdown(
                            id=IMAGE_PANEL.patch,
                            options=patch_options(),
                            value=DEFAULT_PATCH,  # then the model's own
                            clearable=False,
                        ),
                    ),
                    _labelled(
                        "Stride",
                        dcc.Dropdown(
                            id=IMAGE_PANEL.stride,
                            options=[{"label": str(s), "value": s} for s in STRIDES],
                            value=DEFAULT_STRIDE,
                            clearable=False,
                        ),
                    ),
                ],
                className="row two",
            ),
            _labelled(
                "Mode",
                IMAGE_PANEL.mode_radio(),
            ),
            html.Div(
                [
                    _labelled(
                        "Target SSIM",
                        dcc.Slider(
                            id=ids.TARGET_SSIM,
                            min=0.7,
                            max=1.0,
                            step=0.01,
                            value=DEFAULT_TARGET_SSIM,
                            marks={0.7: "0.7", 0.8: "0.8", 0.9: "0.9", 1.0: "1"},
                        ),
                        "visual similarity to the exact heatmap; sets τ",
                    ),
                    _labelled(
                        "Drill-down fraction",
                        dcc.Slider(
                            id=ids.DRILL_DOWN,
                            min=0.05,
                            max=1.0,
                            step=0.05,
                            value=DEFAULTS.r_drill_down,
                            marks={0.1: "0.1", 0.25: "0.25", 0.5: "0.5", 1.0: "1"},
                        ),
                        "share of the region refined at full resolution",
                    ),
                    _labelled(
                        "Target speedup",
                        dcc.Slider(
                            id=ids.TARGET_SPEEDUP,
                            min=1.5,
                            max=8,
                            step=0.5,
                            value=DEFAULTS.target_speedup,
                            marks={2: "2", 3: "3", 5: "5", 8: "8"},
                        ),
                    ),
                ],
                id=ids.APPROXIMATE_SETTINGS,
                style={"display": "none"},
            ),
            _labelled(
                "Occlusion colour",
                html.Div(
                    [
                        dcc.RadioItems(
                            id=ids.COLOUR,
                            value="gray",
                            inline=True,
                            options=[
                                {"label": "Gray", "value": "gray"},
                                {"label": "Black", "value": "black"},
                                {"label": "Custom", "value": "custom"},
                            ],
                        ),
                        dcc.Input(
                            id=ids.CUSTOM_COLOUR,
                            value="#808080",
                            type="text",
                            debounce=True,
                            className="colour-input",
                        ),
                    ],
                    className="row",
                ),
            ),
            _labelled(
                "Class to explain",
                dcc.Dropdown(id=IMAGE_PANEL.label, clearable=False),
                "switching class re-colours an exact or naive heatmap at once",
            ),
            tick(ids.SNAP, " snap a new region to the last grid (reuses computed cells)", True),
            *IMAGE_PANEL.compare_controls(),
            model_upload(max_model_bytes, trusted_uploads),
        ],
        className="panel settings-panel",
    )


def _result_section(pacs: bool = False) -> html.Section:
    """The heatmap panel: overlay controls, the live picture, the result and downloads
    (and Send to PACS, ``pacs``: the operator configured one)."""
    return html.Section(
        [
            html.H2("Heatmap"),
            _overlay_controls(),
            IMAGE_PANEL.strip.live(),
            html.Div(
                html.Div(
                    [
                        # the summary's first lines above the picture: on a 1366x768 laptop
                        # they show without scrolling
                        IMAGE_PANEL.summary_box(),
                        dcc.Graph(
                            id=ids.HEATMAP_GRAPH,
                            config={"displaylogo": False},
                            figure=placeholder_figure("Press Run to compute the heatmap"),
                        ),
                        *IMAGE_PANEL.strip.downloads(EXPORTS),
                        dcc.Checklist(
                            id=ids.DICOM_IDENTITY,
                            options=[
                                {
                                    "label": " copy the patient's identity (name, "
                                    "ID, birth date, sex, accession number) into "
                                    "the DICOM export",
                                    "value": "identity",
                                }
                            ],
                            value=[],
                            className="help",
                            style={"display": "none"},
                        ),
                        *([pacs_send(IMAGE_PANEL)] if pacs else []),
                    ],
                    id=IMAGE_PANEL.result_area,  # hidden at the click that changes the image
                ),
                id=ids.RESULT_PANEL_BODY,
            ),
        ],
        className="panel result-panel",
    )


def build_layout(
    models: list[dict],
    default_model: str | None,
    max_image_bytes: int = 25 * 2**20,
    max_model_bytes: int = 200 * 2**20,
    trusted_uploads: bool = False,
    volume_models: list[dict] | None = None,
    default_volume: str | None = None,
    max_volume_bytes: int = 200 * 2**20,
    pacs: bool = False,
) -> html.Div:
    """The whole page; a function so every browser tab gets its own session id. ``pacs``:
    the operator configured a PACS (its search, above both panels, and Send buttons)."""

    return html.Div(
        [
            dcc.Store(id=ids.SESSION, data=str(uuid.uuid4())),
            *IMAGE_PANEL.stores(),  # the image's, its result's and its run strip's
            dcc.Store(id=ids.PREDICTION_STORE),
            dcc.Store(id=ids.IMAGE_SHOWN),
            dcc.Store(id=ids.OVERLAY_STORE),
            dcc.Store(id=ids.MODEL_UPLOAD_TICKET),  # the server's token for a weights file
            html.Header(
                [
                    html.H1("Krypton"),
                    html.Span(
                        "occlusion explanations of CNN predictions, computed incrementally",
                        className="tagline",
                    ),
                ]
            ),
            IMAGE_PANEL.strip.message_box(),
            *([pacs_search()] if pacs else []),
            html.Main(
                [
                    _image_section(max_image_bytes),
                    _settings_section(models, default_model, max_model_bytes, trusted_uploads),
                    _result_section(pacs),
                ],
                className="grid",
            ),
            # the Compare view, the page's width: three maps side by side (panels.compare)
            html.Section(id=IMAGE_PANEL.compare_panel, className="panel compare"),
            volume_section(volume_models or [], default_volume, max_volume_bytes, pacs),
            html.Footer(
                "Red cells mark where occluding the image lowers the class probability "
                "most. Relative to the prediction: from 75% to 125% of the probability "
                "without the patch (at most 1); absolute drop: how much the probability "
                "falls, from 0 to 1. The colour bar always names the scale shown."
            ),
        ],
        className="page",
    )
