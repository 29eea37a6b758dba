"""The server's limits and deployment settings, read once from the environment.

Every limit the app enforces is decided here (and documented in README, "Security and
limits"); the rest of the app reads a :class:`ServerSettings`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from krypton._environment import SettingError, check_library_settings, number_setting
from krypton.pacs.dicomweb import PacsSettings

__all__ = ["ServerSettings", "SettingsError", "LOCAL_HOSTS", "BROKER_ENV"]

LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
# Set (redis://HOST:PORT/DB): team mode, runs go to Celery workers (webapp/team.py).
BROKER_ENV = "KRYPTON_BROKER_URL"
_TRUE = {"1", "true", "yes", "on"}


class SettingsError(ValueError):
    """An environment variable holds a value the server cannot use."""


# Upper bounds of the settings: far above any real deployment, far below what overflows.
MAX_MB = 1024 * 1024  # 1 TB
MAX_COUNT = 100_000
MAX_SECONDS = 7 * 24 * 3600


def _number(name: str, default: float, minimum: float = 0.0, maximum: float = MAX_MB) -> float:
    """$``name`` through the one parser of numeric settings (krypton._environment)."""
    try:
        return number_setting(name, default, minimum=minimum, maximum=maximum)
    except SettingError as exc:
        raise SettingsError(str(exc)) from None


def _count(name: str, default: int, minimum: int) -> int:
    """A setting that counts things: a whole number."""
    try:
        return int(number_setting(name, default, minimum=minimum, maximum=MAX_COUNT, integer=True))
    except SettingError as exc:
        raise SettingsError(str(exc)) from None


def _threads_and_requests(cls) -> dict[str, int]:
    """KRYPTON_SERVER_THREADS and KRYPTON_FRONT_REQUESTS_PER_ADDRESS, checked together:
    one address may have at most half the threads' worth of requests in flight."""
    threads = _count("KRYPTON_SERVER_THREADS", cls.server_threads, 2)
    requests = _count("KRYPTON_FRONT_REQUESTS_PER_ADDRESS", cls.front_requests_per_address, 1)
    if requests > threads // 2:
        raise SettingsError(
            f"KRYPTON_FRONT_REQUESTS_PER_ADDRESS={requests} with KRYPTON_SERVER_THREADS="
            f"{threads}: one address may have at most half the server's threads' worth of "
            f"requests in flight ({threads // 2}), or it could hold every thread"
        )
    return {"server_threads": threads, "front_requests_per_address": requests}


def _list(name: str) -> tuple[str, ...]:
    return tuple(
        part.strip().lower() for part in os.environ.get(name, "").split(",") if part.strip()
    )


def _device() -> str:
    """KRYPTON_DEVICE, checked now: a server told to use a card it lacks says so at start."""
    from krypton.devices import DEVICE_ENVIRONMENT, resolve_device

    text = os.environ.get(DEVICE_ENVIRONMENT, "").strip() or "auto"
    try:
        resolve_device(text)
    except ValueError as exc:
        raise SettingsError(f"{DEVICE_ENVIRONMENT}: {exc}") from None
    return text


def _pacs() -> PacsSettings | None:
    """The operator's PACS, or None; a bad setting stops the server with its one line."""
    from krypton.pacs.dicomweb import PacsError

    try:
        return PacsSettings.from_environment()
    except PacsError as exc:
        raise SettingsError(str(exc)) from None


@dataclass(frozen=True)
class ServerSettings:
    """Limits and access rules of one server process."""

    # Request bodies, checked from Content-Length before anything is read or parsed.
    max_image_mb: float = 25.0  # an image file (the upload is base64: 4/3 of this)
    max_model_mb: float = 200.0  # a weights file in "Add your own model"
    max_volume_mb: float = 200.0  # a volume (NIfTI, a zipped DICOM series) for the volume panel
    max_request_kb: float = 1024.0  # every other request
    # Background runs.
    max_running_jobs: int = 2  # at once, all sessions together
    max_queued_jobs: int = 32  # waiting behind them; more are refused
    max_jobs_per_session: int = 1  # a browser tab runs one job at a time
    # Running or waiting per client: the authenticated user (KRYPTON_AUTH_HEADER), else the
    # address. Session ids are the client's to choose; this is not.
    max_jobs_per_client: int = 4
    # A job whose page stopped polling is cancelled. Over a minute: a browser tab hidden
    # for five minutes may poll only once a minute (Chrome's timer throttling), and its
    # run must not be taken for abandoned.
    abandon_seconds: float = 75.0
    # Team mode: a run that no worker picks up is withdrawn after this long.
    no_worker_seconds: float = 45.0
    # Uploaded images and sources kept on the server, on disk; each client holds at most a
    # quarter (webapp/image_store.py), so a client's 200 MB volume evicts none of another's.
    image_store_mb: float = 1024.0
    image_store_count: int = 500
    results_kept: int = 256  # sessions whose last result is kept for export/refinement
    result_store_mb: float = 512.0  # their arrays together (least recently used go first)
    cell_cache_mb: float = 512.0  # every computed cell kept for reuse, all sessions
    gradient_cache_mb: float = 256.0  # Compare's gradient maps per pixel, kept for re-runs
    upload_store_mb: float = 1024.0  # uploads on disk not yet taken by the page (15 min)
    # A client's file reads (images, volumes) run one at a time; another is refused at once
    # (webapp.services.Services.intake): no request waits inside a server thread.
    # Slow clients: a request must arrive whole within this many seconds of inactivity.
    read_timeout_seconds: float = 30.0
    # make serve's nginx front (webapp/front.py): connections one address may hold (counted
    # at accept; a browser opens about six per server, a few users may share an address)
    # and the seconds a request's headers may take in all.
    front_connections_per_address: int = 32
    header_timeout_seconds: float = 10.0
    # Requests one address may have in flight (the front answers 429 past it) beside the
    # threads waitress answers them with: set together, the cap at most half the threads,
    # so one address (a browser opens about six connections) never holds every thread.
    server_threads: int = 16
    front_requests_per_address: int = 8
    # Where runs compute: auto (a CUDA card when PyTorch sees one, else the CPU), cpu,
    # cuda or cuda:N (KRYPTON_DEVICE; krypton.devices decides what each means).
    device: str = "auto"
    # TorchScript runs its author's code: only for trusted uploaders.
    trusted_uploads: bool = False
    # Access.
    allowed_hosts: tuple[str, ...] = field(default=LOCAL_HOSTS)  # "*" allows any
    username: str | None = None
    password: str | None = None
    auth_header: str | None = None  # set by a trusted reverse proxy, e.g. X-Forwarded-User
    # The operator's PACS (KRYPTON_DICOMWEB_URL and its sign-in, krypton.pacs.dicomweb): the
    # volume panel searches and opens its series and sends results back. None: no PACS.
    pacs: PacsSettings | None = field(default=None, repr=False)

    @property
    def pacs_actions(self) -> int:
        """PACS actions (a search, a listing, an open, a send) in flight at once, all
        clients together: half the server's threads, so however slow the PACS, the
        other half answers pages (each client has one at a time: Services.pacs_call)."""
        return max(1, self.server_threads // 2)

    @classmethod
    def from_environment(cls, bind_host: str | None = None) -> ServerSettings:
        """Settings from KRYPTON_* variables; ``bind_host`` joins the allowed hosts. The
        library's own numeric settings (memory and decode budgets, ...) are checked too,
        so a bad one stops the server at start with its one line."""
        try:
            check_library_settings()
        except SettingError as exc:
            raise SettingsError(str(exc)) from None
        hosts = _list("KRYPTON_ALLOWED_HOSTS")
        if not hosts:
            hosts = LOCAL_HOSTS
            if bind_host in ("0.0.0.0", "::", ""):
                hosts = ("*",)  # bound to every interface: the operator decides (warned)
            elif bind_host:
                hosts = LOCAL_HOSTS + (bind_host.lower(),)
        username = os.environ.get("KRYPTON_USERNAME") or None
        password = os.environ.get("KRYPTON_PASSWORD") or None
        if bool(username) != bool(password):
            raise SettingsError("set both KRYPTON_USERNAME and KRYPTON_PASSWORD, or neither")
        return cls(
            max_image_mb=_number("KRYPTON_MAX_IMAGE_MB", cls.max_image_mb, 0.01),
            max_model_mb=_number("KRYPTON_MAX_MODEL_MB", cls.max_model_mb, 0.01),
            max_volume_mb=_number("KRYPTON_MAX_VOLUME_MB", cls.max_volume_mb, 0.01),
            max_request_kb=_number("KRYPTON_MAX_REQUEST_KB", cls.max_request_kb, 16),
            max_running_jobs=_count("KRYPTON_MAX_RUNNING_JOBS", cls.max_running_jobs, 1),
            max_queued_jobs=_count("KRYPTON_MAX_QUEUED_JOBS", cls.max_queued_jobs, 0),
            max_jobs_per_session=_count(
                "KRYPTON_MAX_JOBS_PER_SESSION", cls.max_jobs_per_session, 1
            ),
            abandon_seconds=_number("KRYPTON_ABANDON_SECONDS", cls.abandon_seconds, 2, MAX_SECONDS),
            no_worker_seconds=_number(
                "KRYPTON_NO_WORKER_SECONDS", cls.no_worker_seconds, 1, MAX_SECONDS
            ),
            image_store_mb=_number("KRYPTON_IMAGE_STORE_MB", cls.image_store_mb, 1),
            image_store_count=_count("KRYPTON_IMAGE_STORE_COUNT", cls.image_store_count, 1),
            max_jobs_per_client=_count("KRYPTON_MAX_JOBS_PER_CLIENT", cls.max_jobs_per_client, 1),
            result_store_mb=_number("KRYPTON_RESULT_STORE_MB", cls.result_store_mb, 1),
            cell_cache_mb=_number("KRYPTON_CELL_CACHE_MB", cls.cell_cache_mb, 1),
            gradient_cache_mb=_number("KRYPTON_GRADIENT_CACHE_MB", cls.gradient_cache_mb, 1),
            upload_store_mb=_number("KRYPTON_UPLOAD_STORE_MB", cls.upload_store_mb, 1),
            read_timeout_seconds=_number(
                "KRYPTON_READ_TIMEOUT_SECONDS", cls.read_timeout_seconds, 1, MAX_SECONDS
            ),
            front_connections_per_address=_count(
                "KRYPTON_FRONT_CONNECTIONS_PER_ADDRESS", cls.front_connections_per_address, 4
            ),
            header_timeout_seconds=_number(
                "KRYPTON_HEADER_TIMEOUT_SECONDS", cls.header_timeout_seconds, 1, MAX_SECONDS
            ),
            **_threads_and_requests(cls),
            device=_device(),
            trusted_uploads=os.environ.get("KRYPTON_TRUSTED_UPLOADS", "").lower() in _TRUE,
            allowed_hosts=hosts,
            username=username,
            password=password,
            auth_header=os.environ.get("KRYPTON_AUTH_HEADER") or None,
            pacs=_pacs(),
        )

    @property
    def authenticates(self) -> bool:
        return bool(self.username or self.auth_header)

    @property
    def max_image_bytes(self) -> int:
        return int(self.max_image_mb * 2**20)

    @property
    def max_model_bytes(self) -> int:
        return int(self.max_model_mb * 2**20)

    @property
    def max_volume_bytes(self) -> int:
        return int(self.max_volume_mb * 2**20)

    @staticmethod
    def mb(value: float) -> int:
        """Megabytes as bytes."""
        return int(value * 2**20)
