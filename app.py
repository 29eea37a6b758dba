"""Krypton web app: interactive occlusion explanations in the browser.

    python app.py [--host 127.0.0.1] [--port 8050]     (or: make run; one local user)
    python app.py --production ...                      (or: make serve; waitress, for a team)

Layout, callbacks and helpers live in webapp/; the engine in krypton/. Limits, access
rules and the TorchScript switch come from KRYPTON_* environment variables
(webapp/settings.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import diskcache
from dash import Dash

from krypton.registry import default_model_name
from webapp.front import Front, find_nginx, front_wanted
from webapp.guard import RequestGuard
from webapp.jobs import ThreadedDiskcacheManager
from webapp.layout import build_layout
from webapp.panels import (
    RUN_MESSAGE_OUTPUT,
    RUN_OUTPUTS,
    default_volume_model,
    model_options,
    register_callbacks,
    volume_model_options,
    waiting_progress,
)
from webapp.services import Services
from webapp.settings import BROKER_ENV, LOCAL_HOSTS, ServerSettings, SettingsError
from webapp.uploads import add_upload_route

ROOT = Path(__file__).resolve().parent


def create_app(
    cache_dir: str | Path | None = None,
    settings: ServerSettings | None = None,
    broker_url: str | None = None,
) -> Dash:
    """Build the Dash app; ``cache_dir`` holds job results and uploaded images. With a
    ``broker_url`` (default: $KRYPTON_BROKER_URL) runs go to Celery workers and state to
    Redis (team mode); without one, jobs are threads of this process."""
    settings = settings or ServerSettings.from_environment()
    cache_dir = Path(cache_dir or os.environ.get("KRYPTON_CACHE_DIR", ROOT / "cache"))
    cache_dir.mkdir(parents=True, exist_ok=True)
    broker = broker_url if broker_url is not None else os.environ.get(BROKER_ENV, "")
    team = None
    if broker:  # team mode: Celery workers and Redis (webapp/team.py)
        from webapp.team import TeamManager, TeamStores, make_celery

        team = TeamStores(broker)
        manager = TeamManager(
            make_celery(broker),
            broker,
            message_output=RUN_MESSAGE_OUTPUT,
            outputs=RUN_OUTPUTS,
            no_worker_seconds=settings.no_worker_seconds,
            waiting_progress=waiting_progress,
        )
    else:
        manager = ThreadedDiskcacheManager(
            diskcache.Cache(str(cache_dir / "jobs")),
            expire=3600,
            abandon_seconds=settings.abandon_seconds,
        )
    app = Dash(
        __name__,
        title="Krypton",
        background_callback_manager=manager,
        assets_folder=str(ROOT / "assets"),
    )
    guard = RequestGuard(app.server.wsgi_app, settings)
    app.server.wsgi_app = guard  # host, authentication and size checks come first
    app.server.config["MAX_CONTENT_LENGTH"] = guard.largest_limit()  # a second line
    services = Services(cache_dir, settings, team)
    add_upload_route(app.server, services.uploads, settings)
    app.layout = lambda: build_layout(
        model_options(),
        default_model_name(),
        settings.max_image_bytes,
        settings.max_model_bytes,
        settings.trusted_uploads,
        volume_model_options(),
        default_volume_model(),
        settings.max_volume_bytes,
        settings.pacs is not None,
    )
    register_callbacks(app, manager, services)
    app.krypton_celery = getattr(manager, "handle", None)  # what `make worker` serves
    return app


class QuietPolls(logging.Filter):
    """Drops the request log lines of successful callback polls: a running job is polled
    several times a second, which would bury everything else in the server log."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            "/_dash-update-component" in message and ('" 200 ' in message or '" 204 ' in message)
        )


def serve_production(app: Dash, host: str, port: int, settings: ServerSettings) -> None:
    """Serve ``app`` with waitress: one process (jobs, models and the queue live in it),
    ``server_threads`` (16) threads for requests that have fully arrived. In front of it,
    unless KRYPTON_FRONT=none, Debian's nginx (webapp/front.py): it caps each address's
    connections at accept and its requests in flight at ``front_requests_per_address``
    (8, at most half the threads), bounds header and body times and buffers bodies, and waitress
    listens on a unix socket only the front reaches. Waitress itself reads requests on one
    event loop (slow clients hold sockets, never threads), closes a connection idle for
    ``read_timeout_seconds`` and refuses bodies over the largest upload limit."""
    import waitress

    largest = RequestGuard(None, settings).largest_limit()
    options = dict(
        threads=settings.server_threads,
        channel_timeout=int(settings.read_timeout_seconds),
        connection_limit=1000,
        asyncore_use_poll=True,  # select() stops at 1024 file descriptors
        max_request_body_size=largest,
        ident="Krypton",
    )
    if not front_wanted():
        waitress.serve(app.server, host=host, port=port, **options)
        return
    front = Front(host, port, settings, largest)
    server = waitress.create_server(
        app.server,
        unix_socket=str(front.app_socket),
        unix_socket_perms="600",
        trusted_proxy="localhost",  # the unix socket's peer: the front, alone
        trusted_proxy_headers={"x-forwarded-for", "x-forwarded-proto"},
        clear_untrusted_proxy_headers=True,
        **options,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so the front stops with us
    try:
        front.start()
        server.run()
    finally:
        front.stop()


def warn_if_exposed(host: str, settings: ServerSettings) -> None:
    """Say so when the server listens beyond this machine without authentication."""
    if host not in LOCAL_HOSTS and not settings.authenticates:
        print(
            f"WARNING: serving on {host} without authentication: anyone who can reach "
            f"this address can use the app and upload models. Set KRYPTON_USERNAME and "
            f"KRYPTON_PASSWORD, or KRYPTON_AUTH_HEADER behind a trusted reverse proxy "
            f"(README: Security and limits).",
            file=sys.stderr,
            flush=True,
        )


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be served, or None if it is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            return (
                f"cannot serve on {host}:{port}: {exc.strerror or exc}. Is Krypton "
                f"already running? Stop it, or choose another port (make run PORT=8051)"
            )
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description="Krypton web app")
    parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8050)))
    parser.add_argument(
        "--production",
        action="store_true",
        help="serve with waitress (make serve): for more than one user, beyond localhost",
    )
    parser.add_argument(
        "--device",
        help="where runs compute: auto (default, or $KRYPTON_DEVICE): a CUDA card when "
        "PyTorch sees one, else the CPU; or cpu, cuda, cuda:N",
    )
    args = parser.parse_args()
    if args.device:  # one setting for the server and the workers it starts
        os.environ["KRYPTON_DEVICE"] = args.device
    problem = port_problem(args.host, args.port)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    try:
        settings = ServerSettings.from_environment(args.host)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    warn_if_exposed(args.host, settings)
    if args.production and front_wanted():
        try:
            find_nginx()  # before anything loads: a missing front is said at once
        except SettingsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
    app = create_app(settings=settings)
    print(f"Krypton is running at http://{args.host}:{args.port}/ (Ctrl+C to stop)", flush=True)
    if args.production:
        serve_production(app, args.host, args.port, settings)
        return
    logging.getLogger("werkzeug").addFilter(QuietPolls())
    app.run(host=args.host, port=args.port, debug=False)


if __name__ == "__main__":
    main()
