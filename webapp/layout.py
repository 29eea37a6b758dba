"""Page layout of the Krypton app (thesis §7.1, Fig 7.1, and past it)."""

from __future__ import annotations

import functools
import uuid
from pathlib import Path

from dash import dcc, html

from krypton.dicom import WINDOW_PRESETS

PATCH_SIZES = (4, 8, 16, 32)
EXPORTS = (
    ("PNG", "png", "heatmap over the image, with colour bar and title"),
    (".npy", "npy", "the explained class's probabilities (rows x cols)"),
    ("All classes (.npz)", "npz", "every class's probabilities, positions, names"),
    ("CSV", "csv", "x, y, probability per position"),
    ("JSON", "json", "settings and result"),
    (
        "DICOM",
        "dcm",
        "the overlay as a DICOM Secondary Capture in the source's study, referencing the "
        "source image (DICOM input only)",
    ),
)
STRIDES = (2, 4, 8, 16)
SAMPLES_DIR = Path(__file__).resolve().parents[1] / "assets" / "samples"
SAMPLE_NAMES = {
    "retina.jpg": "Retina (fundus)",
    "microaneurysms.png": "Microaneurysms",
    "chelsea.png": "Cat",
    "coffee.png": "Coffee",
}
# DICOM samples: files pydicom ships in pydicom/data/test_files (its README gives their
# sources and licences), read from the installed package rather than copied here.
DICOM_SAMPLES = {
    "CT_small.dcm": (
        "CT chest (DICOM)",
        "CT slice, signed 16-bit, 128×128, from NEMA's public WG04 sample set (CT1_UNC, "
        "downsized), as pydicom ships it",
    ),
    "MR_small.dcm": (
        "MR (DICOM)",
        "MR slice, 64×64, from NEMA's public WG04 sample set (MR1_UNC, downsized), as "
        "pydicom ships it",
    ),
    "examples_overlay.dcm": (
        "MR abdomen (DICOM)",
        "MR abdomen slice, 484×300, GDCM's MR-SIEMENS-DICOM-WithOverlays (BSD licence), "
        "cropped, as pydicom ships it",
    ),
}
WINDOW_LABELS = {
    "file": "From the file",
    **{
        name: f"{name.capitalize()} (C {centre:g}, W {width:g})"
        for name, (centre, width) in WINDOW_PRESETS.items()
    },
    "manual": "Manual…",
}


def dicom_samples_dir() -> Path:
    import pydicom

    return Path(pydicom.__file__).resolve().parent / "data" / "test_files"


def sample_path(name: str) -> Path:
    """Where a gallery sample's file is (a project image or a pydicom test file)."""
    if name in DICOM_SAMPLES:
        return dicom_samples_dir() / name
    if name in SAMPLE_NAMES:
        return SAMPLES_DIR / name
    raise KeyError(name)


@functools.lru_cache(maxsize=None)
def _dicom_thumbnail(name: str) -> str | None:
    """A small PNG data URL of a DICOM sample in its own window (None if unreadable)."""
    from krypton.dicom import load_dicom

    from .helpers import data_url

    try:
        picture = load_dicom(sample_path(name)).picture
    except (OSError, ValueError):
        return None
    picture.thumbnail((96, 96))
    return data_url(picture)


def mode_options(traceable: bool = True) -> list[dict]:
    """Naive always; Exact and Approximate only for models torch.fx can capture."""
    why = "" if traceable else " (needs a model torch.fx can capture)"
    return [
        {"label": "Naive", "value": "naive"},
        {"label": "Exact" + why, "value": "exact", "disabled": not traceable},
        {"label": "Approximate" + why, "value": "approximate", "disabled": not traceable},
    ]


def _labelled(label: str, control, help_text: str | None = None) -> html.Div:
    children = [html.Label(label, className="control-label"), control]
    if help_text:
        children.append(html.Small(help_text, className="help"))
    return html.Div(children, className="control")


def _sample_button(name: str, title: str, thumbnail: str, caption: str) -> html.Button:
    return html.Button(
        [html.Img(src=thumbnail, className="thumb"), html.Span(title)],
        id={"type": "sample", "name": name},
        className="sample",
        title=caption,
        n_clicks=0,
    )


def _gallery() -> html.Div:
    buttons = []
    for filename, title in SAMPLE_NAMES.items():
        if (SAMPLES_DIR / filename).exists():
            buttons.append(_sample_button(filename, title, f"/assets/samples/{filename}", title))
    for filename, (title, caption) in DICOM_SAMPLES.items():
        thumbnail = _dicom_thumbnail(filename) if sample_path(filename).exists() else None
        if thumbnail:
            buttons.append(_sample_button(filename, title, thumbnail, caption))
    return html.Div(buttons, className="gallery")


def _dicom_panel() -> html.Div:
    """Window/level and frame for a DICOM image (hidden for other images)."""
    return html.Div(
        [
            html.Div(id="dicom-info", className="help"),
            html.Div(
                [
                    _labelled(
                        "Window",
                        dcc.Dropdown(
                            id="window-preset",
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
                                    id="window-centre", type="number", debounce=True, step="any"
                                ),
                            ),
                            _labelled(
                                "Width",
                                dcc.Input(
                                    id="window-width",
                                    type="number",
                                    debounce=True,
                                    min=1,
                                    step="any",
                                ),
                            ),
                        ],
                        id="manual-window",
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
                        id="dicom-frame",
                        min=1,
                        max=1,
                        step=1,
                        value=1,
                        marks=None,
                        tooltip={"placement": "bottom", "always_visible": True},
                    ),
                ),
                id="frame-picker",
                style={"display": "none"},
            ),
        ],
        id="dicom-panel",
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
                        id="overlay-show",
                        options=[{"label": " show heatmap", "value": "show"}],
                        value=["show"],
                        inline=True,
                    ),
                    dcc.RadioItems(
                        id="overlay-view",
                        options=[
                            {"label": "Overlay", "value": "overlay"},
                            {"label": "Side by side", "value": "side"},
                        ],
                        value="overlay",
                        inline=True,
                    ),
                    dcc.RadioItems(
                        id="overlay-scale",
                        options=[
                            {"label": "Relative scale (paper)", "value": "relative"},
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
                            id="overlay-opacity",
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
                            id="overlay-threshold",
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


def _model_upload(max_model_bytes: int, trusted_uploads: bool) -> html.Details:
    torchscript = (
        [{"label": "TorchScript file (trusted uploads only)", "value": "torchscript"}]
        if trusted_uploads
        else []
    )
    accepted = "a state_dict for a torchvision architecture (any number of classes)" + (
        " or a TorchScript file" if trusted_uploads else ""
    )
    return html.Details(
        [
            html.Summary("Add your own model"),
            html.P(
                f"Upload {accepted}, plus its class names (up to "
                f"{max_model_bytes / 2**20:g} MB). Models you add can be removed again; "
                f"shipped ones cannot.",
                className="help",
            ),
            dcc.Upload(
                html.Div(["Weights file (.pt / .pth): drop or ", html.A("choose")]),
                id="model-upload",
                className="upload small",
                max_size=max_model_bytes,
            ),
            html.Div(id="model-upload-name", className="help"),
            dcc.Input(
                id="model-name",
                placeholder="name, e.g. oct-resnet18",
                type="text",
                className="text-input",
            ),
            dcc.Dropdown(
                id="model-architecture",
                placeholder="architecture",
                options=torchscript
                + [
                    {"label": a, "value": a}
                    for a in (
                        "resnet18",
                        "resnet50",
                        "vgg16",
                        "inception_v3",
                        "densenet121",
                        "mobilenet_v2",
                        "efficientnet_b0",
                    )
                ],
            ),
            dcc.Textarea(
                id="model-classes",
                placeholder="class names, one per line or comma-separated",
                className="text-input",
            ),
            dcc.Input(
                id="model-size",
                placeholder="input size, e.g. 224",
                type="number",
                min=16,
                max=1024,
                className="text-input",
            ),
            html.Div(
                [
                    html.Button("Register model", id="model-register", n_clicks=0),
                    html.Button(
                        "Remove selected model",
                        id="model-remove",
                        n_clicks=0,
                        title="removes the model chosen above, if a user added it",
                    ),
                ],
                className="row",
            ),
            html.Div(id="model-register-message", className="message"),
        ],
        className="panel",
    )


def placeholder_figure(text: str) -> dict:
    """An empty panel with a line of text, instead of bare axes."""
    return {
        "data": [],
        "layout": {
            "xaxis": {"visible": False},
            "yaxis": {"visible": False},
            "height": 420,
            "margin": {"l": 0, "r": 0, "t": 0, "b": 0},
            "annotations": [
                {
                    "text": text,
                    "showarrow": False,
                    "xref": "paper",
                    "yref": "paper",
                    "x": 0.5,
                    "y": 0.5,
                    "font": {"size": 14, "color": "#777"},
                }
            ],
        },
    }


def build_layout(
    models: list[dict],
    default_model: str | None,
    max_image_bytes: int = 25 * 2**20,
    max_model_bytes: int = 200 * 2**20,
    trusted_uploads: bool = False,
) -> html.Div:
    """The whole page; a function so every browser tab gets its own session id."""
    return html.Div(
        [
            dcc.Store(id="session", data=str(uuid.uuid4())),
            dcc.Store(id="image-store"),
            dcc.Store(id="region-store"),
            dcc.Store(id="prediction-store"),
            dcc.Store(id="result-store"),
            dcc.Store(id="overlay-store"),
            dcc.Download(id="download"),
            html.Header(
                [
                    html.H1("Krypton"),
                    html.Span(
                        "occlusion explanations of CNN predictions, computed incrementally",
                        className="tagline",
                    ),
                ]
            ),
            html.Div(id="message", className="message", role="alert"),
            html.Main(
                [
                    html.Section(
                        [
                            html.H2("Image"),
                            dcc.Upload(
                                html.Div(
                                    [
                                        "Drop an image here or ",
                                        html.A("choose a file"),
                                        html.Small(
                                            f" (PNG, JPEG, TIFF, BMP, DICOM; up to "
                                            f"{max_image_bytes / 2**20:g} MB)"
                                        ),
                                    ]
                                ),
                                id="upload",
                                className="upload",
                                max_size=max_image_bytes,
                                # no accept filter: DICOM files often have no extension
                            ),
                            _gallery(),
                            _dicom_panel(),
                            dcc.Graph(
                                id="image-graph",
                                config={
                                    "displaylogo": False,
                                    "modeBarButtonsToRemove": ["lasso2d"],
                                },
                            ),
                            html.Div(
                                [
                                    html.Span(id="region-text", className="region-text"),
                                    html.Button("Whole image", id="reset-region", n_clicks=0),
                                ],
                                className="row",
                            ),
                            html.Small(
                                "Drag a rectangle on the image to explain only that region.",
                                className="help",
                            ),
                        ],
                        className="panel image-panel",
                    ),
                    html.Section(
                        [
                            html.H2("Settings"),
                            _labelled(
                                "Model",
                                dcc.Dropdown(
                                    id="model", options=models, value=default_model, clearable=False
                                ),
                            ),
                            html.Div(id="model-card", className="model-card"),
                            html.Div(
                                [
                                    _labelled(
                                        "Patch size",
                                        dcc.Dropdown(
                                            id="patch",
                                            options=[
                                                {"label": f"{p}x{p}", "value": p}
                                                for p in PATCH_SIZES
                                            ],
                                            value=16,
                                            clearable=False,
                                        ),
                                    ),
                                    _labelled(
                                        "Stride",
                                        dcc.Dropdown(
                                            id="stride",
                                            options=[
                                                {"label": str(s), "value": s} for s in STRIDES
                                            ],
                                            value=4,
                                            clearable=False,
                                        ),
                                    ),
                                ],
                                className="row two",
                            ),
                            _labelled(
                                "Mode",
                                dcc.RadioItems(
                                    id="mode", value="exact", inline=True, options=mode_options()
                                ),
                            ),
                            html.Div(
                                [
                                    _labelled(
                                        "Target SSIM",
                                        dcc.Slider(
                                            id="target-ssim",
                                            min=0.7,
                                            max=1.0,
                                            step=0.01,
                                            value=0.9,
                                            marks={0.7: "0.7", 0.8: "0.8", 0.9: "0.9", 1.0: "1"},
                                        ),
                                        "visual similarity to the exact heatmap; sets τ",
                                    ),
                                    _labelled(
                                        "Drill-down fraction",
                                        dcc.Slider(
                                            id="drill-down",
                                            min=0.05,
                                            max=1.0,
                                            step=0.05,
                                            value=0.25,
                                            marks={0.1: "0.1", 0.25: "0.25", 0.5: "0.5", 1.0: "1"},
                                        ),
                                        "share of the region refined at full resolution",
                                    ),
                                    _labelled(
                                        "Target speedup",
                                        dcc.Slider(
                                            id="target-speedup",
                                            min=1.5,
                                            max=8,
                                            step=0.5,
                                            value=3,
                                            marks={2: "2", 3: "3", 5: "5", 8: "8"},
                                        ),
                                    ),
                                ],
                                id="approximate-settings",
                                style={"display": "none"},
                            ),
                            _labelled(
                                "Occlusion colour",
                                html.Div(
                                    [
                                        dcc.RadioItems(
                                            id="colour",
                                            value="gray",
                                            inline=True,
                                            options=[
                                                {"label": "Gray", "value": "gray"},
                                                {"label": "Black", "value": "black"},
                                                {"label": "Custom", "value": "custom"},
                                            ],
                                        ),
                                        dcc.Input(
                                            id="custom-colour",
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
                                dcc.Dropdown(id="label", clearable=False),
                                "switching class re-colours an exact or naive heatmap at once",
                            ),
                            dcc.Checklist(
                                id="snap",
                                value=["snap"],
                                className="help",
                                options=[
                                    {
                                        "label": " snap a new region to the last grid "
                                        "(reuses computed cells)",
                                        "value": "snap",
                                    }
                                ],
                            ),
                            html.Div(id="top5", className="top5"),
                            html.Div(id="estimate", className="estimate"),
                            html.Div(
                                [
                                    html.Button("Run", id="run", n_clicks=0, className="primary"),
                                    html.Button("Cancel", id="cancel", n_clicks=0, disabled=True),
                                ],
                                className="row",
                            ),
                            html.Progress(id="progress", value="0", max="1"),
                            _model_upload(max_model_bytes, trusted_uploads),
                        ],
                        className="panel settings-panel",
                    ),
                    html.Section(
                        [
                            html.H2("Heatmap"),
                            _overlay_controls(),
                            html.Div(
                                [
                                    dcc.Graph(
                                        id="live-graph",
                                        config={"displaylogo": False},
                                        figure=placeholder_figure("Starting…"),
                                    ),
                                    html.Div(id="live-status", className="status"),
                                ],
                                id="live-panel",
                                style={"display": "none"},
                            ),
                            html.Div(
                                [
                                    dcc.Graph(
                                        id="heatmap-graph",
                                        config={"displaylogo": False},
                                        figure=placeholder_figure(
                                            "Press Run to compute the heatmap"
                                        ),
                                    ),
                                    html.Div(id="result-summary", className="summary"),
                                    html.Div(
                                        [
                                            html.Span("Download: "),
                                            *[
                                                html.Button(
                                                    text,
                                                    id={"type": "export", "format": fmt},
                                                    disabled=True,
                                                    title=title,
                                                )
                                                for text, fmt, title in EXPORTS
                                            ],
                                        ],
                                        className="row exports",
                                    ),
                                    dcc.Checklist(
                                        id="dicom-identity",
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
                                ],
                                id="result-panel-body",
                            ),
                        ],
                        className="panel result-panel",
                    ),
                ],
                className="grid",
            ),
            html.Footer(
                "Red cells mark where occluding the image lowers the class probability "
                "most. Relative scale: 0.75p to min(1, 1.25p), p = unoccluded "
                "probability (as in the Krypton paper); absolute scale: the probability "
                "drop from 0 to 1. The colour bar always names the scale shown."
            ),
        ],
        className="page",
    )
