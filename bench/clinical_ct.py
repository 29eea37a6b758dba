"""A routine clinical CT from a local Orthanc, Open to heatmap at default settings.

    python -m bench.clinical_ct [--slices 300,600] [--json out/bench-clinical-ct.json]

For each slice count: a generated chest CT of that many 512 x 512 slices (0.7 mm pixels,
1.25 mm apart, int16, the chest-CT sample's body scaled into the field of view) stored
in Debian's Orthanc with its DICOMweb plugin; then, as ``krypton explain --dicomweb
--send`` does it with chestct-demo at its defaults (exact, its patch, the volume
stride), each stage timed: the series listing (QIDO), the fetch (WADO, four instances
at once), decode-and-resample (slice by slice into the model's block), the run, and
the write-back (the source-grid Parametric Map and the captures built and stored,
STOW). Peak memory is the process's resident size above what it held before the
listing, sampled every 20 ms. Targets: at most 60 s and 1 GB for 300 slices; 600 slices
about twice the time of 300.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import requests
from scipy.ndimage import zoom

import krypton
from demo.pacs import DEMO_PASSWORD, DEMO_USER, ct_series, start_orthanc
from krypton.pacs import dicomweb
from krypton.pacs.results import VolumeSource, result_key, send_result
from krypton.synthetic.chestct import ChestCTGenerator

ROWS, PIXEL_MM, SLICE_MM = 512, 0.7, 1.25
TARGET_SECONDS, TARGET_BYTES = 60.0, 2**30


def _plane_maker():
    """(slice index, count) -> one 512 x 512 HU plane of the chest sample, scaled from
    its 5 mm voxels into the 0.7 mm field of view and 1.25 mm slices (air around it)."""
    sample = ChestCTGenerator(seed=40).sample(label=1, nodules=1).volume
    side = int(round(48 * 5.0 / PIXEL_MM))
    top = (ROWS - side) // 2

    def plane(index: int, count: int) -> np.ndarray:
        out = np.full((ROWS, ROWS), -1000.0, np.float32)
        depth = (index - (count - 48 * 5.0 / SLICE_MM) / 2) * SLICE_MM / 5.0
        if 0 <= depth < 48:
            scaled = zoom(sample[int(depth)], side / 48, order=1)[:side, :side]
            out[top : top + scaled.shape[0], top : top + scaled.shape[1]] = scaled
        return out

    return plane


def store_series(root: str, count: int) -> tuple[str, str]:
    """A ``count``-slice CT stored in Orthanc a file at a time (its REST API); its study
    and series UIDs."""
    plane = _plane_maker()
    session = requests.Session()
    session.auth = (DEMO_USER, DEMO_PASSWORD)
    rest = root.rsplit("/dicom-web", 1)[0]
    study = series = ""
    template = None
    for index in range(count):
        (dataset,) = ct_series(plane(index, count)[None], (SLICE_MM, PIXEL_MM, PIXEL_MM),
                               "Bench^ClinicalCT", origin=(-179.0, -179.0, -400.0))  # fmt: skip
        if template is None:
            template = dataset
        dataset.StudyInstanceUID, dataset.SeriesInstanceUID = (
            template.StudyInstanceUID, template.SeriesInstanceUID)  # fmt: skip
        dataset.FrameOfReferenceUID = template.FrameOfReferenceUID
        dataset.InstanceNumber = index + 1
        dataset.ImagePositionPatient = [-179.0, -179.0, -400.0 + index * SLICE_MM]
        buffer = io.BytesIO()
        dataset.save_as(buffer, enforce_file_format=True)
        session.post(f"{rest}/instances", data=buffer.getvalue(), timeout=60).raise_for_status()
        study, series = str(dataset.StudyInstanceUID), str(dataset.SeriesInstanceUID)
    return study, series


class PeakMemory:
    """The process's resident size above its size at the start, at its highest, sampled
    every 20 ms on a thread."""

    def __init__(self):
        self.process = psutil.Process()
        self.start = self.process.memory_info().rss
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.process.memory_info().rss) - self.start


def open_to_heatmap(root: str, study: str, series: str, model) -> dict:
    """The stages of Open to heatmap to stored map, timed, with the peak memory."""
    pacs = dicomweb.connect(dicomweb.PacsSettings(root, DEMO_USER, DEMO_PASSWORD))
    times: dict[str, float] = {}
    memory = PeakMemory()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="krypton-bench-") as folder:
        dicomweb.find_series(pacs, study)
        times["list"] = time.perf_counter() - started
        mark = time.perf_counter()
        dicomweb.fetch_series(pacs, study, series, Path(folder))
        times["fetch"] = time.perf_counter() - mark
        mark = time.perf_counter()
        prepared, geometry = model.read_volume(folder)
        times["decode and resample"] = time.perf_counter() - mark
    mark = time.perf_counter()
    options = {"patch": model.patch, "stride": model.default_stride, "mode": "exact"}
    heatmap = krypton.explain(model, prepared.tensor, fill=model.gray_fill(), **options)
    times["run"] = time.perf_counter() - mark
    mark = time.perf_counter()
    settings = {**options, "label": heatmap.label}
    key = result_key(series, model, settings)
    source = VolumeSource(prepared, list(geometry.headers))
    send_result(pacs, study, model, heatmap, source, key, settings)
    times["write-back"] = time.perf_counter() - mark
    times["total"] = time.perf_counter() - started
    return {
        "slices": geometry.shape[0],
        "seconds": times,
        "peak_bytes": memory.stop(),
        "class": model.class_name(heatmap.label),
        "probability": float(heatmap.prob),
        "orientation": prepared.orientation,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", default="300,600")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--port", type=int, default=8063)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.slices.split(",")]
    model = krypton.registry.load_model("chestct-demo")
    rows = []
    with tempfile.TemporaryDirectory(prefix="krypton-bench-orthanc-") as folder:
        process, root = start_orthanc(Path(folder), args.port)
        try:
            for count in counts:
                study, series = store_series(root, count)
                rows.append(open_to_heatmap(root, study, series, model))
        finally:
            process.terminate()
            process.wait(30)
    load = psutil.getloadavg()[0]
    print(f"clinical CT from Orthanc, 512 x 512 at {PIXEL_MM} mm, {SLICE_MM} mm slices; "
          f"chestct-demo at defaults; load {load:.1f} on {psutil.cpu_count()} cores")  # fmt: skip
    stages = list(rows[0]["seconds"])
    print(f"{'slices':>6}  " + "  ".join(f"{s:>19}" for s in stages) + "  peak MB  answer")
    for row in rows:
        seconds = "  ".join(f"{row['seconds'][s]:>18.1f}s" for s in stages)
        met = row["seconds"]["total"] <= TARGET_SECONDS and row["peak_bytes"] <= TARGET_BYTES
        verdict = "" if row["slices"] > 300 else ("  target met" if met else "  TARGET MISSED")
        print(f"{row['slices']:>6}  {seconds}  {row['peak_bytes'] / 2**20:>7.0f}  "
              f"{row['class']} {row['probability']:.2f}{verdict}")  # fmt: skip
    if len(rows) > 1:
        ratio = rows[-1]["seconds"]["total"] / rows[0]["seconds"]["total"]
        print(f"{rows[-1]['slices']} / {rows[0]['slices']} slices: {ratio:.2f}x the time")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
