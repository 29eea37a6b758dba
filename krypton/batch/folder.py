"""Heatmaps for a whole dataset: ``krypton batch INPUT --model NAME --out DIR``.

INPUT is a folder (its image files, sorted), a glob pattern, or a CSV file with a
``path`` column (relative to the CSV's folder) and an optional ``label`` column (class
index or name: the class to explain). For every image the run writes into DIR:

* ``<name>.png`` — the overlay with colour bar, as ``krypton explain`` writes it;
* ``<name>.npy`` — the explained class's heatmap, and ``<name>.npz`` every class's
  (exact and naive modes);
* ``<name>.json`` — its summary row and the settings used, written last: an image with
  one is done, and a run that is interrupted and started again with the same settings
  skips it (other settings explain it again).

At the end ``summary.csv`` (one row per image, files that failed included with their
error) and ``index.html`` (a contact sheet) are written from all the rows. Browser-free:
the CLI calls :func:`run_batch`.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import html
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ..explainer import explain
from ..host import describe_share
from ..io.images import ImageLoadError, load_image
from ..registry.models import LoadedModel
from ..registry.ood import caveat
from ..render.exports import WARNING_SUFFIX, all_classes_npz, heatmap_title, values_npy
from ..render.overlay import heatmap_picture

__all__ = [
    "BatchItem",
    "BatchRow",
    "batch_settings",
    "collect_inputs",
    "done_row",
    "explain_item",
    "heatmap_files",
    "run_batch",
    "store_outputs",
    "write_contact_sheet",
    "write_summary",
    "SUMMARY_FIELDS",
]

SUMMARY_FIELDS = (
    "image",
    "given_label",
    "predicted_class",
    "predicted_probability",
    "explained_class",
    "explained_probability",
    "lowest_probability",
    "lowest_at_x",
    "lowest_at_y",
    "lowest_at_z",
    "mode",
    "plan",
    "seconds",
    "ood_score",
    "outputs",
    "error",
    "gradcam_seconds",
    "gradcam_spearman",
    "ig_seconds",
    "ig_spearman",
)


@dataclass(frozen=True)
class BatchItem:
    """One input image: where it is, the name of its outputs, its label if given."""

    path: Path
    name: str  # output stem, unique within the run
    label: str | None = None


@dataclass
class BatchRow:
    """One image's line of summary.csv."""

    image: str
    given_label: str = ""
    predicted_class: str = ""
    predicted_probability: float | str = ""
    explained_class: str = ""
    explained_probability: float | str = ""
    lowest_probability: float | str = ""
    lowest_at_x: int | str = ""
    lowest_at_y: int | str = ""
    lowest_at_z: int | str = ""  # volumes only
    mode: str = ""
    plan: str = ""
    threads: str = ""  # the run's torch threads, who chose them, its schedules
    seconds: float | str = ""
    ood_score: float | str = ""  # models with an out-of-distribution reference only
    ood_flagged: bool | str = ""  # score above the model's threshold: not meaningful
    outputs: str = ""
    error: str = ""
    # --methods: each gradient method's seconds and its rank correlation with occlusion
    gradcam_seconds: float | str = ""
    gradcam_spearman: float | str = ""
    ig_seconds: float | str = ""
    ig_spearman: float | str = ""
    extra: dict = field(default_factory=dict, repr=False)


def batch_row(fields: dict) -> BatchRow:
    """A row sent as a dict (by a worker, which may run another version): the fields this
    version knows; a column it does not know is left out rather than failing the image."""
    known = {f.name for f in dataclasses.fields(BatchRow)}
    return BatchRow(**{name: value for name, value in fields.items() if name in known})


def _output_name(relative: str) -> str:
    """A file-name-safe stem from an input's relative path ('a/b c.png' -> 'a__b_c')."""
    if relative.lower().endswith(".nii.gz"):
        relative = relative[: -len(".gz")]
    stem = os.path.splitext(relative)[0].replace(os.sep, "__").replace("/", "__")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "image"


def _unique(items: list[tuple[Path, str, str | None]]) -> list[BatchItem]:
    taken: set[str] = set()
    result = []
    for path, relative, label in items:
        name = _output_name(relative)
        candidate, number = name, 2
        while candidate.lower() in taken:
            candidate, number = f"{name}-{number}", number + 1
        taken.add(candidate.lower())
        result.append(BatchItem(path, candidate, label))
    return result


VOLUME_FILES = (".nii", ".nii.gz", ".zip", ".dcm")


def collect_inputs(source: str, volumes: bool = False) -> list[BatchItem]:
    """The images of a folder, a glob pattern or a CSV list (see the module docstring).
    With ``volumes`` (a volume model), a folder's inputs are its subfolders (each a DICOM
    series) and its NIfTI, zip and multi-frame DICOM files."""
    path = Path(source)
    if path.is_dir() and volumes:
        entries = sorted(p for p in path.iterdir() if not p.name.startswith("."))
        found = [p for p in entries if p.is_dir() or p.name.lower().endswith(VOLUME_FILES)]
        return _unique([(p, p.name, None) for p in found])
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        # every extension Pillow reads, DICOM's, and files without one (they are tried)
        known = {suffix.lower() for suffix in Image.registered_extensions()} | {".dcm"}
        files = [p for p in files if p.suffix.lower() in known or not p.suffix]
        return _unique([(p, str(p.relative_to(path)), None) for p in files])
    if path.is_file() and path.suffix.lower() == ".csv":
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            if not reader.fieldnames or "path" not in reader.fieldnames:
                raise ValueError(f"{source}: a CSV list needs a 'path' column")
            rows = [
                (
                    (path.parent / row["path"]).resolve(),
                    row["path"],
                    (row.get("label") or "").strip() or None,
                )
                for row in reader
                if (row.get("path") or "").strip()
            ]
        return _unique(rows)
    if any(char in source for char in "*?["):
        matches = sorted(Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
        return _unique([(p, p.name if len(matches) == 1 else str(p), None) for p in matches])
    if path.is_file():
        return _unique([(path, path.name, None)])
    raise ValueError(f"{source}: no such folder, file, CSV list or matching glob pattern")


def _label_index(label: str | None, model: LoadedModel) -> int | None:
    if label is None:
        return None
    if label.lstrip("-").isdigit():
        index = int(label)
    elif label in model.classes:
        index = model.classes.index(label)
    else:
        raise ValueError(f"label {label!r} is neither a class index nor one of the model's classes")
    if not 0 <= index < len(model.classes):
        raise ValueError(
            f"label {index} is out of range: the model has {len(model.classes)} classes"
        )
    return index


def done_row(out_dir: Path, item: BatchItem, settings: str) -> BatchRow | None:
    """The row of an image a previous run finished with the same settings (its .json
    and outputs exist); other settings mean the image is explained again."""
    record = out_dir / f"{item.name}.json"
    if not record.exists():
        return None
    try:
        fields = json.loads(record.read_text())
        if fields.pop("settings", None) != settings:
            return None
        row = BatchRow(**fields)
    except (OSError, ValueError, TypeError):
        return None  # a half-written record: do the image again
    outputs = [out_dir / name for name in row.outputs.split(";") if name]
    return row if outputs and all(p.exists() for p in outputs) else None


def heatmap_files(picture, heatmap, model: LoadedModel) -> dict[str, bytes]:
    """One explanation's output files by suffix: the overlay PNG (colour bar, title), the
    explained class's values (.npy) and, where kept, every class's (.npz)."""
    random = " — RANDOM weights: this explains an untrained network" if model.random_weights else ""
    title = heatmap_title(
        model.name,
        model.class_name(heatmap.label),
        heatmap.prob,
        heatmap.mode,
        heatmap.patch,
        heatmap.stride,
        time.strftime("%Y-%m-%d %H:%M"),
        random,
    )
    files = {
        ".png": heatmap_picture(
            picture,
            heatmap.values,
            heatmap.xs,
            heatmap.ys,
            heatmap.patch,
            heatmap.prob,
            model.input_size,
            title,
            warning=caveat(heatmap.extra.get("ood")),
        )
    }
    files[".npy"] = values_npy(heatmap.values)
    warning = caveat(heatmap.extra.get("ood"))
    if heatmap.class_values is not None:
        files[".npz"] = all_classes_npz(
            heatmap.class_values,
            heatmap.xs,
            heatmap.ys,
            model.classes,
            heatmap.base_probs,
            warning,
        )
    if warning:  # the .npy holds one array: its warning goes beside it
        files[WARNING_SUFFIX] = f"{warning}\n".encode()
    return files


def explain_item(
    source: Path | bytes,
    label: str | None,
    model: LoadedModel,
    options: dict,
    window: str | tuple | None = None,
    frame: int | None = None,
    image: str = "",
) -> tuple[BatchRow, dict[str, bytes]]:
    """One image's summary row and output files (suffix -> bytes); a file that cannot be
    read or explained gives a row with its error and no files. The local loop and the
    Celery workers (krypton.batch.broker) both call this."""
    row = BatchRow(image=image or str(source), given_label=label or "")
    options, methods = _split_methods(options)
    if model.is_volume:
        return _explain_volume_item(source, label, model, options, row, methods)
    started = time.perf_counter()
    try:
        picture = load_image(source, window=window, frame=frame)
        tensor = model.preprocess(picture)
        heatmap = explain(model, tensor, label=_label_index(label, model), **options)
        files = heatmap_files(picture, heatmap, model)
        _fill_row(row, heatmap, model, started)
        if methods:
            size = tuple(model.input_size)[::-1]
            background = np.asarray(picture.convert("L").resize(size), np.float32)
            files.update(method_files(model, tensor, heatmap, options, methods, background, row))
    except ImageLoadError as exc:
        row.error = str(exc)
        return row, {}
    except (ValueError, TypeError, OSError) as exc:  # explain() refused, a bad label, ...
        row.error = f"{type(exc).__name__}: {exc}"
        return row, {}
    return row, files


GRADIENT_METHODS = {"gradcam": "gradcam", "integrated_gradients": "ig"}  # name: column


def _split_methods(options: dict) -> tuple[dict, dict]:
    """explain()'s options, and what :func:`method_files` needs: the gradient methods to
    set beside occlusion (``options["methods"]``: ``krypton batch --methods``) and
    Grad-CAM's layer (``options["gradcam_layer"]``: ``--layer``; None: the default rule)."""
    methods = tuple(m for m in options.get("methods") or () if m in GRADIENT_METHODS)
    kept = {k: v for k, v in options.items() if k not in ("methods", "gradcam_layer")}
    return kept, {"methods": methods, "layer": options.get("gradcam_layer")} if methods else {}


def method_files(model, tensor, heatmap, options: dict, methods: dict, background, row) -> dict:
    """Grad-CAM and/or Integrated Gradients on the occlusion heatmap's own cells
    (:mod:`krypton.methods`): STEM.methods.png side by side, STEM.methods.json with every
    map, agreement and deletion/insertion areas; each method's seconds and rank
    correlation with occlusion go into ``row``. ``methods``: :func:`_split_methods`'s."""
    from ..methods import agreement, compare, comparison_record, from_heatmap
    from ..render.methods import methods_picture

    occlusion = from_heatmap(heatmap)
    maps = {"occlusion": occlusion, **compare(
        model, tensor, patch=heatmap.patch, stride=heatmap.stride, label=heatmap.label,
        region=options.get("region"), fill=options.get("fill"), **methods,
    )}  # fmt: skip
    for method, column in GRADIENT_METHODS.items():
        if method in maps:
            setattr(row, f"{column}_seconds", round(maps[method].seconds, 3))
            rho = agreement(occlusion, maps[method])["spearman"]
            setattr(row, f"{column}_spearman", round(rho, 4))
    record = comparison_record(model, tensor, maps)
    return {
        ".methods.png": methods_picture(maps, background),
        ".methods.json": json.dumps(record, indent=1).encode(),
    }


def _fill_row(row: BatchRow, heatmap, model: LoadedModel, started: float) -> None:
    """A finished explanation's summary columns."""
    predicted = int(np.argmax(heatmap.base_probs))
    lowest = np.unravel_index(np.nanargmin(heatmap.values), heatmap.values.shape)
    row.predicted_class = model.class_name(predicted)
    row.predicted_probability = round(float(heatmap.base_probs[predicted]), 6)
    row.explained_class = model.class_name(heatmap.label)
    row.explained_probability = round(float(heatmap.prob), 6)
    row.lowest_probability = round(float(np.nanmin(heatmap.values)), 6)
    row.lowest_at_x, row.lowest_at_y = int(heatmap.xs[lowest[-1]]), int(heatmap.ys[lowest[-2]])
    if heatmap.is_volume:
        row.lowest_at_z = int(heatmap.zs[lowest[0]])
    row.mode = heatmap.mode
    row.plan = heatmap.extra.get("plan", "")
    row.threads = describe_share(heatmap.extra.get("host"))
    row.seconds = round(time.perf_counter() - started, 3)
    ood = heatmap.extra.get("ood")
    if ood is not None:
        row.ood_score, row.ood_flagged = round(float(ood["score"]), 4), bool(ood["flagged"])


def _explain_volume_item(
    source: Path | bytes,
    label: str | None,
    model: LoadedModel,
    options: dict,
    row: BatchRow,
    methods: tuple[str, ...] = (),
) -> tuple[BatchRow, dict[str, bytes]]:
    """:func:`explain_item` for a volume model: a DICOM series (folder or zip), a
    multi-frame DICOM or a NIfTI file; its files as ``krypton explain`` writes them
    (:func:`krypton.render.volumes.volume_files`)."""
    from ..render.volumes import volume_files

    started = time.perf_counter()
    if isinstance(source, (bytes, bytearray)):
        row.error = "a volume is read from its path (a series folder, zip, NIfTI or .dcm)"
        return row, {}
    try:
        prepared, _ = model.read_volume(source)
        tensor = prepared.tensor
        heatmap = explain(model, tensor, label=_label_index(label, model), **options)
        files = volume_files(heatmap, prepared, model, warning=caveat(heatmap.extra.get("ood")))
        _fill_row(row, heatmap, model, started)
        row.extra = {"heatmap": heatmap, "prepared": prepared}  # a PACS run sends them
        if methods:
            background = tensor[0].numpy()
            files.update(method_files(model, tensor, heatmap, options, methods, background, row))
    except ImageLoadError as exc:
        row.error = str(exc)
        return row, {}
    except (ValueError, TypeError, OSError) as exc:
        row.error = f"{type(exc).__name__}: {exc}"
        return row, {}
    return row, files


# submit(items) yields (item, row, files) as images finish, in any order (krypton.batch.broker)
Submit = Callable[[list[BatchItem]], Iterator[tuple[BatchItem, BatchRow, dict[str, bytes]]]]


def store_outputs(
    out_dir: Path, item: BatchItem, row: BatchRow, files: dict, settings: str
) -> None:
    """Write an image's files, then its .json record (the image is done only then)."""
    if row.error:
        return
    written = []
    for suffix, data in files.items():
        path = out_dir / f"{item.name}{suffix}"
        path.write_bytes(data)
        written.append(path.name)
    row.outputs = ";".join(written)
    record = asdict(row)
    record.pop("extra")
    record["settings"] = settings
    temporary = out_dir / f".{item.name}.json.tmp"
    temporary.write_text(json.dumps(record))
    temporary.replace(out_dir / f"{item.name}.json")


def batch_settings(model: LoadedModel, options: dict, window=None, frame=None) -> str:
    """The settings a finished image's record carries: a later run with the same ones
    skips it (:func:`done_row`)."""
    return json.dumps(
        {"model": model.name, "window": window, "frame": frame, **options},
        sort_keys=True,
        default=str,
    )


def run_batch(
    items: Iterable[BatchItem],
    model: LoadedModel,
    out_dir: Path,
    options: dict,
    progress: Callable[[int, int, str], None] | None = None,
    window: str | tuple | None = None,
    frame: int | None = None,
    submit: Submit | None = None,
) -> list[BatchRow]:
    """Explain every item, skipping those a previous run finished; return every row.

    ``options``: explain() keyword arguments (patch, stride, mode, fill, ...).
    ``window``/``frame`` apply to DICOM inputs (:func:`krypton.io.images.load_image`).
    ``submit`` sends the images elsewhere (Celery workers) instead of explaining them in
    this process; the outputs are the same. A file that cannot be read or explained gets
    a row with its error, and the run goes on.
    """
    items = list(items)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = batch_settings(model, options, window, frame)
    rows: dict[str, BatchRow] = {}
    todo = []
    for item in items:
        done = done_row(out_dir, item, settings)
        if done is not None:
            rows[item.name] = done
        else:
            todo.append(item)
    if submit is None:

        def local(todo_items):
            for item in todo_items:
                if progress is not None:
                    progress(len(rows), len(items), item.path.name)
                yield (item, *explain_item(item.path, item.label, model, options, window, frame))

        outcomes = local(todo)
    else:
        outcomes = submit(todo)
    for item, row, files in outcomes:
        store_outputs(out_dir, item, row, files, settings)
        rows[item.name] = row
        if submit is not None and progress is not None:
            progress(len(rows), len(items), item.path.name)
    if progress is not None:
        progress(len(items), len(items), "")
    ordered = [rows[item.name] for item in items]
    write_summary(out_dir, ordered)
    write_contact_sheet(out_dir, ordered, model)
    return ordered


def write_summary(out_dir: Path, rows: list[BatchRow]) -> Path:
    """summary.csv: one row per image, errors included."""
    path = out_dir / "summary.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(SUMMARY_FIELDS)
        for row in rows:
            writer.writerow([getattr(row, name) for name in SUMMARY_FIELDS])
    return path


def write_contact_sheet(out_dir: Path, rows: list[BatchRow], model: LoadedModel) -> Path:
    """index.html: every overlay with its caption, and the files that failed."""
    cells, failures = [], []
    for row in rows:
        name = html.escape(Path(row.image).name)
        if row.error:
            failures.append(f"<li><b>{name}</b>: {html.escape(row.error)}</li>")
            continue
        pictures = [p for p in row.outputs.split(";") if p.endswith(".png")]
        picture = next((p for p in pictures if p.endswith(".axial.png")), pictures[0])
        at = f"{row.lowest_at_x}, {row.lowest_at_y}" + (
            f", {row.lowest_at_z}" if row.lowest_at_z != "" else ""
        )
        caption = (
            f"{name}<br>{html.escape(row.predicted_class)} {float(row.predicted_probability):.3f}"
            f" · explained {html.escape(row.explained_class)}<br>lowest "
            f"{float(row.lowest_probability):.3f} at ({at})"
        )
        if row.ood_flagged is True or row.ood_flagged == "True":
            caption += (
                "<br><b>not like the model's training images: prediction and heatmap are "
                "not meaningful</b>"
            )
        cells.append(
            f'<figure><a href="{html.escape(picture)}"><img src="{html.escape(picture)}" '
            f'alt="{name}"></a><figcaption>{caption}</figcaption></figure>'
        )
    failed = (
        f"<h2>Not explained ({len(failures)})</h2><ul>{''.join(failures)}</ul>" if failures else ""
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Krypton batch: {html.escape(model.name)}</title>
<style>body{{font-family:sans-serif;margin:1em}} figure{{display:inline-block;width:280px;
margin:.5em;vertical-align:top}} img{{width:100%}} figcaption{{font-size:.8em}}</style></head>
<body><h1>Occlusion heatmaps: {html.escape(model.name)}</h1>
<p>{len(cells)} explained, {len(failures)} not; see summary.csv.</p>
{"".join(cells)}{failed}</body></html>
"""
    path = out_dir / "index.html"
    path.write_text(page)
    return path
