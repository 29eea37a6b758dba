"""A study batch over a PACS: each image series of a study explained with a volume model
(the files ``krypton batch`` writes per volume) and its result sent back into the study,
skipping series whose result the study holds already (:func:`run_study_batch`). Here or
on the team's workers (:mod:`krypton.batch.broker`), one series is :func:`explain_series`."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..pacs.dicomweb import (
    Pacs,
    PacsError,
    SeriesRow,
    content_labels,
    fetch_series,
    fetched_headers,
)
from ..pacs.results import (
    ALREADY_THERE,
    PARAMETRIC_MAP_STORAGE,
    SentResult,
    VolumeSource,
    explainable_series,
    in_study,
    result_key,
    send_result,
)
from .folder import (
    BatchItem,
    BatchRow,
    batch_settings,
    done_row,
    explain_item,
    store_outputs,
    write_contact_sheet,
    write_summary,
)

__all__ = ["StudyBatch", "explain_series", "local_series", "run_study_batch"]


@dataclass
class StudyBatch:
    """A study batch's outcome: every series' row, what was sent and what was there."""

    rows: list = field(default_factory=list)
    explained: int = 0  # by this run (rows also holds earlier runs' for series skipped)
    sent: list[SentResult] = field(default_factory=list)
    already_sent: list[str] = field(default_factory=list)  # series whose result was there


# submit(todo): for each (series row, result key) to explain, in any order, the series
# row, its summary row (krypton.batch.folder.BatchRow), output files and what was sent
SeriesOutcome = tuple[SeriesRow, object, dict, SentResult | None]
SeriesSubmit = Callable[[list[tuple[SeriesRow, str]]], Iterator[SeriesOutcome]]


def explain_series(
    pacs: Pacs, study_uid: str, series_uid: str, model, options: dict, label: str | None,
    key: str | None, send: bool,
) -> tuple[object, dict[str, bytes], SentResult | None]:  # fmt: skip
    """Fetch one series, explain it with the volume ``model`` (the row and files
    ``krypton batch`` writes for a volume) and, with ``send``, store the result in the
    study labelled ``key`` unless the study holds it already (:data:`ALREADY_THERE`).
    ``key`` None: the run's own (:func:`result_key` with the class it explained, for a
    batch whose class is the predicted one). A series that cannot be fetched or
    explained gives a row with its error; a refused send raises PacsError. The local
    study batch and the Celery workers (:mod:`krypton.batch.broker`) both call this."""
    with tempfile.TemporaryDirectory(prefix="krypton-pacs-") as folder:
        try:
            files = fetch_series(pacs, study_uid, series_uid, Path(folder))
        except PacsError as exc:
            return BatchRow(image=series_uid, given_label=label or "", error=str(exc)), {}, None
        row, outputs = explain_item(Path(folder), label, model, options, image=series_uid)
        sending = send and not row.error
        sources = fetched_headers(files) if sending else []  # what a stored map references
    sent = None
    if sending:
        extra = row.extra
        heatmap = extra["heatmap"]
        settings = {**options, "label": heatmap.label}
        key = key or result_key(series_uid, model, settings)
        if in_study(pacs, study_uid, key):
            return row, outputs, ALREADY_THERE
        source = VolumeSource(extra["prepared"], sources)
        sent = send_result(pacs, study_uid, model, heatmap, source, key, settings)
    return row, outputs, sent


def local_series(
    pacs: Pacs, study_uid: str, model, options: dict, label: str | None, send: bool
) -> SeriesSubmit:
    """A ``submit`` for :func:`run_study_batch` that explains each series here, one
    after another (:func:`explain_series`)."""

    def submit(todo):
        for found, key in todo:
            row, outputs, sent = explain_series(
                pacs, study_uid, found.series_uid, model, options, label, key, send
            )
            yield found, row, outputs, sent

    return submit


def run_study_batch(
    pacs: Pacs,
    study_uid: str,
    model,
    out_dir: Path,
    options: dict,
    *,
    label: str | None = None,
    modality: str | None = None,
    send: bool = True,
    progress: Callable[[int, int, str], None] | None = None,
    submit: Callable[..., SeriesSubmit] | None = None,
) -> StudyBatch:
    """Explain each series of the study (:func:`explainable_series`) with the volume
    ``model`` into ``out_dir`` (the files ``krypton batch`` writes per volume, then
    summary.csv and index.html) and, with ``send``, store each result in the study.

    With ``send``, a series whose result (:func:`result_key`) the study already holds is
    neither fetched nor explained again where ``label`` names the class; for the
    predicted class the key is known after the run, so the series is explained and
    nothing is sent (counted as already there). A series that cannot be fetched or explained
    gets a row with its error and the run goes on; a refused send ends the run (the
    PACS's message is the error), results sent before it stay. ``submit(pacs,
    study_uid, model, options, label, send)`` makes what explains the series: here by
    default (:func:`local_series`), or on the team's workers
    (:func:`krypton.batch.broker.broker_series`)."""
    if not model.is_volume:
        raise ValueError(f"{model.name} is a 2-D model; a study batch explains series as volumes")
    series = explainable_series(pacs, study_uid, modality)
    there = content_labels(pacs, study_uid, PARAMETRIC_MAP_STORAGE) if send else set()
    settings = batch_settings(model, options)
    outcome = StudyBatch()
    out_dir.mkdir(parents=True, exist_ok=True)

    def item_of(found: SeriesRow) -> BatchItem:
        return BatchItem(Path(found.series_uid), f"series-{found.series_uid}", label)

    todo = []
    for found in series:
        # a class named ahead gives the key ahead; the predicted class's key is the run's
        key = (
            None
            if label is None
            else result_key(found.series_uid, model, {**options, "label": label})
        )
        if send and key in there:
            outcome.already_sent.append(found.series_uid)
            kept = done_row(out_dir, item_of(found), settings)
            if kept is not None:
                outcome.rows.append(kept)
        else:
            todo.append((found, key))
    if progress is not None:
        first = todo[0][0] if todo else None
        progress(0, len(todo), (first.description or first.series_uid) if first else "")
    explained = (submit or local_series)(pacs, study_uid, model, options, label, send)
    for number, (found, row, outputs, sent) in enumerate(explained(todo), start=1):
        store_outputs(out_dir, item_of(found), row, outputs, settings)
        outcome.rows.append(row)
        outcome.explained += not row.error
        if sent is not None and sent.already:
            outcome.already_sent.append(found.series_uid)
        elif sent is not None:
            outcome.sent.append(sent)
        if progress is not None:
            progress(number, len(todo), found.description or found.series_uid)
    if outcome.rows:
        write_summary(out_dir, outcome.rows)
        write_contact_sheet(out_dir, outcome.rows, model)
    return outcome
