"""Team mode: runs go to Celery workers through Redis; images, results and computed
cells live in Redis, so any app process and any worker see the same state.

Set ``KRYPTON_BROKER_URL=redis://HOST:PORT/DB`` and the app serves the same page with
Dash's :class:`~dash.CeleryManager` (subclassed here as :class:`TeamManager`); ``make
worker`` starts a worker (``webapp/worker.py``). Without the variable nothing here is
used: jobs are threads of the server and state is local (webapp/jobs.py).

Faults, and how each is handled:

* **A worker dies mid-run** (SIGKILL, power loss). Tasks are acknowledged late
  (``task_acks_late``), so the broker still holds the message. Redis redelivers an
  unacknowledged message once it has been invisible for ``visibility_timeout`` seconds;
  a running job keeps its message's timestamp fresh (:class:`JobLease`), so only a
  message whose worker stopped refreshing it comes back. The next worker resumes from
  the cells the lost one wrote to :class:`RedisCellCache`.
* **No worker is left.** The page's poll (:meth:`TeamManager.get_progress`) says so
  while the run waits, and gives up with a plain message after ``no_worker_seconds``.
* **Redis goes away.** Every poll and every store call turns the connection error into
  one sentence for the page; the page itself keeps loading (it needs no Redis).
* **Cancel.** A flag in Redis that the running job reads after every batch (a thread of
  a worker cannot be killed), plus a revoke for a run still waiting in the queue.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import redis
from celery import Celery
from dash import CeleryManager

from krypton.batch.broker import (
    PREFIX,
    KeepVisible,
    live_workers,
    make_celery,
    visibility_timeout,
)

from .settings import BROKER_ENV
from .team_stores import (
    STATE_TTL,
    RedisCellCache,
    RedisImageStore,
    RedisResultStore,
    TeamStores,
    redis_client,
    unavailable_message,
)

__all__ = [
    "BROKER_ENV",
    "make_celery",
    "TeamManager",
    "TeamStores",
    "RedisImageStore",
    "RedisResultStore",
    "RedisCellCache",
    "JobLease",
    "WorkerBeacon",
    "live_workers",
    "unavailable_message",
]

logger = logging.getLogger("krypton.team")
WORKER_BEACON_SECONDS = 10.0  # a worker that has not said so for this long is gone


class WorkerBeacon:
    """A worker's 'still here' key, refreshed from a daemon thread; it expires by itself
    when the worker dies, so the app can tell that no worker is left."""

    def __init__(self, client: redis.Redis, name: str):
        self.client, self.name = client, name
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._beat, name="krypton-beacon", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.set(PREFIX + "worker:" + self.name, str(os.getpid()),
                                ex=int(WORKER_BEACON_SECONDS))  # fmt: skip
            except redis.RedisError:
                pass  # Redis is away: the beacon lapses, which is the truth
            self._stop.wait(WORKER_BEACON_SECONDS / 3)

    def stop(self) -> None:
        self._stop.set()
        try:
            self.client.delete(PREFIX + "worker:" + self.name)
        except redis.RedisError:
            pass


class JobLease:
    """What a running job keeps fresh while it runs: its broker message's timestamp (so
    the message is redelivered only when the worker is gone) and a lease naming the
    worker. Its :meth:`stop_reason` reads the page's Cancel and the page's last poll, the
    team-mode counterpart of webapp.jobs' thread record."""

    def __init__(
        self,
        client: redis.Redis,
        job: str,
        delivery_tag: str | None,
        abandon_seconds: float,
        worker: str | None = None,
    ):
        self.client, self.job, self.delivery_tag = client, job, delivery_tag
        self.abandon_seconds = abandon_seconds
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}"
        self.started = time.time()
        self._reason: str | None = None
        self._checked = 0.0

    def wait_for_other_holder(self) -> None:
        """A redelivered job whose first worker is still alive (it kept its lease) waits
        for it to finish or to vanish, instead of computing the same run twice. It waits
        silently: the page shows the running worker's progress, not this wait (it says
        so in this worker's log)."""
        said = False
        while True:
            holder = self.client.get(PREFIX + "lease:" + self.job)
            if holder is None or holder.decode() == self.worker:
                return
            if not said:
                logger.warning(
                    "job %s was delivered again while %s still runs it; waiting for it",
                    self.job,
                    holder.decode(),
                )
                said = True
            time.sleep(1.0)

    def outcome(self) -> list | None:
        """What this job's run gave when a worker finished it before (a redelivered
        message whose first worker finished but could not acknowledge in time), else
        None: the run is computed once, and a delivery after it answers the same."""
        try:
            data = self.client.get(PREFIX + "done:" + self.job)
        except redis.RedisError:
            return None
        return None if data is None else json.loads(data)

    def keep(self, outcome: list) -> None:
        """Record that this worker computed the job's run, and what it gave the page (a
        JSON list), for any later delivery of the same message; the worker's log says
        ``computed run <job>`` once per computation."""
        logger.info("computed run %s on %s", self.job, self.worker)
        try:
            self.client.set(PREFIX + "done:" + self.job, json.dumps(outcome), ex=STATE_TTL)
        except redis.RedisError:
            pass  # the page's result is in the backend anyway; only a redelivery recomputes

    def _hold(self, pipe) -> None:
        # three visibility timeouts: a worker the load starved of a refresh or two (its
        # message already delivered again) still holds the run, so the second delivery
        # waits for it instead of computing beside it; a dead worker's lease is gone soon
        pipe.set(PREFIX + "lease:" + self.job, self.worker, ex=int(3 * visibility_timeout()))

    def __enter__(self) -> JobLease:
        self._keeper = KeepVisible(self.client, self.delivery_tag, also=self._hold).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._keeper.__exit__(*exc)
        try:
            self.client.delete(PREFIX + "lease:" + self.job)
        except redis.RedisError:
            pass

    def stop_reason(self) -> str | None:
        """'cancelled', 'abandoned' or None; reads Redis at most once a quarter second."""
        now = time.time()
        if self._reason is None and now - self._checked > 0.25:
            self._checked = now
            try:
                cancelled, polled = self.client.mget(
                    PREFIX + "cancel:" + self.job, PREFIX + "poll:" + self.job
                )
            except redis.RedisError:
                return None  # keep computing; the result waits for Redis to return
            last_poll = max(float(polled or 0), self.started)
            if cancelled:
                self._reason = "cancelled"
            elif now - last_poll > self.abandon_seconds:
                self._reason = "abandoned"
        return self._reason


class TeamManager(CeleryManager):
    """Dash's CeleryManager with cooperative cancel, abandoned-page detection, a plain
    message when no worker is left, and Redis outages turned into page messages."""

    def __init__(
        self,
        celery_app: Celery,
        url: str,
        *,
        message_output: int,
        outputs: int,
        no_worker_seconds: float = 45.0,
        expire: int | None = None,
        waiting_progress: Callable[[str], list] = lambda text: ["0", "1", None, text],
    ):
        super().__init__(celery_app, expire=expire)
        self.url = url
        self.client = redis_client(url)
        self.message_output, self.outputs = message_output, outputs
        self.no_worker_seconds = no_worker_seconds
        self.waiting_progress = waiting_progress  # the progress outputs showing a text
        self._failed: dict[str, str] = {}  # job key -> why it could not be sent
        self._waiting_since: dict[str, float] = {}  # job key -> when no worker was seen
        self._polled: dict[str, str] = {}  # job -> the key its page polls, until fetched

    def _message_result(self, text: str) -> list:
        result: list = [{"_dash_no_update": "_dash_no_update"}] * self.outputs
        result[self.message_output] = text
        return result

    def call_job_fn(self, key, job_fn, args, context):
        try:
            return super().call_job_fn(key, job_fn, args, context)
        except Exception as exc:  # kombu/redis connection errors, whatever their class
            self._failed[key] = unavailable_message(self.url, exc)
            return f"unsent-{key}"

    def terminate_job(self, job):
        if job is None or str(job).startswith("unsent-"):
            return
        try:
            self.client.set(PREFIX + "cancel:" + str(job), "1", ex=3600)
            self.handle.control.revoke(job)  # a run still in the queue never starts
        except Exception:  # Redis is away: the job cannot be reached either
            pass

    def job_running(self, job):
        """Whether the job is still under way. Dash reads a poll's result first and asks
        this after: a run that stored its result and ended between the two would look
        cancelled and its result be lost, so a job whose result waits to be fetched counts
        (as webapp.jobs.ThreadedDiskcacheManager.job_running does)."""
        if job is None or str(job).startswith("unsent-"):
            return False
        try:
            if super().job_running(job):
                return True
            key = self._polled.get(str(job))
            if key is not None and self.handle.backend.get(key) is not None:
                return True
        except Exception:
            return False
        self._polled.pop(str(job), None)
        return False

    def get_progress(self, key):
        if key in self._failed:
            return None
        try:
            progress = super().get_progress(key)
            if progress is not None:
                self._waiting_since.pop(key, None)
                return progress
            if live_workers(self.client):
                self._waiting_since.pop(key, None)
                return None
        except redis.RedisError:
            return None  # get_result says what happened
        since = self._waiting_since.setdefault(key, time.monotonic())
        text = (
            f"No worker is running: the run waits in the queue (it gives up after "
            f"{self.no_worker_seconds:.0f} s). Start one with `make worker`."
        )
        waited = time.monotonic() - since
        return self.waiting_progress(f"{text} Waiting {waited:.0f} s.")

    def get_result(self, key, job):
        """The job's result, or UNDEFINED while it runs; remembers which key ``job``'s page
        polls until the result is fetched (:meth:`job_running`)."""
        if job is not None:
            self._polled[str(job)] = key
        result = self._result(key, job)
        if result is not self.UNDEFINED and job is not None:
            self._polled.pop(str(job), None)
        return result

    def _result(self, key, job):
        if key in self._failed:
            return self._message_result(self._failed.pop(key))
        try:
            if job is not None:
                self.client.set(PREFIX + "poll:" + str(job), str(time.time()), ex=3600)
            result = self._stored_result(key)
        except redis.RedisError as exc:
            return self._message_result(unavailable_message(self.url, exc))
        since = self._waiting_since.get(key)
        if (
            result is self.UNDEFINED
            and since is not None
            and time.monotonic() - since > self.no_worker_seconds
        ):
            self._waiting_since.pop(key, None)
            self.terminate_job(job)
            return self._message_result(
                f"No worker took the run within {self.no_worker_seconds:.0f} s, so it was "
                f"withdrawn. Start a worker (`make worker`, or `make cluster` on one "
                f"machine) and press Run again."
            )
        return result

    def _stored_result(self, key):
        """CeleryManager.get_result without its closing terminate_job: that would flag
        every finished job as cancelled and revoke it (noise in every worker's log)."""
        result = self.handle.backend.get(key)
        if result is None:
            return self.UNDEFINED
        self.clear_cache_entry(key)
        self.clear_cache_entry(self._make_progress_key(key))
        return json.loads(result)

    def get_updated_props(self, key):
        try:
            return super().get_updated_props(key)
        except redis.RedisError:
            return {}
