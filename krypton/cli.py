"""Command line: ``python -m krypton explain IMAGE ...`` and ``python -m krypton analyze``."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from . import analysis, explainer as explain_module
from .imaging import ImageLoadError, load_image, overlay
from .models import TORCHVISION_MODELS, WeightsUnavailableError, load_torchvision_model
from .registry import RegistryError, available_models, default_model_name, load_model


def _region(text: str) -> tuple[int, int, int, int]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError("region must be x0,y0,x1,y1 integers") from exc
    if len(values) != 4:
        raise argparse.ArgumentTypeError("region must be x0,y0,x1,y1")
    return values


def _fill(text: str):
    if text == "gray":
        return "gray"
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError("fill must be 'gray', a number or r,g,b numbers "
                                         "in the model's input space") from exc
    return values[0] if len(values) == 1 else tuple(values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m krypton",
                                     description="Fast occlusion-based CNN explanations.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("explain", help="occlusion heatmap of one image")
    run.add_argument("image", help="image file (PNG, JPEG, TIFF, BMP, ...)")
    run.add_argument("--model", default=None,
                     help="registered model name (see `python -m krypton models`); default "
                          "the registry's default model")
    run.add_argument("--patch", type=int, default=16)
    run.add_argument("--stride", type=int, default=4)
    run.add_argument("--mode", default="exact", choices=explain_module.MODES)
    run.add_argument("--region", type=_region, help="x0,y0,x1,y1 in model-input pixels")
    run.add_argument("--label", type=int, help="class index (default: the prediction)")
    run.add_argument("--fill", type=_fill, default="gray",
                     help="'gray' (default), or a value / r,g,b in normalised input space")
    run.add_argument("--batch-size", type=int)
    run.add_argument("--random-weights", action="store_true",
                     help="use an untrained network when trained weights are unavailable")
    run.add_argument("--out", default="heatmap.png",
                     help="overlay PNG; raw values go next to it as .npy")

    commands.add_parser("models", help="list registered models and their availability")

    analyze = commands.add_parser("analyze", help="theoretical speedup (paper eqs 9-12)")
    analyze.add_argument("--model", default="vgg16", choices=TORCHVISION_MODELS)
    analyze.add_argument("--patch", type=int, default=16)
    analyze.add_argument("--tau", type=float, default=1.0)
    return parser


def _load(name: str | None, random_weights: bool):
    name = name or default_model_name()
    if name is None:
        raise SystemExit("error: no model is available; run `python -m krypton models`")
    try:
        return load_model(name)
    except RegistryError as exc:
        raise SystemExit(f"error: {exc}")
    except WeightsUnavailableError as exc:
        if not random_weights or name not in TORCHVISION_MODELS:
            raise SystemExit(f"error: {exc}\n(or pass --random-weights to explain an "
                             f"untrained {name}, which shows nothing meaningful)")
        print(f"WARNING: {exc}", file=sys.stderr)
        print("WARNING: using RANDOM weights: this heatmap explains an untrained network "
              "and means nothing about the image", file=sys.stderr)
        return load_torchvision_model(name, random_weights=True)


def run_models() -> int:
    for info in available_models():
        status = "available" if info.available else f"UNAVAILABLE: {info.reason}; fix: " \
                                                     f"{info.fix}"
        default = " (default)" if info.default else ""
        print(f"{info.name}{default}: {len(info.classes)} classes, input "
              f"{info.input_size[0]}x{info.input_size[1]} — {status}")
    return 0


def run_explain(args: argparse.Namespace) -> int:
    try:
        picture = load_image(args.image)
    except ImageLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model = _load(args.model, args.random_weights)
    image = model.preprocess(picture)
    fill = model.gray_fill() if args.fill == "gray" else args.fill

    def progress(done: int, total: int) -> None:
        print(f"\r{done}/{total} positions", end="", file=sys.stderr, flush=True)

    try:
        heatmap = explain_module.explain(
            model.module, image, patch=args.patch, stride=args.stride, mode=args.mode,
            fill=fill, label=args.label, region=args.region, batch_size=args.batch_size,
            progress=progress)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shown = picture.convert("RGB").resize(model.input_size[::-1])
    overlay(shown, heatmap.values, heatmap.xs, heatmap.ys, heatmap.patch, heatmap.prob) \
        .save(out)
    np.save(out.with_suffix(".npy"), heatmap.values)
    weights = "RANDOM weights" if model.random_weights else "trained weights"
    print(f"model      {model.name} ({weights})")
    print(f"label      {heatmap.label} {model.class_name(heatmap.label)}")
    print(f"probability {heatmap.prob:.4f} (lowest with occlusion "
          f"{np.nanmin(heatmap.values):.4f})")
    print(f"positions  {heatmap.positions_evaluated} ({heatmap.values.shape[0]}x"
          f"{heatmap.values.shape[1]}), mode {heatmap.mode}")
    print(f"time       {heatmap.seconds:.2f} s; FLOPs {heatmap.flops_ratio:.2f}x fewer "
          f"than naive")
    print(f"wrote      {out} and {out.with_suffix('.npy')}")
    return 0


def run_analyze(args: argparse.Namespace) -> int:
    model = load_torchvision_model(args.model, random_weights=True)  # shapes only
    try:
        report = analysis.analyze(model.module, (3, *model.input_size), args.patch, args.tau)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.model}, input 3x{model.input_size[0]}x{model.input_size[1]}, patch "
          f"{args.patch} at the centre (worst case), tau {args.tau}")
    print(report.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "explain":
        return run_explain(args)
    if args.command == "models":
        return run_models()
    return run_analyze(args)
