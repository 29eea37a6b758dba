"""WSGI middleware in front of the Dash app: host check, authentication and request size
limits that hold before a request body is read or parsed.

Dash sends every callback to one endpoint, ``/_dash-update-component``, with a JSON body
whose first key is ``"output"`` (the dash-renderer builds it that way). The guard reads at
most the first few kilobytes of the body to learn which callback is called, picks that
callback's limit (an image upload, a model upload, or anything else) and refuses a larger
Content-Length with 413 before the rest is read — so a 700 MB upload costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import io
import json
import re
from typing import Callable, Iterable

from .settings import ServerSettings

__all__ = ["RequestGuard", "UPLOAD_PURPOSES"]

PEEK_BYTES = 4096
# Output ids that identify a callback receiving a file upload, and the limit it gets.
UPLOAD_PURPOSES = {"image-store.data": "image", "model-register-message.children": "model"}
_OUTPUT = re.compile(rb'^\s*\{\s*"output"\s*:\s*"((?:[^"\\]|\\.){0,2048})"')
# JSON and base64 overhead of an upload: the file as a data URL (4/3) plus the request.
_BASE64 = 4 / 3
_ENVELOPE = 64 * 1024


class _Replayed(io.RawIOBase):
    """The request body with its first bytes (already read) put back in front."""

    def __init__(self, head: bytes, rest, remaining: int):
        self._head = head
        self._rest = rest
        self._remaining = remaining  # never read past Content-Length: a socket would block

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._head:
            count = min(len(buffer), len(self._head))
            buffer[:count] = self._head[:count]
            self._head = self._head[count:]
            return count
        if self._remaining <= 0:
            return 0
        data = self._rest.read(min(len(buffer), self._remaining))
        self._remaining -= len(data)
        buffer[: len(data)] = data
        return len(data)


def _respond(
    start_response, status: str, text: str, headers: Iterable[tuple[str, str]] = ()
) -> list[bytes]:
    body = text.encode()
    start_response(
        status,
        [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
            *headers,
        ],
    )
    return [body]


class RequestGuard:
    """Wraps a WSGI app; see the module docstring."""

    def __init__(self, app: Callable, settings: ServerSettings):
        self.app = app
        self.settings = settings

    # -- limits -------------------------------------------------------------------------
    def limit_for(self, purpose: str | None) -> int:
        """Largest request body (bytes) for a callback purpose."""
        if purpose == "image":
            return int(self.settings.max_image_bytes * _BASE64) + _ENVELOPE
        if purpose == "model":
            return int(self.settings.max_model_bytes * _BASE64) + _ENVELOPE
        return int(self.settings.max_request_kb * 1024)

    def largest_limit(self) -> int:
        return max(self.limit_for(p) for p in (None, "image", "model"))

    @staticmethod
    def purpose_of(head: bytes) -> str | None:
        match = _OUTPUT.match(head)
        if not match:
            return None
        try:
            output = json.loads(b'"' + match.group(1) + b'"')
        except ValueError:
            return None
        for key, purpose in UPLOAD_PURPOSES.items():
            if key in output:
                return purpose
        return None

    # -- access -------------------------------------------------------------------------
    def _host_allowed(self, environ) -> bool:
        hosts = self.settings.allowed_hosts
        if "*" in hosts:
            return True
        host = environ.get("HTTP_HOST") or environ.get("SERVER_NAME", "")
        if host.startswith("["):  # [::1]:8050
            name = host[1 : host.find("]")] if "]" in host else host
        else:
            name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return name.lower() in hosts

    def _authenticated(self, environ) -> bool:
        settings = self.settings
        if settings.auth_header:
            key = "HTTP_" + settings.auth_header.upper().replace("-", "_")
            if environ.get(key):
                return True
        if settings.username:
            header = environ.get("HTTP_AUTHORIZATION", "")
            if header.lower().startswith("basic "):
                try:
                    user, _, password = (
                        base64.b64decode(header[6:].strip()).decode("utf-8").partition(":")
                    )
                except (binascii.Error, UnicodeDecodeError):
                    return False
                return hmac.compare_digest(user, settings.username) & hmac.compare_digest(
                    password, settings.password or ""
                )
        return not settings.authenticates

    # -- WSGI ---------------------------------------------------------------------------
    def __call__(self, environ, start_response):
        if not self._host_allowed(environ):
            return _respond(
                start_response,
                "400 Bad Request",
                "this host name is not allowed (KRYPTON_ALLOWED_HOSTS)",
            )
        if not self._authenticated(environ):
            headers = (
                [("WWW-Authenticate", 'Basic realm="Krypton"')] if self.settings.username else []
            )
            return _respond(start_response, "401 Unauthorized", "authentication required", headers)
        if environ.get("REQUEST_METHOD", "GET") in ("POST", "PUT", "PATCH"):
            refused = self._check_size(environ, start_response)
            if refused is not None:
                return refused
        return self.app(environ, start_response)

    def _check_size(self, environ, start_response):
        text = environ.get("CONTENT_LENGTH") or ""
        if not text.isdigit():
            return _respond(
                start_response, "411 Length Required", "requests must state their Content-Length"
            )
        length = int(text)
        if length <= self.limit_for(None):
            return None
        if length > self.largest_limit():
            return self._too_large(start_response, length, self.largest_limit())
        stream = environ["wsgi.input"]
        head = self._read_head(stream, min(PEEK_BYTES, length))
        limit = self.limit_for(self.purpose_of(head))
        if length > limit:
            return self._too_large(start_response, length, limit)
        environ["wsgi.input"] = io.BufferedReader(_Replayed(head, stream, length - len(head)))
        return None

    @staticmethod
    def _read_head(stream, most: int) -> bytes:
        """The body's first bytes, as far as the callback's output id (at most ``most``):
        reads what has arrived, so a client that sends only a head is answered at once."""
        read_some = getattr(stream, "read1", stream.read)
        head = b""
        while len(head) < most and not _OUTPUT.match(head):
            chunk = read_some(most - len(head))
            if not chunk:
                break
            head += chunk
        return head

    @staticmethod
    def _too_large(start_response, length: int, limit: int) -> list[bytes]:
        return _respond(
            start_response,
            "413 Payload Too Large",
            f"the request is {length / 2**20:.1f} MB; this kind of request is "
            f"limited to {limit / 2**20:.1f} MB",
        )
