"""Benchmark: exact (planned) vs naive over the architecture matrix, side by side.

    python -m bench.architectures [--models tv:resnet18,timm:efficientnet_b0] [--side 52]
                                  [--no-neighbour] [--on-off]

Per architecture (random weights, 224x224 — 299 for Inception3 —, patch 16, stride 4,
batch 16, a central region of 100 positions): the FLOP limit from static analysis
(full / incremental MACs for exactly these positions, eqs 9-12 with eq 14's windows: the
paper's per-query limit; the engine's own windows, sized for these positions, are printed
beside it), the share of FLOPs
before the first global op, the capture time, the plan exact mode chose, and the measured
exact/naive ratio and the share of the FLOP limit it reaches. After one first exact call
that captures the graph and times both plans, the ratio is the median over four
back-to-back (naive, exact) pairs on the same explainer, the order swapped every pair
(eight where the first call planned naive: equal work on both sides, whose 1.0x four
pairs cannot tell from 0.95x here): ratios are taken within the run because this machine
is shared and noisy (a best of two per mode read equal work at 0.94x). Then again with a
neighbour: one process per core burning it, as a colleague's job would (the planner's
monitor must keep exact at least as fast as naive under any load), pairs on one torch
thread (--neighbour-threads): two threads on two taken cores stall at random. With
``--on-off``, a third time beside a load that comes and goes: the burners stopped and
resumed every few seconds, as a test suite's bursts are, so the planner's timings and its
monitor's probes meet a load other than the one the batch after them runs under.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from bench.zoo import build
from krypton.torch_threads import threads_for_this_thread

MATRIX = [
    "tv:resnet18",
    "tv:vgg16",
    "tv:inception_v3",
    "tv:densenet121",
    "tv:mobilenet_v2",
    "tv:mobilenet_v3_large",
    "tv:efficientnet_b0",
    "tv:convnext_tiny",
    "tv:regnet_y_400mf",
    "tv:shufflenet_v2_x1_0",
    "tv:resnext50_32x4d",
    "tv:googlenet",
    "tv:squeezenet1_0",
    "timm:resnet50d",
    "timm:efficientnet_b0",
    "timm:convnext_nano",
    "timm:densenet121",
    "timm:regnetx_002",
    "timm:mobilenetv3_large_100",
    "timm:inception_v3",
    "timm:xception41",
    "timm:res2net50_14w_8s",
    "timm:ghostnet_100",
    "timm:hgnetv2_b0",
    "timm:selecsls42b",
    "timm:dla34",
    "timm:cspresnet50",
    "timm:dpn68",
    "timm:repvgg_a0",
    "timm:ese_vovnet19b_dw",
    "timm:rexnet_100",
    "timm:mobilenetv3_small_100",
    # families nobody tuned for (issue 32): >= 40 rows
    "tv:resnet34",
    "tv:vgg11",
    "tv:vgg13",
    "tv:mnasnet1_0",
    "timm:gernet_s",
    "timm:resnest14d",
    "timm:hrnet_w18_small",
    "timm:regnety_002",
    "timm:seresnet18",
    "timm:lcnet_050",
]
PATCH, STRIDE, BATCH = 16, 4, 16
# (naive, exact) pairs per pass. A row whose first call planned naive does the same work on
# both sides, so its true ratio is 1.0 and the 0.95x bar is a test of the measure: four
# pairs put one such row (tv EfficientNet-B0, 2026-11-25) at 0.93x beside the neighbour
# (pairs 0.91-1.05) and 1.06x alone (1.00-1.15), so those rows take eight. The count is
# fixed by the first call's plan, before any pair is timed (never "more pairs until it
# passes").
PAIRS, EQUAL_WORK_PAIRS = 4, 8


def measure(name: str, side: int, neighbour_threads: int = 1, on_off: bool = False) -> dict:
    """One row: alone, then (unless neighbour_threads is 0) beside a CPU burner on
    neighbour_threads torch threads, and (``on_off``) beside burners switched on and off."""
    import krypton
    from krypton.explainer import grid_positions

    model = build(name)
    size = 299 if "inception" in name else 224
    image = torch.randn(3, size, size)
    start = (size - side) // 2
    region = (start, start, start + side, start + side)
    explainer = krypton.OcclusionExplainer(model)
    began = time.perf_counter()
    with torch.inference_mode():
        graph, _ = explainer.views_for(image)
    capture = time.perf_counter() - began
    grid = grid_positions((size, size), PATCH, STRIDE, region)
    ys, xs = np.repeat(grid[0], len(grid[1])), np.tile(grid[1], len(grid[0]))
    # the paper's per-query limit (eq 14's windows) and the engine's own (tight) windows
    incremental, full = graph.macs_per_position(
        graph.geometry((ys, xs), (PATCH, PATCH), tight=False)
    )
    engine_incremental, _ = graph.macs_per_position(graph.geometry((ys, xs), (PATCH, PATCH)))
    first, share = graph.first_global()
    settings = dict(patch=PATCH, stride=STRIDE, region=region, batch_size=BATCH)
    began = time.perf_counter()
    first_call = explainer.explain(image, **settings)
    first_seconds = time.perf_counter() - began
    pairs = EQUAL_WORK_PAIRS if first_call.extra["plan"].startswith("naive") else PAIRS
    alone = paired(explainer, image, settings, name, pairs)
    busy = None
    if neighbour_threads:
        # far noisier: paired calls, the median pair, on neighbour_threads torch threads
        with burning_neighbour(), torch_threads(neighbour_threads):
            busy = paired(explainer, image, settings, name, pairs)
    flickering = None
    if on_off:
        with on_off_neighbour():
            flickering = paired(explainer, image, settings, name, pairs)
    return {
        "model": name,
        "positions": int(first_call.values.size),
        "flop_limit": full / incremental,
        "engine_flop_limit": full / engine_incremental,
        "share_before_first_global": share,
        "first_global": first,
        "capture_s": capture,
        "first_call_s": first_seconds,
        "exact_s": alone["exact_s"],
        "naive_s": alone["naive_s"],
        "ratio": alone["ratio"],
        "limit_reached": alone["ratio"] / (full / incremental),
        "plan": alone["plan"],
        "pair_ratios": alone["pair_ratios"],
        "pairs": pairs,
        "strategy": alone["plan"].split(":")[0],
        "first_plan": first_call.extra["plan"],
        "ratio_with_neighbour": None if busy is None else busy["ratio"],
        "plan_with_neighbour": None if busy is None else busy["plan"],
        "pair_ratios_with_neighbour": None if busy is None else busy["pair_ratios"],
        "ratio_on_off": None if flickering is None else flickering["ratio"],
        "plan_on_off": None if flickering is None else flickering["plan"],
        "pair_ratios_on_off": None if flickering is None else flickering["pair_ratios"],
        "torch_threads": torch.get_num_threads(),
        "torch_threads_with_neighbour": neighbour_threads or None,
        "overhead": None,
    }


def timed_call(explainer, image: torch.Tensor, mode: str, settings: dict) -> tuple[float, object]:
    """(seconds, heatmap) of one explain call in ``mode``."""
    began = time.perf_counter()
    heatmap = explainer.explain(image, mode=mode, **settings)
    return time.perf_counter() - began, heatmap


def paired(explainer, image: torch.Tensor, settings: dict, name: str, pairs: int = PAIRS) -> dict:
    """``pairs`` back-to-back (naive, exact) pairs, the order swapped every pair, and the
    median of the pairs' naive/exact ratios.

    Alone, a best of two calls per mode read equal work (a naive plan on both sides) at
    0.94x on this shared host, where six pairs read 0.97-1.02x. Beside a burner the same
    call drifts by several times within a minute (MobileNetV3-Small's naive call: 3.2 s,
    then 13.9 s, torch's two threads stalling on two busy cores), so the best of each mode
    compares calls taken at different moments; a pair's two calls share the moment, the
    swapped order cancels a drift's favour to whichever runs second, and the median drops
    a pair a stall hit."""
    ratios, exact_times, naive_times = [], [], []
    for index in range(pairs):
        order = ("naive", "exact") if index % 2 == 0 else ("exact", "naive")
        timed = {mode: timed_call(explainer, image, mode, settings) for mode in order}
        assert np.allclose(timed["exact"][1].values, timed["naive"][1].values, atol=1e-4), name
        naive_times.append(timed["naive"][0])
        exact_times.append(timed["exact"][0])
        ratios.append(timed["naive"][0] / timed["exact"][0])
    return {
        "exact_s": float(np.median(exact_times)),
        "naive_s": float(np.median(naive_times)),
        "ratio": float(np.median(ratios)),
        "pair_ratios": [round(r, 3) for r in ratios],
        "plan": timed["exact"][1].extra["plan"],
    }


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Torch's intra-op threads set to ``count`` for the block, in this thread only, then
    restored (torch.set_num_threads would make the count the caller's for every later
    run of the process: krypton.torch_threads)."""
    with threads_for_this_thread(count):
        yield


@contextlib.contextmanager
def burning_neighbour() -> Iterator[list[subprocess.Popen]]:
    """One process per core spinning, for as long as the block runs (the processes)."""
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        time.sleep(0.5)  # let the scheduler see them
        yield burners
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


@contextlib.contextmanager
def on_off_neighbour(on_seconds: float = 3.0, off_seconds: float = 2.0) -> Iterator[None]:
    """The burning neighbour, stopped and resumed (SIGSTOP / SIGCONT) every few seconds
    for as long as the block runs: a load that comes and goes."""
    done = threading.Event()
    with burning_neighbour() as burners:

        def switch() -> None:
            running = True
            while not done.wait(on_seconds if running else off_seconds):
                for burner in burners:
                    burner.send_signal(signal.SIGSTOP if running else signal.SIGCONT)
                running = not running

        switcher = threading.Thread(target=switch, daemon=True)
        switcher.start()
        try:
            yield
        finally:
            done.set()
            switcher.join()


def below_limit_target(row: dict) -> bool:
    """A limit worth reaching (>= 1.5x) of which exact reached under 0.8 (alone)."""
    return row["flop_limit"] >= 1.5 and row["ratio"] < 0.8 * row["flop_limit"]


def verdict(row: dict) -> str:
    """Which target the row meets: >= 0.95x naive always (alone, beside the neighbour
    and beside the on-off load); >= 0.8x of a limit >= 1.5x (alone)."""
    problems = []
    for where, ratio, pairs, plan in (
        ("alone", row["ratio"], row.get("pair_ratios"), row["plan"]),
        (
            "beside the neighbour",
            row.get("ratio_with_neighbour"),
            row.get("pair_ratios_with_neighbour"),
            row.get("plan_with_neighbour"),
        ),
        (
            "beside a load that comes and goes",
            row.get("ratio_on_off"),
            row.get("pair_ratios_on_off"),
            row.get("plan_on_off"),
        ),
    ):
        if ratio is None or ratio >= 0.95:
            continue
        pairs = pairs or [ratio]
        equal = row["strategy"] == "naive" and str(plan).startswith("naive")
        note = "both ran naive: equal work, " if equal else ""
        problems.append(
            f"below 0.95x naive {where} ({note}pairs {min(pairs):.2f}-{max(pairs):.2f}x)"
        )
    if below_limit_target(row):
        problems.append(
            f"below 0.8x of its {row['flop_limit']:.2f}x limit"
            + (f" ({row['overhead']})" if row.get("overhead") else "")
        )
    return "; ".join(problems) or "met"


def print_table(rows: list[dict]) -> None:
    print(
        "| model | FLOP limit | FLOPs before first global op | first global op | capture (s) "
        "| naive (s) | exact (s) | exact/naive | share of limit | exact/naive, neighbour "
        "| exact/naive, on-off load | plan | target |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        busy = r.get("ratio_with_neighbour")
        on_off = r.get("ratio_on_off")
        print(
            f"| {r['model']} | {r['flop_limit']:.2f}x | {r['share_before_first_global']:.0%} | "
            f"{r['first_global']} | {r['capture_s']:.2f} | {r['naive_s']:.2f} | "
            f"{r['exact_s']:.2f} | {r['ratio']:.2f}x | {r['limit_reached']:.0%} | "
            f"{'-' if busy is None else f'{busy:.2f}x'} | "
            f"{'-' if on_off is None else f'{on_off:.2f}x'} | {r['strategy']} | {verdict(r)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MATRIX))
    parser.add_argument("--side", type=int, default=52, help="region side (52: 100 positions)")
    parser.add_argument("--json", default="out/bench-architectures.json")
    parser.add_argument(
        "--no-neighbour", action="store_true", help="skip the runs beside a CPU burner"
    )
    parser.add_argument(
        "--neighbour-threads",
        type=int,
        default=1,
        help="torch threads beside the burner (1, as docs/team.md runs a shared core: two "
        "threads on two taken cores stall 2-7x at random, burying the plans' difference)",
    )
    parser.add_argument(
        "--on-off", action="store_true", help="also beside burners switched on and off"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_grad_enabled(False)
    rows, failed = [], []
    for name in args.models.split(","):
        try:
            threads = 0 if args.no_neighbour else args.neighbour_threads
            row = measure(name, args.side, neighbour_threads=threads, on_off=args.on_off)
        except Exception as error:  # a row that cannot run says why; the others go on
            print(f"{name}: FAILED {type(error).__name__}: {error}", flush=True)
            failed.append(name)
            continue
        if below_limit_target(row):  # name the measured overhead that prevents it
            from bench.profile import overhead, profile

            row["overhead"] = overhead(profile(name))
        rows.append(row)
        busy = row["ratio_with_neighbour"]
        print(
            f"{name}: limit {row['flop_limit']:.2f}x (engine's windows "
            f"{row['engine_flop_limit']:.2f}x), exact/naive {row['ratio']:.2f}x "
            f"({row['limit_reached']:.0%} of it; pairs {row['pair_ratios']})"
            + (
                ""
                if busy is None
                else f", beside the neighbour {busy:.2f}x (pairs "
                f"{row['pair_ratios_with_neighbour']})"
            )
            + (
                ""
                if row["ratio_on_off"] is None
                else f", beside the on-off load {row['ratio_on_off']:.2f}x (pairs "
                f"{row['pair_ratios_on_off']})"
            )
            + f" ({row['plan']}); target: {verdict(row)}",
            flush=True,
        )
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))  # rows so far, if stopped
    print()
    print_table(rows)
    missed = [r["model"] for r in rows if verdict(r) != "met"]
    print(
        f"\n{len(rows) - len(missed)} of {len(rows)} rows meet their targets; missed: "
        f"{missed}; could not run: {failed}"
    )


if __name__ == "__main__":
    main()
