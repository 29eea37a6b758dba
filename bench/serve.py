"""Team mode under load: ``make bench-serve``.

    python -m bench.serve [--sessions 1,4,16] [--images 20]

For 1 and for 2 Celery workers (this machine's cores shared out between them) behind one
app on a local redis-server, and for the embedded server (threads, no Redis) as the
baseline: N sessions start an exact heatmap at the same moment (each its own image,
a 96 x 96 region at stride 8: 121 positions) and poll as the browser does; reported are
positions per second over all sessions (first submit to last result), and p50/p95 of a
light request (the prediction of an uploaded image) sent while the runs are in flight.
Then ``krypton batch --broker`` over 20 generated images (whole image, stride 16: 169
positions each) gives images per minute. Finally, from the measured per-worker
throughput, how many workers a department would need. Local only (127.0.0.1); bounded
(each run stops after --timeout seconds).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from PIL import Image

from bench.dash_client import Server, Tab, free_port, loopback
from krypton.synthetic.fundus import FundusGenerator
from webapp.cluster import Cluster

REGION, STRIDE = [0, 0, 96, 96], 8
POSITIONS = ((96 - 16) // STRIDE + 1) ** 2


def images(count: int, seed: int = 40) -> list[Image.Image]:
    generator = FundusGenerator(seed=seed)
    return [Image.fromarray(generator.sample(label=1 + i % 2).image) for i in range(count)]


def sessions_round(url: str, count: int, timeout: float) -> dict:
    """``count`` sessions run at once; light requests are timed meanwhile."""
    pictures = images(count, seed=100 + count)
    tabs = [Tab.at(url, loopback(index)) for index in range(count)]  # one client each
    uploads = [tab.upload_image(picture) for tab, picture in zip(tabs, pictures)]
    probe = Tab(url)
    probe_image = probe.upload_image(images(1, seed=7)[0])
    finished: list[float] = []
    failures: list[str] = []
    light: list[float] = []
    running = threading.Event()
    running.set()
    barrier = threading.Barrier(count + 1)

    def session(tab: Tab, data: dict) -> None:
        barrier.wait()
        try:
            outcome = tab.run(data, stride=STRIDE, region=REGION, timeout=timeout)
            message = (outcome.get("response") or {}).get("message", {}).get("children")
            if message:
                failures.append(message)
            finished.append(time.perf_counter())
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            failures.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=session, args=pair) for pair in zip(tabs, uploads)]
    for thread in threads:
        thread.start()
    barrier.wait()
    began = time.perf_counter()
    while any(t.is_alive() for t in threads):
        sent = time.perf_counter()
        probe.predict(probe_image)
        light.append(time.perf_counter() - sent)
        time.sleep(0.25)
    for thread in threads:
        thread.join()
    seconds = (max(finished) - began) if finished else float("nan")
    light.sort()
    return {
        "sessions": count,
        "positions_per_second": len(finished) * POSITIONS / seconds if finished else 0.0,
        "seconds": seconds,
        "light_p50_ms": 1e3 * statistics.median(light) if light else float("nan"),
        "light_p95_ms": 1e3 * light[min(len(light) - 1, int(0.95 * len(light)))]
        if light
        else float("nan"),
        "failures": failures,
    }


def batch_round(url: str, count: int, folder: Path) -> float:
    """Images per minute for ``krypton batch --broker`` over ``count`` images."""
    import krypton
    from krypton.batch.broker import broker_submit
    from krypton.batch.folder import collect_inputs, run_batch

    source = folder / "batch-in"
    source.mkdir(exist_ok=True)
    for index, picture in enumerate(images(count, seed=900)):
        picture.save(source / f"image{index:02d}.png")
    loaded = krypton.load_model("fundus-demo")
    options = dict(patch=16, stride=16, mode="exact", fill=loaded.gray_fill())
    out = folder / f"batch-out-{time.monotonic_ns()}"
    began = time.perf_counter()
    rows = run_batch(
        collect_inputs(str(source)),
        loaded,
        out,
        options,
        submit=broker_submit(url, loaded, options),
    )
    seconds = time.perf_counter() - began
    assert not any(row.error for row in rows), [row.error for row in rows if row.error]
    return count / seconds * 60


def team_rounds(workers: int, counts: list[int], image_count: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        cores = os.cpu_count() or 1
        cluster = Cluster(Path(folder), free_port(), torch_threads=max(1, cores // workers))
        try:
            cluster.start_redis()
            for index in range(workers):
                cluster.start_worker(f"bench{index + 1}")
            port = free_port()
            cluster.start_app(port)
            url = f"http://127.0.0.1:{port}"
            warm = Tab(url)  # the first run loads the model in a worker
            warm.run(warm.upload_image(images(1, seed=5)[0]), stride=16, region=[0, 0, 32, 32])
            rounds = [sessions_round(url, count, timeout) for count in counts]
            per_minute = batch_round(cluster.url, image_count, Path(folder))
        finally:
            cluster.stop()
    return {"rounds": rounds, "images_per_minute": per_minute}


def embedded_rounds(counts: list[int], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        server = Server(Path(folder))
        try:
            warm = Tab(server.url)
            warm.run(warm.upload_image(images(1, seed=5)[0]), stride=16, region=[0, 0, 32, 32])
            rounds = [sessions_round(server.url, count, timeout) for count in counts]
        finally:
            server.stop()
    return {"rounds": rounds, "images_per_minute": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="1,4,16")
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    counts = [int(c) for c in args.sessions.split(",")]
    print(
        f"bench-serve on {os.cpu_count()} cores: exact runs of {POSITIONS} positions each "
        f"(fundus-demo, 224 px, region 96 x 96, stride {STRIDE})",
        flush=True,
    )
    setups = {"embedded (threads)": embedded_rounds(counts, args.timeout)}
    for workers in (1, 2):
        setups[f"team, {workers} worker{'s' if workers > 1 else ''}"] = team_rounds(
            workers, counts, args.images, args.timeout
        )
    print(
        "| setup | sessions | positions/s | wall s | light p50 ms | light p95 ms "
        "| batch images/min |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, found in setups.items():
        for index, row in enumerate(found["rounds"]):
            batch = found["images_per_minute"]
            batch_text = f"{batch:.1f}" if batch is not None and index == 0 else ""
            print(
                f"| {name} | {row['sessions']} | {row['positions_per_second']:.0f} | "
                f"{row['seconds']:.1f} | {row['light_p50_ms']:.0f} | {row['light_p95_ms']:.0f} | "
                f"{batch_text} |"
            )
            for failure in row["failures"]:
                print(f"  failure: {failure}")
    cores = os.cpu_count() or 1
    team = {name: found for name, found in setups.items() if name.startswith("team")}
    best_name, best = max(
        ((name, max(r["positions_per_second"] for r in found["rounds"])) for name, found in
         team.items()),
        key=lambda pair: pair[1],
    )  # fmt: skip
    per_core = best / cores
    whole_image = 2809  # a whole 224 x 224 image at patch 16, stride 4
    demand = 20 * whole_image / 120  # 20 radiologists, one whole-image heatmap each 2 min
    print(
        f"\nBest team throughput here: {best:.0f} positions/s ({best_name}, {cores} cores: "
        f"{per_core:.0f} per core). A department of 20 radiologists each asking for a "
        f"whole-image exact heatmap ({whole_image} positions) every 2 minutes needs "
        f"{demand:.0f} positions/s: {math.ceil(demand / per_core)} cores of this kind, e.g. "
        f"{math.ceil(demand / per_core / 8)} worker hosts with 8 cores (one 1-thread worker "
        f"per core)."
    )


if __name__ == "__main__":
    main()
