"""The model upload: a state_dict (or, on a trusted host, a TorchScript file) with its
architecture, class names and input size, registered or removed from the page."""

from __future__ import annotations

from dash import dcc, html

from . import ids
from .panel_scope import size_checked

__all__ = ["model_upload"]


def model_upload(max_model_bytes: int, trusted_uploads: bool) -> html.Details:
    """The "Add your own model" section, its upload capped at ``max_model_bytes``."""
    torchscript = (
        [{"label": "TorchScript file (trusted uploads only)", "value": "torchscript"}]
        if trusted_uploads
        else []
    )
    accepted = "a state_dict for a torchvision architecture (any number of classes)" + (
        " or a TorchScript file" if trusted_uploads else ""
    )
    return html.Details(
        id=ids.MODEL_UPLOAD_DETAILS,
        children=[
            html.Summary("Add your own model"),
            html.P(
                f"Upload {accepted}, plus its class names (up to "
                f"{max_model_bytes / 2**20:g} MB). Models you add can be removed again; "
                f"shipped ones cannot.",
                className="help",
            ),
            size_checked(
                dcc.Upload(
                    html.Div(["Weights file (.pt / .pth): drop or ", html.A("choose")]),
                    id=ids.MODEL_UPLOAD,
                    className="upload small",
                    max_size=max_model_bytes,
                ),
                max_model_bytes,
                ids.MODEL_UPLOAD_TICKET,
            ),
            html.Div(id=ids.MODEL_UPLOAD_NAME, className="help"),
            dcc.Input(
                id=ids.MODEL_NAME,
                placeholder="name, e.g. oct-resnet18",
                type="text",
                className="text-input",
            ),
            dcc.Dropdown(
                id=ids.MODEL_ARCHITECTURE,
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
                id=ids.MODEL_CLASSES,
                placeholder="class names, one per line or comma-separated",
                className="text-input",
            ),
            dcc.Input(
                id=ids.MODEL_SIZE,
                placeholder="input size, e.g. 224",
                type="number",
                min=16,
                max=1024,
                className="text-input",
            ),
            html.Div(
                [
                    html.Button("Register model", id=ids.MODEL_REGISTER, n_clicks=0),
                    html.Button(
                        "Remove selected model",
                        id=ids.MODEL_REMOVE,
                        n_clicks=0,
                        title="removes the model chosen above, if a user added it",
                    ),
                ],
                className="row",
            ),
            html.Div(id=ids.MODEL_REGISTER_MESSAGE, className="message"),
        ],
        className="panel",
    )
