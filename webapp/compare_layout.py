"""The Compare view's one setting beside its tick, for the image and the volume panel
alike: which layer Grad-CAM reads (webapp.comparison.layer_choices fills it per model)."""

from __future__ import annotations

from dash import dcc, html

from .glossary import term_label

DEFAULT_LAYER = "the deepest convolutional block (default)"


def layer_picker(component_id: str) -> html.Div:
    """Grad-CAM's layer: empty for the default rule, or one of the model's convolutional
    blocks (the run names the layer it read beside the map and in the JSON)."""
    return html.Div(
        [
            term_label("Grad-CAM layer"),
            dcc.Dropdown(
                id=component_id, options=[], value=None, placeholder=DEFAULT_LAYER,
                style={"minWidth": "16em"},
            ),
        ],
        className="row help",
    )  # fmt: skip
