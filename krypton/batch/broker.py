"""Celery for team work: the one configuration the app and the workers share
(:func:`make_celery`), and ``krypton batch --broker`` spreading images over the workers.

Both the app's runs (webapp/team.py) and batch images are acknowledged late: a worker
that dies leaves its message with the broker, and Redis hands it to another worker once
it has been invisible for ``visibility_timeout`` seconds. A task that is still running
keeps its message's timestamp fresh (:class:`KeepVisible`), so only a lost task comes
back. Images travel in the task message (workers need no shared disk); results come back
through the Redis result backend as the same bytes a local run would write.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict

from celery import Celery

from .._environment import library_setting

__all__ = [
    "BATCH_TASK",
    "PACS_TASK",
    "broker_series",
    "BrokerError",
    "KeepVisible",
    "delivery_tag",
    "PREFIX",
    "broker_submit",
    "live_workers",
    "make_celery",
    "visibility_timeout",
    "register_batch_task",
]

PREFIX = "krypton:"  # every key Krypton keeps in Redis starts with this
BATCH_TASK = "krypton.batch_image"
PACS_TASK = "krypton.pacs_series"  # one series of a study batch (krypton.pacs.results)
# A message invisible this long with nobody refreshing it goes back to the queue. Short,
# so lost work restarts soon; running tasks refresh theirs every REFRESH_SECONDS.
VISIBILITY_TIMEOUT = 20.0  # default; KRYPTON_VISIBILITY_TIMEOUT sets it (seconds, >= 5)
VISIBILITY_ENV = "KRYPTON_VISIBILITY_TIMEOUT"
REFRESH_SECONDS = 2.0
UNACKED_INDEX = "unacked_index"  # kombu's Redis transport: delivery tag -> time sent


class BrokerError(RuntimeError):
    """The broker cannot be used (unreachable, or no worker answers)."""


def visibility_timeout() -> float:
    """Seconds an unacknowledged message stays invisible: $KRYPTON_VISIBILITY_TIMEOUT or
    20; at least 5 (refreshes come every REFRESH_SECONDS)."""
    return library_setting(VISIBILITY_ENV)


def make_celery(url: str, visibility: float | None = None) -> Celery:
    """The Celery application the app, the workers and ``krypton batch --broker`` share."""
    visibility = visibility_timeout() if visibility is None else visibility
    app = Celery("krypton", broker=url, backend=url)
    app.conf.update(
        task_acks_late=True,  # the message stays with the broker until the task ends
        task_reject_on_worker_lost=True,  # ... and goes back if the worker dies
        worker_prefetch_multiplier=1,  # a busy worker does not hold tasks others could take
        broker_transport_options={
            "visibility_timeout": visibility,
            "unacked_restore_interval": 2,  # look for lost messages every 2 s
            "unacked_restore_throttle": 1,
        },
        result_expires=3600,
        task_publish_retry_policy={"max_retries": 1, "interval_start": 0, "interval_step": 1},
        broker_connection_timeout=3,
        redis_socket_connect_timeout=3,
        redis_socket_timeout=10,
        broker_connection_retry_on_startup=True,
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],  # never pickle: a message must not be able to run code
    )
    return app


def live_workers(client) -> list[str]:
    """Names of the workers whose beacon (webapp/worker.py) is fresh."""
    return sorted(
        key.decode().removeprefix(PREFIX + "worker:")
        for key in client.scan_iter(PREFIX + "worker:*", count=100)
    )


class KeepVisible:
    """While a task runs, refresh its broker message's timestamp from a daemon thread,
    so the message is redelivered only if this worker is gone. ``also`` is called on
    every refresh (with a Redis pipeline) for other keys the task keeps alive."""

    def __init__(self, client, delivery_tag: str | None, also=None):
        self.client, self.delivery_tag, self.also = client, delivery_tag, also
        self._stop = threading.Event()

    def refresh(self) -> None:
        pipe = self.client.pipeline()
        if self.delivery_tag:
            pipe.zadd(UNACKED_INDEX, {self.delivery_tag: time.time()}, xx=True)
        if self.also is not None:
            self.also(pipe)
        pipe.execute()

    def _keep(self) -> None:
        import redis

        while not self._stop.wait(REFRESH_SECONDS):
            try:
                self.refresh()
            except redis.RedisError:
                pass  # Redis is away; the task's result waits for it

    def __enter__(self) -> KeepVisible:
        self.refresh()
        threading.Thread(target=self._keep, name="krypton-keep-visible", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def delivery_tag(request) -> str | None:
    """The broker's tag of the message a task ``request`` came in. Celery keeps it in the
    request's message properties: its ``delivery_info`` holds only exchange, routing key,
    priority and redelivered (reading the tag from there found nothing, so no message was
    kept invisible and every run longer than the visibility timeout was delivered again)."""
    properties = getattr(request, "properties", None) or {}
    info = getattr(request, "delivery_info", None) or {}
    return properties.get("delivery_tag") or info.get("delivery_tag") or None


_models: dict[str, tuple] = {}
_models_lock = threading.Lock()


def _worker_model(name: str):
    """(LoadedModel, weights checksum), loaded the first time a task needs it."""
    from ..devices import resolve_device
    from ..explainer import model_fingerprint
    from ..registry import load_model

    with _models_lock:
        if name not in _models:
            # on this worker's device: $KRYPTON_DEVICE, default auto (its card if it has one)
            loaded = load_model(name).to(resolve_device())
            _models[name] = (loaded, model_fingerprint(loaded.module)[1])
        return _models[name]


def register_batch_task(app: Celery) -> None:
    """Add the batch task to a worker's Celery app (webapp/worker.py does)."""
    import redis

    from .folder import explain_item

    client = redis.Redis.from_url(app.conf.broker_url, socket_timeout=10)

    @app.task(name=BATCH_TASK, bind=True)
    def batch_image(
        task,
        model_name: str,
        checksum: str,
        data: str,
        image: str,
        label: str | None,
        options: dict,
        window,
        frame: int | None,
    ) -> dict:
        """One image of a batch: its row and output files (base64)."""
        worker = task.request.hostname
        with KeepVisible(client, delivery_tag(task.request)):
            model, found = _worker_model(model_name)
            if found != checksum:
                return _failed(
                    worker, image, label, _other_weights(worker, model_name, found, checksum)
                )
            row, files = explain_item(
                base64.b64decode(data), label, model, _from_message(options), window, frame,
                image,
            )  # fmt: skip
        return _answer(worker, row, files)

    @app.task(name=PACS_TASK, bind=True)
    def pacs_series(
        task, model_name: str, checksum: str, pacs_url: str, study: str, series: str,
        label: str | None, options: dict, send: bool, key: str | None,
    ) -> dict:  # fmt: skip
        """One series of a study batch, fetched from and sent to this worker's own PACS
        (its KRYPTON_DICOMWEB_URL and sign-in: no credential travels in a message)."""
        with KeepVisible(client, delivery_tag(task.request)):
            return _pacs_series(
                task.request.hostname, model_name, checksum, pacs_url, study, series, label,
                options, send, key,
            )  # fmt: skip


def _pacs_series(
    worker: str, model_name: str, checksum: str, pacs_url: str, study: str, series: str,
    label: str | None, options: dict, send: bool, key: str | None,
) -> dict:  # fmt: skip
    """The PACS task's work (:func:`krypton.batch.study.explain_series`), its answer a dict: the
    row, the files (base64), what was sent, or ``refused``: the PACS refused the send."""
    from ..pacs.dicomweb import PacsError, PacsSettings, connect
    from .study import explain_series

    def failed(error: str) -> dict:
        return _failed(worker, series, label, error, sent=None)

    model, found = _worker_model(model_name)
    if found != checksum:
        return failed(_other_weights(worker, model_name, found, checksum))
    try:
        settings = PacsSettings.from_environment()
    except PacsError as exc:
        return failed(f"worker {worker}: {exc}")
    if settings is None or settings.url.rstrip("/") != pacs_url.rstrip("/"):
        where = "no PACS" if settings is None else "another PACS"
        return failed(
            f"worker {worker} has {where} configured; give it KRYPTON_DICOMWEB_URL={pacs_url} "
            "and its sign-in"
        )
    try:
        row, files, sent = explain_series(
            connect(settings), study, series, model, _from_message(options), label, key, send
        )
    except PacsError as exc:
        return {**failed(str(exc)), "refused": True}
    return _answer(worker, row, files, sent=None if sent is None else asdict(sent))


def _other_weights(worker: str, model_name: str, found: str, checksum: str) -> str:
    """Why a worker refuses a task: its weights for the model are not the sender's."""
    return (
        f"worker {worker} has different weights for {model_name} (checksum {found[:12]}, "
        f"yours {checksum[:12]}); give every host the same model registry"
    )


def _from_message(options: dict) -> dict:
    """explain()'s options as a JSON message carried them (tuples arrive as lists)."""
    return {key: tuple(value) if key in ("fill", "region") and isinstance(value, list) else value
            for key, value in options.items()}  # fmt: skip


def _failed(worker: str, image: str, label: str | None, error: str, **more) -> dict:
    """A task's answer for an input it could not explain: a row with the error."""
    row = {"image": image, "given_label": label or "", "error": error}
    return {"row": row, "files": {}, "worker": worker, **more}


def _answer(worker: str, row, files: dict[str, bytes], **more) -> dict:
    """A task's answer: the summary row and the output files (base64), as JSON carries them."""
    record = asdict(row)
    record.pop("extra")
    encoded = {k: base64.b64encode(v).decode() for k, v in files.items()}
    return {"row": record, "files": encoded, "worker": worker, **more}


def _workers(url: str, model, wait_for_worker: float) -> Celery:
    """The Celery app on ``url`` once a worker is there (BrokerError otherwise)."""
    import redis

    if model.random_weights:
        raise BrokerError("random weights differ on every worker; --broker needs trained weights")
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise BrokerError(f"cannot reach the broker at {url}: {exc}") from exc
    deadline = time.monotonic() + wait_for_worker
    while not live_workers(client):
        if time.monotonic() > deadline:
            raise BrokerError(
                f"no Krypton worker is running on {url} (start one with `make worker`)"
            )
        time.sleep(0.5)
    return make_celery(url)


def _as_finished(pending: dict) -> Iterator[tuple[object, object]]:
    """(what was sent, its Celery result) for each task of ``pending`` (task id ->
    (what, result)) as it finishes; what is still queued when the caller stops (an
    interrupt, an error) is withdrawn."""
    try:
        while pending:
            for task_id, (what, result) in list(pending.items()):
                if result.ready():
                    del pending[task_id]
                    yield what, result
            time.sleep(0.1)
    finally:
        for _, result in pending.values():
            result.revoke()


def broker_submit(url: str, model, options: dict, window=None, frame=None, wait_for_worker=30.0):
    """A ``submit`` for :func:`krypton.batch.run_batch` that sends each image to the
    Celery workers behind ``url`` and yields results as they finish."""
    from ..explainer import model_fingerprint
    from .folder import BatchRow, batch_row

    app = _workers(url, model, wait_for_worker)
    checksum = model_fingerprint(model.module)[1]

    def submit(items) -> Iterator:
        pending = {}
        for item in items:
            try:
                data = base64.b64encode(item.path.read_bytes()).decode()
            except OSError as exc:
                row = BatchRow(image=str(item.path), given_label=item.label or "")
                row.error = f"cannot read the file: {exc.strerror or exc}"
                yield item, row, {}
                continue
            result = app.send_task(BATCH_TASK, args=(
                model.name, checksum, data, str(item.path), item.label, options, window, frame,
            ))  # fmt: skip
            pending[result.id] = (item, result)
        for item, result in _as_finished(pending):
            if result.successful():
                answer = result.get()
                row = batch_row(answer["row"])
                files = {k: base64.b64decode(v) for k, v in answer["files"].items()}
            else:
                row = BatchRow(image=str(item.path), given_label=item.label or "")
                row.error = f"the worker failed: {result.result!r}"
                files = {}
            result.forget()
            yield item, row, files

    return submit


def broker_series(url: str, wait_for_worker: float = 30.0):
    """A ``submit`` for :func:`krypton.batch.study.run_study_batch` that sends each series to the
    Celery workers behind ``url``. Each worker fetches the series from its own PACS,
    which must be the one the batch names, and sends the result there itself."""

    def make(pacs, study_uid: str, model, options: dict, label: str | None, send: bool):
        from ..explainer import model_fingerprint
        from ..pacs.dicomweb import PacsError
        from ..pacs.results import SentResult
        from .folder import BatchRow, batch_row

        app = _workers(url, model, wait_for_worker)
        checksum = model_fingerprint(model.module)[1]

        def submit(todo) -> Iterator:
            pending = {}
            for found, key in todo:
                result = app.send_task(PACS_TASK, args=(
                    model.name, checksum, pacs.settings.url, study_uid, found.series_uid,
                    label, options, send, key,
                ))  # fmt: skip
                pending[result.id] = (found, result)
            for found, result in _as_finished(pending):
                if not result.successful():
                    error = f"the worker failed: {result.result!r}"
                    yield found, BatchRow(image=found.series_uid, error=error), {}, None
                    continue
                answer = result.get()
                result.forget()
                if answer.get("refused"):  # the PACS refused a send: the run ends
                    raise PacsError(answer["row"]["error"])
                files = {k: base64.b64decode(v) for k, v in answer["files"].items()}
                sent = SentResult(**answer["sent"]) if answer.get("sent") else None
                yield found, batch_row(answer["row"]), files, sent

        return submit

    return make


def worker_threads() -> int | None:
    """Torch threads for a worker: KRYPTON_TORCH_THREADS; None where unset (each run then
    takes the cores the host's load leaves, krypton.host.host_share)."""
    return int(library_setting("KRYPTON_TORCH_THREADS")) or None
