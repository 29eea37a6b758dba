"""Krypton on one CUDA card (``make bench-gpu``): per network and precision, the naive
run's seconds and, as ratios of naive's time, exact as planned, exact forced
incremental and approximate; peak GPU memory naive / incremental; and max |exact -
naive|, both at the same precision. Every time is measured with the card synchronised
around the call, after a warm-up run of each mode (cuDNN's algorithm search); the modes
run in turn, three rounds (``--repeats``), and each mode's median is its time.

    python3 -m bench.gpu [--nets vgg16,resnet18] [--precisions fp32,bf16] [--json FILE]

It stops, saying so, without a card; it needs PyTorch and torchvision only (MONAI's
resnet10 row runs where MONAI is installed). 2-D nets: one 224² image (299² for
Inception3), patch 16, stride 4 (2,809 positions; 5,041 for Inception3), batch 128 (the
engine's CUDA default), approximate at τ 0.5 with drill-down 0.25. 3-D nets: one
3×16×112×112 clip (1×64×64×64 for resnet10), patch (4, 16, 16), stride (4, 8, 8).
Random weights, seed 0: speed and exactness do not depend on them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torchvision

import krypton
from krypton.devices import EXACT_TOLERANCE

NETS = (
    "vgg11,vgg13,vgg16,resnet18,resnet34,resnet50,inception_v3,densenet121,"
    "efficientnet_b0,convnext_tiny,r3d_18,mc3_18,monai_resnet10"
)
VOLUME_NETS = ("r3d_18", "mc3_18", "monai_resnet10")


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor] | None:
    """(model on the card in eval mode, its input on the card), or None if unavailable."""
    torch.manual_seed(0)
    if name == "monai_resnet10":
        try:
            from monai.networks.nets import resnet10
        except ImportError:
            return None
        model = resnet10(spatial_dims=3, n_input_channels=1, num_classes=2)
        image = torch.randn(1, 64, 64, 64)
    elif name in ("r3d_18", "mc3_18"):
        model = getattr(torchvision.models.video, name)(weights=None)
        image = torch.randn(3, 16, 112, 112)
    else:
        kwargs = {"aux_logits": False, "init_weights": False} if name == "inception_v3" else {}
        model = torchvision.models.get_model(name, weights=None, **kwargs)
        side = 299 if name == "inception_v3" else 224
        image = torch.randn(3, side, side)
    return model.eval().cuda(), image.cuda()


def run(model, image, precision: str, **options):
    if image.dim() == 4:
        options.update(patch=(4, 16, 16), stride=(4, 8, 8))
    else:
        options.update(patch=16, stride=4, batch_size=128)
    return krypton.explain(model, image, precision=precision, **options)


def timed(call) -> tuple[float, object, float]:
    """(seconds, result, peak MB) of ``call`` with the card synchronised around it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = call()
    torch.cuda.synchronize()
    return time.perf_counter() - started, result, torch.cuda.max_memory_allocated() / 2**20


def row(name: str, precision: str, repeats: int = 3) -> dict | None:
    built = build(name)
    if built is None:
        return None
    model, image = built
    modes = {
        "naive": dict(mode="naive"),
        "exact": dict(mode="exact"),
        "incremental": dict(mode="exact", strategy="incremental"),
    }
    if name not in VOLUME_NETS:
        modes["approximate"] = dict(mode="approximate", tau=0.5, r_drill_down=0.25)
    for options in modes.values():  # warm-up: cuDNN's algorithm search, first calls
        run(model, image, precision, **options)
    # the modes in turn, ``repeats`` rounds: each mode's median time (a card's clocks and
    # a shared host move single readings by ±10%), its result and peak of the first round
    rounds = [
        {
            key: timed(lambda o=options: run(model, image, precision, **o))
            for key, options in modes.items()
        }
        for _ in range(repeats)
    ]
    results = {
        key: (
            float(np.median([r[key][0] for r in rounds])),
            rounds[0][key][1],
            rounds[0][key][2],
        )
        for key in modes
    }
    naive_s, naive, naive_mb = results["naive"]
    incremental_s, incremental, incremental_mb = results["incremental"]
    exact_s, exact, _ = results["exact"]
    difference = float(np.abs(incremental.values - naive.values).max())
    record = {
        "net": name,
        "precision": precision,
        "positions": int(naive.values.size),
        "naive_s": naive_s,
        "exact_x": naive_s / exact_s,
        "planned": str(exact.extra.get("plan", "")).split(":")[0],
        "plan": str(exact.extra.get("plan", "")),  # why, and any switch while it ran
        "incremental_x": naive_s / incremental_s,
        "approximate_x": naive_s / results["approximate"][0] if "approximate" in results else None,
        "naive_mb": naive_mb,
        "incremental_mb": incremental_mb,
        "max_abs_diff": difference,
        "within_tolerance": difference <= EXACT_TOLERANCE[precision],
    }
    return record


def line(r: dict) -> str:
    approximate = "—" if r["approximate_x"] is None else f"{r['approximate_x']:.2f}×"
    return (
        f"| {r['net']} | {r['precision']} | {r['positions']} | {r['naive_s']:.2f} | "
        f"{r['exact_x']:.2f}× ({r['planned']}) | {r['incremental_x']:.2f}× | {approximate} | "
        f"{r['naive_mb']:,.0f} / {r['incremental_mb']:,.0f} | {r['max_abs_diff']:.1e}"
        f"{'' if r['within_tolerance'] else ' (over tolerance)'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nets", default=NETS)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (median)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: make bench-gpu needs one (nothing measured)")
        return
    torch.backends.cudnn.benchmark = True  # as GPU users set it; exactness holds either way
    print(
        f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}; ratios are naive's "
        f"time over each mode's (medians of {args.repeats} rounds), at the same precision "
        f"(fp32: TF32 off)\n"
    )
    print(
        "| net | precision | positions | naive (s) | exact as planned | forced incremental "
        "| approximate | peak MB naive / incremental | max abs diff |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    records = []
    started = time.perf_counter()
    for name in args.nets.split(","):
        for precision in args.precisions.split(","):
            record = row(name, precision, args.repeats)
            torch.cuda.empty_cache()  # the last net's blocks, before the next peak
            if record is None:
                print(f"| {name} | {precision} | (not installed here) |||||||", flush=True)
                continue
            records.append(record)
            print(line(record), flush=True)
            if args.json:  # as it goes: a run stopped at its time limit keeps its rows
                args.json.write_text(json.dumps(records, indent=1))
    print(f"\n{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
