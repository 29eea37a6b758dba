"""What more than one panel uses: the page's "nothing to show" figure and the inputs that
say what is on screen (a result's provenance is compared with them)."""

from __future__ import annotations

import plotly.graph_objects as go
from dash import Input

from .. import ids
from ..layout import placeholder_figure

# What a result's provenance is compared with: the page's image, model and settings.
SCREEN_INPUTS = [
    Input(ids.IMAGE_STORE, "data"),
    Input(ids.MODEL, "value"),
    Input(ids.REGION_STORE, "data"),
    Input(ids.PATCH, "value"),
    Input(ids.STRIDE, "value"),
    Input(ids.MODE, "value"),
    Input(ids.COLOUR, "value"),
    Input(ids.CUSTOM_COLOUR, "value"),
    Input(ids.TARGET_SSIM, "value"),
    Input(ids.DRILL_DOWN, "value"),
    Input(ids.TARGET_SPEEDUP, "value"),
]


def empty_figure(text: str = "") -> go.Figure:
    """A figure with only ``text`` in it."""
    return go.Figure(placeholder_figure(text))


def origin(trigger, ticket) -> str | None:
    """The request a load answers, named as the browser names it at the click
    (assets/binding.js): 'sample:NAME' for a sample's buttons, 'upload:FILENAME' for a
    file (the image and the volume panel alike); None for no request."""
    if isinstance(trigger, dict) and trigger.get("name") is not None:
        return f"sample:{trigger['name']}"
    if isinstance(trigger, str) and trigger.endswith("ticket"):
        return f"upload:{(ticket or {}).get('name') or ''}" if isinstance(ticket, dict) else None
    return None
