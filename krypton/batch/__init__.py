"""Many images at once: folder and CSV runs that resume (:mod:`.folder`); the same runs
through Celery workers are :mod:`krypton.batch.broker` (needs the ``team`` extra)."""

from .folder import (
    SUMMARY_FIELDS,
    BatchItem,
    BatchRow,
    collect_inputs,
    explain_item,
    heatmap_files,
    run_batch,
)

__all__ = [
    "BatchItem",
    "BatchRow",
    "collect_inputs",
    "explain_item",
    "heatmap_files",
    "run_batch",
    "SUMMARY_FIELDS",
]
