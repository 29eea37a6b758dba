"""A PACS answer read within limits below the HTTP client: every byte that comes off
the socket, every protocol line and the decoded body.

urllib3 1.26 (what requests runs on here) reads a chunk-size line or a trailer with an
unbounded ``readline()``, and inflates a ``Content-Encoding: gzip, gzip`` body one read at
a time with no limit on what one read becomes: 1,820 bytes of stacked gzip were 1 GB
inside one read, before any count above the client saw a byte. Here:

- :class:`WireReader` stands in for the socket's file under http.client and urllib3:
  each line (status, header, chunk size, trailer) is at most :data:`LINE_BYTES`, a head
  at most :data:`HEAD_LINES` lines and a trailer at most :data:`TRAILER_LINES`; every byte
  read is counted against the request's wire budget and its deadline is checked.
- :class:`BoundedDecoder` takes urllib3's decoder's place: identity, or one layer of
  gzip or deflate inflated a piece at a time, each piece at most what the budget has
  left, so the decoded bytes are counted as they come, not after. Stacked and unknown
  codings are refused in words (Krypton asks for ``identity``).

The caller words the refusals (neither knows what the request was for): the reader's
through its ``refuse``, the decoder's from what :func:`decoder_for` returns.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

__all__ = [
    "LINE_BYTES",
    "HEAD_LINES",
    "TRAILER_LINES",
    "WireReader",
    "BoundedDecoder",
    "decoder_for",
]

LINE_BYTES = 8 * 1024  # a status, header, chunk-size or trailer line (nginx's default)
HEAD_LINES = 64  # the status line and the header lines of one answer
TRAILER_LINES = 16  # the trailer lines after a chunked body's last chunk
_PIECE = 1 << 20  # the most one read asks of the socket's file before it is counted


class WireReader:
    """The socket's buffered file, read within limits (module docstring). ``spend(n)``
    is called with each read's size and raises past the wire budget or the deadline;
    ``refuse(words)`` makes the exception for a line past its limit (the words follow
    "the PACS answered …")."""

    def __init__(self, raw, spend: Callable[[int], None], refuse: Callable[[str], Exception]):
        self._raw = raw
        self._spend = spend
        self._refuse = refuse
        self._head_lines = 0
        self._in_head = True
        self._trailer_lines: int | None = None  # counted once the last chunk's line is read

    # -- lines -----------------------------------------------------------------------------

    def readline(self, limit: int = -1) -> bytes:
        whole = limit is None or limit < 0 or limit > LINE_BYTES
        line = self._raw.readline(LINE_BYTES + 1 if whole else limit)
        self._spend(len(line))
        if whole and len(line) > LINE_BYTES:
            raise self._refuse(
                f"with a protocol line (a status, header or chunk-size line) over "
                f"{LINE_BYTES // 1024} KB"
            )
        self._count_line(line)
        return line

    def _count_line(self, line: bytes) -> None:
        blank = line in (b"\r\n", b"\n", b"")
        if self._in_head:
            self._head_lines += 1
            if self._head_lines > HEAD_LINES:
                raise self._refuse(f"with more than {HEAD_LINES} header lines")
            self._in_head = not (blank and self._head_lines > 1)
            return
        if self._trailer_lines is not None:
            self._trailer_lines += 1
            if self._trailer_lines > TRAILER_LINES:
                raise self._refuse(f"with more than {TRAILER_LINES} trailer lines")
            return
        size = line.split(b";", 1)[0].strip()
        if size and not size.strip(b"0"):  # the last chunk's size line: trailers follow
            self._trailer_lines = 0

    # -- bytes -----------------------------------------------------------------------------

    def read(self, size: int | None = -1) -> bytes:
        """``size`` bytes (all, where none is given), read and counted a piece at a time:
        a declared length or chunk size never becomes one allocation past the budget."""
        if size is not None and 0 <= size <= _PIECE:
            data = self._raw.read(size)
            self._spend(len(data))
            return data
        pieces, wanted = [], -1 if size is None else size
        while wanted != 0:
            piece = self._raw.read(_PIECE if wanted < 0 else min(wanted, _PIECE))
            if not piece:
                break
            self._spend(len(piece))
            pieces.append(piece)
            wanted = wanted if wanted < 0 else wanted - len(piece)
        return b"".join(pieces)

    def read1(self, size: int = -1) -> bytes:
        data = self._raw.read1(size if 0 <= size <= _PIECE else _PIECE)
        self._spend(len(data))
        return data

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        count = self._raw.readinto(buffer)
        self._spend(count or 0)
        return count

    def readinto1(self, buffer) -> int:  # type: ignore[no-untyped-def]
        count = self._raw.readinto1(buffer)
        self._spend(count or 0)
        return count

    def peek(self, size: int = 0) -> bytes:
        return self._raw.peek(size)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._raw, name)  # close, closed, fileno, flush, readable, …


class BoundedDecoder:
    """urllib3's ``_decoder``: ``decompress(data)`` and ``flush()``. ``coding`` is
    ``identity``, ``gzip`` or ``deflate``; ``take(n)`` is called with each piece's decoded
    size before the next is made and raises past the budget; ``left()`` is what the
    budget still allows (so no piece is larger than it)."""

    def __init__(self, coding: str, take: Callable[[int], None], left: Callable[[], int]):
        self.coding = coding
        self._take, self._left = take, left
        self._inflater = self._new() if coding != "identity" else None
        self._first = True

    def _new(self):  # type: ignore[no-untyped-def]
        if self.coding == "gzip":
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        return zlib.decompressobj()  # deflate: zlib-wrapped; raw deflate tried if it fails

    def __bool__(self) -> bool:
        return True

    def decompress(self, data: bytes) -> bytes:
        if self._inflater is None:
            self._take(len(data))
            return data
        pieces: list[bytes] = []
        pending = data
        while pending:
            piece = self._inflate(pending)
            pending = self._inflater.unconsumed_tail
            if self._inflater.eof and self._inflater.unused_data:
                if self.coding != "gzip":
                    break  # bytes after a deflate stream: ignored, as urllib3 does
                pending = self._inflater.unused_data  # a gzip of several members
                self._inflater = self._new()
            pieces.append(piece)
            if not piece and not pending:
                break
        return b"".join(pieces)

    def _inflate(self, data: bytes) -> bytes:
        """One piece of inflated bytes, at most one byte over what the budget has left
        (that byte is what tells the budget it was passed)."""
        room = max(0, self._left()) + 1
        try:
            piece = self._inflater.decompress(data, room)  # type: ignore[union-attr]
        except zlib.error:
            if not (self.coding == "deflate" and self._first):
                raise
            self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)  # a raw deflate stream
            piece = self._inflater.decompress(data, room)
        self._first = False
        self._take(len(piece))
        return piece

    def flush(self) -> bytes:
        if self._inflater is None:
            return b""
        rest = self._inflater.flush()
        self._take(len(rest))
        return rest


def decoder_for(
    content_encoding: str, take: Callable[[int], None], left: Callable[[], int]
) -> BoundedDecoder | str:
    """The decoder for an answer's ``Content-Encoding`` header, or the words that refuse
    it (they follow "the PACS answered …"): stacked codings (``gzip, gzip``) and codings
    other than gzip and deflate."""
    codings = [c.strip().lower() for c in content_encoding.split(",") if c.strip()]
    codings = [c for c in codings if c != "identity"]
    if not codings:
        return BoundedDecoder("identity", take, left)
    if len(codings) > 1:
        return (
            f"compressed {len(codings)} times over ({', '.join(codings)[:60]}): Krypton "
            "reads one gzip or deflate layer at most"
        )
    coding = {"x-gzip": "gzip"}.get(codings[0], codings[0])
    if coding not in ("gzip", "deflate"):
        return (
            f"in an encoding Krypton does not read ({coding[:30]}): it reads identity, gzip "
            "or deflate"
        )
    return BoundedDecoder(coding, take, left)
