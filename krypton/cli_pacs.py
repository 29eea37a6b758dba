"""The PACS from the command line (:mod:`krypton.io.dicomweb`; the PACS is the one
``KRYPTON_DICOMWEB_URL`` configures):

    krypton pacs studies [--patient-id ID] [--patient-name NAME] [--dates FROM-TO] ...
    krypton pacs series STUDY_UID
    krypton explain dicomweb:STUDY_UID/SERIES_UID --model chestct-demo --out STEM [--send]

``explain`` of a ``dicomweb:`` source fetches the series through the intake's limits,
explains it as a volume (the files a folder's series gives), and with ``--send`` stores
the heatmap in the source's study as two new series: a DICOM Parametric Map on the
source's frame of reference (:func:`krypton.render.parametric_map.parametric_map`) and,
for viewers without Parametric Maps, a Secondary Capture per axial slice of the block.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .io.dicomweb import PacsError, PacsSettings, connect, fetch_series, find_series, find_studies

__all__ = ["PACS_PREFIX", "add_pacs_parser", "run_pacs", "run_explain_pacs"]

PACS_PREFIX = "dicomweb:"


def add_pacs_parser(commands) -> None:
    """``krypton pacs studies`` and ``krypton pacs series``."""
    pacs = commands.add_parser("pacs", help="search the configured PACS (KRYPTON_DICOMWEB_URL)")
    what = pacs.add_subparsers(dest="pacs_command", required=True)
    studies = what.add_parser("studies", help="studies matching the filters (QIDO-RS)")
    studies.add_argument("--patient-id")
    studies.add_argument("--patient-name", help="may hold * wildcards")
    studies.add_argument("--dates", help="YYYYMMDD-YYYYMMDD")
    studies.add_argument("--modality")
    studies.add_argument("--accession")
    studies.add_argument("--limit", type=int, default=50)
    series = what.add_parser("series", help="the series of one study")
    series.add_argument("study")


def _pacs():
    settings = PacsSettings.from_environment()
    if settings is None:
        raise PacsError("no PACS is configured: set KRYPTON_DICOMWEB_URL (and its sign-in)")
    return connect(settings)


def run_pacs(args: argparse.Namespace) -> int:
    """List studies or series, one per line."""
    try:
        pacs = _pacs()
        if args.pacs_command == "studies":
            dates = None
            if args.dates:
                low, _, high = args.dates.partition("-")
                if not (low.isdigit() and high.isdigit() and len(low) == len(high) == 8):
                    raise PacsError("--dates must be YYYYMMDD-YYYYMMDD")
                dates = (low, high)
            rows = find_studies(
                pacs, patient_id=args.patient_id, patient_name=args.patient_name, dates=dates,
                modality=args.modality, accession=args.accession, limit=args.limit,
            )  # fmt: skip
            for study in rows:
                print(
                    f"{study.study_uid}  {study.date or '-'}  {study.patient_id or '-'}  "
                    f"{'/'.join(study.modalities) or '-'}  {study.description}"
                )
            print(f"{len(rows)} stud{'y' if len(rows) == 1 else 'ies'}", file=sys.stderr)
            return 0
        for found in find_series(pacs, args.study):
            count = "?" if found.instances is None else found.instances
            print(f"{found.series_uid}  {found.modality}  {count} instances  {found.description}")
        return 0
    except PacsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run_explain_pacs(
    args: argparse.Namespace, explain_folder: Callable[[argparse.Namespace, Callable], int]
) -> int:
    """``krypton explain dicomweb:STUDY/SERIES``: fetch, then ``explain_folder(args,
    after)`` on the fetched files (the volume path), and with ``--send`` store the
    Parametric Map in the study."""
    study, _, series = args.image[len(PACS_PREFIX) :].partition("/")
    if not study or not series or "/" in series:
        print(f"error: a PACS source is {PACS_PREFIX}STUDY_UID/SERIES_UID", file=sys.stderr)
        return 2
    try:
        pacs = _pacs()
        with tempfile.TemporaryDirectory(prefix="krypton-pacs-") as folder:
            files = fetch_series(pacs, study, series, Path(folder))
            args.image = folder
            return explain_folder(args, _sender(args, pacs, study, files))
    except PacsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _sender(args: argparse.Namespace, pacs, study: str, files: list) -> Callable | None:
    """What stores the result after the run (``--send``), or None."""
    if not args.send:
        return None

    def send(model, prepared, heatmap) -> None:
        import io

        import pydicom

        from .io.dicomweb import store
        from .render.dicom_series import capture_series, slice_pictures
        from .render.parametric_map import parametric_map

        sources = [pydicom.dcmread(path, stop_before_pixels=True) for path in files]
        class_name = model.class_name(heatmap.label)
        created = parametric_map(
            heatmap, tuple(model.input_size), prepared.affine, sources, model_name=model.name,
            class_name=class_name,
        )  # fmt: skip
        # and, for viewers without Parametric Maps, the heatmap over each axial slice as a
        # Secondary Capture series; both carry the study's patient modules, as DICOM asks
        captures = capture_series(
            sources[0], slice_pictures(model.windowed(prepared), heatmap),
            description=f"Krypton heatmap {class_name}",
            comments=f"{created.SeriesDescription}. Not a diagnosis: shows where occluding "
            f"the volume changed the model's output.",
            include_identity=True,
        )  # fmt: skip
        pictures = [pydicom.dcmread(io.BytesIO(data)) for data in captures]
        store(pacs, [created, *pictures], study)
        print(
            f"sent       a Parametric Map (series {created.SeriesInstanceUID}) and "
            f"{len(pictures)} Secondary Captures (series {pictures[0].SeriesInstanceUID}) "
            f"to study {study}"
        )

    return send
