"""Krypton web app: interactive occlusion explanations in the browser.

    python app.py [--host 127.0.0.1] [--port 8050]     (or: make run)

Layout, callbacks and helpers live in webapp/; the engine in krypton/.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import diskcache
from dash import Dash

from krypton.registry import default_model_name
from webapp.callbacks import Services, model_options, register_callbacks
from webapp.jobs import ThreadedDiskcacheManager
from webapp.layout import build_layout

ROOT = Path(__file__).resolve().parent


def create_app(cache_dir: str | Path | None = None) -> Dash:
    """Build the Dash app; ``cache_dir`` holds job results and uploaded images."""
    cache_dir = Path(cache_dir or os.environ.get("KRYPTON_CACHE_DIR", ROOT / "cache"))
    cache_dir.mkdir(parents=True, exist_ok=True)
    manager = ThreadedDiskcacheManager(diskcache.Cache(str(cache_dir / "jobs")), expire=3600)
    app = Dash(__name__, title="Krypton", background_callback_manager=manager,
               assets_folder=str(ROOT / "assets"))
    app.server.config["MAX_CONTENT_LENGTH"] = 700 * 2**20  # model uploads; images are 25 MB
    services = Services(cache_dir)
    app.layout = lambda: build_layout(model_options(), default_model_name())
    register_callbacks(app, manager, services)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="Krypton web app")
    parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", 8050)))
    args = parser.parse_args()
    app = create_app()
    print(f"Krypton is running at http://{args.host}:{args.port}/ (Ctrl+C to stop)",
          flush=True)
    app.run(host=args.host, port=args.port, debug=False)


if __name__ == "__main__":
    main()
