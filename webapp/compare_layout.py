"""The Compare view's settings beside its tick, for the image and the volume panel alike:
which layer Grad-CAM reads (webapp.comparison.layer_choices fills it per model) and how
many gradient evaluations Integrated Gradients may spend (webapp.path_budget)."""

from __future__ import annotations

from dash import dcc, html

from .glossary import term_label
from .path_budget import budget_options

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


def steps_picker(component_id: str) -> html.Div:
    """Integrated Gradients' most gradient evaluations per map: the default, or more for
    a path the Compare view says stopped short of completeness."""
    options = budget_options()
    return html.Div(
        [
            term_label("Integrated Gradients steps"),
            dcc.Dropdown(
                id=component_id, options=options, value=options[0]["value"], clearable=False,
                style={"minWidth": "10em"},
            ),
        ],
        className="row help",
    )  # fmt: skip
