"""The volume kind's views: three linked views of a CT or MR volume through one crosshair,
the region boxed on them, the crosshair moved to a result's strongest cell, and the live
picture of a run (the image kind has one picture: webapp.panels.image.intake draws it).
The figures are webapp.volume_views'."""

from __future__ import annotations

import numpy as np
from dash import ALL, Input, Output, State, ctx, no_update
from dash.exceptions import PreventUpdate

from krypton.render.volumes import VIEWS, voxel_values

from ... import ids, runs, volume_views
from ...figures import placeholder_figure
from ...helpers import InputError
from ...panel_scope import VOLUME_PANEL
from ...runs import volumes
from ...services import Services

__all__ = ["VolumeViews", "live_views", "GRAPHS", "SLIDERS", "VOLUME_SETTINGS"]

GRAPHS = [graph for _, graph, _ in ids.VOLUME_GRAPHS]  # in VIEWS' order
SLIDERS = [slider for _, _, slider in ids.VOLUME_GRAPHS]

# The panel's run settings a shown result must match (with the volume, model and region).
VOLUME_SETTINGS = [
    Input(VOLUME_PANEL.patch, "value"),
    Input(VOLUME_PANEL.stride, "value"),
    Input(VOLUME_PANEL.mode, "value"),
    Input(VOLUME_PANEL.label, "value"),
]


class VolumeViews:
    """The volume panel's views (a part of :class:`webapp.panels.volume.VolumePanel`)."""

    services: Services

    def register_views_callbacks(self, app) -> None:
        """Attach the views' callbacks to ``app``."""
        app.callback(
            *[Output(s, "max") for s in SLIDERS],
            *[Output(s, "value", allow_duplicate=True) for s in SLIDERS],
            Output(ids.VOLUME_INFO, "children"),
            Output(VOLUME_PANEL.label, "options"),
            Output(VOLUME_PANEL.label, "placeholder"),
            Output(VOLUME_PANEL.patch, "value"),
            Output(VOLUME_PANEL.strip.message, "children", allow_duplicate=True),
            Input(VOLUME_PANEL.store, "data"),
            Input(VOLUME_PANEL.model, "value"),
            State(ids.SESSION, "data"),
            prevent_initial_call=True,
        )(self.show_volume)
        app.callback(  # after a run, the views go through its strongest cell
            *[Output(s, "value", allow_duplicate=True) for s in SLIDERS],
            Input(VOLUME_PANEL.result, "data"),
            State(VOLUME_PANEL.store, "data"),
            State(VOLUME_PANEL.model, "value"),
            State(ids.SESSION, "data"),
            prevent_initial_call=True,
        )(self.focus_strongest)
        app.callback(
            *[Output(s, "value", allow_duplicate=True) for s in SLIDERS],
            *[Input(g, "clickData") for g in GRAPHS],
            *[State(s, "value") for s in SLIDERS],
            prevent_initial_call=True,
        )(self.move_cursor)
        app.callback(
            Output(VOLUME_PANEL.region, "data", allow_duplicate=True),
            *[Input(g, "selectedData") for g in GRAPHS],
            Input(VOLUME_PANEL.reset_region, "n_clicks"),
            State(VOLUME_PANEL.region, "data"),
            State(VOLUME_PANEL.model, "value"),
            prevent_initial_call=True,
        )(self.select_region)
        app.callback(
            *[Output(g, "figure") for g in GRAPHS],
            Output(VOLUME_PANEL.region_text, "children"),
            Input(VOLUME_PANEL.store, "data"),
            Input(VOLUME_PANEL.model, "value"),
            *[Input(s, "value") for s in SLIDERS],
            Input(VOLUME_PANEL.region, "data"),
            Input(VOLUME_PANEL.result, "data"),
            Input(ids.VOLUME_WINDOW, "value"),
            *VOLUME_SETTINGS,
            State(ids.SESSION, "data"),
            prevent_initial_call=True,
        )(self.draw_views)
        # A new volume or model: the live picture of the run it stops goes at once, in the
        # browser, before any answer from the server (as the image panels' does).
        # The views, the summary and the downloads go at once too: until the server has
        # answered, the old volume, its heatmap and its result must not sit under the new
        # volume's name.
        app.clientside_callback(
            """function(volume, model) {
                const blank = {"data": [], "layout": {"height": 300,
                    "xaxis": {"visible": false}, "yaxis": {"visible": false},
                    "annotations": [{"text": "Loading…", "showarrow": false,
                                     "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}]}};
                const off = dash_clientside.callback_context.outputs_list[5].map(() => true);
                return [{"display": "none"}, blank, blank, blank, "", off, []];
            }""",
            Output(VOLUME_PANEL.strip.live_panel, "style", allow_duplicate=True),
            *[Output(g, "figure", allow_duplicate=True) for g in GRAPHS],
            Output(VOLUME_PANEL.summary, "children", allow_duplicate=True),
            Output(
                {"type": VOLUME_PANEL.strip.export, "format": ALL}, "disabled", allow_duplicate=True
            ),
            Output(VOLUME_PANEL.compare_panel, "children", allow_duplicate=True),
            Input(VOLUME_PANEL.store, "data"),
            Input(VOLUME_PANEL.model, "value"),
            prevent_initial_call=True,
        )

    def show_volume(self, record, model, session):
        """A new volume or model: the sliders' range and the crosshair at the centre, what
        was read and how it was prepared, the model's classes and cube."""
        if not record or not model:
            raise PreventUpdate
        unchanged = [no_update] * (2 * len(SLIDERS) + 4)
        try:
            loaded = self.services.model(model, rank=3)
            prepared = self._prepared(record, model, session)
        except InputError as exc:
            return (*unchanged, str(exc))
        size = loaded.input_size
        source = prepared.source
        info = (
            f"{record['name']}: {'x'.join(map(str, source.shape))} voxels at "
            f"{'x'.join(f'{s:g}' for s in source.spacing)} mm"
            f"{'' if not source.modality else f' ({source.modality})'}; resampled to "
            f"{'x'.join(f'{s:g}' for s in loaded.volume['spacing_mm'])} mm "
            f"({'x'.join(map(str, prepared.model_input.resampled_shape))}) and windowed "
            f"{loaded.volume['window_hu']}; axes {prepared.model_input.orientation}; "
            f"the views show the centred "
            f"{'x'.join(map(str, size))} block {model} sees (corner "
            f"{list(prepared.model_input.corner)})."
            + ("" if record.get("frame") else " The file gave no scanner frame: the NIfTI "
               "export is in model voxels.")
        )  # fmt: skip
        probs = volumes.volume_prediction(loaded, prepared)
        classes = [
            {"label": f"{i}: {n} ({p:.1%})", "value": i}
            for i, (n, p) in enumerate(zip(loaded.classes, probs))
        ]
        top = int(np.argmax(probs))
        predicted = f"{loaded.classes[top]} ({probs[top]:.1%}, the prediction)"
        return (
            *[s - 1 for s in size],
            *[s // 2 for s in size],
            info,
            classes,
            predicted,
            int(loaded.patch),
            "",
        )

    def focus_strongest(self, handle, record, model, session):
        """The crosshair at the centre of the kept result's strongest cell (its largest
        drop in probability), so the views show what mattered most, not the centre: once
        per run (a Compare run's later early handles, each map that joins, leave the
        crosshair where the user put it)."""
        if isinstance(handle, dict) and handle.get("maps_left") and not handle.get("first"):
            raise PreventUpdate
        if isinstance(handle, dict) and handle.get("refused") is not None:
            raise PreventUpdate  # another class was refused: the crosshair stays
        result = self._result_for(handle, record, model, session)
        if result is None:
            raise PreventUpdate
        cursor = volumes.strongest_voxel(result)
        if cursor is None:
            raise PreventUpdate
        return tuple(cursor[VIEWS[v]] for v in VIEWS)

    def move_cursor(self, *args):
        """A click on a view moves the crosshair (the other views' sliders) there."""
        clicks, cursor = args[: len(GRAPHS)], args[len(GRAPHS) :]
        view = _view_of(ctx.triggered_id)
        if view is None or None in cursor:
            raise PreventUpdate
        moved = volume_views.clicked_voxel(view, clicks[list(VIEWS).index(view)], cursor)
        if moved is None:
            raise PreventUpdate
        return tuple(moved[VIEWS[v]] for v in VIEWS)

    def select_region(self, *args):
        """A box on a view sets the region's two axes the view shows; Whole block clears."""
        selections, (_, region, model) = args[: len(GRAPHS)], args[len(GRAPHS) :]
        if ctx.triggered_id == VOLUME_PANEL.reset_region:
            return None
        view = _view_of(ctx.triggered_id)
        if view is None or not model:
            raise PreventUpdate
        try:
            size = self.services.model(model, rank=3).input_size
        except InputError:
            raise PreventUpdate from None
        picked = volume_views.region_from_view(
            view, selections[list(VIEWS).index(view)], size, region
        )
        if picked is None:
            raise PreventUpdate
        return picked

    def draw_views(
        self, record, model, z, y, x, region, handle, window, patch, stride, mode, label, session
    ):
        """The three views through the crosshair in the display ``window`` (a preset's
        name, or "model": what the model sees), with the heatmap over them only when the
        kept result explains this volume with this model."""
        if not record or not model or None in (z, y, x):
            raise PreventUpdate
        try:
            prepared = self._prepared(record, model, session)
        except InputError as exc:
            return (*[placeholder_figure(str(exc))] * len(GRAPHS), "")
        per_voxel, value_range, title = None, (0.0, 1.0), ""
        result = self._result_for(
            handle, record, model, session, (region, patch, stride, mode, label)
        )
        if result is not None:
            heatmap = runs.result_heatmap(result)
            per_voxel = voxel_values(heatmap, prepared.unit.shape)
            values = np.asarray(result["values"], np.float64)
            value_range = (float(np.nanmin(values)), float(np.nanmax(values)) + 1e-9)
            title = f" · {runs.picture_title(result)} ({result['mode']})"
        cursor = (int(z), int(y), int(x))
        shown = volume_views.displayed(prepared.unit, prepared.model_input.values, window)
        figures = [
            volume_views.view_figure(
                shown, view, cursor, per_voxel, value_range, region,
                f"{view} · {'zyx'[axis]} = {cursor[axis]}{title}",
            )
            for view, axis in VIEWS.items()
        ]  # fmt: skip
        text = (
            "Region: the whole block"
            if not region
            else f"Region z {region[0]}–{region[3]}, y {region[1]}–{region[4]}, "
            f"x {region[2]}–{region[5]}"
        )
        return (*figures, text)


def _view_of(trigger) -> str | None:
    for view, graph, _ in ids.VOLUME_GRAPHS:
        if trigger == graph:
            return view
    return None


def live_views(prepared, cursor):
    """How the volume panel draws the picture so far: the three views through the
    crosshair with each voxel's nearest computed cell (unknown cells take their nearest
    known one) on the grid the run computes; nothing until a cell is known."""
    size = prepared.unit.shape

    def draw(partial: runs.Partial):
        filled = partial.filled
        if np.isnan(filled).all():
            return None
        heatmap = runs.grid_heatmap(filled, partial.axes, partial.patch)
        low, high = float(np.nanmin(filled)), float(np.nanmax(filled)) + 1e-9
        return volume_views.views_live_figure(
            prepared.unit, cursor, voxel_values(heatmap, size), (low, high), "computing…"
        )

    return draw
