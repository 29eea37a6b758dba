"""Does the range the page shows before Run contain the time the run then takes?

    python -m bench.estimates [--runs 20]          (part of make bench)

Twenty runs of mixed settings (mode, stride, region) on the default model, each as the
page does it: the estimate shown before Run (webapp.runs.find_estimate, which learns
from this host's runtime log), then the run (webapp.runs.execute, which logs it). Done
twice in one benchmark run, with a fresh runtime log each time: on an idle host, and
with a neighbour process burning every core. Prints each run and the share of runs whose
actual time fell inside the shown range.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from krypton.fundus import FundusGenerator
from webapp import runs
from webapp.services import Services

MODES = ("exact", "exact", "naive", "approximate")
STRIDES = (8, 12, 16)
REGIONS = (None, (0, 0, 112, 112), (48, 32, 176, 160), (64, 64, 224, 224))


def settings(count: int, seed: int = 0) -> list[dict]:
    """``count`` mixed settings, the same list on every call."""
    chooser = random.Random(seed)
    return [
        {
            "mode": chooser.choice(MODES),
            "stride": chooser.choice(STRIDES),
            "region": chooser.choice(REGIONS),
        }
        for _ in range(count)
    ]


def one_pass(count: int, label: str) -> float:
    """Run the settings in a fresh KRYPTON_HOME (an empty runtime log); the coverage."""
    inside = 0
    with tempfile.TemporaryDirectory() as home:
        os.environ["KRYPTON_HOME"] = home
        services = Services(Path(home) / "cache")
        generator = FundusGenerator(seed=3)
        print(f"\n{label}")
        print(f"{'run':>3}  {'mode':<11} {'stride':>6} {'region':<20} {'shown':<26} actual  inside")
        for number, chosen in enumerate(settings(count), 1):
            # a new image per run: no cells to reuse (they are kept per image, not per tab)
            image = Image.fromarray(generator.sample(label=1, lesions=2).image)
            key = services.images.put(image)
            request = runs.RunRequest(
                image_key=key, image_name="bench.png", model="fundus-demo", patch=16,
                stride=chosen["stride"], mode=chosen["mode"], fill_rgb=(0.5, 0.5, 0.5),
                region=chosen["region"],
            )  # fmt: skip
            shown = runs.find_estimate(
                "fundus-demo", 16, request.stride, request.mode, request.region, 0.25, 3.0
            )
            began = time.perf_counter()
            runs.execute(services, "bench", request, lambda *a: None)
            actual = time.perf_counter() - began
            hit = shown is not None and shown.low <= actual <= shown.high
            inside += hit
            text = "none" if shown is None else runs.estimate_text(shown.__dict__)
            print(
                f"{number:>3}  {request.mode:<11} {request.stride:>6} "
                f"{str(request.region or 'whole'):<20} {text:<26} {actual:6.1f}  "
                f"{'yes' if hit else 'NO'}"
            )
    share = inside / count
    print(f"{label}: the shown range contained the actual time in {inside} of {count} runs "
          f"({share:.0%})")  # fmt: skip
    return share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    idle = one_pass(args.runs, "idle host")
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        busy = one_pass(args.runs, f"with a neighbour burning {len(burners)} cores")
    finally:
        for burner in burners:
            burner.kill()
    print(
        f"\nestimate coverage: idle {idle:.0%}, under a CPU-burning neighbour {busy:.0%} "
        f"(targets: idle >= 80%, beside the neighbour >= 60%)"
    )


if __name__ == "__main__":
    main()
