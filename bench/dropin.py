"""Drop-in benchmark: Captum's Occlusion vs krypton.captum.Occlusion, MONAI's
OcclusionSensitivity vs krypton.monai's, at the libraries' own defaults and the call
patterns of their tutorials: a fresh instance per call, both timed alternately in one
process (best of 2), random weights (speed does not depend on them).

    python -m bench.dropin [--quick] [--no-monai]     (or: make bench-dropin)
    python -m bench.dropin --volume-side 64           (the 3-D FLOP/time-limit row)

Captum: window (3, 16, 16) on ResNet18 112² at ``perturbations_per_eval=1`` (Captum's
default) and 16, and VGG16 112² at 16. MONAI: DenseNet121 and ResNet18 2-D 64² at MONAI's
defaults (the small input: fixed costs weigh most);
the 3-D classification tutorial's pattern (DenseNet121, mask 12, a one-slice box) at
``n_batch=1`` and 10; resnet10 3-D at the defaults. The speedup is library seconds over
krypton seconds; the maximum difference between the two results is printed beside it.
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


def paired(library_call, krypton_call, repeats: int = 2) -> tuple[float, float, object, object]:
    """Best-of-``repeats`` seconds of each call, run alternately (library, krypton, ...)
    in one process so load on a shared machine hits both alike; and their last results.
    Each call builds its own instance, as a tutorial's loop does."""
    library_times, krypton_times = [], []
    library_result = krypton_result = None
    for _ in range(repeats):
        library_result, seconds = timed(library_call)
        library_times.append(seconds)
        krypton_result, seconds = timed(krypton_call)
        krypton_times.append(seconds)
    return min(library_times), min(krypton_times), library_result, krypton_result


def captum_row(name: str, side: int, stride: int, per_eval: int, repeats: int = 2) -> dict:
    """Captum's Occlusion and the drop-in on one ``side``-squared image: window
    (3, 16, 16), stride (3, S, S), ``perturbations_per_eval`` as given (Captum's default
    is 1), a fresh instance per call."""
    from captum.attr import Occlusion as CaptumOcclusion

    from krypton.captum import Occlusion

    model = build(name)
    image = torch.randn(1, 3, side, side)
    arguments = dict(
        sliding_window_shapes=(3, 16, 16),
        strides=(3, stride, stride),
        target=0,
        perturbations_per_eval=per_eval,
    )
    engines = []

    def ours():
        occlusion = Occlusion(model)
        result = occlusion.attribute(image, **arguments)
        engines.append(f"{occlusion.last_engine}/{occlusion.last_strategy}")
        return result

    captum_seconds, krypton_seconds, expected, got = paired(
        lambda: CaptumOcclusion(model).attribute(image, **arguments), ours, repeats
    )
    return {
        "case": f"Captum, {name} {side}², stride {stride}, perturbations_per_eval={per_eval}",
        "library": captum_seconds,
        "krypton": krypton_seconds,
        "engine": engines[-1],
        "diff": float((got - expected).abs().max()),
    }


def monai_row(case: str, model, x, settings: dict, box=None, repeats: int = 2) -> dict:
    """MONAI's OcclusionSensitivity and the drop-in, a fresh instance per call."""
    from monai.visualize import OcclusionSensitivity as MonaiOcclusionSensitivity

    from krypton.monai import OcclusionSensitivity

    engines = []

    def ours():
        sensitivity = OcclusionSensitivity(model, verbose=False, **settings)
        result = sensitivity(x, b_box=box)
        engines.append(sensitivity.last_engine)
        return result[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        monai_seconds, krypton_seconds, expected, got = paired(
            lambda: MonaiOcclusionSensitivity(model, verbose=False, **settings)(x, b_box=box)[0],
            ours,
            repeats,
        )
    return {
        "case": case,
        "library": monai_seconds,
        "krypton": krypton_seconds,
        "engine": engines[-1],
        "diff": float((got - expected).abs().max()),
    }


def monai_rows(quick: bool) -> list[dict]:
    import torchvision
    from monai.networks.nets import DenseNet121, resnet10

    torch.manual_seed(0)
    dense_2d = DenseNet121(spatial_dims=2, in_channels=1, out_channels=3).eval()
    dense_3d = DenseNet121(spatial_dims=3, in_channels=1, out_channels=2).eval()
    res_3d = resnet10(spatial_dims=3, n_input_channels=1, num_classes=2).eval()
    small_2d = torchvision.models.resnet18(weights=None, num_classes=3).eval()
    side = 32 if quick else 48
    volume = torch.randn(1, 1, side, side, side)
    middle = side // 2
    # MONAI's 3-D classification tutorial: DenseNet121, mask 12, one slice's box
    tutorial_box = [-1, -1, -1, -1, middle - 1, middle]
    rows = [
        monai_row(
            "MONAI, DenseNet121 2-D 64², defaults",
            dense_2d, torch.randn(1, 1, 64, 64), {},
        ),
        monai_row(  # a small input: the engine's fixed costs weigh most here
            "MONAI, ResNet18 2-D 64², defaults",
            small_2d, torch.randn(1, 3, 64, 64), {},
        ),
        monai_row(
            f"MONAI 3-D tutorial, DenseNet121 {side}³, mask 12, n_batch=1",
            dense_3d, volume, {"mask_size": 12, "n_batch": 1}, tutorial_box,
        ),
        monai_row(
            f"MONAI 3-D tutorial, DenseNet121 {side}³, mask 12, n_batch=10",
            dense_3d, volume, {"mask_size": 12, "n_batch": 10}, tutorial_box,
        ),
        monai_row(
            f"MONAI, resnet10 3-D {side}³, defaults",
            res_3d, volume, {},
        ),
    ]  # fmt: skip
    return rows


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
    parser.add_argument("--quick", action="store_true", help="smaller volumes")
    parser.add_argument("--no-monai", action="store_true")
    parser.add_argument("--volume-side", type=int, default=0, help="the FLOP/time limit row")
    parser.add_argument("--box", help="that row's b_box, e.g. 40,60,40,60,40,60 (both libraries)")
    args = parser.parse_args()
    if args.volume_side:
        box = None if args.box is None else [int(value) for value in args.box.split(",")]
        _print_volume_row(monai_volume_row(args.volume_side, box))
        return
    rows = [
        captum_row("resnet18", 112, 8, 1),  # Captum's default perturbations_per_eval
        captum_row("resnet18", 112, 4, 16),
        captum_row("vgg16", 112, 8, 16),
    ]
    if not args.no_monai:
        rows += monai_rows(args.quick)
    print(
        f"\nThe libraries' classes vs Krypton's drop-ins, a fresh instance per call, "
        f"best of 2 run alternately, {os.cpu_count()} cores (library s / krypton s):\n"
    )
    print("| case | library (s) | krypton (s) | speedup | engine | max abs diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['library']:.2f} | {r['krypton']:.2f} | "
            f"{r['library'] / r['krypton']:.2f}× | {r['engine']} | {r['diff']:.1e} |",
            flush=True,
        )


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
