"""Images and uploaded sources kept on the server by content key, so the browser only holds
the key; each client's share of the store bounded, so one client cannot evict another's.

Images arrive reduced to what any model can use (:data:`krypton.io.images.MAX_SIDE`) and
are stored at that resolution; DICOM and volume uploads are kept as sent
(:meth:`ImageStore.put_source`), for their tab alone, so the window and frame can change and
the exports can reference the source.

Bounded: at most ``max_bytes`` of files and ``max_count`` of them. Each client (the
authenticated user or the address, :data:`webapp.client.CLIENT_HEADER`) may hold at
most :data:`webapp.client.CLIENT_SHARE` of either; a client's new file first evicts that
client's own least recently used ones. When many clients together fill the store, the
least recently used file of the client holding the most goes, one at a time: five
addresses with 101 small images each evicted another user's one image when the oldest of
anyone's went first. A file that may be on another client's screen or in its run — one
of that client's :data:`ON_SCREEN_PER_CLIENT` most recently used, used within
:data:`ON_SCREEN_SECONDS` — is never evicted for someone else's: when only such files
are left, the new file is refused instead ("try again in a few minutes").
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from pathlib import Path

from PIL import Image

from krypton.io.images import MAX_SIDE

from .client import CLIENT_SHARE
from .helpers import InputError, owner_tag

__all__ = [
    "ImageStore",
    "ON_SCREEN_SECONDS",
    "ON_SCREEN_PER_CLIENT",
    "image_key",
    "reduced_for_storage",
    "check_stored_key",
]

# A client's files that may be on its screen or in its run: its most recently used (a
# picture shown, predicted, run or exported is read, which marks it used), two for two
# tabs, and only while used this recently.
ON_SCREEN_PER_CLIENT = 2
ON_SCREEN_SECONDS = 30 * 60


def image_key(image: Image.Image) -> str:
    """Content hash of an image (same pixels, same key)."""
    digest = hashlib.blake2b(image.tobytes(), digest_size=12)
    digest.update(repr(image.size).encode())
    return digest.hexdigest()


def reduced_for_storage(image: Image.Image) -> Image.Image:
    """The image as the stores keep it: at most :data:`krypton.io.images.MAX_SIDE` a side."""
    if max(image.size) > MAX_SIDE:
        image = image.copy()
        image.thumbnail((MAX_SIDE, MAX_SIDE), Image.LANCZOS)
    return image


def check_stored_key(key: str, what: str) -> None:
    """A stored file's key is a content hash; anything else the page sent is refused."""
    if not re.fullmatch(r"[0-9a-f]{24}", key or ""):
        raise InputError(f"unknown {what}; load it again")


FULL_OF_OTHERS = (
    "the server's image store is full of files other users have open; try again in a few minutes"
)


class ImageStore:
    """See the module docstring."""

    def __init__(self, directory: Path, max_bytes: int = 1024 * 2**20, max_count: int = 500):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.max_count = max_bytes, max_count
        self._clients: dict[str, str] = {}  # file name -> client tag of who stored it
        self._lock = threading.Lock()

    def put(self, image: Image.Image, client: str = "") -> str:
        """Store ``image`` (reduced to what a model can use) for ``client``; its key."""
        image = reduced_for_storage(image)
        key = image_key(image)
        self._keep(self.directory / f"{key}.png", lambda to: image.save(to, format="PNG"), client)
        return key

    def put_source(self, data: bytes, owner: str, client: str = "") -> str:
        """Keep an uploaded file's bytes (a DICOM source) for the tab ``owner`` (its
        session id) alone, counted in ``client``'s share: its key, which no other tab can
        read it with."""
        key = hashlib.blake2b(data, digest_size=12).hexdigest()
        self._keep(self.directory / f"{key}.{owner_tag(owner)}.dcm", Path.write_bytes, client, data)
        return key

    def _keep(self, path: Path, write, client: str, *data) -> None:
        """``path`` written (``write(temporary, *data)``, then moved into place) or, if it
        is there already, marked recently used; counted in ``client``'s share (a content
        key two clients stored stays the first one's) and the store kept in its bounds."""
        with self._lock:
            new = not path.exists()
            if new:
                temporary = path.with_suffix(".tmp")
                write(temporary, *data)
                os.replace(temporary, path)
            else:
                os.utime(path)
            self._clients.setdefault(path.name, owner_tag(client))
            if not self._evict(keep=path) and new:
                path.unlink(missing_ok=True)
                self._clients.pop(path.name, None)
                raise InputError(FULL_OF_OTHERS)

    def source(self, key: str, owner: str) -> bytes:
        """The bytes :meth:`put_source` kept for ``owner`` (another tab gets none)."""
        check_stored_key(key, "DICOM file")
        path = self.directory / f"{key}.{owner_tag(owner)}.dcm"
        try:
            with self._lock:
                os.utime(path)
            return path.read_bytes()
        except FileNotFoundError:
            raise InputError(
                "the DICOM file is no longer on the server (or was loaded in another tab); "
                "load it again"
            ) from None

    def get(self, key: str) -> Image.Image:
        check_stored_key(key, "image")
        path = self.directory / f"{key}.png"
        try:
            with self._lock:
                os.utime(path)  # recently used
            with Image.open(path) as image:
                return image.convert("RGB")
        except FileNotFoundError:
            raise InputError("the image is no longer on the server; load it again") from None

    def _files(self) -> list[Path]:
        return [*self.directory.glob("*.png"), *self.directory.glob("*.dcm")]

    def usage(self) -> tuple[int, int]:
        """(files, bytes) stored."""
        files = self._files()
        return len(files), sum(f.stat().st_size for f in files)

    def _evict(self, keep: Path) -> bool:
        """The client that stored ``keep`` back within its share (its own oldest first),
        then the store within its bounds (the largest holder's oldest first, never a file
        another client may have on screen); ``keep`` stays. Whether the store fits."""
        files = []
        for path in self._files():
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        files.sort()
        client = self._clients.get(keep.name, "")
        mine = [f for f in files if self._clients.get(f[2].name, "") == client]
        self._drop_oldest(mine, keep, CLIENT_SHARE * self.max_bytes, CLIENT_SHARE * self.max_count)
        files = [f for f in files if f[2].exists()]
        on_screen = self._on_screen(files, client)
        return self._drop_from_the_largest(files, keep, on_screen)

    def _on_screen(self, files: list, client: str) -> set[Path]:
        """Other clients' files that may be on their screens or in their runs: each
        one's ON_SCREEN_PER_CLIENT most recently used, if used within ON_SCREEN_SECONDS."""
        now, latest = time.time(), {}  # client -> its newest files
        for mtime, _, path in reversed(files):  # newest first
            owner = self._clients.get(path.name, "")
            kept = latest.setdefault(owner, [])
            if owner != client and len(kept) < ON_SCREEN_PER_CLIENT:
                if now - mtime <= ON_SCREEN_SECONDS:
                    kept.append(path)
        return {path for paths in latest.values() for path in paths}

    def _drop_from_the_largest(self, files: list, keep: Path, on_screen: set[Path]) -> bool:
        """The store within its bounds: the oldest file of the client holding the most
        bytes goes first (``keep`` and the files ``on_screen`` stay), until the store
        fits; whether it does."""
        total, count = sum(size for _, size, _ in files), len(files)
        held: dict[str, int] = {}
        for _, size, path in files:
            if path != keep and path not in on_screen:
                owner = self._clients.get(path.name, "")
                held[owner] = held.get(owner, 0) + size
        while (total > self.max_bytes or count > self.max_count) and held:
            largest = max(held, key=held.__getitem__)
            _, size, path = next(
                f
                for f in files
                if f[2] != keep
                and f[2] not in on_screen
                and self._clients.get(f[2].name, "") == largest
            )
            path.unlink(missing_ok=True)
            self._clients.pop(path.name, None)
            files = [f for f in files if f[2] != path]
            total, count = total - size, count - 1
            held[largest] -= size
            if held[largest] <= 0:
                del held[largest]
        return total <= self.max_bytes and count <= self.max_count

    def _drop_oldest(self, files: list, keep: Path, max_bytes: float, max_count: float) -> None:
        total, count = sum(size for _, size, _ in files), len(files)
        for _, size, path in files:
            if total <= max_bytes and count <= max_count:
                break
            if path == keep:
                continue
            path.unlink(missing_ok=True)
            self._clients.pop(path.name, None)
            total -= size
            count -= 1
