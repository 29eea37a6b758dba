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

Past any of them the request ends with :class:`PacsError`, one line naming the PACS step
and the limit. The watchdog is one daemon thread for the process, asleep while no
request is in flight.
"""

from __future__ import annotations

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

__all__ = ["PacsError", "PacsBudgets", "RequestBudget", "BoundedAdapter", "bounded"]

STORE_BYTES_PER_SECOND = 10 * 2**20  # a store's deadline grows by a second per 10 MB sent


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

    @classmethod
    def from_environment(cls) -> PacsBudgets:
        """The budgets the environment sets (a bad value: PacsError naming it)."""
        try:
            return cls(
                library_setting("KRYPTON_DICOMWEB_TIMEOUT_SECONDS"),
                library_setting("KRYPTON_DICOMWEB_DEADLINE_SECONDS"),
                int(library_setting("KRYPTON_DICOMWEB_ANSWER_MB") * 2**20),
                int(library_setting("KRYPTON_DICOMWEB_PAGES")),
            )
        except SettingError as exc:
            raise PacsError(str(exc)) from None


@dataclass
class RequestBudget:
    """One request's limits while it is in flight: its deadline (monotonic), the bytes
    its answer may hold, and what it is (for the message)."""

    what: str
    deadline: float
    seconds: float
    max_bytes: int
    bytes_reason: str
    expired: bool = False
    warning: str = ""  # the answer's Warning header (a QIDO server that cut its page)
    connections: list = field(default_factory=list)

    def check(self) -> None:
        if self.expired or time.monotonic() > self.deadline:
            self.expired = True
            raise PacsError(self.late())

    def late(self) -> str:
        return (
            f"the PACS did not finish {self.what} within {self.seconds:g} s "
            "(KRYPTON_DICOMWEB_DEADLINE_SECONDS)"
        )


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


@contextmanager
def bounded(
    budgets: PacsBudgets,
    what: str,
    *,
    max_bytes: int | None = None,
    bytes_reason: str = "",
    extra_seconds: float = 0.0,
) -> Iterator[RequestBudget]:
    """Around one PACS request (``what``: the step, for messages): its deadline is
    watched and its answer counted against ``max_bytes`` (default: the answer budget)."""
    seconds = budgets.deadline + extra_seconds
    limit = budgets.answer_bytes if max_bytes is None else max_bytes
    reason = bytes_reason or f"{limit / 2**20:.3g} MB (KRYPTON_DICOMWEB_ANSWER_MB) for {what}"
    budget = RequestBudget(what, time.monotonic() + seconds, seconds, limit, reason)
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
    pass


class _WatchedHTTPSConnection(_Watched, HTTPSConnection):
    pass


class _WatchedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


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
            _count_reads(response, budget)
        return response


def _count_reads(response, budget: RequestBudget) -> None:  # type: ignore[no-untyped-def]
    """Wrap the raw reads of ``response`` (plain and chunked): past the budget's bytes,
    or its deadline, the download stops."""
    raw, counted = response.raw, [0]

    def count(chunk):  # type: ignore[no-untyped-def]
        counted[0] += len(chunk)
        if counted[0] > budget.max_bytes:
            response.close()
            raise PacsError(f"the PACS sent more than {budget.bytes_reason}")
        budget.check()
        return chunk

    def counting(read):  # type: ignore[no-untyped-def]
        def wrapped(*args, **kwargs):  # type: ignore[no-untyped-def]
            result = read(*args, **kwargs)
            if isinstance(result, (bytes, bytearray)):
                return count(result)
            return (count(chunk) for chunk in result)  # read_chunked yields chunks

        return wrapped

    raw.read = counting(raw.read)
    raw.read_chunked = counting(raw.read_chunked)
