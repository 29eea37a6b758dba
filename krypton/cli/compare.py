"""``krypton compare``: occlusion, Grad-CAM and Integrated Gradients on one image or volume
(:mod:`krypton.methods`), side by side in one PNG, with their agreement, deletion and
insertion areas and times in JSON and on the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..io.images import ImageLoadError, load_image
from ..methods import METHODS, compare, comparison_record
from ..render.methods import TITLES, methods_picture

SHORT_NAMES = {"occlusion": "occlusion", "gradcam": "gradcam", "ig": "integrated_gradients"}


def add_compare_parser(commands) -> None:
    """The ``compare`` subcommand's options."""
    parser = commands.add_parser(
        "compare",
        help="occlusion beside Grad-CAM and Integrated Gradients on one image or volume",
        description="Each method's map on occlusion's grid, as evidence for the class "
        "(higher is more): OUT.png side by side, OUT.json with every map, the times, the "
        "methods' agreement (Spearman, top-5%% overlap) and deletion/insertion areas.",
    )
    parser.add_argument("image", help="an image file, or a volume for a volume model")
    parser.add_argument("--model", default=None, help="registered model (default: the default)")
    parser.add_argument("--out", default="compare.png", help="the PNG; OUT.json beside it")
    parser.add_argument("--methods", default="occlusion,gradcam,ig",
                        help="comma-separated: occlusion, gradcam, ig")  # fmt: skip
    parser.add_argument("--patch", type=int, help="default the model's own")
    parser.add_argument("--stride", type=int, help="default the model's (4 image, 5 volume)")
    parser.add_argument("--mode", default="exact", choices=("exact", "approximate", "naive"))
    parser.add_argument("--label", type=int, help="class index (default: the prediction)")
    parser.add_argument("--layer", help="Grad-CAM's layer (default: the deepest convolutional "
                        "block, never a pooling layer)")  # fmt: skip
    parser.add_argument("--window", help="DICOM images: lung, mediastinum, bone, brain or "
                        "centre,width (default the file's own window)")  # fmt: skip
    parser.add_argument("--frame", type=int, help="DICOM multi-frame: which frame (default middle)")


def parse_methods(text: str) -> list[str]:
    """``--methods`` (comma-separated short names) as krypton.methods' names; ValueError
    names what is unknown."""
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in SHORT_NAMES]
    if unknown or not chosen:
        raise ValueError(f"unknown methods {unknown}; choose from occlusion, gradcam, ig")
    return [SHORT_NAMES[name] for name in chosen]


def run_compare(args: argparse.Namespace, load) -> int:
    """Run the chosen methods and write OUT.png and OUT.json; ``load`` is the CLI's model
    loader."""
    from .volumes import default_volume_model, wants_volume

    try:
        methods = parse_methods(args.methods)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if wants_volume(args.image, args.model):
            model = load(args.model or default_volume_model())
            prepared, _ = model.read_volume(args.image)
            tensor, background = prepared.tensor, prepared.tensor[0].numpy()
        else:
            model = load(args.model)
            picture = load_image(args.image, window=args.window, frame=args.frame)
            tensor = model.preprocess(picture)
            size = tuple(model.input_size)
            background = np.asarray(picture.convert("L").resize(size[::-1]), np.float32)
        maps = compare(
            model, tensor, patch=args.patch or model.patch,
            stride=args.stride or model.default_stride, label=args.label, mode=args.mode,
            methods=[m for m in METHODS if m in methods], layer=args.layer,
        )  # fmt: skip
    except (ImageLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(methods_picture(maps, background))
    record = comparison_record(model, tensor, maps)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    first = next(iter(maps.values()))
    print(f"model      {model.name}; class {first.label} {model.class_name(first.label)} "
          f"(p = {first.prob:.3f})")  # fmt: skip
    print("method                 seconds  deletion AUC (low: good)  insertion AUC (high: good)")
    for method, entry in record["methods"].items():
        print(f"{TITLES[method]:<22} {entry['seconds']:7.2f}  {entry['deletion_auc']:24.3f}  "
              f"{entry['insertion_auc']:26.3f}")  # fmt: skip
    for method, found in maps.items():
        if method != "occlusion":  # the layer Grad-CAM read; IG's steps and completeness
            print(f"ran        {TITLES[method]}: {found.detail}")
    for pair in record["agreement"]:
        print(f"agreement  {pair['methods'][0]} / {pair['methods'][1]}: Spearman "
              f"{pair['spearman']:+.2f}, top-5% overlap {pair['top_overlap']:.0%}")  # fmt: skip
    print(f"wrote      {out}, {out.with_suffix('.json')}")
    return 0
