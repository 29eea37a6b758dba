"""Benchmark: approximate mode's quality on trained weights and its speed, side by side.

    python -m bench.approximate [--images 20] [--no-speed]

Quality (the demo model, its tuned τ, held-out generated images with one lesion each,
the model's own patch as the app defaults to it (fundus-demo: 12), stride 4): per
setting and drill-down rule, SSIM against exact, the localisation figures
(:func:`krypton.approximate.tuning.localisation`: the exact map's lowest cell among the approximate
map's lowest 1%, and the overlap of the lowest 5%), whether the approximate map's lowest
cell still points at the lesion, and the time against naive. Speed (random weights,
central regions as in bench.bench, patch 16): VGG16 and ResNet18 at r 0.1 / target 5
with the paper's τ, and timm EfficientNet-B0 / MobileNetV3-Large with frozen gates,
against naive in the same run.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch

PATCH, STRIDE = 16, 4  # the speed part's (the paper's patch); quality uses the model's
SETTINGS = ((0.25, 3.0), (0.1, 5.0), (0.4, 2.0))  # the first is explain()'s default
RULES = ("drop+variation", "drop")


def add_scores(record: dict, exact, approx, lesion, seconds: float, patch: int) -> None:
    """Append one image's figures for an approximate heatmap against the exact one."""
    from krypton.approximate.tuning import heatmap_ssim, localisation

    where = localisation(exact.values, approx.values)
    row, col = np.unravel_index(np.nanargmin(approx.values), approx.values.shape)
    for key, value in (
        ("ssim", heatmap_ssim(exact.values, approx.values, exact.prob)),
        ("kept", where.minimum_kept),
        ("overlap", where.lowest_overlap),
        ("points", lesion.covered_by(int(approx.xs[col]), int(approx.ys[row]), patch)),
        ("seconds", seconds),
        ("positions", approx.positions_evaluated),
        ("error", float(np.nanmax(np.abs(approx.values - exact.values)))),
    ):
        record.setdefault(key, []).append(value)


def quality(count: int, patch: int | None = None) -> None:
    from PIL import Image

    import krypton
    from krypton.synthetic.fundus import FundusGenerator

    loaded = krypton.load_model("fundus-demo")
    generator = FundusGenerator(seed=7, size=loaded.input_size[0])
    explainer = krypton.OcclusionExplainer(loaded.module)
    fill = loaded.gray_fill()
    patch = loaded.patch if patch is None else patch
    rows: dict[tuple, dict[str, list]] = {}
    naive_times, exact_times = [], []
    taus: set[tuple[float, str]] = set()  # what the heatmaps say they used
    for index in range(count):
        sample = generator.sample(label=1 + index % 2, lesions=1)
        image = loaded.preprocess(Image.fromarray(sample.image))
        lesion = sample.lesions[0]
        common = dict(patch=patch, stride=STRIDE, fill=fill)
        if index < 3:  # naive on a few images: it is the slow one
            naive_times.append(explainer.explain(image, mode="naive", **common).seconds)
        exact = explainer.explain(image, **common)
        exact_times.append(exact.seconds)
        for setting in SETTINGS:
            for rule in RULES:
                approx = explainer.explain(
                    image,
                    mode="approximate",
                    r_drill_down=setting[0],
                    target_speedup=setting[1],
                    refine_by=rule,
                    label=exact.label,
                    tuning=loaded.tuning,  # the model's tuned τ, as the app and CLI use it
                    **common,
                )
                taus.add((approx.extra["tau"], approx.extra["tau_source"]))
                record = rows.setdefault((setting, rule), {})
                add_scores(record, exact, approx, lesion, approx.seconds, patch)
        print(f"  image {index + 1}/{count}", flush=True)
    naive = float(np.median(naive_times))
    used = "; ".join(f"τ {tau:g} — {source}" for tau, source in sorted(taus))
    print(
        f"\nApproximate mode, quality (trained weights: fundus-demo, "
        f"{loaded.input_size[0]}x{loaded.input_size[1]}, {count} held-out generated images "
        f"with one lesion, patch {patch}, stride {STRIDE}, {used}):\n"
    )
    print(
        "| setting | drill-down rule | positions | mean SSIM | min SSIM | lowest cell kept "
        "| lowest 5% overlap | points at the lesion | median seconds | × naive |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| exact | | {exact.values.size} | 1.000 | 1.000 | {count}/{count} | 100% | | "
        f"{np.median(exact_times):.2f} | {naive / np.median(exact_times):.1f}× |"
    )
    for (setting, rule), record in rows.items():
        ssim = np.array(record["ssim"])
        print(
            f"| r={setting[0]:g} target={setting[1]:g} | {rule} | "
            f"{np.mean(record['positions']):.0f} | {ssim.mean():.3f} | {ssim.min():.3f} | "
            f"{sum(record['kept'])}/{count} | {np.mean(record['overlap']):.0%} | "
            f"{sum(record['points'])}/{count} | {np.median(record['seconds']):.2f} | "
            f"{naive / np.median(record['seconds']):.1f}× |"
        )
    print(
        f"\n(naive: {naive:.2f} s per image, median of {len(naive_times)}; seconds are medians "
        "over the images: a shared machine's stalls would move a mean)"
    )


def speed() -> None:
    import timm

    import krypton
    from krypton.registry.models import load_torchvision_model

    cases = [
        ("vgg16", 52, 0.5, True),
        ("vgg16", 100, 0.5, True),
        ("resnet18", 136, 0.7, True),
        ("timm:efficientnet_b0", 100, 1.0, True),
        ("timm:mobilenetv3_large_100", 100, 1.0, True),
        ("timm:efficientnet_b0", 100, 1.0, False),
    ]
    print(
        "\nApproximate mode, speed (random weights, 224x224, patch 16, stride 4, central "
        "region, r 0.1 / target 5; τ the paper's for VGG16/ResNet18, 1.0 for the gated "
        "nets):\n"
    )
    print(
        "| model | region | τ | frozen gates | positions | capture, once (s) | naive (s) "
        "| approximate (s) | × naive |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, side, tau, freeze in cases:
        if name.startswith("timm:"):
            torch.manual_seed(0)
            module = timm.create_model(name[5:], pretrained=False).eval()
        else:
            module = load_torchvision_model(name, random_weights=True).module
        image = torch.randn(3, 224, 224)
        start = (224 - side) // 2
        region = (start, start, start + side, start + side)
        explainer = krypton.OcclusionExplainer(module)
        common = dict(patch=PATCH, stride=STRIDE, region=region, batch_size=16)
        # Capture once on another image, as a session does for its first picture: the
        # timed run still materialises this image's views, but does not trace the model.
        began = time.perf_counter()
        explainer.explain(
            torch.randn(3, 224, 224),
            mode="approximate",
            tau=tau,
            freeze_gates=freeze,
            patch=PATCH,
            positions=[(0, 0)],
        )
        capture = time.perf_counter() - began
        began = time.perf_counter()
        naive = explainer.explain(image, mode="naive", **common)
        naive_seconds = time.perf_counter() - began
        began = time.perf_counter()
        approx = explainer.explain(
            image,
            mode="approximate",
            tau=tau,
            r_drill_down=0.1,
            target_speedup=5.0,
            freeze_gates=freeze,
            **common,
        )
        seconds = time.perf_counter() - began
        print(
            f"| {name} | {side} | {tau} | {len(approx.extra['frozen_gates']) or 'none'} | "
            f"{approx.positions_evaluated} of {naive.values.size} | {capture:.2f} | "
            f"{naive_seconds:.2f} | {seconds:.2f} | {naive_seconds / seconds:.1f}× |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--no-quality", action="store_true")
    parser.add_argument("--patch", type=int, help="quality: default the model's own (registry)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if not args.no_quality:
        quality(args.images, args.patch)
    if not args.no_speed:
        speed()


if __name__ == "__main__":
    main()
