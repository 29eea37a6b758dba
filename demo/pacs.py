"""A PACS to try Krypton with: Debian's Orthanc with its DICOMweb plugin on a local port,
its own storage folder and a user, loaded with the chest-CT sample as a CT series, the
fundus samples as photographs (Secondary Captures) and pydicom's CT and MR test files.

    make pacs                  (python -m demo.pacs --folder cache/pacs --port 8042)

It prints the environment that points Krypton at it, then serves until Ctrl-C. The
tests start the same Orthanc through :func:`start_orthanc` (tests/test_pacs.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

ORTHANC = shutil.which("Orthanc") or "/usr/sbin/Orthanc"
DICOMWEB_PLUGIN = "/usr/share/orthanc/plugins/libOrthancDicomWeb.so"
DEMO_USER, DEMO_PASSWORD = "krypton", "krypton-demo"


# A site's routing rule for an AI node: each stable CT or MR series goes to the modality
# "krypton" (Orthanc 1.10's Lua SendToModality could not read its own attachment here;
# its REST store route, called from Lua, sends the same series)
NODE_ROUTE = """
function OnStableSeries(seriesId, tags, metadata)
  if tags['Modality'] == 'CT' or tags['Modality'] == 'MR' then
    RestApiPost('/modalities/krypton/store',
                '{"Resources": ["' .. seriesId .. '"], "Asynchronous": true}')
  end
end
"""


def node_routing(
    folder: Path, node_port: int, pacs_ae: str = "ORTHANC", stable_seconds: int = 5
) -> dict:
    """Orthanc's configuration routing each stable CT or MR series to Krypton's node (AE
    KRYPTON on 127.0.0.1:``node_port``) as a site configures it: a modality entry and a
    Lua ``OnStableSeries`` rule (:data:`NODE_ROUTE`, written into ``folder``); Orthanc
    calls itself ``pacs_ae``, the title the node must allow."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "route-to-krypton.lua"
    script.write_text(NODE_ROUTE)
    return {
        "DicomAet": pacs_ae, "StableAge": stable_seconds, "LuaScripts": [str(script)],
        "DicomModalities": {"krypton": ["KRYPTON", "127.0.0.1", node_port]},
    }  # fmt: skip


def start_orthanc(
    folder: Path,
    port: int,
    user: str = DEMO_USER,
    password: str = DEMO_PASSWORD,
    extra: dict | None = None,
) -> tuple[subprocess.Popen, str]:
    """Orthanc serving ``folder``'s storage on 127.0.0.1:``port`` with basic
    authentication; (its process, its DICOMweb root) once it answers. ``extra``: more of
    Orthanc's configuration (a modality to route series to, a Lua script)."""

    if not Path(ORTHANC).exists() or not Path(DICOMWEB_PLUGIN).exists():
        raise SystemExit("Orthanc is not installed: apt-get install orthanc orthanc-dicomweb")
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "Name": "krypton-demo", "StorageDirectory": str(folder / "db"),
        "IndexDirectory": str(folder / "db"), "HttpPort": port,
        "DicomServerEnabled": False, "RemoteAccessAllowed": False,
        "AuthenticationEnabled": True, "RegisteredUsers": {user: password},
        "Plugins": [DICOMWEB_PLUGIN], "DicomWeb": {"Enable": True, "Root": "/dicom-web/"},
        **(extra or {}),
    }  # fmt: skip
    (folder / "orthanc.json").write_text(json.dumps(config, indent=2))
    log = open(folder / "orthanc.log", "w")
    process = subprocess.Popen([ORTHANC, str(folder / "orthanc.json")], stdout=log, stderr=log)
    root = f"http://127.0.0.1:{port}"
    wait_answering(process, f"{root}/system", 60, "Orthanc", folder / "orthanc.log",
                   auth=(user, password))  # fmt: skip
    return process, f"{root}/dicom-web"


def wait_answering(
    process: subprocess.Popen, url: str, seconds: float, what: str, log: Path, **get
) -> None:
    """Wait for the state (``url`` answering), not for a fixed time: RuntimeError with
    ``log``'s text where ``process`` exits or ``seconds`` pass first (it is killed)."""
    import requests

    deadline = time.monotonic() + seconds
    while True:
        try:
            if requests.get(url, timeout=2, **get).ok:
                return
        except requests.ConnectionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"{what} did not start: {log.read_text()}")
        time.sleep(0.2)


def ct_series(
    hu: np.ndarray,
    spacing: tuple[float, float, float],
    patient: str,
    origin: tuple[float, float, float] = (0.0, 0.0, 0.0),
    study_uid: str | None = None,
    description: str = "chest CT sample",
    window: tuple[float, float] = (-600.0, 1500.0),
) -> list:
    """A (z, y, x) volume in Hounsfield units as a CT series (one file per axial slice,
    identity orientation, the first slice's corner at ``origin`` in LPS mm, the reading
    ``window`` (centre, width; the lung window) in its header as a scanner writes it):
    pydicom datasets with new series and frame UIDs, in ``study_uid`` or a new study."""
    import pydicom
    from pydicom.data import get_testdata_file
    from pydicom.uid import generate_uid

    template = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    study, series, frame = study_uid or generate_uid(), generate_uid(), generate_uid()
    datasets = []
    for index, plane in enumerate(hu):
        dataset = copy.deepcopy(template)  # its file meta too: one per instance
        dataset.StudyInstanceUID, dataset.SeriesInstanceUID = study, series
        dataset.FrameOfReferenceUID, dataset.SOPInstanceUID = frame, generate_uid()
        dataset.PatientName, dataset.PatientID = patient, "KRYPTON-DEMO"
        dataset.StudyDescription = "Krypton demo: chest CT"
        dataset.SeriesDescription, dataset.InstanceNumber = description, index + 1
        dataset.Rows, dataset.Columns = plane.shape
        dataset.ImageOrientationPatient = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        dataset.ImagePositionPatient = [origin[0], origin[1], origin[2] + index * spacing[0]]
        dataset.SliceThickness = spacing[0]
        dataset.PixelSpacing = [spacing[1], spacing[2]]
        dataset.RescaleSlope, dataset.RescaleIntercept = 1, -1024
        dataset.WindowCenter, dataset.WindowWidth = window
        dataset.PixelData = np.round(plane + 1024).astype(np.int16).tobytes()  # signed
        dataset.file_meta.MediaStorageSOPInstanceUID = dataset.SOPInstanceUID
        datasets.append(dataset)
    return datasets


FUNDUS_SAMPLES = ("fundus-exudates.png", "fundus-microaneurysms.png", "fundus-normal-disc.png")
PYDICOM_FILES = ("CT_small.dcm", "MR_small.dcm")  # pydicom's own test files: a CT and an MR


def photograph(pixels: np.ndarray, patient: str, description: str) -> object:
    """An RGB picture as a Secondary Capture of its own study (no frame of reference, as a
    fundus camera's photograph): a pydicom dataset."""
    import pydicom
    from pydicom.data import get_testdata_file
    from pydicom.uid import generate_uid

    dataset = pydicom.dcmread(get_testdata_file("SC_rgb_small_odd.dcm"))  # an RGB SC template
    dataset.Rows, dataset.Columns = pixels.shape[:2]
    dataset.PixelData = np.ascontiguousarray(pixels, dtype=np.uint8).tobytes()
    dataset.StudyInstanceUID, dataset.SeriesInstanceUID = generate_uid(), generate_uid()
    dataset.SOPInstanceUID = dataset.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    dataset.PatientName, dataset.PatientID = patient, "KRYPTON-FUNDUS"
    dataset.StudyDescription = dataset.SeriesDescription = description
    return dataset


def load_demo_photographs(root: str, user: str = DEMO_USER, password: str = DEMO_PASSWORD):
    """The fundus samples as photographs and pydicom's CT and MR test files, each its own
    study; their study UIDs."""
    import pydicom
    from PIL import Image
    from pydicom.data import get_testdata_file

    from krypton.pacs.dicomweb import PacsSettings, connect, store
    from webapp.panel_scope import SAMPLES_DIR

    pacs = connect(PacsSettings(root, user, password))
    datasets = [
        photograph(np.asarray(Image.open(SAMPLES_DIR / name).convert("RGB")), "Demo^Fundus",
                   f"Krypton demo: {name[:-4]}")
        for name in FUNDUS_SAMPLES
    ] + [pydicom.dcmread(get_testdata_file(name)) for name in PYDICOM_FILES]  # fmt: skip
    for dataset in datasets:
        store(pacs, [dataset], dataset.StudyInstanceUID)
    return [str(dataset.StudyInstanceUID) for dataset in datasets]


def load_demo_study(root: str, user: str = DEMO_USER, password: str = DEMO_PASSWORD) -> str:
    """Store the chest-CT sample in the PACS as a CT series (STOW-RS); its study UID."""
    from krypton.io.volumes import read_volume
    from krypton.pacs.dicomweb import PacsSettings, connect, store
    from webapp.volume_layout import volume_sample_path

    volume = read_volume(volume_sample_path("chestct-nodule.nii.gz"))
    datasets = ct_series(np.asarray(volume.voxels), tuple(volume.spacing), "Demo^Chest")
    store(connect(PacsSettings(root, user, password)), datasets, datasets[0].StudyInstanceUID)
    return str(datasets[0].StudyInstanceUID)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folder", type=Path, default=Path("cache/pacs"))
    parser.add_argument("--port", type=int, default=8042)
    parser.add_argument(
        "--route-to", type=int, default=None, metavar="PORT",
        help="route each stable CT or MR series to Krypton's node on this port (make node)",
    )  # fmt: skip
    args = parser.parse_args()
    extra = None if args.route_to is None else node_routing(args.folder, args.route_to)
    process, root = start_orthanc(args.folder, args.port, extra=extra)
    try:
        study = load_demo_study(root)
        others = load_demo_photographs(root)
        print(f"Orthanc with DICOMweb at {root} (storage {args.folder}); the chest-CT sample is "
              f"study {study}, beside {len(others)} studies of one image (the fundus samples as "
              f"photographs, pydicom's CT and MR test files). Point Krypton at it:\n"
              f"  export KRYPTON_DICOMWEB_URL={root} KRYPTON_DICOMWEB_USER={DEMO_USER} "
              f"KRYPTON_DICOMWEB_PASSWORD={DEMO_PASSWORD}\n"
              f"  .venv/bin/krypton pacs series {study}\n"
              f"  make run   (the volume panel's From the PACS searches it)\n"
              f"Ctrl-C stops it.", flush=True)  # fmt: skip
        process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        process.terminate()
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
