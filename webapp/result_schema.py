"""The result record's one schema, an image's and a volume's alike: what a kept run holds
on the server (:func:`webapp.runs.records.result_record` makes it from the library's
:class:`krypton.Heatmap`; :func:`webapp.runs.records.result_heatmap` reads it back).
Type-checked in ``make lint``: a field read under a name no run writes is an error, so
the two panels cannot drift apart on a name again. The record stays a plain mapping of
JSON-able values and arrays: team mode keeps it in Redis, the JSON export writes it."""

# No postponed annotations here: Python 3.11's TypedDict reads NotRequired only from
# evaluated ones (ResultRecord.__required_keys__ is the schema's test).
from typing import Any, NotRequired, TypedDict

import numpy as np

__all__ = ["ImageFields", "VolumeFields", "ResultRecord"]


class ImageFields(TypedDict, total=False):
    """What only an image's record holds (a volume's has none of it)."""

    fill_rgb: list[float]  # the occluder's colour in [0, 1]


class VolumeFields(TypedDict, total=False):
    """What only a volume's record holds (an image's has none of it)."""

    kind: str  # "volume"
    affine: list | None  # voxel to world, where the file had one


class ResultRecord(ImageFields, VolumeFields):
    """One run's result, with its subject's own fields. The grid is ``ys``/``xs`` (and
    ``zs`` for a volume) in tensor order; ``values`` the class's probability per cell
    (NaN where none was computed)."""

    id: str  # changes when the class shown changes (the page's handle follows it)
    # the stored input, an image's picture or a volume's file or series (never leaves
    # the server): the key the panel's store holds for what it shows
    source_key: str
    provenance: dict | None  # what it explains (webapp.runs.provenance.Provenance.as_dict)
    mode: str
    model: str
    weights_checksum: str
    image: str  # the input's file name, as the user gave it
    label: int
    label_name: str
    classes: list[str]
    prob: float  # the class's probability on the unoccluded input
    base_probs: list[float]  # every class's
    patch: int
    stride: int
    input_size: list[int]
    region: list[int] | None  # the panel's flat form; None: the whole input
    # the DICOM source, for either kind (None: the input was not DICOM): "source", the
    # stored file's key (it never leaves the server); an image's also the window and
    # frame it was read in, its headers; a volume's its series' UID
    dicom: dict | None
    date: str
    zs: NotRequired[list[int]]
    ys: list[int]
    xs: list[int]
    values: np.ndarray
    class_values: np.ndarray | None  # every class's values (exact and naive runs)
    seconds: float  # the whole run, as the user waited
    evaluated: int  # positions computed by this run
    approximate: dict  # approximate mode's heatmap.extra (empty otherwise)
    plan: str | None  # the plan line: strategy and why
    host: NotRequired[dict | None]  # the run's threads, who chose them, its schedules
    reused: NotRequired[int]  # cells known from earlier runs
    reuse_note: NotRequired[str]
    estimate: NotRequired[dict | None]  # what the page estimated (krypton.estimator.Estimate)
    speed: NotRequired[dict | None]  # what the run timed side by side, or None
    ood: NotRequired[dict | None]  # the out-of-distribution report
    methods: NotRequired[dict[str, Any] | None]  # Compare's maps (webapp.comparison)
    methods_pending: NotRequired[dict[str, Any] | None]  # the maps still to come
    classes_dropped: NotRequired[str]  # why class_values were let go (the store's budget)
    # a cancelled run's cells so far (webapp.runs.records.partial_fields): NaN elsewhere
    partial: NotRequired[dict[str, Any] | None]
