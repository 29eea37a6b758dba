"""``make bench-hostile``: every hostile volume of bench.hostile_volumes against ``make
serve``'s server (nginx front, waitress, basic auth) and ``krypton explain``: server RSS
growth and time per upload, the CLI's peak RSS and exit code; then one client uploading the
worst of them eight times at once while another user loads an ordinary volume and image;
then a valid series at the slice limit while another user asks for the page; then 2,000
slow sockets from one address (127.0.0.2) while a user (127.0.0.1) asks for the
page. Loopback only; bounded in time."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

from bench import hostile_volumes
from bench.costs import measured
from bench.dash_client import ROOT, Server, Tab

AUTH = ("bench", "hostile-bench")


def _models(folder: Path) -> Path:
    import shutil

    for stem in ("fundus-demo", "chestct-demo"):
        for suffix in (".json", ".pt", ".ood.npz"):
            shutil.copy(ROOT / "krypton" / "shipped_models" / f"{stem}{suffix}", folder)
    return folder


def cli_cost(path: Path, *extra: str) -> tuple[float, float, int, str]:
    """(peak RSS MB, seconds, exit code, its error line) of ``krypton explain``."""
    command = [sys.executable, "-m", "krypton", "explain", str(path), "--model", "chestct-demo",
               "--out", str(path.with_suffix(".out.png")), *extra]  # fmt: skip
    started = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL)
    watched, peak = psutil.Process(process.pid), 0.0
    while process.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss / 2**20)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    error = process.stderr.read().decode(errors="replace") if process.stderr else ""
    said = [line for line in error.splitlines() if line.startswith("error:")] or [""]
    return peak, time.perf_counter() - started, process.returncode, said[0]


def cli_baseline(folder: Path) -> float:
    """Peak RSS MB of ``krypton explain`` on an ordinary 48³ volume, one cell of it: what
    loading a plain volume costs the CLI (torch, the model, the volume)."""
    path = folder / "ordinary.nii.gz"
    path.write_bytes(hostile_volumes.ordinary_volume())
    peak, seconds, code, line = cli_cost(
        path, "--mode", "naive", "--patch", "8", "--stride", "8", "--region", "0,0,0,8,8,8"
    )
    if code != 0:
        raise RuntimeError(f"the plain volume failed in the CLI: {line}")
    print(f"krypton explain on a plain 48³ volume (one cell): peak {peak:.0f} MB, {seconds:.1f} s")
    return peak


def uploads(server: Server, folder: Path) -> None:
    """Each hostile volume uploaded and loaded (server RSS growth, time, the slowest light
    callback meanwhile) and explained by the CLI (peak RSS over a plain volume's)."""
    baseline = cli_baseline(folder)
    print(f"{'hostile volume':40s} {'size':>9s} {'server':>8s} {'time':>6s} {'light':>6s} "
          f"{'CLI':>8s} {'CLI':>6s} exit  answer")  # fmt: skip
    for name, make in hostile_volumes.HOSTILE_VOLUMES.items():
        filename, data = make()
        path = folder / filename
        path.write_bytes(data)
        tab, light = Tab(server.url, auth=AUTH), Tab(server.url, auth=AUTH)
        started = time.perf_counter()
        with measured(server, light) as cost:
            response = tab.load_volume_response(data, filename)
        seconds = time.perf_counter() - started
        text = response.text if response.status_code != 200 else str(response.json())
        said = re.search(hostile_volumes.REFUSALS[name], text) is not None
        peak, cli_seconds, code, line = cli_cost(path)
        cli_growth = peak - baseline
        print(f"{name:40s} {len(data) / 1024:7.0f}KB {cost.growth_mb:+7.0f}MB {seconds:5.2f}s "
              f"{cost.slowest_light:5.2f}s {cli_growth:+6.0f}MB {cli_seconds:5.1f}s {code:4d}  "
              f"HTTP {response.status_code}, {'refused as expected' if said else 'UNEXPECTED'}; "
              f"CLI: {line[:70]}")  # fmt: skip


def concurrent(server: Server) -> None:
    """The worst hostile volume eight times at once from one client (127.0.0.2), and an
    ordinary volume and image from another (127.0.0.3) meanwhile."""
    from PIL import Image

    from bench.dash_client import png_bytes
    from krypton.synthetic.fundus import FundusGenerator

    name = "deflated multi-frame 1 GB"
    filename, data = hostile_volumes.HOSTILE_VOLUMES[name]()
    volume = hostile_volumes.ordinary_volume()
    image = png_bytes(Image.fromarray(FundusGenerator(seed=3).sample(label=1).image))

    def attack(index: int) -> None:
        Tab.at(server.url, "127.0.0.2", auth=AUTH).load_volume_response(data, f"{index}.dcm")

    user = Tab.at(server.url, "127.0.0.3", auth=AUTH)
    with measured(server) as cost:
        threads = [threading.Thread(target=attack, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        started = time.perf_counter()
        user.load_volume(volume, "chest.nii.gz")
        volume_seconds = time.perf_counter() - started
        started = time.perf_counter()
        user.load_file(image, "fundus.png")
        image_seconds = time.perf_counter() - started
        for thread in threads:
            thread.join(120)
    print(
        f"\n8 x {name} at once from one client: server {cost.growth_mb:+.0f} MB; another "
        f"user's 48³ volume loaded in {volume_seconds:.2f} s, image in {image_seconds:.2f} s"
    )


def series_at_the_limit(server: Server, loads: int = 3) -> None:
    """A valid series at the slice limit (2,048 slices of 4×4) loaded ``loads`` times by
    one user (127.0.0.2) while another (127.0.0.3) asks for the page every 0.1 s."""
    filename, data = hostile_volumes.tiny_series()
    user = Tab.at(server.url, "127.0.0.2", auth=AUTH)
    seconds: list[float] = []
    light: list[float] = []
    done = threading.Event()

    def other() -> None:
        while not done.is_set():
            started = time.perf_counter()
            requests.get(server.url + "/", auth=AUTH, timeout=30).raise_for_status()
            light.append(time.perf_counter() - started)
            done.wait(0.1)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        for index in range(loads):
            started = time.perf_counter()
            record = user.load_volume(data, f"{index}-{filename}")
            seconds.append(time.perf_counter() - started)
            assert record["shape"] == [2048, 4, 4], record
    finally:
        done.set()
        thread.join(30)
    print(
        f"a 2,048-slice series (4x4 slices, {len(data) / 2**20:.1f} MB zipped), uploaded and "
        f"loaded {loads} times: {min(seconds):.2f}-{max(seconds):.2f} s each; another "
        f"user's page meanwhile {len(light)} times, slowest {max(light):.2f} s"
    )


def slow_sockets(server: Server, count: int) -> None:
    """``count`` slow sockets from 127.0.0.2 trickling a byte a second; an authenticated
    page request from 127.0.0.1 meanwhile."""
    import resource

    from bench.costs import slow_sockets as opened
    from bench.costs import trickle

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, count + 1024)), hard))
    attack = opened(server.port, count)
    slowest, alive = 0.0, len(attack)
    try:
        for _ in range(5):
            started = time.perf_counter()
            requests.get(server.url + "/", auth=AUTH, timeout=30).raise_for_status()
            slowest = max(slowest, time.perf_counter() - started)
            time.sleep(1.0)
            alive = trickle(attack)
    finally:
        for connection in attack:
            connection.close()
    print(
        f"{count} slow sockets from 127.0.0.2: {alive} held by the front after 5 s; the "
        f"slowest authenticated answer to 127.0.0.1 took {slowest:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sockets", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="krypton-hostile-") as folder:
        root = Path(folder)
        models = root / "models"
        models.mkdir()
        env = {"KRYPTON_USERNAME": AUTH[0], "KRYPTON_PASSWORD": AUTH[1]}
        server = Server(root / "server", env=env, models_dir=_models(models), production=True)
        try:
            print(f"make serve at {server.url} (nginx front, waitress, basic auth); RSS of the "
                  f"app's process, before each file: {server.rss_mb():.0f} MB")  # fmt: skip
            uploads(server, root)
            concurrent(server)
            series_at_the_limit(server)
            slow_sockets(server, args.sockets)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
