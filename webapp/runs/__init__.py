"""One heatmap run of the app, for an image or a volume, orchestrated without a browser.

Both panels' Run callbacks call :func:`execute` with a :class:`RunRequest`; everything a
run decides happens here and is tested without Chromium:

- ``request``: what the user asked for (rank 2: an image, 3: a volume) and the picture
  so far;
- ``subjects``: the only things an image and a volume do differently (their model,
  tensor, fill, region form and words, cell key, own result fields);
- ``execute``: the one body — region snapped onto the last grid, known cells reused,
  coarse-to-fine chunks, the live picture, the runtime log, the result kept;
- ``cells``: the cell cache and the one reuse loop over a grid of any rank;
- ``timing``: estimates, the speed line, the runtime log;
- ``provenance``: what a run explains, and whether a kept result may be shown beside
  what the page shows now;
- ``records``: the result record (its schema: webapp.result_schema), its summary,
  another class, the JSON export;
- ``volumes``: reading a volume upload and what only the volume panel shows;
- ``pacs_send``: one Send to the PACS for both subjects.

Tensor algebra stays in the engine (krypton); the page stays in webapp/panels/.
"""

from ..result_schema import ResultRecord
from .cells import CellCache, KnownCells, count_known, grid_cells, run_cells
from .execute import PlannedRun, compare_left, execute, is_light, plan_run, shown_estimate
from .pacs_send import ALREADY_SENT, send_result
from .provenance import Provenance, ResultView, result_view
from .records import (
    DROPPED_RESULT,
    NOT_KEPT,
    ResultUnavailable,
    export_json,
    grid_heatmap,
    kept_result,
    partial_text,
    picture_title,
    provenance,
    refuse_partial,
    relabel,
    result_heatmap,
    shown_view,
    summary_lines,
    switch_class,
)
from .regions import check_grid, grid_count
from .request import FIRST_CHUNK, LARGEST_CHUNK, Partial, Reporter, RunRequest
from .subjects import Services, cell_key, results_key, subject_for
from .timing import (
    CACHED_MODE,
    cached_estimate,
    counts_estimate,
    estimate_text,
    find_estimate,
    finished_run,
    format_seconds,
    host_load,
    measured_speed,
    plan_text,
    share_host,
    speed_text,
)

__all__ = [
    "ALREADY_SENT",
    "send_result",
    "RunRequest",
    "Partial",
    "Reporter",
    "FIRST_CHUNK",
    "LARGEST_CHUNK",
    "Services",
    "execute",
    "compare_left",
    "plan_run",
    "is_light",
    "PlannedRun",
    "shown_estimate",
    "CellCache",
    "KnownCells",
    "cell_key",
    "count_known",
    "grid_cells",
    "run_cells",
    "results_key",
    "subject_for",
    "provenance",
    "Provenance",
    "ResultView",
    "result_view",
    "ResultRecord",
    "DROPPED_RESULT",
    "NOT_KEPT",
    "kept_result",
    "switch_class",
    "ResultUnavailable",
    "result_heatmap",
    "shown_view",
    "grid_heatmap",
    "summary_lines",
    "relabel",
    "export_json",
    "partial_text",
    "picture_title",
    "refuse_partial",
    "check_grid",
    "grid_count",
    "CACHED_MODE",
    "cached_estimate",
    "counts_estimate",
    "estimate_text",
    "find_estimate",
    "finished_run",
    "format_seconds",
    "host_load",
    "measured_speed",
    "plan_text",
    "share_host",
    "speed_text",
]
