"""WSGI middleware in front of the Dash app: host check, authentication, the client's
identity and request size limits that hold before a request body is parsed.

- Files arrive on their own route (:mod:`webapp.uploads`): ``/_krypton/upload/image``
  and ``/_krypton/upload/model`` take up to the image and model limits, streamed to disk.
- Every other body (Dash's callbacks are JSON) is limited to ``max_request_kb``: a larger
  Content-Length is refused with 413 before a byte is read. A JSON body is then read
  (it is small) and refused with 400 if any object in it repeats a key: Python's parser
  keeps the last, so a guard and a handler reading different copies of one key can never
  disagree (a body with two "output" keys once slipped a 20 MB upload past a 1 MB limit).
- The client's identity for per-client limits, :data:`CLIENT_HEADER`, is set here and
  only here (a client's own header of that name is overwritten): the user a trusted proxy
  names in ``KRYPTON_AUTH_HEADER``, else the peer address.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import io
import ipaddress
import json
from collections.abc import Callable, Iterable

from .client import CLIENT_HEADER
from .settings import ServerSettings
from .uploads import PURPOSES, UPLOAD_ROUTE

__all__ = ["RequestGuard", "CLIENT_HEADER", "DuplicateKeyError", "strict_json"]


def client_network(address: str) -> str:
    """The share an address draws on: an IPv4 address itself, an IPv6 address its /64
    (one host is routinely given a whole /64, so 2^64 addresses are one client's); an
    IPv4-mapped IPv6 address is its IPv4 address. Anything else is kept as it came."""
    try:
        parsed = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)


def _environ_key(header: str) -> str:
    """Where WSGI keeps a request header: X-Forwarded-User -> HTTP_X_FORWARDED_USER."""
    return "HTTP_" + header.upper().replace("-", "_")


_CLIENT_ENVIRON = _environ_key(CLIENT_HEADER)


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice."""


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        repeated = next(key for key in keys if keys.count(key) > 1)
        raise DuplicateKeyError(f"the request names {repeated!r} twice in one object")
    return dict(pairs)


def strict_json(body: bytes):
    """``json.loads`` that refuses a repeated key in any object (DuplicateKeyError)."""
    return json.loads(body, object_pairs_hook=_unique_pairs)


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
        """Largest request body (bytes): a file upload of ``purpose``, else a callback."""
        if purpose == "image":
            return self.settings.max_image_bytes
        if purpose == "model":
            return self.settings.max_model_bytes
        if purpose == "volume":
            return self.settings.max_volume_bytes
        return int(self.settings.max_request_kb * 1024)

    def largest_limit(self) -> int:
        return max(self.limit_for(p) for p in (None, *PURPOSES))

    @staticmethod
    def purpose_of(path: str) -> str | None:
        """The upload purpose a request path names, or None for anything else."""
        if path.startswith(UPLOAD_ROUTE):
            purpose = path[len(UPLOAD_ROUTE) :].strip("/")
            return purpose if purpose in PURPOSES else None
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
        if self._proxy_user(environ):
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

    def _proxy_user(self, environ) -> str | None:
        """The user a trusted proxy names in ``auth_header``, if it is configured and set."""
        if not self.settings.auth_header:
            return None
        return environ.get(_environ_key(self.settings.auth_header)) or None

    def client_of(self, environ) -> str:
        """Who sends the request, for per-client limits: the proxy-authenticated user,
        else the peer's network (:func:`client_network`; a shared basic-auth account does
        not tell people apart)."""
        user = self._proxy_user(environ)
        if user:
            return "user:" + user
        return "address:" + client_network(str(environ.get("REMOTE_ADDR", "")))

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
        environ[_CLIENT_ENVIRON] = self.client_of(environ)
        if environ.get("REQUEST_METHOD", "GET") in ("POST", "PUT", "PATCH"):
            refused = self._check_body(environ, start_response)
            if refused is not None:
                return refused
        return self.app(environ, start_response)

    def _check_body(self, environ, start_response):
        text = environ.get("CONTENT_LENGTH") or ""
        if not text.isdigit():
            return _respond(
                start_response, "411 Length Required", "requests must state their Content-Length"
            )
        length = int(text)
        purpose = self.purpose_of(environ.get("PATH_INFO", ""))
        limit = self.limit_for(purpose)
        if length > limit:
            return self._too_large(start_response, length, limit)
        if purpose is not None or "json" not in environ.get("CONTENT_TYPE", ""):
            return None  # an upload streams to disk; other bodies are small
        body = _read_exactly(environ["wsgi.input"], length)
        try:
            strict_json(body)
        except DuplicateKeyError as exc:
            return _respond(start_response, "400 Bad Request", str(exc))
        except ValueError:
            return _respond(start_response, "400 Bad Request", "the request body is not JSON")
        environ["wsgi.input"] = io.BytesIO(body)
        return None

    @staticmethod
    def _too_large(start_response, length: int, limit: int) -> list[bytes]:
        return _respond(
            start_response,
            "413 Payload Too Large",
            f"the request is {length / 2**20:.1f} MB; this kind of request is "
            f"limited to {limit / 2**20:.1f} MB",
        )


def _read_exactly(stream, length: int) -> bytes:
    """``length`` bytes of the body (fewer if the client stopped sending)."""
    parts, received = [], 0
    while received < length:
        chunk = stream.read(length - received)
        if not chunk:
            break
        parts.append(chunk)
        received += len(chunk)
    return b"".join(parts)
