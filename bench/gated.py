"""Benchmark: frozen gates on trained weights.

    python -m bench.gated [--epochs 12] [--images 12]

No model with squeeze-excitation gates and trained weights can be downloaded here, so this
trains one: torchvision's MobileNetV3-Small on the demo task (generated fundus images,
at the generator's size, the demo model's recipe; seeded; cached under out/ by size, so a
second run skips it and a generator of another size does not reuse it).
Then, on held-out images with one lesion each, approximate mode with the gates frozen is
compared with exact: at τ 1 without drill-down (the gates' error alone) and at the default
drill-down setting — SSIM, the localisation figures, whether the lowest cell still points
at the lesion, and the time against naive, all in one run.
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from bench.approximate import PATCH, STRIDE, add_scores
from krypton.synthetic.fundus import IMAGE_SIZE

WEIGHTS = Path(f"out/fundus-gated-mobilenet_v3_small-{IMAGE_SIZE}px.pt")


def trained(epochs: int) -> torch.nn.Module:
    from demo.fundus.evaluate import accuracy
    from demo.fundus.train import build_model, recalibrate_batch_norm, train

    model = build_model("mobilenet_v3_small")
    if WEIGHTS.exists():
        model.load_state_dict(torch.load(WEIGHTS, weights_only=True))
        print(f"weights from {WEIGHTS}")
    else:
        model, record = train(epochs=epochs, architecture="mobilenet_v3_small")
        WEIGHTS.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), WEIGHTS)
        print(f"trained in {record['train_seconds']:.0f} s; wrote {WEIGHTS}")
    recalibrate_batch_norm(model)  # its BN momentum (0.01) leaves eval statistics stale
    print(f"held-out accuracy {accuracy(model, count=300):.3f} (300 generated images)")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--images", type=int, default=12)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import krypton
    from demo.fundus.data import to_tensor
    from krypton.synthetic.fundus import FundusGenerator

    model = trained(args.epochs)
    explainer = krypton.OcclusionExplainer(model)
    generator = FundusGenerator(seed=7)
    settings = {
        "frozen gates, τ 1, no drill-down": dict(tau=1.0, r_drill_down=1.0),
        "frozen gates, τ 1, r 0.25 / target 3": dict(tau=1.0),
        "gates exact, τ 1, r 0.25 / target 3": dict(tau=1.0, freeze_gates=False),
    }
    rows = {name: {} for name in settings}
    naive_times, exact_times, gates = [], [], 0
    for index in range(args.images):
        sample = generator.sample(label=1 + index % 2, lesions=1)
        image = to_tensor(sample.image[None])[0]
        common = dict(patch=PATCH, stride=STRIDE)
        if index < 2:
            began = time.perf_counter()
            explainer.explain(image, mode="naive", **common)
            naive_times.append(time.perf_counter() - began)
        began = time.perf_counter()
        exact = explainer.explain(image, **common)
        exact_times.append(time.perf_counter() - began)
        for name, options in settings.items():
            began = time.perf_counter()
            approx = explainer.explain(
                image, mode="approximate", label=exact.label, **common, **options
            )
            seconds = time.perf_counter() - began
            gates = max(gates, len(approx.extra["frozen_gates"]))
            add_scores(rows[name], exact, approx, sample.lesions[0], seconds)
        print(f"  image {index + 1}/{args.images}", flush=True)
    naive = float(np.mean(naive_times))
    print(
        f"\nFrozen gates on trained weights (MobileNetV3-Small trained here on the demo task, "
        f"{gates} gates, {IMAGE_SIZE}x{IMAGE_SIZE}, {args.images} held-out lesion images, "
        f"patch {PATCH}, "
        f"stride {STRIDE}; exact ran {naive / np.mean(exact_times):.2f}x naive):\n"
    )
    print(
        "| setting | mean SSIM | min SSIM | lowest cell kept | lowest 5% overlap "
        "| points at the lesion | largest probability error | seconds | × naive |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, record in rows.items():
        ssim = np.array(record["ssim"])
        count = len(ssim)
        print(
            f"| {name} | {ssim.mean():.3f} | {ssim.min():.3f} | {sum(record['kept'])}/{count} | "
            f"{np.mean(record['overlap']):.0%} | {sum(record['points'])}/{count} | "
            f"{max(record['error']):.3f} | {np.mean(record['seconds']):.2f} | "
            f"{naive / np.mean(record['seconds']):.1f}× |"
        )
    print(f"\n(naive: {naive:.2f} s per image, mean of {len(naive_times)})")


if __name__ == "__main__":
    main()
