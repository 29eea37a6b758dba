"""The hostile mix of ``make bench-load``: the twelve requests of the cost audit arrive,
one a second, among normal sessions on the production server (``make serve``). Each
client speaks from its own loopback address (127.0.x.y), as distinct people would, so the
per-client limits apply as they do in a deployment. Loopback only; bounded in time."""

from __future__ import annotations

import io
import json
import socket
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pydicom
import requests
import torch
import torchvision
from PIL import Image

from bench import hostile
from bench.dash_client import Server, Tab, light_callback, loopback
from krypton.registry import register_model


def _models(home: Path, folder: Path) -> None:
    """The hostile mix's own models: 10,000 classes at 40 px, and classes named in $...$."""
    torch.manual_seed(0)
    for name, classes, size in (
        ("many", [f"c{i}" for i in range(10_000)], 40),
        ("dollars", [r"$\frac{1}{0}$ \unknown{", "$x^2$"], 64),
    ):
        weights = folder / f"{name}.pt"
        model = torchvision.models.resnet18(weights=None, num_classes=len(classes))
        torch.save(model.state_dict(), weights)
        register_model(
            name,
            weights,
            classes,
            architecture="resnet18",
            input_size=(size, size),
            directory=home / "models",
        )


def _hostile_requests(url: str, image: Image.Image, folder: Path, sockets: list) -> list:
    """(name, request) for the twelve findings; each request returns what it saw."""

    def message(response: requests.Response) -> str:
        if response.status_code != 200:
            return f"HTTP {response.status_code}"
        answer = response.json()["response"]
        text = answer.get("message", {}).get("children") or ""
        return str(text)[:70] if text else f"loaded {answer['image-store']['data']['size']}"

    def bombs():
        tab = Tab.at(url, "127.0.3.1")
        made = (hostile.j2k_bomb(), hostile.jpeg_ls_bomb(), hostile.deflate_bomb(23170, 23170))
        return " | ".join(message(tab.load_file(data, "b.dcm")) for data in made)

    def big_png():
        return message(Tab.at(url, "127.0.3.2").load_file(hostile.png16_bomb(), "big.png"))

    def architecture():
        torch.save({"stem.0.weight": torch.zeros(1)}, folder / "tiny.pt")
        tab = Tab.at(url, "127.0.3.3")
        weights = (folder / "tiny.pt").read_bytes()
        said = tab.register(weights, "w.pt", "x", "regnet_y_128gf", "a,b")
        return json.loads(said)["model-register-message"]["children"]["props"]["children"][:70]

    def amplification():
        tab = Tab.at(url, "127.0.3.4")
        body = b'{"output":"..model.options..","padding":' + b"[" + b"[]," * 7_000_000 + b"[]]}"
        return f"HTTP {tab.post_raw(body).status_code}"

    def many_classes():
        tab = Tab.at(url, "127.0.3.5")
        data = tab.upload_image(image)
        done = tab.run(data, "many", patch=2, stride=2, timeout=600)
        return "result kept" if "run-outcome" in (done["response"] or {}) else "no result"

    def idle_sockets():
        for _ in range(64):
            connection = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            connection.sendall(b"GET / HTTP/1.1\r\n")
            sockets.append(connection)
        return "64 sockets open"

    def duplicate_keys():
        tab = Tab.at(url, "127.0.3.7")
        body = (
            b'{"output":"..image-store.data..","output":"..label.options..","x":"'
            + b"x" * (20 * 2**20)
            + b'"}'
        )
        return f"HTTP {tab.post_raw(body).status_code}"

    def made_up_sessions():
        tab = Tab.at(url, "127.0.3.8")
        data = tab.upload_image(image)
        handles = []
        for index in range(34):
            tab.session = f"made-up-{index}"
            handles.append(tab.run(data, mode="naive", patch=4, stride=2, poll=False))
        time.sleep(3)
        said = [json.dumps(tab.poll_once("run-outcome.data", h) or {}) for h in handles]
        return f"{sum('limit per user' in s for s in said)} of 34 refused"

    def foreign_key():
        dataset = pydicom.dcmread(hostile.shipped("CT_small.dcm"))
        dataset.PatientName = "Doe^Jane"
        buffer = io.BytesIO()
        dataset.save_as(buffer, enforce_file_format=True)
        owner, other = Tab.at(url, "127.0.3.9"), Tab.at(url, "127.0.3.10")
        data = owner.load_file(buffer.getvalue(), "x.dcm").json()["response"]["image-store"]
        done = other.run(data["data"], patch=32, stride=32, region=[0, 0, 64, 64])
        answer = other.export("dicom", done["response"]["run-outcome"]["data"], identity=True)
        return "refused" if "another tab" in answer.text else "IDENTITY LEAKED"

    def look_alike():
        tab = Tab.at(url, "127.0.3.11")
        said = tab.register((folder / "dollars.pt").read_bytes(), "w.pt", "fundus-demo\n",
                            "resnet18", "a, b")  # fmt: skip
        return "refused" if "already registered" in said else "REGISTERED"

    def mathtext():
        tab = Tab.at(url, "127.0.3.12")
        data = tab.upload_image(image)
        done = tab.run(data, "dollars", patch=32, stride=32, region=[0, 0, 64, 64])
        exported = tab.export("png", done["response"]["run-outcome"]["data"])
        return f"PNG export HTTP {exported.status_code}"

    def malformed():
        tab = Tab.at(url, "127.0.3.13")
        made = (hostile.truncated_deflate(), hostile.rle_liar())
        return " | ".join(message(tab.load_file(data, "m.dcm")) for data in made)

    return [
        ("1 DICOM decode bombs", bombs),
        ("2 49 MP 16-bit PNG", big_png),
        ("3 architecture bomb", architecture),
        ("4 20 MB JSON amplification", amplification),
        ("5 10,000-class results", many_classes),
        ("6 64 idle sockets", idle_sockets),
        ("7 duplicate 'output' keys", duplicate_keys),
        ("8 34 made-up sessions", made_up_sessions),
        ("9 another tab's DICOM key", foreign_key),
        ("10 look-alike model name", look_alike),
        ("11 mathtext class names", mathtext),
        ("12 malformed DICOM", malformed),
    ]


def _normal_session(url: str, index: int, image: Image.Image, timeout: float) -> dict:
    tab = Tab.at(url, loopback(index))
    began = time.perf_counter()
    data = tab.upload_image(image)
    tab.predict(data)
    done = tab.run(data, mode="exact", region=[32, 32, 96, 96], stride=8, timeout=timeout)
    response = done["response"] or {}
    return {"done": "run-outcome" in response, "seconds": time.perf_counter() - began}


def run_mix(folder: Path, image: Image.Image, sessions: int = 8, timeout: float = 600) -> None:
    """The normal sessions alone on a fresh server, then with the hostile requests among
    them on another; prints both."""
    _models(folder / "home", folder)
    alone = _round(folder / "alone", folder, image, sessions, timeout, hostile_requests=False)
    mixed = _round(folder / "mixed", folder, image, sessions, timeout, hostile_requests=True)
    print(
        f"hostile mix: {sessions} normal sessions + the 12 hostile requests (one a second), "
        f"make serve's server, {mixed['wall']:.0f} s wall"
    )
    for name, outcome in sorted(mixed["outcomes"].items(), key=lambda i: int(i[0].split()[0])):
        print(f"  {name:<28} {outcome}")
    print("| | normal sessions finished | time to result median / max | light p50 / p95 | "
          "server peak RSS over idle |")  # fmt: skip
    print("|---|---|---|---|---|")
    for label, row in (("sessions alone", alone), ("with the hostile mix", mixed)):
        print(f"| {label} | {row['finished']} | {row['times']} | {row['light']} | "
              f"+{row['peak']:.0f} MB |")  # fmt: skip


def _round(
    folder: Path,
    models: Path,
    image: Image.Image,
    sessions: int,
    timeout: float,
    hostile_requests: bool,
) -> dict:
    """One server: the sessions, with or without the hostile requests; what they saw."""
    folder.mkdir(parents=True)
    (folder / "home").symlink_to(models / "home", target_is_directory=True)
    server = Server(folder, production=True)
    sockets: list = []
    try:
        process = psutil.Process(server.process.pid)
        baseline = process.memory_info().rss / 2**20
        peak, light, outcomes, normal = [baseline], [], {}, {}
        stop = threading.Event()
        light_tab = Tab.at(server.url, "127.0.2.1")

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], process.memory_info().rss / 2**20)
                stop.wait(0.02)

        def poke():
            while not stop.is_set():
                light.append(light_callback(light_tab))
                stop.wait(0.2)

        def guarded(name: str, request: Callable[[], str]) -> None:
            try:
                outcomes[name] = request()
            except Exception as exc:  # reported, never hidden
                outcomes[name] = f"ERROR {type(exc).__name__}: {str(exc)[:80]}"

        def session(index: int) -> None:
            try:
                normal[index] = _normal_session(server.url, index, image, timeout)
            except Exception as exc:
                normal[index] = {"done": False, "seconds": 0.0, "error": repr(exc)[:80]}

        watchers = [threading.Thread(target=sample), threading.Thread(target=poke)]
        for thread in watchers:
            thread.start()
        workers = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
        for thread in workers:
            thread.start()
        began = time.perf_counter()
        mix = _hostile_requests(server.url, image, models, sockets) if hostile_requests else []
        for name, request in mix:
            thread = threading.Thread(target=guarded, args=(name, request))
            thread.start()
            workers.append(thread)
            time.sleep(1.0)
        for thread in workers:
            thread.join(timeout + 60)
        wall = time.perf_counter() - began
        stop.set()
        for thread in watchers:
            thread.join(30)
    finally:
        for connection in sockets:
            connection.close()
        server.stop()
    finished = [r for r in normal.values() if r["done"]]
    seconds = sorted(r["seconds"] for r in finished)
    light.sort()
    return {
        "wall": wall,
        "outcomes": outcomes,
        "finished": f"{len(finished)} of {sessions}",
        "times": f"{statistics.median(seconds):.1f} s / {seconds[-1]:.1f} s" if seconds else "-",
        "light": (
            f"{light[len(light) // 2] * 1000:.0f} / {light[int(len(light) * 0.95)] * 1000:.0f} ms"
            if light
            else "-"
        ),
        "peak": peak[0] - baseline,
    }
