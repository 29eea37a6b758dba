"""Load run against a real server: many sessions at once plus abandoned jobs.

    python -m bench.load [--sessions 16] [--abandoned 3]      (or: make bench-load)
    python -m bench.load --hostile [--sessions 8]              (the hostile mix, also there)

Starts ``python app.py`` on a free local port (loopback only) with the shipped models,
then at the same moment: ``--abandoned`` clients start a long naive run and never poll it
again (their tab was closed), and ``--sessions`` clients each load the page, upload a
fundus image, get the prediction and run an exact heatmap over a small region, polling as
the browser does. Reports what each session saw (its queue position), the time to its
result, light-request latency during the load, and the server's CPU use once the
abandon window (KRYPTON_ABANDON_SECONDS) has passed — where abandoned runs would show up
as runaway CPU.
With ``--hostile``, the server is the production one (``make serve``) and the sessions
run while the twelve hostile requests of the cost audit (bench/hostile.py: decode bombs,
a 49 MP image, an architecture bomb, JSON amplification, a 10,000-class model's results,
idle sockets, a duplicate-key body, 34 made-up sessions, a foreign DICOM key, look-alike
and mathtext names, malformed DICOM) arrive among them; it reports whether every normal
session finished, the light-request p95 and the server's peak RSS (psutil).
Bounded: every client stops after its run or after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

from PIL import Image

from bench.dash_client import Server, Tab, loopback
from krypton.synthetic.fundus import FundusGenerator
from webapp.settings import ServerSettings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--abandoned", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--hostile", action="store_true", help="the hostile mix")
    args = parser.parse_args()
    image = Image.fromarray(FundusGenerator(seed=3).sample(label=1, lesions=1).image)
    with tempfile.TemporaryDirectory() as folder:
        if args.hostile:
            from bench.hostile_mix import run_mix

            run_mix(Path(folder), image, args.sessions, args.timeout)
            return
        server = Server(Path(folder))
        try:
            report(server, image, args)
        finally:
            server.stop()


def report(server: Server, image: Image.Image, args) -> None:
    results: dict[int, dict] = {}
    light: list[float] = []
    start = threading.Barrier(args.sessions + args.abandoned)

    def abandon(index: int) -> None:
        tab = Tab.at(server.url, loopback(index, block=2))  # each client its own address
        data = tab.upload_image(image)
        start.wait()
        tab.run(data, mode="naive", patch=4, stride=2, poll=False)  # then the tab closes

    def session(index: int) -> None:
        tab = Tab.at(server.url, loopback(index))
        data = tab.upload_image(image)
        start.wait()
        began = time.perf_counter()
        tab.predict(data)
        handles = tab.run(data, mode="exact", region=[32, 32, 96, 96], stride=8, poll=False)
        queue_positions = set()
        deadline = time.time() + args.timeout
        answer = None
        while time.time() < deadline:
            polled = time.perf_counter()
            answer = tab.poll_once("run-outcome.data", handles)
            light.append(time.perf_counter() - polled)
            if answer is None or "response" in answer:
                break
            status = (answer.get("progress") or {}).get("live-status.children") or ""
            if status.startswith("Queued:"):
                queue_positions.add(int(status.split()[1]))
            time.sleep(0.5)
        done = answer is not None and "run-outcome" in (answer.get("response") or {})
        message = ((answer or {}).get("response") or {}).get("message", {}).get("children")
        results[index] = {
            "seconds": time.perf_counter() - began,
            "done": done,
            "queued": sorted(queue_positions),
            "message": message,
        }

    threads = [threading.Thread(target=abandon, args=(i,)) for i in range(args.abandoned)]
    threads += [threading.Thread(target=session, args=(i,)) for i in range(args.sessions)]
    cpu_before = server.cpu_seconds()
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(args.timeout + 60)
    wall = time.perf_counter() - began
    cpu_during = server.cpu_seconds() - cpu_before
    # The abandoned runs were never polled: they must stop once the server's abandon
    # window has passed (plus one batch), whatever else happened.
    abandon = ServerSettings.from_environment().abandon_seconds
    time.sleep(max(0.0, began + abandon + 10 - time.perf_counter()))
    settle = server.cpu_seconds()
    time.sleep(5)
    idle_cpu = (server.cpu_seconds() - settle) / 5

    finished = [r for r in results.values() if r["done"]]
    seen = sorted({p for r in results.values() for p in r["queued"]})
    seconds = sorted(r["seconds"] for r in finished)
    print(
        f"{args.sessions} sessions + {args.abandoned} abandoned naive runs (3969 positions "
        f"each), one server, {wall:.0f} s wall, {cpu_during:.0f} CPU-s"
    )
    print(f"finished runs           {len(finished)} of {args.sessions}")
    if seconds:
        print(
            f"time to result          median {statistics.median(seconds):.1f} s, "
            f"max {seconds[-1]:.1f} s"
        )
    print(f"queue positions shown   {seen or 'none'}")
    refused = [r["message"] for r in results.values() if not r["done"]]
    if refused:
        print(f"not finished            {refused}")
    if light:
        light.sort()
        print(
            f"poll latency            p50 {light[len(light) // 2] * 1000:.0f} ms, "
            f"p95 {light[int(len(light) * 0.95)] * 1000:.0f} ms over {len(light)} polls"
        )
    print(
        f"server CPU {abandon + 10:.0f} s in   {idle_cpu:.2f} cores busy (abandoned runs "
        f"stopped {abandon:.0f} s after their last poll: {'yes' if idle_cpu < 0.2 else 'NO'})"
    )


if __name__ == "__main__":
    main()
