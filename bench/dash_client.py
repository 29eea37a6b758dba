"""A Dash client that speaks HTTP the way the browser's dash-renderer does.

It loads the page (for the server-signed ``endId``), the layout (for the tab's session
id) and the callback list, then posts callbacks to ``/_dash-update-component`` with the
same JSON body the renderer builds, and polls background callbacks with their signed
``cacheKey``/``job`` handles. Attack tests use it to send what a browser could never send.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import requests
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
_CONFIG = re.compile(r'<script id="_dash-config" type="application/json">(.*?)</script>', re.S)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def png_data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def find(layout, component_id: str):
    """The component with ``component_id`` in a serialised layout, or None."""
    if isinstance(layout, dict):
        if layout.get("props", {}).get("id") == component_id:
            return layout
        for value in layout.values():
            found = find(value, component_id)
            if found is not None:
                return found
    elif isinstance(layout, list):
        for value in layout:
            found = find(value, component_id)
            if found is not None:
                return found
    return None


def light_callback(tab: Tab) -> float:
    """Seconds for one light callback (the overlay settings), as a browser sends it."""
    started = time.perf_counter()
    response = tab.call(
        "overlay-store.data",
        {
            "overlay-show.value": ["show"],
            "overlay-view.value": "overlay",
            "overlay-scale.value": "relative",
            "overlay-opacity.value": 0.5,
            "overlay-threshold.value": 0,
        },
        timeout=30,
    )
    assert response.status_code == 200, response.text[:200]
    return time.perf_counter() - started


class Server:
    """``python app.py`` in a subprocess on a free port, with its own folders."""

    def __init__(
        self,
        tmp_path: Path,
        env: dict | None = None,
        models_dir: Path | None = None,
        production: bool = False,
    ):
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.environment = dict(
            os.environ,
            KRYPTON_HOME=str(tmp_path / "home"),
            KRYPTON_CACHE_DIR=str(tmp_path / "cache"),
            PYTHONUNBUFFERED="1",
            **(env or {}),
        )
        if models_dir is not None:
            self.environment["KRYPTON_MODELS_DIR"] = str(models_dir)
        self.log = open(tmp_path / f"server-{self.port}.log", "w+")
        self.process = subprocess.Popen(
            [sys.executable, "app.py", "--port", str(self.port)]
            + (["--production"] if production else []),  # production: what make serve runs
            cwd=ROOT,
            env=self.environment,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 90
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if requests.get(self.url + "/_dash-layout", timeout=2).status_code < 500:
                    return  # answering (401 where authentication is required)
            except requests.ConnectionError:
                time.sleep(0.3)
        raise RuntimeError(f"server did not start: {self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


class _FromAddress(requests.adapters.HTTPAdapter):
    """Connections from a given local address."""

    def __init__(self, address: str):
        self.address = address
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (self.address, 0)
        super().init_poolmanager(*args, **kwargs)


def loopback(index: int, block: int = 1) -> str:
    """The ``index``-th loopback address of ``block`` (127.0.block.1, .2, ...): a client
    of its own for the server's per-client limits, on this machine."""
    return f"127.0.{block}.{index % 250 + 1}"


# The page's controls a result's provenance is compared with (webapp/runs/provenance.py).
SCREEN = (
    "image-store.data",
    "model.value",
    "region-store.data",
    "patch.value",
    "stride.value",
    "mode.value",
    "colour.value",
    "custom-colour.value",
    "label.value",
)


class Tab:
    """One browser tab: its own page load (endId) and session id."""

    def __init__(self, url: str, auth=None, http: requests.Session | None = None):
        self.url = url
        self.http = http or requests.Session()
        self.http.auth = auth
        page = self.http.get(url + "/", timeout=30)
        page.raise_for_status()
        self.end_id = json.loads(_CONFIG.search(page.text).group(1))["end_id"]
        self.layout = self.http.get(url + "/_dash-layout", timeout=30).json()
        self.session = find(self.layout, "session")["props"]["data"]
        self.callbacks = self.http.get(url + "/_dash-dependencies", timeout=30).json()
        self.screen: dict = {}  # the controls' values of the last Run

    @classmethod
    def at(cls, url: str, address: str, auth=None) -> Tab:
        """A tab of a client connecting from ``address`` (a loopback address: another
        person, as far as the server's per-client limits go)."""
        http = requests.Session()
        http.mount("http://", _FromAddress(address))
        return cls(url, auth=auth, http=http)

    def spec(self, output_part: str, values: dict | None = None, background: bool = False) -> dict:
        """The callback writing ``output_part``; where several do, the one triggered by
        an input named in ``values`` (``background``: only a background callback, the one
        a poll answers)."""
        matches = [
            c
            for c in self.callbacks
            if output_part in c["output"] and (c.get("background") or not background)
        ]
        assert matches, f"no callback outputs {output_part}"
        triggered = [
            c
            for c in matches
            if any(f"{d['id']}.{d['property']}" in (values or {}) for d in c["inputs"])
        ]
        return (triggered or matches)[0]

    def payload(self, spec: dict, values: dict) -> dict:
        """The renderer's request body: ``values`` maps 'id.property' to a value (a
        wildcard input gets an empty list unless given)."""

        def fill(dependency):
            key = f"{dependency['id']}.{dependency['property']}"
            if dependency["id"].startswith("{"):
                return values.get(key, [])
            return {
                "id": dependency["id"],
                "property": dependency["property"],
                "value": values.get(key),
            }

        outputs: list = []
        for part in spec["output"].strip(".").split("..."):
            ident, prop = part.rsplit(".", 1)
            identity = json.loads(ident) if ident.startswith("{") else ident
            if isinstance(identity, dict) and any(isinstance(v, list) for v in identity.values()):
                outputs.append([])  # a wildcard output: this client matches no component
                continue
            outputs.append({"id": identity, "property": prop.split("@")[0]})
        inputs = [fill(d) for d in spec["inputs"]]
        changed = [
            k for k in values if any(f"{d['id']}.{d['property']}" == k for d in spec["inputs"])
        ]
        return {
            "output": spec["output"],
            "outputs": outputs if len(outputs) > 1 else outputs[0],
            "inputs": inputs,
            "changedPropIds": changed,
            "state": [fill(d) for d in spec["state"]],
        }

    def call(
        self,
        output_part: str,
        values: dict,
        timeout: float = 120,
        poll: bool = True,
        changed: list[str] | None = None,
        background: bool = False,
    ) -> requests.Response | dict:
        """Post one callback; background callbacks are polled until they answer (the
        final response's JSON is returned as a dict with 'progress' seen on the way)."""
        spec = self.spec(output_part, values, background)
        body = self.payload(spec, values)
        if changed is not None:  # the prop that fired, as the renderer names it
            body["changedPropIds"] = changed
        response = self.http.post(
            f"{self.url}/_dash-update-component",
            params={"endId": self.end_id},
            json=body,
            timeout=timeout,
        )
        if not spec.get("background") or response.status_code != 200:
            return response
        handles = response.json()
        if not poll:
            return handles
        return self.poll(output_part, handles, timeout)

    def post_raw(self, body: bytes, timeout: float = 60) -> requests.Response:
        """Post ``body`` as a callback's JSON, exactly as given (a forged request)."""
        return self.http.post(
            f"{self.url}/_dash-update-component",
            params={"endId": self.end_id},
            data=body,
            headers={"Content-Type": "application/json"},
            timeout=timeout,
        )

    def poll_once(self, output_part: str, handles: dict) -> dict | None:
        """One poll, as the renderer sends it: the JSON answer (None for 204)."""
        response = self.http.post(
            f"{self.url}/_dash-update-component",
            json=self.payload(self.spec(output_part, background=True), {}),
            timeout=60,
            params={"endId": self.end_id, "cacheKey": handles["cacheKey"], "job": handles["job"]},
        )
        return None if response.status_code == 204 else response.json()

    def poll(self, output_part: str, handles: dict, timeout: float = 120) -> dict:
        progress = []
        deadline = time.time() + timeout
        while time.time() < deadline:
            data = self.poll_once(output_part, handles)
            if data is None:
                return {"response": None, "progress": progress}
            if "progress" in data:
                progress.append(data["progress"])
            if "response" in data:
                return {"response": data["response"], "progress": progress}
            time.sleep(0.3)
        raise TimeoutError(f"background callback {output_part} did not finish")

    # -- what a user does ----------------------------------------------------------------
    def upload_file(self, data: bytes, purpose: str, filename: str) -> dict:
        """Post a file to the upload route as the page's script does: the ticket the page
        then hands to its callback ({"token": ...} or {"error": ...})."""
        response = self.http.post(
            f"{self.url}/_krypton/upload/{purpose}",
            data=data,
            headers={
                "Content-Type": "application/octet-stream",
                "X-Krypton-Session": self.session,
                "X-Krypton-Filename": quote(filename),
            },
            timeout=300,
        )
        try:
            ticket = response.json()
        except ValueError:
            ticket = {"error": response.text}
        ticket.setdefault("name", filename)
        return ticket

    def load_file(self, data: bytes, filename: str = "image.png") -> requests.Response:
        """Upload an image file and load it, as choosing it in the page does."""
        ticket = self.upload_file(data, "image", filename)
        return self.call(
            "image-store.data", {"upload-ticket.data": ticket, "session.data": self.session}
        )

    def upload_image(self, image: Image.Image, filename: str = "image.png") -> dict:
        response = self.load_file(png_bytes(image), filename)
        assert response.status_code == 200, response.text[:300]
        return response.json()["response"]["image-store"]["data"]

    def predict(self, image_data: dict, model: str = "fundus-demo") -> dict:
        response = self.call(
            "prediction-store.data", {"image-store.data": image_data, "model.value": model}
        )
        assert response.status_code == 200, response.text[:300]
        return response.json()["response"]

    def run(
        self,
        image_data: dict,
        model: str = "fundus-demo",
        mode: str = "exact",
        patch: int = 16,
        stride: int = 16,
        region=None,
        poll: bool = True,
        timeout: float = 180,
        compare: bool = False,
    ):
        values = {
            "run.n_clicks": 1,
            "session.data": self.session,
            "image-store.data": image_data,
            "model.value": model,
            "patch.value": patch,
            "stride.value": stride,
            "mode.value": mode,
            "colour.value": "gray",
            "custom-colour.value": "#808080",
            "label.value": None,
            "region-store.data": region,
            "target-ssim.value": 0.9,
            "drill-down.value": 0.25,
            "target-speedup.value": 3,
            "compare.value": ["compare"] if compare else [],
        }
        self.screen = {k: values[k] for k in SCREEN}  # what the page shows while it runs
        answer = self.call("run-outcome.data", values, timeout=timeout, poll=poll, background=True)
        if poll and (answer.get("response") or {}).get("run-outcome"):
            # the page's class list then names the class the run explained
            handle = answer["response"]["run-outcome"]["data"]
            self.screen["label.value"] = handle["provenance"]["label"]
        return answer

    def load_volume_response(self, data: bytes, filename: str) -> requests.Response:
        """Upload a volume and load it into the volume panel: the callback's response."""
        ticket = self.upload_file(data, "volume", filename)
        return self.call(
            "volume-store.data", {"volume-ticket.data": ticket, "session.data": self.session}
        )

    def load_volume(self, data: bytes, filename: str = "volume.nii.gz") -> dict:
        """Upload a volume into the volume panel: the page's record of it."""
        response = self.load_volume_response(data, filename)
        assert response.status_code == 200, response.text[:300]
        answer = response.json()["response"]
        assert answer["volume-store"]["data"], answer
        return answer["volume-store"]["data"]

    def run_volume(
        self,
        record: dict,
        model: str = "chestct-demo",
        mode: str = "exact",
        patch: int = 8,
        stride: int = 8,
        region=None,
        poll: bool = True,
        timeout: float = 180,
    ):
        """Press the volume panel's Run (crosshair at the block's centre)."""
        values = {
            "volume-run.n_clicks": 1,
            "session.data": self.session,
            "volume-store.data": record,
            "volume-model.value": model,
            "volume-patch.value": patch,
            "volume-stride.value": stride,
            "volume-mode.value": mode,
            "volume-label.value": None,
            "volume-region.data": region,
            **{f"volume-slider-{view}.value": 24 for view in ("axial", "coronal", "sagittal")},
        }
        return self.call(
            "volume-run-outcome.data", values, timeout=timeout, poll=poll, background=True
        )

    def show(self, handle: dict | None) -> dict:
        """The result panel's answer for ``handle`` beside what this tab shows."""
        values = dict(
            self.screen,
            **{
                "result-store.data": handle,
                "result-shown.data": handle,
                "session.data": self.session,
            },
        )  # the panel draws what it shows: the result's handle, copied in the browser
        response = self.call("result-summary.children", values)
        assert response.status_code == 200, response.text[:300]
        return response.json()["response"]

    def export(self, fmt: str, handle: dict | None, identity: bool = False) -> requests.Response:
        """Press the download button of ``fmt`` (png, npy, npz, csv, json, dicom)."""
        button = json.dumps({"format": fmt, "type": "export"}, separators=(",", ":"))
        return self.call(
            "download.data",
            {
                '{"format":["ALL"],"type":"export"}.n_clicks': [
                    {"id": {"format": fmt, "type": "export"}, "property": "n_clicks", "value": 1}
                ],
                "session.data": self.session,
                "result-store.data": handle,
                "dicom-identity.value": ["identity"] if identity else [],
                **self.screen,
            },
            changed=[button + ".n_clicks"],
        )

    def register(
        self, data: bytes, filename: str, name: str, architecture: str, classes: str, size: int = 64
    ) -> str:
        ticket = self.upload_file(data, "model", filename)
        response = self.call(
            "model-register-message.children",
            {
                "model-register.n_clicks": 1,
                "model-upload-ticket.data": ticket,
                "model-upload.filename": filename,
                "session.data": self.session,
                "model-name.value": name,
                "model-architecture.value": architecture,
                "model-classes.value": classes,
                "model-size.value": size,
            },
        )
        assert response.status_code == 200, response.text[:300]
        return json.dumps(response.json()["response"])
