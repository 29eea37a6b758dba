"""Command line: ``krypton explain IMAGE ...``, ``krypton analyze``, ``krypton models`` ...

Installed as the ``krypton`` command by ``make`` (``.venv/bin/krypton``);
``python -m krypton`` is the same.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .. import explainer as explain_module
from .._environment import SettingError, check_library_settings
from ..approximate.settings import DEFAULTS
from ..approximate.tuning import DEFAULT_TARGET_SSIM
from ..devices import PRECISIONS, resolve_device
from ..engine import analysis
from ..io.dicom import is_dicom, parse_window
from ..io.images import ImageLoadError, load_image
from ..registry import (
    RegistryError,
    available_models,
    default_model_name,
    load_model,
    remove_model,
)
from ..registry.entries import update_entry
from ..registry.models import (
    CALIBRATION_PATCHES,
    TORCHVISION_MODELS,
    WeightsUnavailableError,
    load_torchvision_model,
)
from .compare import add_compare_parser, parse_methods, run_compare
from .node import add_node_parser, run_node
from .pacs import (
    PACS_PREFIX,
    add_pacs_parser,
    add_pacs_source_options,
    run_batch_pacs,
    run_explain_pacs,
    run_pacs,
)
from .volumes import (
    default_volume_model,
    is_volume_model,
    print_host,
    print_ood,
    print_speed,
    run_explain_volume,
    stem_of,
    wants_volume,
)


def _region(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            "region must be x0,y0,x1,y1 (a volume: z0,y0,x0,z1,y1,x1) integers"
        ) from exc
    if len(values) not in (4, 6):
        raise argparse.ArgumentTypeError("region must be x0,y0,x1,y1 (a volume: z0,y0,x0,z1,y1,x1)")
    return values


def _fill(text: str):
    if text == "gray":
        return "gray"
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            "fill must be 'gray', a number or r,g,b numbers in the model's input space"
        ) from exc
    return values[0] if len(values) == 1 else tuple(values)


def add_explain_options(parser: argparse.ArgumentParser) -> None:
    """The options of one explanation, shared by ``explain`` and ``batch``."""
    parser.add_argument(
        "--model",
        default=None,
        help="registered model name (see `krypton models`); default the registry's default model",
    )
    parser.add_argument(
        "--window",
        help="DICOM images: lung, mediastinum, bone, brain or centre,width "
        "(default the file's own window)",
    )
    parser.add_argument("--frame", type=int, help="DICOM multi-frame: which frame (default middle)")
    parser.add_argument(
        "--patch",
        type=int,
        help="patch side in pixels (default the model's own: its registry entry's "
        "'patch', else 16)",
    )
    parser.add_argument(
        "--stride",
        type=int,
        help="positions' step in pixels or voxels (default 4 for an image model, 5 for a "
        "volume model, as in the app)",
    )
    parser.add_argument("--mode", default="exact", choices=explain_module.MODES)
    parser.add_argument(
        "--region",
        type=_region,
        help="x0,y0,x1,y1 in model-input pixels (a volume: z0,y0,x0,z1,y1,x1 in model voxels)",
    )
    parser.add_argument(
        "--fill",
        type=_fill,
        default="gray",
        help="'gray' (default), or a value / r,g,b in normalised input space",
    )
    parser.add_argument("--batch-size", type=int)
    parser.add_argument(
        "--device",
        help="auto (default, or $KRYPTON_DEVICE): CUDA when PyTorch sees a card, else the "
        "CPU; or cpu, cuda, cuda:N",
    )
    parser.add_argument(
        "--precision",
        default="fp32",
        choices=tuple(PRECISIONS),
        help="fp32 (default: TF32 off, exact equals naive to ~1e-6), or tf32/bf16/fp16 "
        "for speed on a card; naive runs at the same precision",
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="use an untrained network when trained weights are unavailable",
    )
    approximate = parser.add_argument_group(
        "approximate mode (--mode approximate; default τ: the model's tuned value for "
        "SSIM 0.9 and localisation, as in the app)"
    )
    approximate.add_argument("--tau", type=float, help="projective-field threshold in (0, 1]")
    approximate.add_argument(
        "--target-ssim", type=float, help="choose τ from the model's tuned SSIM(τ) curve"
    )
    approximate.add_argument(
        "--drill-down",
        type=float,
        default=DEFAULTS.r_drill_down,
        help="fraction refined at full resolution (1: no drill-down)",
    )
    approximate.add_argument(
        "--target-speedup",
        type=float,
        default=DEFAULTS.target_speedup,
        help="drill-down speedup that sets the stage-one stride",
    )
    approximate.add_argument("--s1", type=int, help="stage-one stride (overrides --target-speedup)")
    approximate.add_argument(
        "--refine-by",
        default=DEFAULTS.refine_by,
        choices=("drop+variation", "drop"),
        help="which stage-one cells drill-down refines (drop: the paper's rule)",
    )
    approximate.add_argument(
        "--no-freeze-gates",
        action="store_true",
        help="compute squeeze-excitation gates exactly instead of keeping their values",
    )
    parser.add_argument(
        "--strategy",
        default="auto",
        choices=explain_module.STRATEGIES,
        help="exact mode: run the faster of incremental and naive (auto; measure: timed "
        "again in each call, not carried from an earlier one) or force one",
    )


def explain_options(args: argparse.Namespace, model) -> dict:
    """explain() keyword arguments from the parsed options (without the image)."""
    options = dict(
        patch=model.patch if args.patch is None else args.patch,
        stride=model.default_stride if args.stride is None else args.stride,
        mode=args.mode,
        fill=model.gray_fill() if args.fill == "gray" else args.fill,
        region=args.region,
        batch_size=args.batch_size,
        strategy=args.strategy,
        precision=args.precision,
    )
    if args.mode == "approximate":
        options.update(
            tau=args.tau,
            target_ssim=args.target_ssim,
            r_drill_down=args.drill_down,
            target_speedup=args.target_speedup,
            s1=args.s1,
            refine_by=args.refine_by,
            freeze_gates=False if args.no_freeze_gates else None,
        )
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="krypton", description="Fast occlusion-based CNN explanations."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("explain", help="occlusion heatmap of one image")
    run.add_argument(
        "image",
        nargs="?",
        help="image file (PNG, JPEG, TIFF, BMP, DICOM, ...), or a volume for a volume model: "
        "a DICOM series folder or zip, a NIfTI file (.nii, .nii.gz), or a series of the "
        "configured PACS as dicomweb:STUDY_UID/SERIES_UID (or --dicomweb --study ...)",
    )
    add_pacs_source_options(run, batch=False)
    run.add_argument(
        "--out",
        default="heatmap.png",
        help="heatmap PNG (image resolution, colour bar, title); the explained "
        "class's values go next to it as .npy, every class's as .npz. A volume: its stem "
        "names STEM.nii.gz, STEM.{axial,coronal,sagittal}.png and STEM.npy",
    )
    run.add_argument(
        "--slices",
        choices=("lowest", "middle"),
        default="lowest",
        help="a volume's three view PNGs: through the lowest cell (default) or the middle",
    )
    add_explain_options(run)
    run.add_argument(
        "--dicom-identity",
        action="store_true",
        help="DICOM images: copy the patient's identity into the .dcm export (default: "
        "only the study, series and image UIDs that reference the source)",
    )
    run.add_argument("--label", type=int, help="class index (default: the prediction)")

    batch = commands.add_parser(
        "batch",
        help="heatmaps for a folder, a glob or a CSV list of images (resumable)",
        description="Explain every image of INPUT into --out: per image an overlay PNG, "
        ".npy/.npz values and a .json row; then summary.csv and index.html. Images "
        "already done (their .json exists) are skipped, so an interrupted run picks up. "
        "With a volume model (--model chestct-demo), INPUT's volumes: its subfolders (each "
        "a DICOM series) and its NIfTI, zip and multi-frame .dcm files; per volume a "
        "NIfTI heatmap, three view PNGs and .npy.",
    )
    batch.add_argument(
        "input",
        nargs="?",
        help="a folder, a glob pattern ('scans/*.png') or a CSV with a "
        "'path' column and an optional 'label' column (index or class name); or, with "
        "--dicomweb --study UID, the study's series",
    )
    batch.add_argument("--out", required=True, help="output folder")
    batch.add_argument(
        "--methods",
        default="occlusion",
        help="occlusion, plus gradcam and/or ig (comma-separated): each image also gets "
        "STEM.methods.png and STEM.methods.json with the maps on occlusion's cells, and "
        "summary.csv each method's seconds and rank correlation with occlusion",
    )
    batch.add_argument(
        "--layer",
        help="Grad-CAM's layer with --methods gradcam (default: the deepest convolutional "
        "block, never a pooling layer); named in STEM.methods.json",
    )
    batch.add_argument(
        "--broker",
        help="redis://HOST:PORT/DB: explain the images on the team's Celery workers "
        "(`make worker`) instead of in this process; the outputs are the same. With "
        "--dicomweb each worker fetches its series from, and sends to, its own "
        "KRYPTON_DICOMWEB_URL, which must be the batch's PACS",
    )
    add_explain_options(batch)
    add_pacs_source_options(batch, batch=True)

    commands.add_parser("models", help="list registered models and their availability")

    remove = commands.add_parser(
        "remove", help="remove a model you registered (shipped models stay)"
    )
    remove.add_argument("name")

    tune = commands.add_parser("tune", help="fit SSIM(tau) for approximate mode (§4.3)")
    tune.add_argument("--model", default=None, help="registered model (default: the default)")
    tune.add_argument(
        "--images",
        help="folder of sample images from the application "
        "domain (default: generated fundus images for "
        "fundus-demo, scikit-image photos otherwise)",
    )
    tune.add_argument("--count", type=int, default=30, help="images for the fit")
    tune.add_argument("--held-out", type=int, default=30, help="images for the check")
    tune.add_argument(
        "--patch", type=int, default=None, help="default: the model's own (its registry entry's)"
    )
    tune.add_argument("--stride", type=int, default=4)
    tune.add_argument(
        "--target", type=float, default=DEFAULT_TARGET_SSIM, help="target SSIM to tune for"
    )

    calibrate = commands.add_parser("calibrate", help="fit the runtime estimator on this host")
    calibrate.add_argument("--model", default=None)
    calibrate.add_argument("--patches", default=",".join(map(str, CALIBRATION_PATCHES)))
    calibrate.add_argument(
        "--keep-other-patches",
        action="store_true",
        help="keep the stored fits of patch sizes not in --patches (default: replace all)",
    )
    calibrate.add_argument(
        "--random-weights",
        action="store_true",
        help="time an ImageNet architecture whose weights are not cached "
        "(run time does not depend on the weights)",
    )
    calibrate.add_argument(
        "--step-classes",
        type=int,
        default=STEP_CLASSES_TIMED,
        help="classes whose Compare gradient step is timed (0: none; default %(default)s)",
    )

    add_pacs_parser(commands)

    analyze = commands.add_parser("analyze", help="theoretical speedup (paper eqs 9-12)")
    analyze.add_argument(
        "--model",
        default="vgg16",
        help="a registered model or a torchvision architecture name "
        "(random weights: the analysis needs shapes only)",
    )
    analyze.add_argument("--patch", type=int, default=16)
    analyze.add_argument("--tau", type=float, default=1.0)
    add_compare_parser(commands)
    add_node_parser(commands)
    return parser


def _load(name: str | None, random_weights: bool, device: str | None = None):
    """The registry model, on ``device`` (--device; default $KRYPTON_DEVICE or auto)."""
    try:
        where = resolve_device(device)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    return _load_model(name, random_weights).to(where)


def _load_model(name: str | None, random_weights: bool):
    name = name or default_model_name()
    if name is None:
        raise SystemExit("error: no model is available; run `krypton models`")
    try:
        return load_model(name)
    except RegistryError as exc:
        raise SystemExit(f"error: {exc}") from None
    except WeightsUnavailableError as exc:
        if not random_weights or name not in TORCHVISION_MODELS:
            raise SystemExit(
                f"error: {exc}\n(or pass --random-weights to explain an "
                f"untrained {name}, which shows nothing meaningful)"
            ) from None
        print(f"WARNING: {exc}", file=sys.stderr)
        print(
            "WARNING: using RANDOM weights: this heatmap explains an untrained network "
            "and means nothing about the image",
            file=sys.stderr,
        )
        return load_torchvision_model(name, random_weights=True)


def run_remove(args: argparse.Namespace) -> int:
    try:
        path = remove_model(args.name)
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"removed '{args.name}' ({path})")
    return 0


def run_models() -> int:
    for info in available_models():
        status = "available" if info.available else f"UNAVAILABLE: {info.reason}; fix: {info.fix}"
        default = " (default)" if info.default else ""
        kind = " (volumes)" if info.is_volume else ""
        print(
            f"{info.name}{default}: {len(info.classes)} classes, input "
            f"{'x'.join(map(str, info.input_size))}{kind} — {status}"
        )
    return 0


def output_problem(out: Path) -> str | None:
    """Why the heatmap cannot be written to ``out`` (checked before any computing)."""
    if out.is_dir():
        return f"--out '{out}' is a folder; name a .png file in it"
    if out.suffix.lower() != ".png":
        return f"--out must name a .png file, got '{out}'"
    folder = out.parent
    while not folder.exists():  # the first folder that exists must be writable
        folder = folder.parent
    if not folder.is_dir():
        return f"cannot create a folder under '{folder}': it is a file"
    try:  # a real write: permission bits say nothing for root or special file systems
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".krypton-probe-"):
            pass
    except OSError as exc:
        return f"cannot write in '{folder}': {exc.strerror or exc}"
    if out.exists() and not os.access(out, os.W_OK):
        return f"cannot write '{out}': permission denied"
    return None


def write_heatmap_files(out: Path, picture, heatmap, model) -> list[Path]:
    """The overlay PNG at ``out``, the explained class's values next to it as .npy and,
    where kept, every class's as .npz (:func:`krypton.batch.heatmap_files`); returns the
    paths written."""
    from ..batch.folder import heatmap_files

    out.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, data in heatmap_files(picture, heatmap, model).items():
        path = out if suffix == ".png" else out.with_suffix(suffix)
        path.write_bytes(data)
        written.append(path)
    return written


def run_explain(args: argparse.Namespace) -> int:
    if args.dicomweb is not None or (args.image or "").startswith(PACS_PREFIX):
        return run_explain_pacs(args, _explain_volume, _explain_image, explain_options)
    if args.send or args.study or args.series:
        print(
            f"error: --send, --study and --series are for a PACS source (--dicomweb or "
            f"{PACS_PREFIX}STUDY/SERIES)",
            file=sys.stderr,
        )
        return 2
    if not args.image:
        print("error: name an image, a volume or a PACS series (--dicomweb)", file=sys.stderr)
        return 2
    if wants_volume(args.image, args.model):
        return _explain_volume(args)
    return _explain_image(args)


def _explain_image(args: argparse.Namespace, after=None) -> int:
    """``krypton explain`` of an image (``args.image``, a file) with a 2-D model;
    ``after(model, heatmap)``, if given, runs once the files are written (a PACS source
    stores its result); its ImageLoadError or ValueError is the command's error."""
    problem = output_problem(Path(args.out))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        picture = load_image(args.image, window=args.window, frame=args.frame)
    except (ImageLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = _load(args.model, args.random_weights, args.device)
    image = model.preprocess(picture)
    bar = tqdm(
        total=0, unit="pos", desc=args.mode, file=sys.stderr, leave=False, disable=None
    )  # disabled automatically when stderr is not a terminal

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        # The LoadedModel itself: the registry's tuned τ applies, as in the app.
        heatmap = explain_module.explain(
            model,
            image,
            label=args.label,
            progress=progress,
            **explain_options(args, model),
        )
    except (ValueError, TypeError) as exc:
        bar.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bar.close()
    out = Path(args.out)
    written = write_heatmap_files(out, picture, heatmap, model)
    dicom_line = None
    if is_dicom(args.image) or str(args.image).lower().endswith(".dcm"):
        dicom_line, capture = _dicom_export(args, heatmap, model)
        out.with_suffix(".dcm").write_bytes(capture)
        written.append(out.with_suffix(".dcm"))
    random = " — RANDOM weights: this explains an untrained network" if model.random_weights else ""
    label_name = model.class_name(heatmap.label)
    weights = "RANDOM weights" if model.random_weights else "trained weights"
    print(f"model      {model.name} ({weights})")
    print(f"label      {heatmap.label} {label_name}{random}")
    print(f"probability {heatmap.prob:.4f} (lowest with occlusion {np.nanmin(heatmap.values):.4f})")
    print(
        f"positions  {heatmap.positions_evaluated} evaluated on a "
        f"{heatmap.values.shape[0]}x{heatmap.values.shape[1]} grid (patch {heatmap.patch}, "
        f"stride {heatmap.stride}), mode {heatmap.mode}"
    )
    print_ood(heatmap.extra.get("ood"))
    print_host(heatmap.extra.get("host"))
    if dicom_line:
        print(f"dicom      {dicom_line}")
    if heatmap.mode == "exact":
        print(f"plan       {heatmap.extra['plan']}")
        print_speed(heatmap, model.name)
    if heatmap.mode == "approximate":
        per_position = heatmap.macs_naive / max(heatmap.positions_evaluated, 1)
        fewer = heatmap.values.size * per_position / max(heatmap.macs_spent, 1)
        print(
            f"tau        {heatmap.extra['tau']:.2f} ({heatmap.extra['tau_source']}); "
            f"drill-down r {heatmap.extra['r_drill_down']:g}"
        )
        print(
            f"time       {heatmap.seconds:.2f} s; FLOPs {fewer:.2f}x fewer than naive "
            f"over the whole grid (thresholding and drill-down)"
        )
    else:
        print(
            f"time       {heatmap.seconds:.2f} s; FLOPs {heatmap.flops_ratio:.2f}x fewer than naive"
        )
    print(f"wrote      {', '.join(str(p) for p in written)}")
    if after is not None:
        try:
            after(model, heatmap)
        except (ImageLoadError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


def _dicom_export(args: argparse.Namespace, heatmap, model) -> tuple[str, bytes]:
    """What the DICOM input was shown as (window, frame), and the heatmap as a Secondary
    Capture that references it."""
    from ..io.dicom import load_dicom
    from ..registry.ood import caveat
    from ..render.dicom_capture import heatmap_capture

    loaded = load_dicom(args.image, window=args.window, frame=args.frame)
    shown = loaded.window_text()
    modality = loaded.info["modality"] or "DICOM"
    line = f"{modality}, {shown}, frame {loaded.frame + 1} of {loaded.frames}"
    capture = heatmap_capture(
        args.image,
        values=heatmap.values,
        xs=heatmap.xs,
        ys=heatmap.ys,
        patch=heatmap.patch,
        stride=heatmap.stride,
        prob=heatmap.prob,
        input_size=model.input_size,
        label_name=model.class_name(heatmap.label),
        mode=heatmap.mode,
        model_name=model.name,
        window=args.window if args.window is None else parse_window(args.window),
        frame=loaded.frame,
        include_identity=args.dicom_identity,
        warning=caveat(heatmap.extra.get("ood")),
    )
    return line, capture


def run_batch_command(args: argparse.Namespace) -> int:
    from ..batch.folder import collect_inputs, run_batch
    from ..io.dicom import parse_window

    if args.dicomweb is not None:
        volume_model = args.model or default_volume_model()
        return run_batch_pacs(
            args, lambda: _load(volume_model, args.random_weights, args.device), explain_options
        )
    if not args.input or args.send or args.study:
        print(
            "error: name INPUT, or a PACS study with --dicomweb --study UID (--send needs it)",
            file=sys.stderr,
        )
        return 2

    try:
        parse_window(args.window)
        items = collect_inputs(args.input, volumes=is_volume_model(args.model))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not items:
        what = (
            "volumes (series folders, NIfTI, zip or .dcm files)"
            if is_volume_model(args.model)
            else "image files"
        )
        print(f"error: no {what} in {args.input}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"error: --out '{out}' is a file; name a folder", file=sys.stderr)
        return 2
    try:
        gradients = [name for name in parse_methods(args.methods) if name != "occlusion"]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = _load(args.model, args.random_weights, args.device)
    options = explain_options(args, model)
    if gradients:  # krypton.batch.folder.explain_item sets them beside occlusion
        options["methods"] = gradients
        if args.layer:
            options["gradcam_layer"] = args.layer
    bar = tqdm(total=len(items), unit="image", file=sys.stderr, disable=None)

    def progress(done: int, total: int, name: str) -> None:
        bar.n = done
        bar.set_postfix_str(name[-30:])

    submit = None
    if args.broker:
        from ..batch.broker import BrokerError, broker_submit

        try:
            submit = broker_submit(args.broker, model, options, args.window, args.frame)
        except BrokerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    rows = run_batch(items, model, out, options, progress, args.window, args.frame, submit)
    bar.close()
    failed = [row for row in rows if row.error]
    print(
        f"{len(rows) - len(failed)} of {len(rows)} images explained into {out} "
        f"(summary.csv, index.html)"
    )
    for row in failed:
        print(f"  not explained: {row.image}: {row.error}", file=sys.stderr)
    return 0 if not failed else 1


def _sample_images(args: argparse.Namespace, model, total: int) -> list:
    """Tuning images: a folder, generated fundus images, or scikit-image's photos."""
    if args.images:
        folder = Path(args.images)
        files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
        images = []
        for path in files:
            try:
                images.append(model.preprocess(load_image(path)))
            except ImageLoadError:
                print(f"skipping {path.name}: not an image", file=sys.stderr)
        if len(images) < 2:
            raise SystemExit(f"error: need at least 2 images in {folder}, found {len(images)}")
        return images[:total]
    if model.name == "fundus-demo":
        from PIL import Image

        from ..synthetic.fundus import FundusGenerator

        generator = FundusGenerator(seed=5)
        return [
            model.preprocess(Image.fromarray(generator.sample(label=1 + i % 2).image))
            for i in range(total)
        ]
    from PIL import Image
    from skimage import data

    photos = [data.chelsea(), data.coffee(), data.astronaut(), data.rocket()]
    return [model.preprocess(Image.fromarray(p)) for p in photos][:total]


def run_tune(args: argparse.Namespace) -> int:

    from ..tune import tune_tau

    model = _load(args.model, random_weights=False)
    images = _sample_images(args, model, args.count + args.held_out)
    split = min(args.count, max(1, len(images) - args.held_out)) if args.held_out else len(images)
    record = tune_tau(
        model.module,
        images[:split],
        patch=model.patch if args.patch is None else args.patch,
        stride=args.stride,
        fill=model.gray_fill(),
        held_out=images[split:],
        target_ssim=args.target,
        log=lambda line: print(line, file=sys.stderr),
    )
    record["sample"] = args.images or (
        "generated fundus images (seed 5)" if model.name == "fundus-demo" else "scikit-image photos"
    )
    path = Path(model.extra["registry_file"])
    update_entry(path, tuning=record)
    a, b, c = record["coefficients"]
    print(f"SSIM(tau) = {a:.3f} tau^2 + {b:.3f} tau + {c:.3f} over {split} images")
    chosen = record["chosen"]
    print(
        f"tau for SSIM {args.target} and localisation: {chosen['tau']} (the curve alone: "
        f"{chosen['curve_tau']}; per-image SSIM and localisation floor {chosen['quality_floor']})"
    )
    if "held_out" in record:
        check = record["held_out"]
        print(
            f"held-out ({check['images']} images): {check['fraction_at_or_above']:.0%} at "
            f"or above {args.target}, worst shortfall {check['worst_shortfall']:.3f}; "
            f"lowest cell kept on {check['minimum_kept']:.0%}, lowest 5% overlap "
            f"{check['lowest_overlap']:.0%}"
        )
    print(f"wrote {path}")
    return 0


STEP_CLASSES_TIMED = 2  # the gradient step is timed per class; two show its spread


def run_calibrate(args: argparse.Namespace) -> int:
    from ..approximate.tuning import TauTuning, choose_tau
    from ..calibration import calibrate, save_calibration
    from ..registry.entries import find_entry

    name = args.model or default_model_name()
    path, entry = find_entry(name)
    model = _load(name, args.random_weights)
    tau = choose_tau(TauTuning.from_record(entry.get("tuning"))).tau
    patches = [int(p) for p in args.patches.split(",")]
    record = calibrate(
        model.module,
        name,
        model.input_size,
        channels=len(model.mean),
        patches=patches,
        tau=tau,
        gradient_labels=range(min(max(args.step_classes, 0), len(model.classes))),
        fill=model.gray_fill(),
        log=lambda line: print(line, file=sys.stderr),
    )
    record["weights"] = "random (timing only)" if model.random_weights else "trained"
    save_calibration(path, record, keep_other_patches=args.keep_other_patches)
    print(
        f"held-out median absolute error {record['held_out_median_abs_error_percent']:.1f}% "
        f"over {record['held_out_runs']} runs (patch "
        f"{', '.join(map(str, record['held_out_patches']))}); wrote {path}"
    )
    return 0


def _shapes_only_model(name: str):
    """A registered model (its own weights if available), a torchvision architecture or
    a timm one ("timm:NAME") with random weights: the analysis needs shapes only."""
    if name.startswith("timm:"):
        return _timm_model(name[len("timm:") :])
    known = {info.name: info for info in available_models()}
    if name in known and known[name].available:
        return load_model(name)
    architecture = known[name].architecture if name in known else name
    try:
        return load_torchvision_model(architecture, random_weights=True)
    except ValueError:
        raise SystemExit(
            f"error: '{name}' is neither a registered model (see `krypton "
            f"models`) nor a torchvision architecture (timm ones: timm:NAME)"
        ) from None


def _timm_model(architecture: str):
    """A timm architecture with random weights, at its default input size."""
    import timm

    from ..registry.models import LoadedModel

    try:
        module = timm.create_model(architecture, pretrained=False)
    except RuntimeError as exc:  # timm's "Unknown model"
        raise SystemExit(f"error: {exc}") from None
    size = tuple(module.pretrained_cfg.get("input_size", (3, 224, 224))[1:])
    return LoadedModel(
        f"timm:{architecture}",
        module.eval(),
        [],
        size,
        random_weights=True,
        description=f"timm {architecture} with RANDOM weights",
    )


def run_analyze(args: argparse.Namespace) -> int:
    model = _shapes_only_model(args.model)
    try:
        report = analysis.analyze(model.module, (3, *model.input_size), args.patch, args.tau)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{args.model}, input 3x{model.input_size[0]}x{model.input_size[1]}, patch "
        f"{args.patch} at the centre (worst case), tau {args.tau}"
    )
    print(report.table())
    return 0


def _explain_volume(args: argparse.Namespace, after=None) -> int:
    problem = output_problem(stem_of(Path(args.out)).with_suffix(".png"))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    model = _load(args.model or default_volume_model(), args.random_weights, args.device)
    return run_explain_volume(args, model, explain_options(args, model), after)


def main_entry() -> None:
    """The ``krypton`` console command."""
    raise SystemExit(main())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_library_settings()  # a bad KRYPTON_* number: its one line, not a traceback
    except SettingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "explain":
        return run_explain(args)
    if args.command == "batch":
        return run_batch_command(args)
    if args.command == "models":
        return run_models()
    if args.command == "remove":
        return run_remove(args)
    if args.command == "tune":
        return run_tune(args)
    if args.command == "calibrate":
        return run_calibrate(args)
    if args.command == "pacs":
        return run_pacs(args)
    if args.command == "node":
        return run_node(args)
    if args.command == "compare":
        return run_compare(args, lambda name: _load(name, False))
    return run_analyze(args)
