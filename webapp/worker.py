"""A team-mode worker: ``make worker`` runs

    celery -A webapp.worker:celery_app worker --pool threads --concurrency 1

with ``KRYPTON_BROKER_URL`` set. Why this pool: PyTorch's CPU thread pool (OpenMP)
deadlocks in a forked child, so the prefork pool is out; ``threads`` runs the job in a
thread of this process while the main thread keeps talking to the broker (revokes,
heartbeats), which ``solo`` cannot do during a run. One job at a time per worker: a run
already uses every thread torch is given (``KRYPTON_TORCH_THREADS``; run one worker per
host with all cores, or several with a share each). Models load lazily, inside the worker,
the first time a run needs them (webapp.services.Services.model).
"""

from __future__ import annotations

import os
import sys

import torch
from celery.signals import worker_ready, worker_shutdown

from app import create_app
from krypton.batch.broker import register_batch_task, worker_threads
from webapp.settings import BROKER_ENV
from webapp.team import WorkerBeacon, redis_client

THREADS = worker_threads()
if THREADS is not None:  # the operator's count, for every torch op of the worker
    torch.set_num_threads(THREADS)

if not os.environ.get(BROKER_ENV):
    sys.exit(f"error: set {BROKER_ENV}=redis://HOST:PORT/DB for a worker (README: Team mode)")

# The same Dash app the server builds: its background callback is the task this worker runs.
dash_app = create_app()
celery_app = dash_app.krypton_celery
register_batch_task(celery_app)  # `krypton batch --broker` sends its images here too
_beacons: dict[str, WorkerBeacon] = {}


@worker_ready.connect
def _announce(sender, **_):
    """Tell the app a worker is here (it says so on the page when none is)."""
    beacon = WorkerBeacon(redis_client(os.environ[BROKER_ENV]), sender.hostname)
    beacon.start()
    _beacons[sender.hostname] = beacon
    print(
        f"krypton worker {sender.hostname} ready: torch threads {torch.get_num_threads()}",
        flush=True,
    )


@worker_shutdown.connect
def _leave(sender, **_):
    for beacon in _beacons.values():
        beacon.stop()
