"""Who sent a request: the identity the guard (webapp/guard.py) writes into every request
it lets through, for the per-client limits (runs, file reads, stored files, uploads)."""

from __future__ import annotations

__all__ = ["CLIENT_HEADER", "CLIENT_SHARE", "request_client"]

CLIENT_HEADER = "X-Krypton-Client"
# The share of a bounded store one client may hold: the stored images and sources
# (webapp/image_store.py) and the pending uploads (webapp/uploads.py). A quarter: at their
# default 1,024 MB a client keeps a 200 MB volume, the upload limit, and three others can too.
CLIENT_SHARE = 0.25


def request_client() -> str:
    """Who sent the request being served, as the guard named it (:data:`CLIENT_HEADER`);
    '' outside a request (a background job)."""
    from flask import has_request_context, request

    return str(request.headers.get(CLIENT_HEADER, "")) if has_request_context() else ""
