"""The three linked views of a volume on the page (axial, coronal, sagittal) as Plotly
figures: the block the model sees in gray, the heatmap over it, the crosshair through
the cursor voxel and the 3-D region's outline.

Axes are model voxels, so a box drawn on a view is a range of voxels directly: the axial
view shows x across and y down; the coronal view x across and z up; the sagittal view y
across and z up (the head, high z, at the top as a radiologist reads them).
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from krypton.io.dicom import WINDOW_PRESETS
from krypton.render.volumes import VIEWS

from .figures import plotly_text

__all__ = [
    "VIEW_AXES",
    "displayed",
    "view_figure",
    "views_live_figure",
    "region_from_view",
    "clicked_voxel",
]

# view -> (axis it slices across, axis drawn across, axis drawn up/down), axes (z, y, x)
VIEW_AXES = {"axial": (0, 2, 1), "coronal": (1, 2, 0), "sagittal": (2, 1, 0)}
AXIS_NAMES = "zyx"
CROSSHAIR = {"color": "#ffd400", "width": 1}
REGION_LINE = {"color": "#00e5ff", "width": 2}


def displayed(unit: np.ndarray, values: np.ndarray | None, window: str | None) -> np.ndarray:
    """What the views draw: ``unit`` (the model's windowed block) for "model", else the
    block's modality ``values`` in the named preset window (display only)."""
    if not window or window == "model" or values is None:
        return unit
    if window not in WINDOW_PRESETS:
        raise ValueError(f"unknown window preset {window!r}")
    centre, width = WINDOW_PRESETS[window]
    low = centre - width / 2
    return np.clip((values - low) / width, 0.0, 1.0).astype(np.float32)


def _plane(array: np.ndarray, view: str, cursor) -> np.ndarray:
    """The 2-D plane of ``array`` (D, H, W) a view shows through ``cursor`` (z, y, x),
    rows along the view's vertical axis."""
    across, horizontal, vertical = VIEW_AXES[view]
    index: list = [slice(None)] * 3
    index[across] = int(cursor[across])
    plane = array[tuple(index)]
    remaining = [a for a in range(3) if a != across]
    return plane if remaining == [vertical, horizontal] else plane.T


def _traces(unit, view, cursor, per_voxel, value_range, show_scale: bool, importance=False):
    """The gray block and the heatmap over it: occlusion's probabilities (red: lowest)
    or, with ``importance``, a Compare map (evidence for the class, red: most)."""
    gray = _plane(unit, view, cursor)
    traces = [
        go.Heatmap(
            z=gray, colorscale="gray", zmin=0.0, zmax=1.0, showscale=False,
            hovertemplate=f"{AXIS_NAMES[VIEW_AXES[view][1]]} %{{x}}, "
            f"{AXIS_NAMES[VIEW_AXES[view][2]]} %{{y}}<extra></extra>",
        )
    ]  # fmt: skip
    if per_voxel is not None:
        low, high = value_range
        traces.append(
            go.Heatmap(
                z=_plane(per_voxel, view, cursor), colorscale="Jet", reversescale=not importance,
                zmin=low, zmax=high, opacity=0.5, hoverongaps=False, showscale=show_scale,
                hovertemplate=("evidence = %{z:.4g}" if importance
                               else "p with the cube here = %{z:.4f}") + "<extra></extra>",
                colorbar={"title": {"text": "evidence (red: most)" if importance
                                    else "p (red: lowest)"}, "thickness": 12},
            )
        )  # fmt: skip
    return traces


def _decorations(figure, view, cursor, region, shape, row=None, col=None) -> None:
    _, horizontal, vertical = VIEW_AXES[view]
    width, height = shape[horizontal], shape[vertical]
    where = {} if row is None else {"row": row, "col": col}
    figure.add_shape(
        type="line", x0=cursor[horizontal], x1=cursor[horizontal], y0=-0.5, y1=height - 0.5,
        line=CROSSHAIR, **where,
    )  # fmt: skip
    figure.add_shape(
        type="line", y0=cursor[vertical], y1=cursor[vertical], x0=-0.5, x1=width - 0.5,
        line=CROSSHAIR, **where,
    )  # fmt: skip
    if region:
        low, high = region[:3], region[3:]
        figure.add_shape(
            type="rect", x0=low[horizontal] - 0.5, x1=high[horizontal] - 0.5,
            y0=low[vertical] - 0.5, y1=high[vertical] - 0.5, line=REGION_LINE, **where,
        )  # fmt: skip


def view_figure(
    unit: np.ndarray,
    view: str,
    cursor,
    per_voxel: np.ndarray | None = None,
    value_range: tuple[float, float] = (0.0, 1.0),
    region=None,
    title: str = "",
) -> go.Figure:
    """One view through ``cursor`` (z, y, x): ``unit`` (D, H, W) in [0, 1] in gray,
    ``per_voxel`` (the heatmap at every voxel, NaN where no cell reaches) over it on a
    shared ``value_range``, the crosshair and ``region`` (z0, y0, x0, z1, y1, x1). Drag a
    box to set the region on this view's two axes; click to move the cursor."""
    figure = go.Figure(_traces(unit, view, cursor, per_voxel, value_range, view == "sagittal"))
    _decorations(figure, view, cursor, region, unit.shape)
    _, horizontal, vertical = VIEW_AXES[view]
    figure.update_xaxes(title={"text": AXIS_NAMES[horizontal]}, constrain="domain", showgrid=False)
    figure.update_yaxes(
        title={"text": AXIS_NAMES[vertical]}, scaleanchor="x", showgrid=False,
        autorange="reversed" if view == "axial" else True,
    )  # fmt: skip
    figure.update_layout(
        title={"text": plotly_text(title or f"{view} · {AXIS_NAMES[VIEW_AXES[view][0]]} = "
                                   f"{int(cursor[VIEW_AXES[view][0]])}"), "font": {"size": 12},
               "x": 0.01, "xanchor": "left", "y": 0.98, "yanchor": "top"},  # clear of the toolbar
        dragmode="select", newselection={"mode": "immediate"},
        margin={"l": 30, "r": 10, "t": 40, "b": 30}, height=300, uirevision=view,
    )  # fmt: skip
    return figure


def views_live_figure(
    unit: np.ndarray,
    cursor,
    per_voxel: np.ndarray | None,
    value_range,
    title: str,
    importance: bool = False,
) -> go.Figure:
    """The three views side by side through ``cursor`` with the picture so far (the live
    picture of a running volume run), or with one Compare map (``importance``)."""
    figure = make_subplots(rows=1, cols=3, subplot_titles=list(VIEWS), horizontal_spacing=0.04)
    for col, view in enumerate(VIEWS, start=1):
        for trace in _traces(unit, view, cursor, per_voxel, value_range, col == 3, importance):
            figure.add_trace(trace, row=1, col=col)
        _decorations(figure, view, cursor, None, unit.shape, row=1, col=col)
    figure.update_yaxes(autorange="reversed", row=1, col=1)
    figure.update_layout(
        title={"text": plotly_text(title), "font": {"size": 12}}, height=300,
        margin={"l": 10, "r": 10, "t": 50, "b": 10},
    )  # fmt: skip
    return figure


def region_from_view(view: str, selected: dict | None, shape, region=None):
    """A box dragged on ``view`` sets the region on the two axes the view shows (the
    third keeps ``region``'s range, else the whole block): (z0, y0, x0, z1, y1, x1), or
    None when the selection is not a box."""
    if not selected or "range" not in selected:
        return None
    ranges = selected["range"]
    if "x" not in ranges or "y" not in ranges:
        return None
    low = list(region[:3]) if region else [0, 0, 0]
    high = list(region[3:]) if region else list(shape)
    _, horizontal, vertical = VIEW_AXES[view]
    for axis, picked in ((horizontal, ranges["x"]), (vertical, ranges["y"])):
        a, b = sorted(float(v) for v in picked)
        low[axis] = int(np.clip(np.floor(a + 0.5), 0, shape[axis]))
        high[axis] = int(np.clip(np.ceil(b + 0.5), 0, shape[axis]))
        if high[axis] <= low[axis]:
            return None
    return [*low, *high]


def clicked_voxel(view: str, clicked: dict | None, cursor):
    """The cursor (z, y, x) after a click on ``view``: the two axes it shows move to the
    clicked voxel, the third stays; None without a click point."""
    points = (clicked or {}).get("points") or []
    if not points or "x" not in points[0] or "y" not in points[0]:
        return None
    moved = [int(c) for c in cursor]
    _, horizontal, vertical = VIEW_AXES[view]
    moved[horizontal] = int(round(float(points[0]["x"])))
    moved[vertical] = int(round(float(points[0]["y"])))
    return moved
