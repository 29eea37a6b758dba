"""Team mode's state in Redis: images, results and computed cells, so any app process and
any worker see the same; a Redis outage becomes one plain sentence for the page
(:func:`unavailable_message`). The run queue over them is :mod:`webapp.team`."""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import redis
from PIL import Image

from krypton.batch.broker import PREFIX

from .helpers import InputError, owner_tag
from .image_store import check_stored_key, image_key, reduced_for_storage

__all__ = [
    "STATE_TTL",
    "RedisCellCache",
    "RedisImageStore",
    "RedisKnown",
    "RedisResultStore",
    "TeamStores",
    "redis_client",
    "unavailable_message",
]

STATE_TTL = 24 * 3600  # images, results and cells are kept a day after their last use


def unavailable_message(url: str, exc: BaseException) -> str:
    """The page's sentence when Redis cannot be reached."""
    where = re.sub(r"//[^@/]*@", "//", url)  # never show a password
    return (
        f"The run queue (Redis at {where}) cannot be reached ({type(exc).__name__}); "
        f"runs and uploads are paused until it is back. The page keeps working."
    )


def redis_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=10)


def redis_errors_as_input_errors(method):
    """Decorator for store methods: a Redis outage becomes the page's InputError."""

    @functools.wraps(method)
    def guarded(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except redis.RedisError as exc:
            raise InputError(unavailable_message(self.url, exc)) from exc

    return guarded


class RedisImageStore:
    """helpers.ImageStore's interface, in Redis: every app process and worker reads the
    same images by content key; each is kept a day after its last use."""

    def __init__(self, client: redis.Redis, url: str, ttl: int = STATE_TTL):
        self.client, self.url, self.ttl = client, url, ttl

    @redis_errors_as_input_errors
    def put(self, image: Image.Image, client: str = "") -> str:
        """Store ``image``; each key expires a day after its last use, whoever stored it
        (``client`` is for the embedded store's per-client shares)."""
        image = reduced_for_storage(image)
        key = image_key(image)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        self.client.set(PREFIX + "image:" + key, buffer.getvalue(), ex=self.ttl)
        return key

    @redis_errors_as_input_errors
    def put_source(self, data: bytes, owner: str, client: str = "") -> str:
        """Keep an uploaded file's bytes (a DICOM source) for the tab ``owner``; its key."""
        key = hashlib.blake2b(data, digest_size=12).hexdigest()
        self.client.set(PREFIX + "source:" + key + ":" + owner_tag(owner), data, ex=self.ttl)
        return key

    def _read(self, kind: str, key: str, what: str, suffix: str = "") -> bytes:
        check_stored_key(key, what)
        data = self.client.getex(PREFIX + kind + key + suffix, ex=self.ttl)
        if data is None:
            raise InputError(f"the {what} is no longer on the server; load it again")
        return data

    @redis_errors_as_input_errors
    def source(self, key: str, owner: str) -> bytes:
        """The bytes :meth:`put_source` kept for ``owner`` (another tab gets none)."""
        return self._read("source:", key, "DICOM file", ":" + owner_tag(owner))

    @redis_errors_as_input_errors
    def get(self, key: str) -> Image.Image:
        with Image.open(io.BytesIO(self._read("image:", key, "image"))) as image:
            return image.convert("RGB")


def _encode_result(result: dict) -> bytes:
    """JSON, with numpy arrays as base64 .npy (no pickle: nothing in Redis can run code)."""

    def default(value):
        if isinstance(value, np.ndarray):
            buffer = io.BytesIO()
            np.save(buffer, value, allow_pickle=False)
            return {"__npy__": base64.b64encode(buffer.getvalue()).decode()}
        if isinstance(value, np.generic):
            return value.item()
        raise TypeError(f"cannot store {type(value).__name__}")

    return json.dumps(result, default=default).encode()


def _decode_result(data: bytes) -> dict:
    def hook(value: dict):
        if set(value) == {"__npy__"}:
            return np.load(io.BytesIO(base64.b64decode(value["__npy__"])), allow_pickle=False)
        return value

    return json.loads(data, object_hook=hook)


class RedisResultStore:
    """helpers.ResultStore's interface, in Redis: the worker that ran a job stores the
    result, the app process that serves the export or the refinement reads it."""

    def __init__(self, client: redis.Redis, url: str, ttl: int = STATE_TTL):
        self.client, self.url, self.ttl = client, url, ttl

    @redis_errors_as_input_errors
    def put(self, session: str, result: Mapping[str, Any]) -> None:
        self.client.set(PREFIX + "result:" + session, _encode_result(result), ex=self.ttl)

    @redis_errors_as_input_errors
    def get(self, session: str | None) -> dict | None:
        data = self.client.getex(PREFIX + "result:" + (session or ""), ex=self.ttl)
        return None if data is None else _decode_result(data)

    def dropped(self, session: str | None) -> bool:
        """Results leave Redis only when they expire (a day unused); none is dropped."""
        return False


@dataclass
class RedisKnown:
    """The cells known for one setting, read from Redis in one round trip; :meth:`add`
    writes new ones back per batch, so a run that dies leaves what it computed. Cells are
    keyed by position: (x, y) for an image, (z, y, x) for a volume."""

    client: redis.Redis
    name: str
    ttl: int
    cells: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)
    origin: tuple[int, ...] | None = None

    def add(self, new: dict[tuple[int, ...], np.ndarray]) -> None:
        self.cells.update(new)
        if new:
            pipe = self.client.pipeline()
            pipe.hset(
                self.name,
                mapping={
                    _position(at): np.asarray(v, dtype=np.float32).tobytes()
                    for at, v in new.items()
                },
            )
            pipe.expire(self.name, self.ttl)
            pipe.execute()

    def set_origin(self, origin: tuple[int, ...]) -> None:
        self.origin = origin
        self.client.hset(self.name, "origin", _position(origin))


def _position(at: tuple[int, ...]) -> str:
    return ",".join(str(int(v)) for v in at)


def _parse_position(text: bytes) -> tuple[int, ...]:
    return tuple(int(v) for v in text.decode().split(","))


class RedisCellCache:
    """Computed positions shared by every worker, keyed by what determines their value:
    image content, model weights and preprocessing, patch, occluder colour and mode
    (exact and naive keep separate cells; approximate runs do not enter the cache). A
    refinement reuses cells whichever worker computed them; a redelivered job resumes
    where the lost one stopped."""

    def __init__(self, client: redis.Redis, url: str, ttl: int = STATE_TTL):
        self.client, self.url, self.ttl = client, url, ttl

    @redis_errors_as_input_errors
    def get(self, key: tuple) -> RedisKnown:
        name = PREFIX + "cells:" + hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()
        stored = self.client.hgetall(name)
        known = RedisKnown(self.client, name, self.ttl)
        for field_name, value in stored.items():
            if field_name == b"origin":
                continue
            known.cells[_parse_position(field_name)] = np.frombuffer(value, np.float32).copy()
        if b"origin" in stored:
            known.origin = _parse_position(stored[b"origin"])
        return known

    def peek(self, key: tuple) -> RedisKnown | None:
        """The cells kept for ``key``, or None (reading writes nothing here either)."""
        known = self.get(key)
        return known if known.cells else None


@dataclass
class TeamStores:
    """The three stores of team mode over one Redis connection."""

    url: str
    client: redis.Redis = field(init=False)

    def __post_init__(self):
        self.client = redis_client(self.url)

    def images(self) -> RedisImageStore:
        return RedisImageStore(self.client, self.url)

    def results(self) -> RedisResultStore:
        return RedisResultStore(self.client, self.url)

    def cells(self) -> RedisCellCache:
        return RedisCellCache(self.client, self.url)
