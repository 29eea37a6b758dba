"""Exact against naive, run after run: 14 torchvision and timm networks (depthwise,
squeeze-excitation, DAG, plain), each called through ``krypton.OcclusionExplainer.explain``
in one process, naive and exact alternated, alone and beside one and two CPU burners.

    python -m bench.schedule_matrix [--burners 0 1 2] [--repeats 5] [--size 128]
                                    [--networks mnasnet0_5 timm:gernet_s ...]

Per load and network: a fresh explainer, one first call of each mode (its capture, its
plan and its batch-schedule measurement: paid once and shown as ``first``), then
``--repeats`` alternated naive / exact calls (in turns: n e, e n, ...) on the same image,
label and grid (patch 16, stride 8: 225 positions at 128²). A repeat's ratio is its
naive seconds over its exact seconds; the table prints the median ratio, the worst
repeat's, and each mode's median absolute deviation over its median (``MAD``: how much
one call varies). ``plan`` is what exact ran (naive where incremental cannot pay),
``schedules`` the batch schedule decided for each kind of batch (krypton.schedule) and
``re`` how many were measured again during the repeats (0 unless the load changed band). A
row passes (``ok``) at a median of at least 0.95x and a worst repeat of at least 0.9x;
where the plan is naive, at a median within 0.95-1.05x. The ``control`` row times one
naive call against the same call, alternated the same way: the spread this host gives
two identical calls. Burners are bounded ``python -c`` loops (bench.beside), one per
busy core.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torchvision

import krypton
from bench.beside import _BURN

# name -> (family, builder); 10 classes, random weights: speed does not depend on them
NETWORKS: dict[str, tuple[str, Callable[[], torch.nn.Module]]] = {
    "resnet18": ("DAG (residual)", lambda: torchvision.models.resnet18(num_classes=10)),
    "mobilenet_v2": ("depthwise", lambda: torchvision.models.mobilenet_v2(num_classes=10)),
    "mobilenet_v3_small": (
        "depthwise + SE",
        lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
    ),
    "mnasnet0_5": ("depthwise", lambda: torchvision.models.mnasnet0_5(num_classes=10)),
    "shufflenet_v2_x0_5": (
        "depthwise, shuffle",
        lambda: torchvision.models.shufflenet_v2_x0_5(num_classes=10),
    ),
    "efficientnet_b0": (
        "depthwise + SE",
        lambda: torchvision.models.efficientnet_b0(num_classes=10),
    ),
    "regnet_y_400mf": ("grouped + SE", lambda: torchvision.models.regnet_y_400mf(num_classes=10)),
    "regnet_x_400mf": ("grouped", lambda: torchvision.models.regnet_x_400mf(num_classes=10)),
    "squeezenet1_1": ("DAG (concat)", lambda: torchvision.models.squeezenet1_1(num_classes=10)),
    "googlenet": (
        "DAG (inception)",
        lambda: torchvision.models.googlenet(num_classes=10, aux_logits=False, init_weights=False),
    ),
    "densenet121": ("DAG (dense)", lambda: torchvision.models.densenet121(num_classes=10)),
    "alexnet": ("plain", lambda: torchvision.models.alexnet(num_classes=10)),
    "timm:gernet_s": ("plain + residual", lambda: _timm("gernet_s")),
    "timm:lcnet_050": ("depthwise + SE", lambda: _timm("lcnet_050")),
}


def _timm(name: str) -> torch.nn.Module:
    import timm

    return timm.create_model(name, num_classes=10, pretrained=False)


@contextmanager
def burners(count: int, hours: float = 3.0) -> Iterator[None]:
    """``count`` bounded CPU-burning processes beside the block."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _BURN.format(hours * 3600)]) for _ in range(count)
    ]
    try:
        time.sleep(0.5 if count else 0.0)
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _mad(values: list[float]) -> float:
    """Median absolute deviation over the median."""
    middle = statistics.median(values)
    return statistics.median(abs(value - middle) for value in values) / middle


def network_row(name: str, size: int, repeats: int) -> dict:
    """One network's first calls and alternated repeats on a fresh explainer."""
    torch.manual_seed(0)
    model = NETWORKS[name][1]().eval()
    image = torch.rand(3, size, size)
    explainer = krypton.OcclusionExplainer(model)
    settings = dict(patch=16, stride=8, label=0)

    def call(mode: str) -> tuple[float, krypton.Heatmap]:
        began = time.perf_counter()
        heatmap = explainer.explain(image, mode=mode, **settings)
        return time.perf_counter() - began, heatmap

    first_exact, _ = call("exact")
    first_naive, _ = call("naive")
    measured_before = explainer.schedules.measurements
    seconds: dict[str, list[float]] = {"naive": [], "exact": []}
    last: dict[str, krypton.Heatmap] = {}
    for repeat in range(repeats):  # alternated, in turns (n e, e n, ...): drift cancels
        for mode in ("naive", "exact") if repeat % 2 == 0 else ("exact", "naive"):
            took, last[mode] = call(mode)
            seconds[mode].append(took)
    ratios = [n / e for n, e in zip(seconds["naive"], seconds["exact"])]
    plan = last["exact"].extra.get("plan", "").split(":")[0]
    decisions = last["exact"].extra["host"].get("decisions", {})
    return {
        "network": name,
        "family": NETWORKS[name][0],
        "plan": plan,
        "first": (first_exact, first_naive),
        "naive": statistics.median(seconds["naive"]),
        "exact": statistics.median(seconds["exact"]),
        "mad": (_mad(seconds["naive"]), _mad(seconds["exact"])),
        "ratio": statistics.median(ratios),
        "worst": min(ratios),
        "schedules": {kind: record["schedule"] for kind, record in decisions.items()},
        "positions": last["exact"].positions_evaluated,
        # schedules measured during the repeats: 0 unless the load changed band
        "remeasured": explainer.schedules.measurements - measured_before,
    }


def control_row(name: str, size: int, repeats: int) -> dict:
    """The host's own floor: one naive call against the same naive call, alternated as
    the rows are. Its spread is what a row's can be without any difference of mode."""
    torch.manual_seed(0)
    explainer = krypton.OcclusionExplainer(NETWORKS[name][1]().eval())
    image = torch.rand(3, size, size)
    pairs: list[tuple[float, float]] = []
    explainer.explain(image, mode="naive", patch=16, stride=8, label=0)
    for _ in range(repeats):
        took = []
        for _ in range(2):
            began = time.perf_counter()
            explainer.explain(image, mode="naive", patch=16, stride=8, label=0)
            took.append(time.perf_counter() - began)
        pairs.append((took[0], took[1]))
    ratios = [a / b for a, b in pairs]
    every = [t for pair in pairs for t in pair]
    return {"ratio": statistics.median(ratios), "worst": min(ratios), "mad": _mad(every)}


def passes(row: dict) -> bool:
    """The targets: a median of at least 0.95x and a worst repeat of at least 0.9x; a
    naive plan within 0.95-1.05x at the median."""
    if row["plan"] == "naive":
        return 0.95 <= row["ratio"] <= 1.05 and row["worst"] >= 0.9
    return row["ratio"] >= 0.95 and row["worst"] >= 0.9


def print_row(row: dict) -> None:
    schedules = ", ".join(f"{kind}: {chosen}" for kind, chosen in row["schedules"].items())
    print(
        f"{row['network']:<20} {row['family']:<18} {row['plan']:<11} "
        f"{row['first'][0]:6.2f} {row['first'][1]:6.2f} {row['naive']:7.2f} {row['exact']:7.2f} "
        f"{row['mad'][0] * 100:5.1f}% {row['mad'][1] * 100:5.1f}% {row['ratio']:5.2f}x "
        f"{row['worst']:5.2f}x {'ok' if passes(row) else 'MISS':>4} {row['remeasured']:>3}  "
        f"{schedules}",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burners", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    missed = 0
    for count in args.burners:
        with burners(count):
            print(f"\n## {'alone' if not count else f'beside {count} CPU burners'}", flush=True)
            print(
                f"{'network':<20} {'family':<18} {'plan':<11} {'first e':>6} {'first n':>6} "
                f"{'naive s':>7} {'exact s':>7} {'MAD n':>6} {'MAD e':>6} {'ratio':>6} "
                f"{'worst':>6} {'':>4} {'re':>3}  schedules"
            )
            for name in args.networks:
                row = network_row(name, args.size, args.repeats)
                print_row(row)
                missed += not passes(row)
            floor = control_row("resnet18", args.size, args.repeats)
            print(
                f"{'control':<20} {'naive vs naive':<18} {'(resnet18)':<11} {'':>13} "
                f"{'':>15} {floor['mad'] * 100:5.1f}% {'':>6} {floor['ratio']:5.2f}x "
                f"{floor['worst']:5.2f}x        the host's own spread",
                flush=True,
            )
    print(f"\n{missed} row(s) missed the targets", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
