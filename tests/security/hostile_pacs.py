"""A hostile DICOMweb server for the PACS tests: a small threaded ``http.server`` on
loopback that answers as an attacker's (or a broken archive's) PACS would. Its ``mode``
may be changed between requests (one app server meets every mode); every request's path
is kept, so a test can say that none left the root.

Modes:

- ``endless``: every listing page is full, of new UIDs, for ever.
- ``same-page``: every listing page is the same full page (a server that ignores offset,
  as Orthanc's own REST list does).
- ``drip``: the answer's status line and headers one byte every ``drip`` seconds.
- ``stall``: the request is read and nothing is ever answered.
- ``rows``: a study search answers 100,000 rows (9 MB) whatever limit it was asked.
- ``rows-over``: a study search answers 1,000 rows (96 kB) when it was asked for fewer.
- ``strings``: every search answers a JSON list of strings.
- ``bad-numbers``: series rows whose numbers are "abc" or lists; instance rows whose rows
  and columns are "abc".
- ``no-preamble``: a good CT series, each instance sent as a bare dataset (no Part-10
  preamble or file meta), as a dataset stored from memory becomes; a store is taken.
- ``big-stow``: like ``no-preamble``, but a store is answered with ``stow_mb`` MB.
- ``redirect``: every request is redirected to another host (``redirect_to``).

Below the byte count, in the HTTP layer:

- ``gzip-stack`` / ``deflate-stack``: every answer a 1 GB run of spaces compressed twice
  (``Content-Encoding: gzip, gzip``: under 2 kB on the wire).
- ``gzip-bomb``: the same 1 GB in one gzip layer (about 1 MB on the wire).
- ``brotli``: an answer labelled with a coding Krypton does not read.
- ``chunk-line``: a chunked answer whose chunk-size line is ``0`` for ever (until 1.5 GB
  or the client hangs up), with no line end.
- ``trailers``: a chunked answer of an empty list followed by trailer lines for ever.
- ``header-flood``: header lines for ever; ``long-header``: one header line for ever.
- ``hang-up``: the request is read and the connection closed without an answer.
- ``slow-pages``: every listing page answered after ``drip`` seconds with one new row and
  a Warning that the page was cut (so a client asks for the next), for ever.
- ``slow-instances``: the ``no-preamble`` series, each instance answered after ``drip``
  seconds.
"""

from __future__ import annotations

import functools
import gzip
import http.server
import json
import select
import socket
import threading
import time
import zlib
from urllib.parse import parse_qs, urlsplit

import numpy as np

ROOT = "/dicom-web"
BOUNDARY = "hostile-boundary"


def _uid(number: int) -> str:
    return f"1.2.826.0.1.3680043.10.7.{number}"


def _instance_row(uid: str, number: int, side: int = 16) -> dict:
    return {
        "00080018": {"vr": "UI", "Value": [uid]},
        "00200013": {"vr": "IS", "Value": [number]},
        "00280010": {"vr": "US", "Value": [side]},
        "00280011": {"vr": "US", "Value": [side]},
        "00280100": {"vr": "US", "Value": [16]},
    }


BOMB_BYTES = 2**30  # what a compressed bomb inflates to


@functools.cache
def _spaces(coding: str) -> bytes:
    """:data:`BOMB_BYTES` of spaces in one gzip or deflate layer (about 1 MB)."""
    block = b" " * 2**20
    packer = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS if coding == "gzip" else 15)
    body = b"".join(packer.compress(block) for _ in range(BOMB_BYTES // len(block)))
    return body + packer.flush()


@functools.cache
def bomb(layers: tuple[str, ...]) -> bytes:
    """:data:`BOMB_BYTES` of spaces compressed by each coding of ``layers`` in turn (made
    once per process)."""
    body = _spaces(layers[0])
    for layer in layers[1:]:
        body = gzip.compress(body, 9) if layer == "gzip" else zlib.compress(body, 9)
    return body


BOMBS = {"gzip-stack": ("gzip", "gzip"), "deflate-stack": ("deflate", "deflate"),
         "gzip-bomb": ("gzip",)}  # fmt: skip


def ready(mode: str) -> None:
    """Make ``mode``'s bomb now, if it has one (a test's own clock and memory then start
    after it)."""
    if mode in BOMBS:
        bomb(BOMBS[mode])


def ct_datasets(slices: int = 48, side: int = 48) -> list:
    """A small CT series (the project's own writer, demo.pacs.ct_series) the ``no-preamble``
    and ``big-stow`` modes serve."""
    from demo.pacs import ct_series
    from krypton.synthetic.chestct import ChestCTGenerator

    volume = ChestCTGenerator(seed=5).sample(label=1).volume[:slices, :side, :side]
    return ct_series(np.ascontiguousarray(volume), (5.0, 5.0, 5.0), "Hostile^Pacs")


def bare_bytes(dataset) -> bytes:  # type: ignore[no-untyped-def]
    """``dataset`` written as a bare dataset: no preamble, no file meta."""
    from pydicom.filebase import DicomBytesIO
    from pydicom.filewriter import write_dataset

    buffer = DicomBytesIO()
    buffer.is_little_endian, buffer.is_implicit_VR = True, False
    bare = dataset.copy()
    bare.file_meta = None  # type: ignore[assignment]
    write_dataset(buffer, bare)
    return buffer.getvalue()


class HostilePacs:
    """The server (``url`` is its DICOMweb root); ``close()`` stops it."""

    def __init__(
        self,
        mode: str,
        *,
        drip: float = 1.0,
        stow_mb: int = 300,
        redirect_to: str = "http://127.0.0.2:9/",
    ):
        self.mode, self.drip, self.stow_mb, self.redirect_to = mode, drip, stow_mb, redirect_to
        self.requests: list[str] = []
        self.arrivals: list[float] = []  # time.monotonic() of each request's arrival
        # seconds from each request's arrival to the end of its answer (the client hung
        # up or the answer was sent): what the client's own deadline cut, measured here,
        # not the client process's start-up
        self.answer_seconds: list[float] = []
        self._datasets: list = []
        self._stop = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # type: ignore[no-untyped-def]
                pass

            def do_GET(self):  # type: ignore[no-untyped-def]
                owner.arrived(self.path)
                owner.answer(self)

            def do_POST(self):  # type: ignore[no-untyped-def]
                owner.arrived(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                elif "chunked" in self.headers.get("Transfer-Encoding", ""):
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        self.rfile.read(size + 2)
                        if size == 0:
                            break
                owner.answer(self)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda request, address: None  # a client that hung up
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{ROOT}"

    @property
    def datasets(self) -> list:
        """The CT series the ``no-preamble`` and ``big-stow`` modes serve (made once)."""
        if not self._datasets:
            self._datasets = ct_datasets()
        return self._datasets

    def arrived(self, path: str) -> None:
        """Keep a request's path and the moment it arrived."""
        self.arrivals.append(time.monotonic())
        self.requests.append(path)

    def forget(self) -> None:
        """Forget the requests so far: a test that follows counts its own."""
        self.requests[:], self.arrivals[:] = [], []

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()

    # -- answers -------------------------------------------------------------------------

    def answer(self, handler) -> None:  # type: ignore[no-untyped-def]
        started = time.monotonic()
        try:
            getattr(self, "_" + self.mode.replace("-", "_"))(handler)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        finally:
            self.answer_seconds.append(time.monotonic() - started)

    @staticmethod
    def _send(handler, status: int, body: bytes, content_type: str, **headers) -> None:  # type: ignore[no-untyped-def]
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            handler.send_header(name.replace("_", "-"), value)
        handler.end_headers()
        handler.wfile.write(body)

    def _json(self, handler, rows: object) -> None:  # type: ignore[no-untyped-def]
        self._send(handler, 200, json.dumps(rows).encode(), "application/dicom+json")

    @staticmethod
    def _paging(path: str) -> tuple[int, int]:
        query = parse_qs(urlsplit(path).query)
        offset = int((query.get("offset") or ["0"])[0])
        limit = int((query.get("limit") or ["100"])[0])
        return offset, limit

    def _endless(self, handler) -> None:  # type: ignore[no-untyped-def]
        offset, limit = self._paging(handler.path)
        if "/instances" in handler.path:
            rows = [_instance_row(_uid(offset + i), offset + i) for i in range(limit)]
        else:
            rows = [
                {
                    "0020000D": {"vr": "UI", "Value": [_uid(offset + i)]},
                    "0020000E": {"vr": "UI", "Value": [_uid(10**6 + offset + i)]},
                    "00080060": {"vr": "CS", "Value": ["CT"]},
                }
                for i in range(limit)
            ]
        self._json(handler, rows)

    def _same_page(self, handler) -> None:  # type: ignore[no-untyped-def]
        _, limit = self._paging(handler.path)
        self._json(handler, [_instance_row(_uid(i), i) for i in range(limit)])

    def answered(self, count: int, timeout: float = 15.0) -> list[float]:
        """``answer_seconds`` once ``count`` answers have ended (the server's thread records
        an answer after the client's hang-up, which can land after the client's exit)."""
        deadline = time.monotonic() + timeout
        while len(self.answer_seconds) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.answer_seconds)

    def _hung_up(self, handler, seconds: float) -> bool:  # type: ignore[no-untyped-def]
        """Wait ``seconds`` (or until the server stops); True when the client hung up."""
        ends = time.monotonic() + seconds
        while (left := ends - time.monotonic()) > 0:
            if self._stop.is_set():
                return True
            readable, _, _ = select.select([handler.connection], [], [], min(left, 0.1))
            if readable and not handler.connection.recv(1, socket.MSG_PEEK):
                return True
        return self._stop.is_set()

    def _drip(self, handler) -> None:  # type: ignore[no-untyped-def]
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/dicom+json\r\nX-Pad: " + b"a" * 4096
        for byte in head:
            if self._hung_up(handler, self.drip):
                return
            handler.wfile.write(bytes([byte]))
            handler.wfile.flush()

    def _stall(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._hung_up(handler, 600)  # nothing is ever answered; timed until the hang-up

    def _rows(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._many_rows(handler, 100_000)

    def _rows_over(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._many_rows(handler, 1000)

    def _many_rows(self, handler, count: int) -> None:  # type: ignore[no-untyped-def]
        """``count`` study rows, streamed a thousand at a time until the connection closes
        (no length): building 9 MB before the first byte took over the client's 2 s
        silence limit beside four CPU burners, so the test met a timeout, not the budget."""
        handler.send_response(200)
        handler.send_header("Content-Type", "application/dicom+json")
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.close_connection = True
        handler.wfile.write(b"[")
        for first in range(0, count, 1000):
            rows = [
                {
                    "0020000D": {"vr": "UI", "Value": [_uid(i)]},
                    "00100020": {"vr": "LO", "Value": [f"P{i}"]},
                    "00080061": {"vr": "CS", "Value": ["CT"]},
                }
                for i in range(first, min(first + 1000, count))
            ]
            handler.wfile.write((", " if first else "").encode() + json.dumps(rows)[1:-1].encode())
            handler.wfile.flush()
        handler.wfile.write(b"]")

    def _strings(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._json(handler, ["not", "a", "DICOM", "JSON", "object"])

    def _bad_numbers(self, handler) -> None:  # type: ignore[no-untyped-def]
        offset, _ = self._paging(handler.path)
        if offset:
            return self._json(handler, [])
        if "/instances" in handler.path:
            row = _instance_row(_uid(1), 1)
            row["00280010"] = {"vr": "US", "Value": ["abc"]}
            return self._json(handler, [row])
        self._json(handler, [
            {
                "0020000E": {"vr": "UI", "Value": [_uid(2)]},
                "00080060": {"vr": "CS", "Value": ["CT"]},
                "00200011": {"vr": "IS", "Value": ["abc"]},
                "00201209": {"vr": "IS", "Value": [["nested"]]},
                "0008103E": {"vr": "LO", "Value": {"not": "a list"}},
            },
            {"0020000E": "not an element", "00080060": {"vr": "CS", "Value": ["CT"]}},
        ])  # fmt: skip

    def _no_preamble(self, handler) -> None:  # type: ignore[no-untyped-def]
        path = urlsplit(handler.path).path
        if handler.command == "POST":
            return self._json(handler, {})
        offset, limit = self._paging(handler.path)
        if path.endswith("/instances"):
            rows = [
                {
                    "00080018": {"vr": "UI", "Value": [str(d.SOPInstanceUID)]},
                    "00200013": {"vr": "IS", "Value": [int(d.InstanceNumber)]},
                    "00280010": {"vr": "US", "Value": [int(d.Rows)]},
                    "00280011": {"vr": "US", "Value": [int(d.Columns)]},
                    "00280100": {"vr": "US", "Value": [int(d.BitsAllocated)]},
                }
                for d in self.datasets
            ]
            return self._json(handler, rows[offset : offset + limit])
        if path.endswith("/series"):
            first = self.datasets[0]
            return self._json(handler, [] if offset else [{
                "0020000E": {"vr": "UI", "Value": [str(first.SeriesInstanceUID)]},
                "00080060": {"vr": "CS", "Value": ["CT"]},
                "00201209": {"vr": "IS", "Value": [len(self.datasets)]},
            }])  # fmt: skip
        uid = path.rsplit("/", 1)[-1]
        dataset = next((d for d in self.datasets if str(d.SOPInstanceUID) == uid), None)
        if dataset is None:
            return self._send(handler, 404, b"", "text/plain")
        part = (
            f"--{BOUNDARY}\r\nContent-Type: application/dicom\r\n\r\n".encode()
            + bare_bytes(dataset)
            + f"\r\n--{BOUNDARY}--\r\n".encode()
        )
        kind = f'multipart/related; type="application/dicom"; boundary={BOUNDARY}'
        self._send(handler, 200, part, kind)

    def _big_stow(self, handler) -> None:  # type: ignore[no-untyped-def]
        if handler.command != "POST":
            return self._no_preamble(handler)
        total = self.stow_mb * 2**20
        handler.send_response(200)
        handler.send_header("Content-Type", "application/dicom+json")
        handler.send_header("Content-Length", str(total))
        handler.end_headers()
        chunk = b" " * 2**20
        for _ in range(self.stow_mb):
            if self._stop.is_set():
                return
            handler.wfile.write(chunk)

    # -- below the byte count ------------------------------------------------------------

    def _coded(self, handler, layers: tuple[str, ...], label: str) -> None:  # type: ignore[no-untyped-def]
        self._send(handler, 200, bomb(layers), "application/dicom+json", Content_Encoding=label)

    def _gzip_stack(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._coded(handler, BOMBS["gzip-stack"], "gzip, gzip")

    def _deflate_stack(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._coded(handler, BOMBS["deflate-stack"], "deflate, deflate")

    def _gzip_bomb(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._coded(handler, BOMBS["gzip-bomb"], "gzip")

    def _brotli(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._send(handler, 200, b"[]", "application/dicom+json", Content_Encoding="br")

    def _forever(self, handler, head: bytes, unit: bytes) -> None:  # type: ignore[no-untyped-def]
        """``head``, then ``unit`` repeated (64 kB a write) until 1.5 GB are sent or the
        client hangs up."""
        handler.close_connection = True
        handler.wfile.write(head)
        block = unit * max(1, 2**16 // len(unit))
        for _ in range(int(1.5 * 2**30) // len(block)):
            if self._stop.is_set():
                return
            handler.wfile.write(block)

    def _chunk_line(self, handler) -> None:  # type: ignore[no-untyped-def]
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/dicom+json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
        self._forever(handler, head, b"0")

    def _trailers(self, handler) -> None:  # type: ignore[no-untyped-def]
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/dicom+json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n2\r\n[]\r\n0\r\n")  # fmt: skip
        self._forever(handler, head, b"X-Trailer: endless\r\n")

    def _header_flood(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._forever(handler, b"HTTP/1.1 200 OK\r\n", b"X-Flood: a\r\n")

    def _long_header(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._forever(handler, b"HTTP/1.1 200 OK\r\nX-Long: ", b"a")

    def _hang_up(self, handler) -> None:  # type: ignore[no-untyped-def]
        handler.close_connection = True  # the request is read; nothing is answered

    def _slow_pages(self, handler) -> None:  # type: ignore[no-untyped-def]
        if self._hung_up(handler, self.drip):
            return
        offset, _ = self._paging(handler.path)
        row = _instance_row(_uid(offset), offset)
        row["0020000E"] = {"vr": "UI", "Value": [_uid(10**6 + offset)]}
        row["00080060"] = {"vr": "CS", "Value": ["CT"]}
        self._send(handler, 200, json.dumps([row]).encode(), "application/dicom+json",
                   Warning='299 hostile "The results are truncated"')  # fmt: skip

    def _slow_instances(self, handler) -> None:  # type: ignore[no-untyped-def]
        listing = urlsplit(handler.path).path.endswith(("/instances", "/series"))
        if listing or not self._hung_up(handler, self.drip):
            self._no_preamble(handler)

    def _redirect(self, handler) -> None:  # type: ignore[no-untyped-def]
        self._send(handler, 302, b"", "text/plain", Location=self.redirect_to + "system")


def serve_for(seconds: float, mode: str) -> None:  # pragma: no cover - by hand
    """Run one mode for ``seconds`` (an attack to try by hand against `make serve`)."""
    pacs = HostilePacs(mode)
    print(pacs.url, flush=True)
    time.sleep(seconds)
    pacs.close()


if __name__ == "__main__":  # pragma: no cover
    import sys

    serve_for(float(sys.argv[2]) if len(sys.argv) > 2 else 600, sys.argv[1])
