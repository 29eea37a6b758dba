"""Drop-in benchmark: Captum's Occlusion vs krypton.captum.Occlusion, MONAI's
OcclusionSensitivity vs krypton.monai's — side by side in one run, same machine, same
windows, same batch size, random weights (speed does not depend on them).

    python -m bench.dropin [--models resnet18,vgg16,timm:resnet18] [--captum-stride 4]
                           (or: make bench-dropin)

Captum: 224 x 224 input, window (3, 16, 16), stride (3, S, S), 16 occluded images per
forward. MONAI: a 2-D ResNet18 at MONAI's defaults (mask 16, overlap 0.6, gaussian, batch
16), and a 3-D DenseNet121 on a 64^3 volume at the same defaults (``--volume-side``).
Every figure is one run of each library on the same image; the maximum difference between
the two results is printed next to the times.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name.startswith("timm:"):
        import timm

        return timm.create_model(name[5:], pretrained=False).eval()
    import torchvision

    return torchvision.models.get_model(name, weights=None).eval()


def timed(call):
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def captum_rows(names: list[str], stride: int) -> list[dict]:
    from captum.attr import Occlusion as CaptumOcclusion

    from krypton.captum import Occlusion

    rows = []
    image = torch.randn(1, 3, 224, 224)
    arguments = dict(
        sliding_window_shapes=(3, 16, 16),
        strides=(3, stride, stride),
        target=0,
        perturbations_per_eval=16,
    )
    for name in names:
        model = build(name)
        ours = Occlusion(model)
        krypton_result, krypton_seconds = timed(lambda: ours.attribute(image, **arguments))  # noqa: B023
        captum_result, captum_seconds = timed(
            lambda: CaptumOcclusion(model).attribute(image, **arguments)  # noqa: B023
        )
        rows.append(
            {
                "model": name,
                "captum": captum_seconds,
                "krypton": krypton_seconds,
                "engine": ours.last_engine,
                "diff": float((krypton_result - captum_result).abs().max()),
            }
        )
        print(
            f"  {name}: Captum {captum_seconds:.1f} s, Krypton {krypton_seconds:.1f} s "
            f"({ours.last_engine})",
            flush=True,
        )
    return rows


def monai_row() -> dict:
    from monai.visualize import OcclusionSensitivity as MonaiOcclusionSensitivity

    from krypton.monai import OcclusionSensitivity

    model = build("resnet18")
    image = torch.randn(1, 3, 224, 224)
    ours = OcclusionSensitivity(model, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        (krypton_map, _), krypton_seconds = timed(lambda: ours(image))
        (monai_map, _), monai_seconds = timed(
            lambda: MonaiOcclusionSensitivity(model, verbose=False)(image)
        )
    return {
        "model": "resnet18",
        "monai": monai_seconds,
        "krypton": krypton_seconds,
        "engine": ours.last_engine,
        "diff": float((krypton_map - monai_map).abs().max()),
    }


def monai_volume_row(side: int, box: list[int] | None = None) -> dict:
    """MONAI's defaults on a 3-D DenseNet121 over a ``side``-cubed one-channel volume
    (MONAI's 3-D tutorials): both libraries on the same volume, the FLOP limit beside.
    ``box``: MONAI's ``b_box`` (min, max per axis, inclusive), the same for both, so a
    large volume can be timed on its central windows."""
    from monai.networks.nets import DenseNet121
    from monai.visualize import OcclusionSensitivity as MonaiOcclusionSensitivity

    import krypton
    from krypton.monai import OcclusionSensitivity

    torch.manual_seed(0)
    model = DenseNet121(spatial_dims=3, in_channels=1, out_channels=2).eval()
    volume = torch.randn(1, 1, side, side, side)
    ours = OcclusionSensitivity(model, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        (krypton_map, _), krypton_seconds = timed(lambda: ours(volume, b_box=box))
        (monai_map, _), monai_seconds = timed(
            lambda: MonaiOcclusionSensitivity(model, verbose=False)(volume, b_box=box)
        )
    where = "" if box is None else f", b_box {box}"
    batch = max(1, round(16 * (64 / side) ** 3))  # MONAI's 16 at 64^3, memory alike
    time_bound, in_full = time_limit(model, volume, 16, batch)
    return {
        "model": f"DenseNet121 3-D, {side}^3{where}",
        "monai": monai_seconds,
        "krypton": krypton_seconds,
        "engine": ours.last_engine,
        "diff": float((krypton_map - monai_map).abs().max()),
        "limit": krypton.theoretical_speedup(model, (1, side, side, side), 16),
        "time_limit": time_bound,
        "in_full": in_full,
    }


def time_limit(
    model: torch.nn.Module, volume: torch.Tensor, mask: int, batch: int = 16
) -> tuple[float, float]:
    """The time analogue of the FLOP limit for a centred ``mask``: a full forward pass of
    ``batch`` copies of ``volume`` (1, C, D, H, W) timed node by node (bench.profile's
    TimedInterpreter, best of two), each node's seconds scaled by the share of its output
    the engine's windows for that position cover (1 from the first global op on, 0 for
    what does not depend on the image). Returns (full time over that time, the share of
    the full time in nodes the mask changes in full): what an exact method gains at most
    with PyTorch's own kernels."""
    import numpy as np

    import krypton
    from bench.profile import TimedInterpreter, best_of
    from krypton.engine import NodeKind

    with torch.inference_mode():
        graph, _ = krypton.OcclusionExplainer(model).views_for(volume[0])
        corner = tuple(np.array([(size - mask) // 2]) for size in volume.shape[2:])
        geometry = graph.geometry(corner, (mask,) * len(corner))
        volumes = volume.repeat(batch, *([1] * (volume.dim() - 1)))
        timings = best_of(2, lambda t: TimedInterpreter(graph.module, t).run(volumes))
    needed = in_full = 0.0
    for step in graph.steps:
        seconds = timings.get(step.node.name, 0.0)
        windows = geometry.windows.get(step.node)
        if step.kind == NodeKind.GLOBAL:
            share = 1.0
        elif windows is None:
            share = 0.0
        else:
            spatial = [graph.shapes[step.node][d] for d in graph.dims_of(step.node)]
            share = float(np.prod([w.length / n for w, n in zip(windows, spatial)]))
        needed += min(share, 1.0) * seconds
        in_full += seconds if share >= 1.0 else 0.0
    total = sum(timings.values())
    return total / needed, in_full / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,vgg16,timm:resnet18")
    parser.add_argument("--captum-stride", type=int, default=4)
    parser.add_argument("--no-monai", action="store_true")
    parser.add_argument("--volume-side", type=int, default=64, help="0 skips the 3-D row")
    parser.add_argument("--only-volume", action="store_true", help="just the 3-D MONAI row")
    parser.add_argument(
        "--box", help="the 3-D row's b_box, e.g. 40,60,40,60,40,60 (both libraries)"
    )
    args = parser.parse_args()
    box = None if args.box is None else [int(value) for value in args.box.split(",")]
    if args.only_volume:
        _print_volume_row(monai_volume_row(args.volume_side, box))
        return
    rows = captum_rows(args.models.split(","), args.captum_stride)
    print(
        f"\nCaptum's Occlusion vs krypton.captum.Occlusion: 224x224, window (3, 16, 16), "
        f"stride (3, {args.captum_stride}, {args.captum_stride}), batch 16, "
        f"{os.cpu_count()} cores, one run each:\n"
    )
    print("| model | Captum (s) | krypton.captum (s) | speedup | engine | max abs diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['captum']:.1f} | {r['krypton']:.1f} | "
            f"{r['captum'] / r['krypton']:.2f}× | {r['engine']} | {r['diff']:.1e} |"
        )
    if not args.no_monai:
        r = monai_row()
        print(
            "\nMONAI's OcclusionSensitivity vs krypton.monai's, 2-D ResNet18 224x224, "
            "MONAI's defaults (mask 16, overlap 0.6, gaussian, batch 16):\n"
        )
        print("| model | MONAI (s) | krypton.monai (s) | speedup | engine | max abs diff |")
        print("|---|---|---|---|---|---|")
        print(
            f"| {r['model']} | {r['monai']:.1f} | {r['krypton']:.1f} | "
            f"{r['monai'] / r['krypton']:.2f}× | {r['engine']} | {r['diff']:.1e} |"
        )
        if args.volume_side:
            _print_volume_row(monai_volume_row(args.volume_side, box))


def _print_volume_row(r: dict) -> None:
    print(
        "\nMONAI's OcclusionSensitivity vs krypton.monai's on a volume, MONAI's defaults "
        "(mask 16, overlap 0.6, gaussian, batch 16):\n"
    )
    print(
        "| model | MONAI (s) | krypton.monai (s) | speedup | FLOP limit | time limit "
        "| in full | engine | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {r['model']} | {r['monai']:.1f} | {r['krypton']:.1f} | "
        f"{r['monai'] / r['krypton']:.2f}× | {r['limit']:.2f}× | {r['time_limit']:.2f}× | "
        f"{r['in_full']:.0%} | {r['engine']} | {r['diff']:.1e} |"
    )
    print(
        "\n(time limit: a full pass timed node by node, each node's time scaled by the "
        "share a centred mask changes (bench.dropin.time_limit); in full: the share of the "
        "time in nodes it changes in full, which no exact method skips)"
    )


if __name__ == "__main__":
    main()
