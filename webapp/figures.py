"""The page's Plotly figures: the model-input image with its region, and a heatmap over
it with a colour bar that names its scale."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from PIL import Image

from krypton.render.overlay import OverlayStyle, styled_heatmap

from .helpers import InputError

if TYPE_CHECKING:
    from .runs import Partial


def model_view(image: Image.Image, input_size: Sequence[int]) -> Image.Image:
    """The image as the model sees it (resized to its input size)."""
    height, width = input_size
    return image.convert("RGB").resize((width, height), Image.BILINEAR)


def data_url(image: Image.Image) -> str:
    """A picture as a PNG data URL, the source of a figure's image trace."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def plotly_text(text: str) -> str:
    """User text (class, model and file names) for a Plotly title: Plotly renders a subset
    of HTML there (links, styles), so every markup character is escaped."""
    return html.escape(str(text), quote=True)


def image_figure(image: Image.Image, region: list[int] | None) -> go.Figure:
    """The model-input image; drag a box on it to choose the region."""
    figure = go.Figure(go.Image(source=data_url(image), hoverinfo="x+y"))
    if region:
        x0, y0, x1, y1 = region
        figure.add_shape(
            type="rect",
            x0=x0 - 0.5,
            y0=y0 - 0.5,
            x1=x1 - 0.5,
            y1=y1 - 0.5,
            line={"color": "#00e5ff", "width": 2},
        )
    figure.update_layout(
        dragmode="select",
        margin={"l": 0, "r": 0, "t": 0, "b": 0},
        xaxis={"visible": False},
        yaxis={"visible": False},
        height=420,
        uirevision="image",
        newselection={"mode": "immediate"},
    )
    return figure


def overlay_style(data: dict | None) -> OverlayStyle:
    """The overlay controls' values (the overlay-store) as an OverlayStyle."""
    data = data or {}
    try:
        return OverlayStyle(
            opacity=float(data.get("opacity", 0.55)),
            threshold=float(data.get("threshold", 0.0)),
            scale=str(data.get("scale", "relative")),
            show=bool(data.get("show", True)),
        )
    except (TypeError, ValueError) as exc:
        raise InputError(f"overlay settings: {exc}") from None


def _wrapped(text: str, width: int = 22) -> str:
    """A colour-bar title broken into short lines (Plotly's <br>), escaped."""
    import textwrap

    return "<br>".join(plotly_text(line) for line in textwrap.wrap(text, width))


def heatmap_figure(
    image: Image.Image,
    values: np.ndarray,
    xs,
    ys,
    patch: int,
    prob: float,
    title: str = "",
    style: OverlayStyle | None = None,
    side_by_side: bool = False,
) -> go.Figure:
    """The heatmap over the image, red = most sensitive, with a colour bar that names its
    scale; ``side_by_side`` puts the plain image on the left (zoom and pan linked)."""
    from plotly.subplots import make_subplots

    style = style or OverlayStyle()
    styled = styled_heatmap(values, prob, style)
    raw = np.asarray(values, dtype=np.float64)
    source = data_url(image)
    columns = 2 if side_by_side else 1
    figure = make_subplots(rows=1, cols=columns, horizontal_spacing=0.02)
    for column in range(1, columns + 1):
        figure.add_trace(go.Image(source=source, hoverinfo="skip"), row=1, col=column)
    centres_x = np.asarray(xs) + (patch - 1) / 2
    centres_y = np.asarray(ys) + (patch - 1) / 2
    figure.add_trace(
        go.Heatmap(
            z=styled.values,
            x=centres_x,
            y=centres_y,
            zmin=styled.low,
            zmax=styled.high,
            colorscale="Jet",
            reversescale=styled.colormap == "jet_r",
            opacity=style.opacity,
            visible=style.show,
            customdata=np.dstack([raw, prob - raw]),
            hoverongaps=False,
            hovertemplate=(
                "patch at (%{x:.0f}, %{y:.0f}): p = %{customdata[0]:.4f}, "
                "drop %{customdata[1]:.4f}<extra></extra>"
            ),
            colorbar={"title": {"text": _wrapped(styled.label)}, "thickness": 14},
        ),
        row=1,
        col=columns,
    )
    figure.update_xaxes(visible=False)
    figure.update_yaxes(visible=False, autorange="reversed")
    if side_by_side:
        figure.update_xaxes(matches="x")
        figure.update_yaxes(matches="y", scaleanchor="x")
    figure.update_layout(
        margin={"l": 0, "r": 0, "t": 30 if title else 0, "b": 0},
        title={"text": plotly_text(title), "font": {"size": 13}},
        height=420,
    )
    if styled.note and style.show:  # no cell coloured: Plotly drops the colour bar too
        figure.add_annotation(
            text=_wrapped(styled.note, 60),
            xref="paper",
            yref="paper",
            x=0.5,
            y=0.02,
            showarrow=False,
            bgcolor="rgba(255, 255, 255, 0.85)",
            font={"size": 12},
        )
    return figure


def importance_figure(image: Image.Image, found, title: str) -> go.Figure:
    """One method's map (a krypton.methods.MethodMap on the occlusion grid) over the image,
    on its own colour scale: evidence for the class, red = most."""
    values = np.asarray(found.importance, np.float64)
    ys, xs = (np.asarray(a) for a in found.axes)
    low, high = found.value_range()
    flat = found.flat()  # no colour scale from 0 to 1e-9: one colour, and the title says so
    figure = go.Figure(go.Image(source=data_url(image), hoverinfo="skip"))
    figure.add_trace(
        go.Heatmap(
            z=values,
            x=xs + (found.patch[1] - 1) / 2,
            y=ys + (found.patch[0] - 1) / 2,
            zmin=low,
            zmax=low + 1.0 if flat else high,
            colorscale="Jet",
            opacity=0.2 if flat else 0.55,
            showscale=not flat,
            hoverongaps=False,
            hovertemplate="cell at (%{x:.0f}, %{y:.0f}): %{z:.4g}<extra></extra>",
            colorbar={"title": {"text": _wrapped("evidence for the class", 12)}, "thickness": 10},
        )
    )
    figure.update_xaxes(visible=False)
    figure.update_yaxes(visible=False, autorange="reversed", scaleanchor="x")
    figure.update_layout(
        margin={"l": 0, "r": 0, "t": 40, "b": 0},
        title={"text": _wrapped(title, 40), "font": {"size": 12}},
        height=300,
    )
    return figure


def live_heatmap(
    image: Image.Image, input_size: Sequence[int], overlay: dict | None
) -> Callable[[Partial], go.Figure]:
    """How the image panel draws a run's picture so far (a :class:`webapp.runs.Partial`):
    its values over the image as the model sees it, styled by the overlay settings,
    titled with the class and "(computing)". The settings are read now, so a bad one
    refuses the run before it queues."""
    style = overlay_style(overlay)
    shown = model_view(image, input_size)

    def draw(partial: Partial) -> go.Figure:
        ys, xs = partial.axes
        return heatmap_figure(
            shown, partial.filled, xs, ys, partial.patch, partial.prob,
            f"{partial.label_name} (computing)", style,
        )  # fmt: skip

    return draw


PLACEHOLDER_LINE = 40  # characters: Plotly does not wrap an annotation, so it is wrapped here


def placeholder_figure(text: str) -> dict:
    """An empty panel with a message, instead of bare axes: wrapped into short lines (a long
    one ran past the edges of the plot, the volume views' narrower still), and escaped, as
    it may name the user's files."""
    import html as markup
    import textwrap

    lines = textwrap.wrap(text, PLACEHOLDER_LINE) or [""]
    return {
        "data": [],
        "layout": {
            "xaxis": {"visible": False},
            "yaxis": {"visible": False},
            "height": 420,
            "margin": {"l": 0, "r": 0, "t": 0, "b": 0},
            "annotations": [
                {
                    "text": "<br>".join(markup.escape(line) for line in lines),
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
