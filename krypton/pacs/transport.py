"""The PACS's wire, bounded: every DICOMweb request Krypton makes goes through one
requests session mounted with :class:`BoundedAdapter`, and every call is made inside
:func:`bounded` (one request, one budget):

- **a total deadline** (``KRYPTON_DICOMWEB_DEADLINE_SECONDS``, 20 s; a store gets one
  second more per 10 MB it sends). The per-read timeout (``_TIMEOUT_SECONDS``) alone lets a
  server that sends a byte every 5 s hold a request for ever, headers included; here a
  watchdog thread shuts the connection's socket when the deadline passes, whatever
  phase the request is in.
- **a byte budget counted as the answer arrives**: a search's or a store's answer at most
  ``KRYPTON_DICOMWEB_ANSWER_MB`` (4 MB), an instance its declared pixels and a header.
- **no redirects** and **no address outside the configured root**: a 3xx answer is
  refused, and a URL that is not under the root is never sent.
- **the HTTP layer bounded too** (:mod:`krypton.pacs.wire`): each protocol line at most
  8 KB, every byte off the socket counted against the request's wire budget, and the
  body decoded (identity, or one gzip or deflate layer) a piece at a time inside the byte
  budget; stacked and unknown codings refused. Krypton asks for ``identity``.
- **one deadline and one byte budget per user action** (:func:`action`: a search, a
  listing, an open, a send), across all the requests it makes
  (``KRYPTON_DICOMWEB_ACTION_SECONDS``, 45 s, and ``KRYPTON_DICOMWEB_ACTION_MB``, 16 MB;
  a series' download gets a second more per 4 MB and the bytes its listing declares).

Past any of them the request ends with :class:`PacsError`, one line naming the PACS step
and the limit. The watchdog is one daemon thread for the process, asleep while no
request is in flight.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

from .._environment import SettingError, library_setting
from ..io._decoding import ImageLoadError
from .wire import WireReader, decoder_for

__all__ = [
    "PacsError",
    "PacsBudgets",
    "ActionBudget",
    "RequestBudget",
    "BoundedAdapter",
    "literal_wildcards",
    "action",
    "joined",
    "bounded",
]

# the slowest pace a PACS may keep: a store's deadline, and a series download's action,
# grow by a second per this many bytes sent or declared
PACE_BYTES_PER_SECOND = 4 * 2**20
WIRE_SLACK = 64 * 1024  # bytes on the wire beyond the body: status, headers, chunk framing


class PacsError(ImageLoadError):
    """The PACS could not be reached, refused a request or sent what it did not declare."""


@dataclass(frozen=True)
class PacsBudgets:
    """What one PACS request may cost (each a library setting, parsed and range-checked
    by :func:`krypton._environment.library_setting`)."""

    read_timeout: float = 10.0  # seconds without a byte: KRYPTON_DICOMWEB_TIMEOUT_SECONDS
    deadline: float = 20.0  # seconds for a whole request: KRYPTON_DICOMWEB_DEADLINE_SECONDS
    answer_bytes: int = 4 * 2**20  # a search's or store's answer: KRYPTON_DICOMWEB_ANSWER_MB
    pages: int = 20  # pages of one listing: KRYPTON_DICOMWEB_PAGES
    action_seconds: float = 45.0  # one user action: KRYPTON_DICOMWEB_ACTION_SECONDS
    action_bytes: int = 16 * 2**20  # its answers: KRYPTON_DICOMWEB_ACTION_MB

    @classmethod
    def from_environment(cls) -> PacsBudgets:
        """The budgets the environment sets (a bad value: PacsError naming it)."""
        try:
            return cls(
                library_setting("KRYPTON_DICOMWEB_TIMEOUT_SECONDS"),
                library_setting("KRYPTON_DICOMWEB_DEADLINE_SECONDS"),
                int(library_setting("KRYPTON_DICOMWEB_ANSWER_MB") * 2**20),
                int(library_setting("KRYPTON_DICOMWEB_PAGES")),
                library_setting("KRYPTON_DICOMWEB_ACTION_SECONDS"),
                int(library_setting("KRYPTON_DICOMWEB_ACTION_MB") * 2**20),
            )
        except SettingError as exc:
            raise PacsError(str(exc)) from None


def _round(seconds: float) -> str:
    """Seconds as a message says them: 20 s, 4 s, 0.5 s (never 20.0316 s)."""
    return f"{seconds:.0f}" if seconds >= 1 else f"{seconds:.1g}"


def _megabytes(count: int) -> str:
    return f"{count / 2**20:.3g}"


@dataclass
class ActionBudget:
    """One user action's limits across all its requests (:func:`action`): its deadline
    (monotonic), the answer bytes it may read in all, and what it is (for the message)."""

    what: str
    deadline: float
    seconds: float
    max_bytes: int
    received: int = 0
    # its requests may run on several threads at once (a series' concurrent downloads)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def extend(self, seconds: float, max_bytes: int) -> None:
        """More time and bytes for what the action now knows it must fetch (a series'
        declared pixels)."""
        self.deadline += seconds
        self.seconds += seconds
        self.max_bytes += max_bytes

    def take(self, count: int) -> None:
        with self._lock:
            self.received += count
            received = self.received
        if received > self.max_bytes:
            raise PacsError(
                f"the PACS sent more than {_megabytes(self.max_bytes)} MB for {self.what} "
                "(KRYPTON_DICOMWEB_ACTION_MB)"
            )

    def late(self) -> str:
        return (
            f"the PACS did not finish {self.what} within {_round(self.seconds)} s "
            "(KRYPTON_DICOMWEB_ACTION_SECONDS)"
        )


@dataclass
class RequestBudget:
    """One request's limits while it is in flight: its deadline (monotonic; the
    action's where that comes first), the decoded bytes its answer may hold, and what it
    is (for the message)."""

    what: str
    deadline: float
    seconds: float
    max_bytes: int
    bytes_reason: str
    expired: bool = False
    warning: str = ""  # the answer's Warning header (a QIDO server that cut its page)
    connections: list = field(default_factory=list)
    action: ActionBudget | None = None
    received: int = 0  # decoded bytes of the answer
    on_wire: int = 0  # bytes read off the socket, head and framing included

    def check(self) -> None:
        if self.expired or time.monotonic() > self.deadline:
            self.expired = True
            raise PacsError(self.late())

    def late(self) -> str:
        if self.action is not None and self.action.deadline <= self.deadline:
            return self.action.late()
        return (
            f"the PACS did not finish {self.what} within {_round(self.seconds)} s "
            "(KRYPTON_DICOMWEB_DEADLINE_SECONDS)"
        )

    def left(self) -> int:
        """The decoded bytes the answer may still hold (the action's, where fewer)."""
        left = self.max_bytes - self.received
        if self.action is not None:
            left = min(left, self.action.max_bytes - self.action.received)
        return left

    def take(self, count: int) -> None:
        """Count ``count`` decoded bytes of the answer (past the budget: PacsError)."""
        self.received += count
        if self.received > self.max_bytes:
            raise PacsError(f"the PACS sent more than {self.bytes_reason}")
        if self.action is not None:
            self.action.take(count)

    def refuse(self, words: str) -> PacsError:
        """The error for an answer refused in the HTTP layer (``words`` say how)."""
        return PacsError(f"the PACS answered {self.what} {words}")

    def spend(self, count: int) -> None:
        """Count ``count`` bytes off the socket and check the deadline: the wire may carry
        the budget, a quarter more for framing, and the head."""
        self.on_wire += count
        if self.on_wire > self.max_bytes + self.max_bytes // 4 + WIRE_SLACK:
            raise PacsError(f"the PACS sent more than {self.bytes_reason}")
        self.check()


class _Watchdog:
    """Shuts the sockets of requests past their deadline (one thread, started when the
    first request is watched, asleep on a condition until the next deadline). A request
    past its deadline is shut again every 0.2 s until it ends: one still connecting when
    its deadline passed has no socket to shut yet."""

    def __init__(self) -> None:
        self._budgets: dict[int, RequestBudget] = {}
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, budget: RequestBudget) -> None:
        with self._condition:
            self._budgets[id(budget)] = budget
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="krypton-pacs-deadlines", daemon=True
                )
                self._thread.start()
            self._condition.notify()

    def forget(self, budget: RequestBudget) -> None:
        with self._condition:
            self._budgets.pop(id(budget), None)

    def _run(self) -> None:
        while True:
            with self._condition:
                now = time.monotonic()
                due = [b for b in self._budgets.values() if b.deadline <= now]
                if not due:
                    upcoming = min((b.deadline for b in self._budgets.values()), default=now + 60)
                    self._condition.wait(timeout=max(0.01, upcoming - now))
                    continue
            for budget in due:
                budget.expired = True
                _shut(budget.connections)
            time.sleep(0.2)


def _shut(connections: list) -> None:
    """Wake whatever a request's connections are blocked in (connect, send, recv)."""
    for connection in connections:
        sock = getattr(connection, "sock", None)
        if sock is None:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


_WATCHDOG = _Watchdog()
_CURRENT = threading.local()  # the budget of the request this thread has in flight


def _current() -> RequestBudget | None:
    return getattr(_CURRENT, "budget", None)


def _current_action() -> ActionBudget | None:
    return getattr(_CURRENT, "action", None)


@contextmanager
def action(budgets: PacsBudgets, what: str) -> Iterator[ActionBudget]:
    """Around one user action (``what``: a search, a listing, an open, a send): every
    request inside it ends by the action's deadline and its answers share the action's
    bytes. An action inside another (a series download's listing) is part of it."""
    outer = _current_action()
    if outer is not None:
        yield outer
        return
    seconds = budgets.action_seconds
    budget = ActionBudget(what, time.monotonic() + seconds, seconds, budgets.action_bytes)
    _CURRENT.action = budget
    try:
        yield budget
    finally:
        _CURRENT.action = None


@contextmanager
def joined(owner: ActionBudget) -> Iterator[ActionBudget]:
    """This thread's requests inside the action ``owner`` that another thread started
    (one of a series' concurrent downloads): its deadline and bytes, shared."""
    outer = _current_action()
    _CURRENT.action = owner
    try:
        yield owner
    finally:
        _CURRENT.action = outer


@contextmanager
def bounded(
    budgets: PacsBudgets,
    what: str,
    *,
    max_bytes: int | None = None,
    bytes_reason: str = "",
    extra_seconds: float = 0.0,
) -> Iterator[RequestBudget]:
    """Around one PACS request (``what``: the step, for messages): its deadline (and its
    action's, :func:`action`) is watched and its answer counted against ``max_bytes``
    (default: the answer budget)."""
    seconds = budgets.deadline + extra_seconds
    limit = budgets.answer_bytes if max_bytes is None else max_bytes
    reason = bytes_reason or f"{_megabytes(limit)} MB (KRYPTON_DICOMWEB_ANSWER_MB) for {what}"
    owner = _current_action()
    deadline = time.monotonic() + seconds
    if owner is not None:
        deadline = min(deadline, owner.deadline)
    budget = RequestBudget(what, deadline, seconds, limit, reason, action=owner)
    budget.check()  # an action past its deadline starts no request
    outer, _CURRENT.budget = _current(), budget
    _WATCHDOG.watch(budget)
    try:
        yield budget
        budget.check()  # an answer cut short by the deadline is not an answer
    except PacsError:
        raise
    except Exception:
        if budget.expired:
            raise PacsError(budget.late()) from None
        raise
    finally:
        _WATCHDOG.forget(budget)
        _CURRENT.budget = outer


class _BoundedResponse(http.client.HTTPResponse):
    """http.client's response over :class:`krypton.pacs.wire.WireReader`: the status
    line, the headers and everything after them read within the limits of the request in
    flight on this thread."""

    def __init__(self, sock, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(sock, *args, **kwargs)
        budget = _current() or RequestBudget(  # outside bounded() (no PACS call is)
            "a request", float("inf"), 0.0, PacsBudgets.answer_bytes, "the answer budget"
        )
        self.fp = WireReader(self.fp, budget.spend, budget.refuse)  # type: ignore[assignment]


class _Watched:
    """A connection that tells the request in flight on this thread about itself as it
    starts a request, so the watchdog can shut it."""

    def putrequest(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        budget = _current()
        if budget is not None:
            budget.check()
            budget.connections.append(self)
        return super().putrequest(*args, **kwargs)  # type: ignore[misc]


class _WatchedHTTPConnection(_Watched, HTTPConnection):
    response_class = _BoundedResponse


class _WatchedHTTPSConnection(_Watched, HTTPSConnection):
    response_class = _BoundedResponse


class _WatchedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


def literal_wildcards(url: str) -> str:
    """``url`` with a QIDO search's wildcards (``*``, ``?``) in its query sent as
    themselves: dicomweb-client percent-encodes them (``%2A``), which RFC 3986 allows
    unencoded there, and Orthanc (1.10.1 with its DICOMweb plugin 1.7, Debian 12's)
    matched ``%2A`` literally: a patient name search, ``*name*``, found nothing."""
    head, mark, query = url.partition("?")
    if not mark:
        return url
    return head + mark + query.replace("%2A", "*").replace("%2a", "*").replace("%3F", "?")


class BoundedAdapter(HTTPAdapter):
    """requests' adapter for the PACS: only URLs under ``root``, the read timeout on
    every request, watched connections, no redirects, and each answer counted against
    the budget of the request in flight."""

    def __init__(self, root: str, read_timeout: float):
        self.root = root.rstrip("/") + "/"
        self.read_timeout = read_timeout
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {
            "http": _WatchedHTTPPool,
            "https": _WatchedHTTPSPool,
        }

    def send(self, request, **kwargs):  # type: ignore[no-untyped-def,override]
        if not str(request.url).startswith(self.root):
            raise PacsError("Krypton asks the PACS only for addresses under its DICOMweb root")
        request.url = literal_wildcards(str(request.url))
        kwargs["timeout"] = self.read_timeout
        return super().send(request, **kwargs)

    def build_response(self, req, resp):  # type: ignore[no-untyped-def,override]
        response = super().build_response(req, resp)
        budget = _current()
        what = budget.what if budget is not None else "a request"
        if 300 <= response.status_code < 400:
            response.close()
            raise PacsError(
                f"the PACS answered {what} with a redirect (HTTP {response.status_code}); "
                "Krypton follows none: set KRYPTON_DICOMWEB_URL to the address it redirects to"
            )
        if budget is not None:
            budget.warning = response.headers.get("Warning", "")
            coding = response.headers.get("Content-Encoding", "")
            decoder = decoder_for(coding, budget.take, budget.left)
            if isinstance(decoder, str):
                response.close()
                raise budget.refuse(decoder)
            resp._decoder = decoder  # urllib3 inflates through it, never past the budget
        return response
