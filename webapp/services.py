"""What the page's callbacks share, per server: loaded models and their explainers
(captured graphs and materialised views), stored images and uploads, each session's last
result, the cell cache and the job queue. Built once in app.create_app and handed to
every panel."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

import krypton
from krypton.devices import resolve_device
from krypton.explainer import model_fingerprint
from krypton.registry import CheckpointError, RegistryError, load_model

from . import helpers
from .client import request_client
from .gradient_store import KeptAttributions
from .helpers import VOLUME_MODEL_REASON, InputError
from .image_store import ImageStore
from .jobs import JobQueue, running_as
from .pacs import PacsSources
from .runs import CellCache, volumes
from .settings import ServerSettings
from .uploads import UploadStore


class OnceJob(Protocol):
    """A run's job as its run sees it: what an earlier delivery of it computed, and a
    place to record what this one computed (:class:`webapp.team.JobLease` in team mode)."""

    def outcome(self) -> list | None: ...

    def keep(self, outcome: list) -> None: ...


class Services:
    """Loaded models, their explainers (graphs and views), stored images, the sessions'
    last results and the job queue, per server."""

    def __init__(self, cache_dir: Path, settings: ServerSettings | None = None, team=None):
        self.settings = settings or ServerSettings()
        self.team = team  # webapp.team.TeamStores in team mode: state lives in Redis
        if team is not None:
            self.images, self.results, self.cells = team.images(), team.results(), team.cells()
        else:
            self.images = ImageStore(
                Path(cache_dir) / "images",
                self.settings.mb(self.settings.image_store_mb),
                self.settings.image_store_count,
            )
            self.results = helpers.ResultStore(
                self.settings.results_kept, self.settings.mb(self.settings.result_store_mb)
            )
            self.cells = CellCache(max_bytes=self.settings.mb(self.settings.cell_cache_mb))
        # Compare's gradient maps per pixel (each process its own, team mode's workers too)
        self.gradients = KeptAttributions(self.settings.mb(self.settings.gradient_cache_mb))
        self.uploads = UploadStore(
            Path(cache_dir) / "uploads", self.settings.mb(self.settings.upload_store_mb)
        )
        self._checksums: dict[str, str] = {}
        self.jobs = JobQueue(
            self.settings.max_running_jobs,
            self.settings.max_queued_jobs,
            self.settings.max_jobs_per_session,
            self.settings.max_jobs_per_client,
        )
        self._models: dict[str, krypton.LoadedModel] = {}
        self._explainers: dict[str, krypton.OcclusionExplainer] = {}
        self._lock = threading.Lock()
        # volumes: the prepared blocks the three views draw (their cells share self.cells,
        # keyed apart by a leading "volume", in Redis in team mode)
        self.volumes = volumes.VolumeCache()
        self.volume_sources = volumes.VolumeCache(max_items=1)  # source voxels are large
        self.pacs_sources = PacsSources()  # stored series opened from the PACS: their study
        self._intakes: dict[str, list] = {}  # client -> [its lock, requests holding or waiting]
        self._intakes_lock = threading.Lock()  # not self._lock: that one is held while loading
        self._pacs_slots = threading.BoundedSemaphore(self.settings.pacs_actions)

    @contextmanager
    def intake(self, busy: str = "") -> Iterator[str]:
        """Around reading a file a request sent (an image, a DICOM frame, a volume): one
        read at a time per client (:func:`webapp.client.request_client`), so one client's
        uploads leave the decode budget to others. A read that cannot start now is refused
        at once, never parked in a server thread: 32 loads kept in flight by one address
        each held one of waitress's 16 threads for up to 30 s, and another user's page
        took 26-29 s to load. Yields the client. Outside a request (a background job)
        nothing waits."""
        client = request_client()
        if not client:
            yield client
            return
        with self._intakes_lock:  # re-entrant: a read inside a read of the same request
            entry = self._intakes.setdefault(client, [threading.RLock(), 0])
            entry[1] += 1
        try:
            if not entry[0].acquire(blocking=False):
                raise InputError(
                    busy
                    or "your other file is still being read; try this one again when it has loaded"
                )
            try:
                yield client
            finally:
                entry[0].release()
        finally:
            with self._intakes_lock:
                entry[1] -= 1
                if entry[1] == 0:
                    self._intakes.pop(client, None)

    @contextmanager
    def pacs_call(self) -> Iterator[str]:
        """Around one PACS action a request asks for (a search, a listing, an open, a
        send): one at a time per client (:meth:`intake`, refused in the PACS's words) and
        :attr:`ServerSettings.pacs_actions` at a time for the server (past it: refused at
        once), so a slow PACS holds at most half the threads. Yields the client."""
        from .pacs import PACS_BUSY, PACS_FULL

        with self.intake(PACS_BUSY) as client:
            if not self._pacs_slots.acquire(blocking=False):
                raise InputError(PACS_FULL.format(count=self.settings.pacs_actions))
            try:
                yield client
            finally:
                self._pacs_slots.release()

    @contextmanager
    def job(self) -> Iterator[OnceJob | None]:
        """Around a run: None in embedded mode (the thread manager tracks the job, which
        is never delivered twice); in team mode, inside a Celery worker, the job's lease
        (cancel, abandoned page, the broker message kept from redelivery while this
        worker is alive, and the outcome of a run already computed for this job: a
        redelivery answers it again instead of computing twice)."""
        request = None
        if self.team is not None:
            from celery import current_task

            request = getattr(current_task, "request", None)
        if request is None or not getattr(request, "id", None):
            yield None
            return
        from krypton.batch.broker import delivery_tag

        from .team import JobLease

        lease = JobLease(
            self.team.client, request.id, delivery_tag(request), self.settings.abandon_seconds
        )
        lease.wait_for_other_holder()
        with lease, running_as(lease):
            yield lease

    def forget(self, name: str) -> None:
        """Drop a removed model from memory."""
        with self._lock:
            self._models.pop(name, None)
            self._explainers.pop(name, None)
            self._checksums.pop(name, None)

    def model(self, name: str, rank: int | None = 2) -> krypton.LoadedModel:
        """The model ``name``, refused in the page's words where its rank is not ``rank``
        (2: an image model, 3: a volume model; None: either)."""
        loaded = self._load(name)
        if rank is None or len(loaded.input_size) == rank:
            return loaded
        if loaded.is_volume:  # a request naming one, though the image list disables it
            raise InputError(f"{name} is a volume model: {VOLUME_MODEL_REASON}")
        raise InputError(f"{name} is a 2-D model; choose a volume model for a volume")

    def _load(self, name: str) -> krypton.LoadedModel:
        if not name:
            raise InputError("choose a model")
        with self._lock:
            if name not in self._models:
                try:
                    loaded = load_model(name).to(resolve_device(self.settings.device))
                except (RegistryError, CheckpointError, krypton.WeightsUnavailableError) as exc:
                    raise InputError(str(exc)) from exc
                self._models[name] = loaded
                self._explainers[name] = krypton.OcclusionExplainer(self._models[name])
            return self._models[name]

    def weights_checksum(self, name: str) -> str:
        """Digest of the model's weights and settings: which version made a result."""
        module = self._load(name).module
        with self._lock:
            if name not in self._checksums:
                self._checksums[name] = model_fingerprint(module)[1]
            return self._checksums[name]

    def explainer(self, name: str, rank: int | None = 2) -> krypton.OcclusionExplainer:
        """The explainer of the model ``name`` (its captured graph and views), refused as
        :meth:`model` refuses."""
        self.model(name, rank)
        return self._explainers[name]

    def prepared_volume(
        self, key: str, session: str, model: str, name: str | None = None
    ) -> volumes.PreparedVolume:
        """The volume this tab stored under ``key`` (a file called ``name``) as ``model``
        takes it: from memory when recently used, else read again from the stored file."""
        loaded = self.model(model, rank=3)

        def build() -> volumes.PreparedVolume:
            with self.intake():
                kept = self.volume_sources.peek((key, helpers.owner_tag(session)))
                model_input, geometry = volumes.prepare_uploaded_volume(
                    lambda: self.images.source(key, session), name, loaded, kept
                )
            unit = loaded.windowed(model_input)
            return volumes.PreparedVolume(volumes.SourceInfo.of(geometry), model_input, unit)

        return self.volumes.get((key, helpers.owner_tag(session), model), build)

    def top_classes(
        self, name: str, tensor: torch.Tensor, count: int = 5
    ) -> tuple[list[tuple[int, float]], str | None]:
        """The model's ``count`` most probable classes for the unoccluded image as (class,
        probability), most probable first, and why exact and approximate modes cannot
        run (None when they can). This also materialises the views a Run will reuse
        (krypton.OcclusionExplainer.predict)."""
        found = self.explainer(name).predict(tensor, ood=False)
        probabilities = found.probabilities
        top = torch.topk(torch.from_numpy(probabilities), min(count, probabilities.size))
        return [(int(i), float(p)) for p, i in zip(top.values, top.indices)], found.capture_error
