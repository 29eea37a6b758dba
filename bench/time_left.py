"""Is the first "about N s left" the page shows close to the time the run then takes?

    python -m bench.time_left [--runs 10] [--burners 2]     (part of make bench)

Runs of mixed settings on the default model through the app's run path
(webapp.runs.execute), beside ``--burners`` CPU-burning processes, each on a new image
(no cells to reuse). Every progress report is recorded with its time, and the page's
lifecycle (webapp.jobs.RunLifecycle) replays it as the run strip does (a status with
each picture, else at most every LIVE_UPDATE_SECONDS), twice on the same reports: with
the pace from the run's first report (the rule before), and as a chunked run now (no
time left until the first chunk is done, the pace from there). For each: the first
time-left the page would show, the time the run actually still took from then, their
ratio, and how many runs are within 25%. ``--burners 0`` runs it on an idle host.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from krypton.synthetic.fundus import FundusGenerator
from webapp import runs
from webapp.jobs import RunLifecycle
from webapp.run_strip import LIVE_UPDATE_SECONDS
from webapp.services import Services

# (mode, stride, region): 100-850 positions each, ~5-60 s beside two burners on 2 cores
CASES = (
    ("exact", 4, (48, 48, 176, 176)),
    ("naive", 8, None),
    ("exact", 8, None),
    ("exact", 4, (0, 0, 112, 112)),
    ("naive", 6, (32, 32, 192, 192)),
    ("exact", 6, None),
    ("exact", 4, (64, 32, 224, 160)),
    ("naive", 4, (80, 80, 176, 176)),
    ("exact", 8, (0, 0, 224, 160)),
    ("exact", 4, (96, 96, 224, 224)),
)
WITHIN = 0.25


@dataclass
class Trace:
    """One run's progress reports: (done, total, picture, seconds since it began)."""

    reports: list[tuple[int, int, bool, float]] = field(default_factory=list)
    seconds: float = 0.0


def record(services: Services, key: str, mode: str, stride: int, region) -> Trace:
    trace = Trace()
    request = runs.RunRequest(
        key=key, name="bench.png", model="fundus-demo", patch=16, stride=stride, mode=mode,
        fill_rgb=(0.5, 0.5, 0.5), region=region,
    )  # fmt: skip
    began = time.perf_counter()

    def report(done: int, total: int, partial=None) -> None:
        if total:
            trace.reports.append((done, total, partial is not None, time.perf_counter() - began))

    runs.execute(services, "bench", request, report)
    trace.seconds = time.perf_counter() - began
    return trace


def first_time_left(trace: Trace, chunked: bool) -> tuple[float, float] | None:
    """(the first time-left the page shows, the seconds the run still took from then) on
    ``trace``, the page's status sent with each picture or at most every
    LIVE_UPDATE_SECONDS; None where it never showed one."""
    lifecycle = RunLifecycle(chunked=chunked)
    lifecycle.queue()
    lifecycle.start()
    sent = -LIVE_UPDATE_SECONDS
    for done, total, picture, when in trace.reports:
        lifecycle.progress(done, total, picture, now=when)
        if not picture and when - sent < LIVE_UPDATE_SECONDS:
            continue
        sent = when
        left = lifecycle.seconds_left()
        if left is not None and done < total:
            return left, trace.seconds - when
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=len(CASES))
    parser.add_argument("--burners", type=int, default=2)
    args = parser.parse_args()
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)
    ]
    rules = {"pace from the first report": False, "after the first chunk (now)": True}
    held = dict.fromkeys(rules, 0)
    try:
        with tempfile.TemporaryDirectory() as home:
            os.environ["KRYPTON_HOME"] = home
            services = Services(Path(home) / "cache")
            generator = FundusGenerator(seed=5)
            print(f"first time-left beside {args.burners} burners")
            head = f"{'run':>3}  {'mode':<6}{'stride':>6} {'region':<20}{'seconds':>8}"
            print(f"{head}  " + "  ".join(f"{name:<31}" for name in rules))
            for number, (mode, stride, region) in enumerate(CASES[: args.runs], 1):
                image = Image.fromarray(generator.sample(label=1, lesions=2).image)
                trace = record(services, services.images.put(image), mode, stride, region)
                cells = []
                for name, chunked in rules.items():
                    found = first_time_left(trace, chunked)
                    if found is None:
                        cells.append(f"{'none shown':<31}")
                        continue
                    shown, actual = found
                    ratio = shown / max(actual, 1e-9)
                    held[name] += abs(ratio - 1) <= WITHIN
                    cells.append(f"{shown:5.1f} s for {actual:5.1f} s ({ratio:4.2f}x)   ")
                print(f"{number:>3}  {mode:<6}{stride:>6} {str(region or 'whole'):<20}"
                      f"{trace.seconds:8.1f}  " + "  ".join(cells))  # fmt: skip
            load = os.getloadavg()
    finally:
        for burner in burners:
            burner.kill()
    print(f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    for name in rules:
        print(f"{name}: first time-left within {WITHIN:.0%} in {held[name]} of {args.runs} runs")


if __name__ == "__main__":
    main()
