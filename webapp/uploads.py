"""File uploads over a plain route, streamed to disk, instead of JSON callback bodies.

A dcc.Upload gives the browser the file as a base64 data URL; sent inside a callback's
JSON body, a 200 MB weights file became a 267 MB body parsed whole, and a JSON body of
``[[],[],...]`` as large cost 25 times its size in Python objects. Here the page's
clientside callback (assets/uploads.js) posts the file's bytes to
``/_krypton/upload/<purpose>`` (image, model or volume) instead; the server copies the
body to disk a megabyte at a time (the guard has already refused a Content-Length over
the purpose's limit) and answers with a token. The Dash callback that loads the image,
the volume or registers the model then sends only the token, which works for the tab
(session) that uploaded it and only once.

Pending uploads are bounded: one per tab and purpose (a new one replaces it), gone after
:data:`PENDING_SECONDS`, and at most ``max_bytes`` on disk together. Each client (the
guard's :data:`webapp.client.CLIENT_HEADER`: the authenticated user or the address;
tabs are the client's to make up) holds at most :data:`webapp.client.CLIENT_SHARE` of
that, its own oldest going first, so one client's uploads never push out another's; past
that, the oldest of anyone's go.
"""

from __future__ import annotations

import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote

from flask import Flask, jsonify, request

from .client import CLIENT_SHARE, request_client
from .helpers import InputError, owner_tag
from .settings import ServerSettings

__all__ = ["UPLOAD_ROUTE", "PURPOSES", "UploadStore", "add_upload_route"]

UPLOAD_ROUTE = "/_krypton/upload/"
PURPOSES = ("image", "model", "volume")
PENDING_SECONDS = 15 * 60
CHUNK_BYTES = 1 << 20


@dataclass
class _Pending:
    path: Path
    purpose: str
    owner: str  # session_tag of the tab that uploaded it
    client: str  # who sent it (the guard's client identity), for the per-client share
    filename: str
    size: int
    created: float


class UploadStore:
    """Uploaded files waiting for the callback that uses them (see module docstring)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory = Path(directory)
        shutil.rmtree(self.directory, ignore_errors=True)  # nothing pending survives a restart
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()

    def save(
        self,
        stream: BinaryIO,
        length: int,
        purpose: str,
        session: str,
        filename: str,
        limit: int,
        client: str = "",
    ) -> str:
        """Copy ``length`` bytes of ``stream`` to disk for ``client``; the token that names
        them."""
        if purpose not in PURPOSES:
            raise InputError(f"unknown upload kind {purpose!r}")
        if length > limit:
            raise InputError(
                f"{filename or 'the file'} is {length / 2**20:.1f} MB; the limit is "
                f"{limit / 2**20:g} MB"
            )
        if length <= 0:
            raise InputError(f"{filename or 'the file'} is empty")
        token = secrets.token_urlsafe(18)
        path = self.directory / f"{token}.{purpose}"
        received = 0
        try:
            with open(path, "wb") as out:
                while received < length:
                    chunk = stream.read(min(CHUNK_BYTES, length - received))
                    if not chunk:
                        break
                    out.write(chunk)
                    received += len(chunk)
        except OSError as exc:
            path.unlink(missing_ok=True)
            raise InputError(f"the upload broke off ({exc})") from exc
        if received != length:
            path.unlink(missing_ok=True)
            raise InputError("the upload broke off before the whole file arrived")
        owner = owner_tag(session)
        with self._lock:
            for old, pending in list(self._pending.items()):  # one per tab and purpose
                if pending.owner == owner and pending.purpose == purpose:
                    self._drop(old)
            self._pending[token] = _Pending(
                path, purpose, owner, client, str(filename or "")[:255], received, time.time()
            )
            self._evict(keep=token)
        return token

    @contextmanager
    def take(self, token: str, purpose: str, session: str) -> Iterator[tuple[Path, str]]:
        """The file behind ``token`` (path, the uploader's file name) for the tab that
        sent it; removed when the block ends, kept for another try if it raises."""
        with self._lock:
            self._evict()
            pending = self._pending.get(str(token or ""))
            if pending is None or pending.purpose != purpose or pending.owner != owner_tag(session):
                raise InputError("the uploaded file is no longer on the server; upload it again")
            del self._pending[token]
        try:
            yield pending.path, pending.filename
        except BaseException:  # not used after all (a taken name, say): keep it for a retry
            with self._lock:
                self._pending.setdefault(token, pending)
            raise
        pending.path.unlink(missing_ok=True)

    def usage(self) -> tuple[int, int]:
        """(files, bytes) pending."""
        with self._lock:
            return len(self._pending), sum(p.size for p in self._pending.values())

    def _drop(self, token: str) -> None:
        pending = self._pending.pop(token, None)
        if pending is not None:
            pending.path.unlink(missing_ok=True)

    def _evict(self, keep: str | None = None) -> None:
        """Expired uploads out; then ``keep``'s client back within its share (its own
        oldest first), then the store within its bytes (anyone's oldest first)."""
        now = time.time()
        for token, pending in list(self._pending.items()):
            if now - pending.created > PENDING_SECONDS:
                self._drop(token)
        oldest = sorted(self._pending, key=lambda t: self._pending[t].created)
        if keep in self._pending:
            client = self._pending[keep].client
            self._drop_oldest(
                [t for t in oldest if self._pending[t].client == client],
                CLIENT_SHARE * self.max_bytes,
                keep,
            )
        self._drop_oldest([t for t in oldest if t in self._pending], self.max_bytes, keep)

    def _drop_oldest(self, tokens: list[str], max_bytes: float, keep: str | None) -> None:
        total = sum(self._pending[t].size for t in tokens)
        for token in tokens:
            if total <= max_bytes:
                break
            if token != keep:
                total -= self._pending[token].size
                self._drop(token)


def add_upload_route(server: Flask, store: UploadStore, settings: ServerSettings) -> None:
    """``POST /_krypton/upload/<purpose>`` with the file as the body and the tab's session
    and the file's name (percent-encoded) in the X-Krypton-Session and X-Krypton-Filename
    headers (URLs are logged; file names can name patients): ``{"token": …}``, or
    ``{"error": …}`` with status 400 or 413."""
    limits = {
        "image": settings.max_image_bytes,
        "model": settings.max_model_bytes,
        "volume": settings.max_volume_bytes,
    }

    @server.route(UPLOAD_ROUTE + "<purpose>", methods=["POST"])
    def krypton_upload(purpose: str):
        if purpose not in limits:
            return jsonify(error=f"unknown upload kind {purpose!r}"), 404
        name = unquote(request.headers.get("X-Krypton-Filename", ""))
        length = request.content_length or 0
        try:
            token = store.save(
                request.stream,
                length,
                purpose,
                request.headers.get("X-Krypton-Session", ""),
                name,
                limits[purpose],
                request_client(),
            )
        except InputError as exc:
            return jsonify(error=str(exc)), 413 if length > limits[purpose] else 400
        return jsonify(token=token, name=name, bytes=length)
