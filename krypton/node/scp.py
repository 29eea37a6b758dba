"""Krypton as an AI node: a DICOM Storage SCP (pynetdicom) a PACS routes new series to,
which explains each series once it is stable and stores the result (Parametric Map,
captures and the finding's Structured Report) back in its study over DICOMweb.

- **Who may send**: only calling AE titles on the allow-list; an association from any
  other is rejected (and logged).
- **What it keeps**: image storage of the modalities its models take (CT, MR, and the
  2-D models' photographs and captures); any other SOP class, a malformed instance and
  an instance past the spool's quota are refused with a status and a logged reason, and
  the node goes on serving.
- **When it explains**: a series no instance has reached for the stable time
  (:class:`~krypton.node.spool.Spool`), one at a time, in the node's process.
- **With what**: the model given, else the first available model whose card names the
  series' modality (the registry's ``modalities``): a volume model for a series of
  slices, an image model for a series of one; else it is skipped, with why.
- **Once**: the result key of the series, model and settings
  (:func:`krypton.pacs.results.result_key`) is asked of the study first, so a series
  re-sent or re-delivered, or a node restarted mid-run, stores nothing twice.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .spool import SeriesState, Spool

__all__ = ["NodeSettings", "Node", "IMAGE_STORAGE"]

logger = logging.getLogger("krypton.node")

# image storage the node keeps: CT, MR (and their enhanced forms), and what 2-D models
# take (ophthalmic photographs, secondary captures)
IMAGE_STORAGE = {
    "1.2.840.10008.5.1.4.1.1.2": "CT Image Storage",
    "1.2.840.10008.5.1.4.1.1.2.1": "Enhanced CT Image Storage",
    "1.2.840.10008.5.1.4.1.1.4": "MR Image Storage",
    "1.2.840.10008.5.1.4.1.1.4.1": "Enhanced MR Image Storage",
    "1.2.840.10008.5.1.4.1.1.77.1.5.1": "Ophthalmic Photography 8 Bit Image Storage",
    "1.2.840.10008.5.1.4.1.1.7": "Secondary Capture Image Storage",
}
REFUSED_CLASS, OUT_OF_RESOURCES, CANNOT_UNDERSTAND = 0x0122, 0xA700, 0xC210


@dataclass(frozen=True)
class NodeSettings:
    """The node's AE title, address, the calling AE titles it accepts, its spool and
    quota, the seconds after which a series is stable, and the model (None: by
    modality)."""

    ae_title: str = "KRYPTON"
    host: str = "127.0.0.1"
    port: int = 11112
    callers: tuple[str, ...] = ()
    spool: Path = Path("node-spool")
    quota_mb: int = 2048
    stable_seconds: float = 10.0
    model: str | None = None


class Node:
    """The Storage SCP and the loop that explains stable series (:meth:`start`,
    :meth:`stop`), sending results to ``pacs`` (a connected DICOMweb client)."""

    def __init__(self, settings: NodeSettings, pacs) -> None:
        self.settings = settings
        self.pacs = pacs
        self.spool = Spool(settings.spool, settings.quota_mb * 2**20, settings.stable_seconds)
        self._server = None
        self._stopping = threading.Event()
        self._worker: threading.Thread | None = None

    def start(self) -> None:
        """Listen for associations and explain stable series, in background threads."""
        from pynetdicom import AE, StoragePresentationContexts, evt
        from pynetdicom.sop_class import Verification  # type: ignore[attr-defined]

        if not self.settings.callers:
            raise ValueError("the node accepts no caller: name the PACS's AE title (--allow)")
        ae = AE(ae_title=self.settings.ae_title)
        ae.require_calling_aet = list(self.settings.callers)
        ae.supported_contexts = StoragePresentationContexts
        ae.add_supported_context(Verification)
        handlers = [(evt.EVT_C_STORE, self._on_store), (evt.EVT_REJECTED, self._on_rejected)]
        self._server = ae.start_server(
            (self.settings.host, self.settings.port), block=False, evt_handlers=handlers
        )
        self._worker = threading.Thread(target=self._explain_loop, name="krypton-node", daemon=True)
        self._worker.start()
        logger.info(
            "node %s listening on %s:%d for %s", self.settings.ae_title, self.settings.host,
            self.settings.port, ", ".join(self.settings.callers),
        )  # fmt: skip

    def stop(self) -> None:
        """Stop listening and explaining (a run in progress finishes first)."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
        if self._worker is not None:
            self._worker.join(timeout=600)

    @staticmethod
    def _on_rejected(event) -> None:
        requestor = event.assoc.requestor
        logger.warning(
            "refused an association from AE %r at %s: not on the node's allow-list",
            requestor.ae_title, requestor.address,
        )  # fmt: skip

    def _on_store(self, event) -> int:
        """One C-STORE: kept in the spool, or refused with a status and its reason."""
        caller = event.assoc.requestor.ae_title
        sop_class = str(event.request.AffectedSOPClassUID)
        if sop_class not in IMAGE_STORAGE:
            logger.warning("refused an instance from %s: SOP class %s is not an image the "
                           "node explains", caller, sop_class)  # fmt: skip
            return REFUSED_CLASS
        try:
            dataset = event.dataset  # decoded for its UIDs; the bytes kept are those sent
            series, study = str(dataset.SeriesInstanceUID), str(dataset.StudyInstanceUID)
            sop, modality = str(dataset.SOPInstanceUID), str(dataset.get("Modality", ""))
        except Exception as exc:  # a malformed instance: its reason, and serve on
            logger.warning("refused a malformed instance from %s: %s", caller, exc)
            return CANNOT_UNDERSTAND
        sent = event.encoded_dataset()  # the file as sent: preamble, meta, data set
        refused = self.spool.receive(sent, series, study, sop, modality, caller)
        if refused:
            logger.warning("refused an instance of series %s from %s: %s", series, caller, refused)
            return OUT_OF_RESOURCES
        return 0x0000

    def _explain_loop(self) -> None:
        while not self._stopping.is_set():
            for series in self.spool.take_stable():
                self.explain(series)
            self._stopping.wait(0.5)

    def explain(self, series: SeriesState) -> None:
        """Explain one stable series and store its result in its study; its state and
        reason recorded whatever happens."""
        try:
            state, reason = self._explain(series)
        except Exception as exc:  # the node serves on; the series says why
            logger.exception("series %s failed", series.series)
            state, reason = "failed", f"{type(exc).__name__}: {exc}"
        self.spool.mark(series.series, state, reason)
        logger.info("series %s: %s (%s)", series.series, state, reason)

    def _explain(self, series: SeriesState) -> tuple[str, str]:
        import pydicom

        from ..pacs.results import MANUFACTURER

        folder = self.spool.series_folder(series.series)
        files = sorted(folder.glob("*.dcm"))
        if not files:
            return "failed", "no instance of the series is in the spool"
        header = pydicom.dcmread(files[0], stop_before_pixels=True)
        if header.get("Manufacturer") == MANUFACTURER:
            return "skipped", "one of Krypton's own results"
        volume = len(files) > 1
        what = "series of slices" if volume else "images"
        model = self._model(series.modality, volume)
        if model is None:
            return "skipped", f"no model here is made for {series.modality or 'these'} {what}"
        if model.is_volume != volume:
            return "skipped", f"the node's model {model.name} does not take {what}"
        if volume:
            return self._explain_volume(series, model, folder, files)
        return self._explain_image(series, model, files[0])

    def _model(self, modality: str, volume: bool):
        """The node's model, else the first available model made for ``modality`` that
        takes volumes (a series of slices) or images (a series of one)."""
        from ..registry import available_models, load_model

        if self.settings.model:
            return load_model(self.settings.model)
        made_for = [
            info.name for info in available_models()
            if info.available and info.is_volume == volume and modality in info.modalities
        ]  # fmt: skip
        return load_model(made_for[0]) if made_for else None

    @staticmethod
    def _options(model) -> dict:
        """The settings the node explains with: exact, the model's patch, stride and gray."""
        return {"mode": "exact", "patch": model.patch, "stride": model.default_stride,
                "fill": model.gray_fill()}  # fmt: skip

    def _store(self, series: SeriesState, model, heatmap, source, settings: dict, began: float):
        """Store the result in the series' study unless it holds it already: the state
        and reason the series ends with."""
        from ..pacs.dicomweb import action
        from ..pacs.results import in_study, result_key, send_result

        key = result_key(series.series, model, settings)
        with action(self.pacs, f"sending the result to study {series.study}"):
            if in_study(self.pacs, series.study, key):
                return "done", f"the study holds its result already ({key})"
            sent = send_result(self.pacs, series.study, model, heatmap, source(), key, settings)
        took = time.perf_counter() - began
        return "done", (
            f"{model.name}: {model.class_name(heatmap.label)} p={heatmap.prob:.3f}, "
            f"stored {sent.words()} in {took:.1f} s"
        )

    def _explain_image(self, series: SeriesState, model, path: Path):
        """One image (its middle frame, in the file's own window) by a 2-D model, keyed
        as ``krypton explain --send`` and the app key it."""
        import pydicom

        from ..explainer import explain
        from ..io.images import ImageLoadError, load_image
        from ..pacs.results import ImageSource

        began = time.perf_counter()
        options = self._options(model)
        try:
            picture = load_image(path)
        except ImageLoadError as exc:
            return "failed", str(exc)
        heatmap = explain(model, model.preprocess(picture), **options)
        header = pydicom.dcmread(path, stop_before_pixels=True)
        frame = int(header.get("NumberOfFrames", 1) or 1) // 2
        settings = {**options, "label": heatmap.label, "instance": str(header.SOPInstanceUID),
                    "frame": frame, "window": None}  # fmt: skip
        return self._store(series, model, heatmap, lambda: ImageSource(path), settings, began)

    def _explain_volume(self, series: SeriesState, model, folder: Path, files: list[Path]):
        """A series of slices by a volume model, read as ``krypton batch`` reads a
        series folder (the series streamed into the model's block)."""
        import pydicom

        from ..batch.folder import explain_item
        from ..pacs.results import VolumeSource

        began = time.perf_counter()
        options = self._options(model)
        row, _ = explain_item(folder, None, model, options, image=series.series)
        if row.error:
            return "failed", row.error
        heatmap, prepared = row.extra["heatmap"], row.extra["prepared"]

        def source() -> VolumeSource:  # the headers read only when the study lacks it
            headers = [pydicom.dcmread(path, stop_before_pixels=True) for path in files]
            return VolumeSource(prepared, headers)

        settings = {**options, "label": heatmap.label}
        return self._store(series, model, heatmap, source, settings, began)
