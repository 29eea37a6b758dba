"""Explanations of PACS series, sent back to their studies by one sender,
:func:`send_result`, placed on their source.

A volume's result (a :class:`VolumeSource`) goes into the source study as new series: a
DICOM Parametric Map of the drop in the class's probability on the source's frame of
reference, and a Secondary Capture per axial slice of the explained block, each naming
the source slice nearest it, for viewers without Parametric Maps. An image's result (an
:class:`ImageSource`) is a Parametric Map at the source image's pixels where the source
can place one, and the heatmap over the frame as a Secondary Capture. Either kind's
finding comes with it as a Structured Report (:mod:`krypton.render.structured_report`).
All carry the study's patient modules, as DICOM requires.

Every map Krypton stores carries a result key as its Content Label: a digest of the
source series, the model (name and weights) and the run's settings
(:func:`result_key`). A study batch (:func:`krypton.batch.study.run_study_batch`) asks
the PACS which keys its study holds and explains only the series whose result is not
there, so a run repeated with the same model and settings sends nothing new.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..io.volumes import ModelVolume
from .dicomweb import (
    Pacs,
    SeriesRow,
    content_labels,
    find_series,
)

__all__ = [
    "PARAMETRIC_MAP_STORAGE",
    "NOT_IMAGES",
    "explainable_series",
    "in_study",
    "source_instance",
    "value_settings",
    "is_explainable",
    "result_key",
    "ImageSource",
    "SentResult",
    "VolumeSource",
    "send_result",
]

PARAMETRIC_MAP_STORAGE = "1.2.840.10008.5.1.4.1.1.30"
KEY_PREFIX = "KRYPTON_"  # + 8 hex digits: 16 characters, DICOM's limit for a Content Label
# modalities of series without images to explain: reports, segmentations, states, ...
NOT_IMAGES = frozenset(
    {"SR", "SEG", "PR", "KO", "REG", "RTSTRUCT", "RTPLAN", "RTDOSE", "RWV", "DOC"}
)
MANUFACTURER = "Krypton"  # what Krypton's own results (maps, captures) name as their maker


# the settings that decide a result's values beside mode, patch, stride, class, region
# and fill: an approximate run's quality settings, the arithmetic's precision
_APPROXIMATE = ("tau", "target_ssim", "r_drill_down", "target_speedup", "s1", "refine_by")
_SOURCE = ("instance", "frame", "window")  # which image of a series, and how it was read


def value_settings(model, settings: Mapping) -> dict:
    """The settings that decide a result's values, in one form whoever ran it (the app,
    the CLI, batch, a worker): mode; patch and stride as one side per axis; the class as
    its index (a name or a number given as text is resolved; None is refused: the caller
    passes the class the run explained); the region as integers or None; the fill as
    "gray" where it is the model's gray; the precision where not fp32; an approximate
    run's settings that were set; and, for one image of a series, its instance, frame
    and window. Anything else (batch size, strategy, device) changes speed only."""
    rank = 3 if getattr(model, "is_volume", False) else 2
    mode = str(settings.get("mode") or "exact")
    decided: dict = {
        "mode": mode,
        "patch": _sides(settings.get("patch", model.patch), rank),
        "stride": _sides(settings.get("stride", model.default_stride), rank),
        "label": _class_index(model, settings.get("label")),
        "region": None if not settings.get("region") else [int(v) for v in settings["region"]],
        "fill": _fill(model, settings.get("fill")),
    }
    if settings.get("precision") not in (None, "fp32"):
        decided["precision"] = str(settings["precision"])
    if mode == "approximate":
        decided.update({k: settings[k] for k in _APPROXIMATE if settings.get(k) is not None})
    for name in _SOURCE:
        value = settings.get(name)
        if value not in (None, ""):
            decided[name] = [float(v) for v in value] if isinstance(value, (list, tuple)) else value
    return decided


def _sides(value, rank: int) -> list[int]:
    sides = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * rank
    return sides * rank if len(sides) == 1 else sides


def _class_index(model, label) -> int:
    if label is None or label == "":
        raise ValueError("a result key names the class the run explained, not None")
    if isinstance(label, str) and not label.strip().lstrip("-").isdigit():
        names = [name.lower() for name in model.classes]
        if label.strip().lower() not in names:
            raise ValueError(f"{model.name} has no class {label!r}")
        return names.index(label.strip().lower())
    return int(label)


def _fill(model, fill) -> object:
    if fill is None or fill == "gray":
        return "gray"
    values = [round(float(v), 6) for v in (fill if isinstance(fill, (list, tuple)) else [fill])]
    gray = [round(float(v), 6) for v in model.gray_fill()]
    return "gray" if values == gray or values == gray[:1] * len(values) else values


def result_key(series_uid: str, model, settings: Mapping) -> str:
    """The Content Label of ``model``'s result for the source series ``series_uid``: a
    digest of the series, the model's name and weights, and :func:`value_settings` of
    ``settings``. The same result from the app, the CLI, batch or a worker gets the same
    key; other weights or settings another."""
    from .._fingerprint import model_fingerprint

    weights = model_fingerprint(model.module)[1]
    described = json.dumps(
        {"series": series_uid, "model": model.name, "weights": weights,
         **value_settings(model, settings)},
        sort_keys=True,
        default=str,
    )  # fmt: skip
    return KEY_PREFIX + hashlib.sha256(described.encode()).hexdigest()[:8].upper()


def source_instance(source: Path | bytes) -> str:
    """The SOP Instance UID of a DICOM file (a path or its bytes): which image of a
    series an image's result explains, in its key."""
    import io

    import pydicom

    readable = io.BytesIO(source) if isinstance(source, bytes) else source
    return str(pydicom.dcmread(readable, stop_before_pixels=True).SOPInstanceUID)


def in_study(pacs: Pacs, study_uid: str, key: str) -> bool:
    """Whether the study holds the result ``key`` already: a Parametric Map labelled
    with it (what every entry point asks before it stores)."""
    return key in content_labels(pacs, study_uid, PARAMETRIC_MAP_STORAGE)


@dataclass(frozen=True)
class SentResult:
    """What one send stored: the map's series, the captures' series and the report's;
    ``already``: the study held the result, and nothing was stored."""

    map_series: str
    capture_series: str
    captures: int
    already: bool = False
    report_series: str = ""  # the finding's Structured Report (krypton.render.structured_report)

    def words(self, class_name: str | None = None) -> str:
        """What was stored, in one wording for the page and the CLI: "a Parametric Map
        of NODULE (series …), 48 Secondary Captures (series …) and a Structured Report
        of the finding (series …)"."""
        of = f" of {class_name}" if class_name else ""
        captures = (
            "a Secondary Capture" if self.captures == 1 else f"{self.captures} Secondary Captures"
        )
        placed = (
            f"a Parametric Map{of} (series {self.map_series}), "
            if self.map_series
            else "no Parametric Map (the image has no frame of reference to place one on), "
        )
        stored = f"{placed}{captures} (series {self.capture_series})"
        if not self.report_series:
            return stored
        return f"{stored} and a Structured Report of the finding (series {self.report_series})"


ALREADY_THERE = SentResult("", "", 0, already=True)


@dataclass(frozen=True)
class VolumeSource:
    """A volume's source as a Send places its result: ``prepared``, the model's view of
    the series (its affine from the model's voxels to the patient), and ``headers``, the
    series' DICOM headers. Its result is the Parametric Map on the series' frame of
    reference and a Secondary Capture per axial slice of the explained block."""

    prepared: ModelVolume
    headers: list

    def datasets(self, model, heatmap, key: str, settings: Mapping) -> tuple[list, SentResult]:
        """The DICOM objects of ``heatmap``'s result, labelled ``key``, made with
        ``settings`` (its :func:`value_settings`), and what they are."""
        import io

        import pydicom

        from ..registry.ood import caveat
        from ..render.dicom_series import capture_series, nearest_sources, slice_pictures
        from ..render.exports import dicom_comments
        from ..render.parametric_map import parametric_map, source_slices
        from ..render.structured_report import finding_report, volume_region

        class_name = model.class_name(heatmap.label)
        warning = caveat(heatmap.extra.get("ood"))
        affine = self.prepared.affine
        created = parametric_map(
            heatmap, tuple(model.input_size), affine, self.headers, model_name=model.name,
            class_name=class_name, content_label=key, comments=dicom_comments(warning),
        )  # fmt: skip
        pictures = slice_pictures(model.windowed(self.prepared), heatmap)
        captures = capture_series(
            self.headers[0], pictures, description=f"Krypton heatmap {class_name}",
            comments=dicom_comments(warning, f"{created.SeriesDescription}. Not a diagnosis: "
                                    "shows where occluding the volume changed the model's output."),
            include_identity=True,
            sources=nearest_sources(self.headers, affine, len(pictures)),
        )  # fmt: skip
        datasets = [pydicom.dcmread(io.BytesIO(data)) for data in captures]
        slices = source_slices(self.headers)
        region = None if slices is None else volume_region(heatmap, affine, slices)
        report = finding_report(
            heatmap, model, region, [*self.headers, created, *datasets], created,
            settings=value_settings(model, settings), warning=warning,
        )  # fmt: skip
        sent = SentResult(created.SeriesInstanceUID, datasets[0].SeriesInstanceUID, len(datasets),
                          report_series=report.SeriesInstanceUID)  # fmt: skip
        return [created, *datasets, report], sent


@dataclass(frozen=True)
class ImageSource:
    """An image's source as a Send places its result: the DICOM ``file`` (a path or its
    bytes) in the ``window`` and ``frame`` it was read. Its result is a Parametric Map at
    the file's pixels where it has a frame of reference to place one on (a CT or MR
    slice; not a photograph), and always the heatmap over the frame as a Secondary
    Capture."""

    file: Path | bytes
    window: object = None
    frame: int | None = None

    def datasets(self, model, heatmap, key: str, settings: Mapping) -> tuple[list, SentResult]:
        """The DICOM objects of ``heatmap``'s result, labelled ``key``, made with
        ``settings`` (its :func:`value_settings`), and what they are (``map_series``
        empty where no map could be placed)."""
        import io

        import pydicom

        from ..registry.ood import caveat
        from ..render.dicom_capture import heatmap_capture
        from ..render.exports import dicom_comments
        from ..render.parametric_map import image_parametric_map
        from ..render.structured_report import finding_report, image_region

        class_name = model.class_name(heatmap.label)
        warning = caveat(heatmap.extra.get("ood"))
        readable = io.BytesIO(self.file) if isinstance(self.file, bytes) else self.file
        header = pydicom.dcmread(readable, stop_before_pixels=True)
        datasets = []
        try:
            datasets.append(image_parametric_map(
                heatmap, tuple(model.input_size), header, model_name=model.name,
                class_name=class_name, content_label=key, comments=dicom_comments(warning),
            ))  # fmt: skip
        except ValueError:
            pass  # no frame of reference or several frames: the capture alone
        capture = heatmap_capture(
            self.file, values=heatmap.values, xs=heatmap.xs, ys=heatmap.ys,
            patch=heatmap.patch, stride=heatmap.stride, prob=heatmap.prob,
            input_size=model.input_size, label_name=class_name, mode=heatmap.mode,
            model_name=model.name, window=self.window, frame=self.frame,
            include_identity=True, warning=warning,
        )  # fmt: skip
        datasets.append(pydicom.dcmread(io.BytesIO(capture)))
        placed = datasets[0] if len(datasets) == 2 else None
        report = finding_report(
            heatmap, model, image_region(heatmap, model.input_size, header),
            [header, *datasets], placed, settings=value_settings(model, settings),
            warning=warning,
        )  # fmt: skip
        sent = SentResult("" if placed is None else placed.SeriesInstanceUID,
                          datasets[-1].SeriesInstanceUID, 1,
                          report_series=report.SeriesInstanceUID)  # fmt: skip
        return [*datasets, report], sent


def send_result(
    pacs: Pacs,
    study_uid: str,
    model,
    heatmap,
    source: ImageSource | VolumeSource,
    key: str,
    settings: Mapping,
) -> SentResult:
    """Store ``heatmap``'s result, labelled ``key`` (:func:`result_key` of ``settings``,
    the run's), in the study ``study_uid``, placed on its ``source`` (an
    :class:`ImageSource` or a :class:`VolumeSource`: the source says what the result
    is), with the finding's Structured Report, in one STOW-RS request (the PACS takes
    all or says which it refused). The one sender of the app's Send, the CLI's
    ``--send``, study batches and the workers."""
    from .dicomweb import store

    datasets, sent = source.datasets(model, heatmap, key, settings)
    store(pacs, datasets, study_uid)
    return sent


def explainable_series(pacs: Pacs, study_uid: str, modality: str | None = None) -> list[SeriesRow]:
    """The study's image series (:func:`is_explainable`): ``modality``'s where given, else
    every one."""
    found = [row for row in find_series(pacs, study_uid) if is_explainable(row)]
    if modality:
        return [row for row in found if row.modality.upper() == modality.upper()]
    return found


def is_explainable(row: SeriesRow) -> bool:
    """A series of images that is not one of Krypton's own results."""
    return row.modality.upper() not in NOT_IMAGES and row.manufacturer != MANUFACTURER
