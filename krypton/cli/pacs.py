"""The PACS from the command line (:mod:`krypton.pacs.dicomweb`; the PACS is the one
``KRYPTON_DICOMWEB_URL`` configures, or ``--dicomweb URL``; the sign-in always comes from
the environment):

    krypton pacs studies [--patient-id ID] [--patient-name NAME] [--dates FROM-TO] ...
    krypton pacs series STUDY_UID
    krypton explain --dicomweb [URL] --study UID [--series UID] --model M --out STEM [--send]
    krypton explain dicomweb:STUDY_UID/SERIES_UID ...           (the same, shorter)
    krypton batch --dicomweb [URL] --study UID [--modality CT] --out DIR [--send]

``explain`` of a PACS series fetches it through the intake's limits and explains it as a
volume (the files a folder's series gives). ``--send`` stores the heatmap in the source's
study as two new series (:func:`krypton.pacs.results.send_result`): a DICOM Parametric Map
on the source's frame of reference and a Secondary Capture per axial slice of the block.
``batch`` does that for each image series of a study and skips the series whose result
the study already holds (:func:`krypton.batch.study.run_study_batch`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..pacs.dicomweb import (
    PacsError,
    PacsSettings,
    action,
    connect,
    fetch_series,
    find_series,
    find_studies,
)

__all__ = [
    "PACS_PREFIX",
    "add_pacs_parser",
    "add_pacs_source_options",
    "run_pacs",
    "configured_pacs",
    "run_explain_pacs",
    "run_batch_pacs",
]

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


def add_pacs_source_options(parser: argparse.ArgumentParser, *, batch: bool) -> None:
    """``--dicomweb [URL] --study UID`` (``--series UID`` for explain, ``--modality`` for
    batch) and ``--send``."""
    group = parser.add_argument_group("a PACS source (DICOMweb)")
    group.add_argument(
        "--dicomweb", nargs="?", const="", metavar="URL",
        help="read from the PACS at URL (default: KRYPTON_DICOMWEB_URL); the sign-in comes "
        "from KRYPTON_DICOMWEB_USER and _PASSWORD, or _TOKEN (or their _FILE forms)",
    )  # fmt: skip
    group.add_argument("--study", metavar="UID", help="the study's StudyInstanceUID")
    if batch:
        group.add_argument(
            "--modality", help="only this modality's series (default: every image series)"
        )
    else:
        group.add_argument(
            "--series", metavar="UID", help="the series (default: the study's one image series)"
        )
        group.add_argument(
            "--instance", metavar="UID|NUMBER",
            help="with a 2-D model: the series' image to explain, by UID or instance number "
            "(default: a series' only image)",
        )  # fmt: skip
    group.add_argument(
        "--send", action="store_true",
        help="store each heatmap in its study: a DICOM Parametric Map and a Secondary "
        "Capture series" + (" (series whose result is there already are skipped)" if batch else ""),
    )  # fmt: skip


def configured_pacs(url: str | None = None):
    """The PACS the environment names (``url`` in its place where given), connected;
    PacsError naming the setting where none is configured."""
    environ = dict(os.environ)
    if url:
        environ["KRYPTON_DICOMWEB_URL"] = url
    settings = PacsSettings.from_environment(environ)
    if settings is None:
        raise PacsError("no PACS is configured: set KRYPTON_DICOMWEB_URL (and its sign-in)")
    return connect(settings)


def run_pacs(args: argparse.Namespace) -> int:
    """List studies or series, one per line."""
    try:
        pacs = configured_pacs()
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


def _source(args: argparse.Namespace, pacs) -> tuple[str, str]:
    """(study, series) from ``dicomweb:STUDY/SERIES`` or ``--study``/``--series``; a study
    with one image series needs no ``--series``."""
    from ..pacs.results import explainable_series

    if args.image:
        study, _, series = args.image[len(PACS_PREFIX) :].partition("/")
        if not study or not series or "/" in series:
            raise PacsError(f"a PACS source is {PACS_PREFIX}STUDY_UID/SERIES_UID")
        return study, series
    if not args.study:
        raise PacsError("--dicomweb needs --study STUDY_UID (krypton pacs studies lists them)")
    if args.series:
        return args.study, args.series
    found = explainable_series(pacs, args.study)
    if len(found) != 1:
        listed = "; ".join(f"{row.series_uid} ({row.modality} {row.description})" for row in found)
        raise PacsError(
            f"study {args.study} has {len(found)} image series: name one with --series"
            + (f" ({listed})" if listed else "")
        )
    return args.study, found[0].series_uid


def run_explain_pacs(
    args: argparse.Namespace,
    explain_folder: Callable[[argparse.Namespace, Callable], int],
    explain_image: Callable[[argparse.Namespace, Callable], int],
    options_of: Callable[[argparse.Namespace, object], dict],
) -> int:
    """``krypton explain`` of a PACS series: fetch it, then ``explain_folder(args,
    after)`` on the fetched files (the volume path) or, with a 2-D model,
    ``explain_image(args, after)`` on one image of it; with ``--send`` ``after`` stores
    the result in the study (its key from ``options_of(args, model)``)."""
    from ..pacs.dicomweb import ImageNotChosen, fetch_instance
    from .volumes import is_volume_model

    try:
        pacs = configured_pacs(args.dicomweb)
        study, series = _source(args, pacs)
        with tempfile.TemporaryDirectory(prefix="krypton-pacs-") as folder:
            if args.model and not is_volume_model(args.model):
                image = fetch_instance(pacs, study, series, args.instance, Path(folder))
                args.image = str(image)
                sender = _image_sender(args, pacs, study, series, options_of)
                return explain_image(args, sender)
            files = fetch_series(pacs, study, series, Path(folder), progress=_fetch_progress())
            args.image = folder
            sender = _sender(args, pacs, study, series, files, options_of)
            return explain_folder(args, sender)
    except ImageNotChosen as exc:
        print(f"error: {exc}, with --instance", file=sys.stderr)
        return 2
    except PacsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _fetch_progress() -> Callable[[int, int], None]:
    """What a series download says on stderr: "fetched n of N instances" at every
    quarter and at the end (a line each, so it reads the same in a log as on a terminal)."""
    said = [0]

    def progress(done: int, total: int) -> None:
        quarter = 4 * done // max(total, 1)
        if done == total or quarter > said[0]:
            said[0] = quarter
            print(f"fetched {done} of {total} instances", file=sys.stderr, flush=True)

    return progress


ALREADY = "already    study {study} holds this result ({key}): nothing new was stored"


def _image_sender(args: argparse.Namespace, pacs, study: str, series: str, options_of):
    """What stores an image's result after the run (``--send``), or None: unless the
    study holds it already (its key, :func:`krypton.pacs.results.result_key`, as the app's)."""
    if not args.send:
        return None

    def send(model, heatmap) -> None:
        import pydicom

        from ..io.dicom import parse_window
        from ..pacs.results import ImageSource, in_study, result_key, send_result

        window = None if args.window is None else parse_window(args.window)
        header = pydicom.dcmread(args.image, stop_before_pixels=True)
        frames = int(header.get("NumberOfFrames", 1) or 1)  # the frame read: the middle one
        frame = frames // 2 if args.frame is None else int(args.frame)  # unless one is named
        settings = {
            **options_of(args, model), "label": heatmap.label,
            "instance": str(header.SOPInstanceUID), "frame": frame, "window": window,
        }  # fmt: skip
        key = result_key(series, model, settings)
        with action(pacs, f"sending the result to study {study}"):  # one deadline for both
            if in_study(pacs, study, key):
                print(ALREADY.format(study=study, key=key))
                return
            source = ImageSource(Path(args.image), window, args.frame)
            sent = send_result(pacs, study, model, heatmap, source, key, settings)
        print(f"sent       {sent.words()} to study {study}")

    return send


def _sender(args: argparse.Namespace, pacs, study: str, series: str, files: list, options_of):
    """What stores the result after the run (``--send``), or None: unless the study
    holds it already (its key, :func:`krypton.pacs.results.result_key`, as the app's and
    batch's)."""
    if not args.send:
        return None

    def send(model, prepared, heatmap) -> None:
        from ..pacs.dicomweb import fetched_headers
        from ..pacs.results import VolumeSource, in_study, result_key, send_result

        settings = {**options_of(args, model), "label": heatmap.label}
        key = result_key(series, model, settings)
        with action(pacs, f"sending the result to study {study}"):  # one deadline for both
            if in_study(pacs, study, key):
                print(ALREADY.format(study=study, key=key))
                return
            source = VolumeSource(prepared, fetched_headers(files))
            sent = send_result(pacs, study, model, heatmap, source, key, settings)
        print(f"sent       {sent.words()} to study {study}")

    return send


def run_batch_pacs(
    args: argparse.Namespace,
    load: Callable[[], object],
    options_of: Callable[[argparse.Namespace, object], dict],
) -> int:
    """``krypton batch --dicomweb [URL] --study UID``: every image series of the study
    (:func:`krypton.batch.study.run_study_batch`), here or with ``--broker`` on the team's
    workers; ``load()`` gives the volume model, ``options_of(args, model)`` explain()'s
    options."""
    from tqdm import tqdm

    from ..batch.broker import BrokerError
    from ..batch.study import run_study_batch

    if args.input:
        print("error: name either INPUT or --dicomweb, not both", file=sys.stderr)
        return 2
    if not args.study:
        print("error: --dicomweb needs --study STUDY_UID", file=sys.stderr)
        return 2
    try:
        pacs = configured_pacs(args.dicomweb)
        model = load()
        options = options_of(args, model)
        bar = tqdm(total=0, unit="series", file=sys.stderr, disable=None)

        def progress(done: int, total: int, name: str) -> None:
            bar.total, bar.n = total, done
            bar.set_postfix_str(name[-30:])

        submit = None
        if args.broker:  # each series on a worker, which reads and writes its own PACS
            from ..batch.broker import broker_series

            submit = broker_series(args.broker)
        try:
            outcome = run_study_batch(
                pacs, args.study, model, Path(args.out), options, modality=args.modality,
                send=args.send, progress=progress, submit=submit,
            )  # fmt: skip
        finally:
            bar.close()
    except (PacsError, ValueError, BrokerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = [row for row in outcome.rows if row.error]
    print(f"{outcome.explained} series explained into {args.out} (summary.csv, index.html)")
    if args.send:
        print(
            f"sent       {len(outcome.sent)} Parametric Maps with their Secondary Captures to "
            f"study {args.study}; {len(outcome.already_sent)} series had theirs already"
        )
    for row in failed:
        print(f"  not explained: series {row.image}: {row.error}", file=sys.stderr)
    return 0 if not failed else 1
