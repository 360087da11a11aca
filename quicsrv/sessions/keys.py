"""The MAC keyring: a current key plus previous ones that still verify until they expire.

Keys live in ``<data_dir>/mac-keys.json`` (created 0600 on first start) unless given by config.
Rotation (``quicsrv keys rotate``) makes a new current key; the old one keeps verifying for
``previous_key_ttl_s``. A running server notices the rewritten file and reloads it.

With a Redis store the keyring is one Redis value instead (:class:`SharedKeyRing`), the same
JSON, so every process sharing the store signs and verifies with the same keys; servers reread it
every sweep interval.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

__all__ = ["KeyRing", "SharedKeyRing"]

KEY_BYTES = 32


@dataclass(frozen=True, slots=True)
class _Key:
    key: bytes
    retired_at_s: float | None  # None: the current key


class KeyRing:
    def __init__(
        self, keys: list[_Key], previous_key_ttl_s: float, path: Path | None = None
    ) -> None:
        self._keys = keys
        self._ttl_s = previous_key_ttl_s
        self._path = path
        self._mtime_ns = path.stat().st_mtime_ns if path is not None and path.exists() else 0

    @classmethod
    def load_or_create(cls, path: Path, *, previous_key_ttl_s: float = 86400.0) -> KeyRing:
        if path.exists():
            return cls(_read(path), previous_key_ttl_s, path)
        ring = cls([_Key(secrets.token_bytes(KEY_BYTES), None)], previous_key_ttl_s)
        ring.save(path)
        ring._path, ring._mtime_ns = path, path.stat().st_mtime_ns
        return ring

    @classmethod
    def from_secret(cls, secret: bytes) -> KeyRing:
        if len(secret) != KEY_BYTES:
            raise ValueError(f"a MAC key is {KEY_BYTES} bytes")
        return cls([_Key(secret, None)], 0.0)

    def refresh(self) -> None:
        """Reread a ring other processes may have rotated; one in a file (reread when it
        changes) or made from a secret has nothing to reread."""

    @property
    def current(self) -> bytes:
        self._reload_if_changed()
        return next(k.key for k in self._keys if k.retired_at_s is None)

    def verifying_keys(self, now_s: float) -> list[bytes]:
        self._reload_if_changed()
        return [
            k.key
            for k in self._keys
            if k.retired_at_s is None or now_s - k.retired_at_s < self._ttl_s
        ]

    def rotate(self, now_s: float) -> None:
        kept = [_Key(k.key, k.retired_at_s or now_s) for k in self._keys]
        kept = [
            k for k in kept if k.retired_at_s is not None and now_s - k.retired_at_s < self._ttl_s
        ]
        self._keys = [_Key(secrets.token_bytes(KEY_BYTES), None), *kept]

    def _reload_if_changed(self) -> None:
        if self._path is None:
            return
        try:
            mtime_ns = self._path.stat().st_mtime_ns
            if mtime_ns != self._mtime_ns:
                self._keys, self._mtime_ns = _read(self._path), mtime_ns
        except (OSError, ValueError):
            pass  # a half-written or vanished file: keep the keys we have

    def to_json(self) -> bytes:
        return json.dumps([[k.key.hex(), k.retired_at_s] for k in self._keys]).encode()

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_json()
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


class SharedKeyRing(KeyRing):
    """The keyring as one Redis value: the first process to start creates it (``SET NX``)."""

    def __init__(self, client: redis.Redis, key: str, *, previous_key_ttl_s: float) -> None:
        self._client, self._redis_key = client, key
        first = KeyRing([_Key(secrets.token_bytes(KEY_BYTES), None)], previous_key_ttl_s)
        client.set(key, first.to_json(), nx=True)
        super().__init__(self._fetch(), previous_key_ttl_s)

    def refresh(self) -> None:
        """Reread the keys (blocking: call it off the event loop); keep ours on any failure.
        A Redis that came back without them (restarted with no persistence) gets ours back,
        so that every process and the next one verify the checkpoints already handed out."""
        import redis

        try:
            raw = self._client.get(self._redis_key)
            if raw is None:
                self._client.set(self._redis_key, self.to_json(), nx=True)
                raw = self._client.get(self._redis_key)
            self._keys = _parse(raw)
        except (redis.RedisError, ValueError, KeyError):
            pass

    def rotate_shared(self, now_s: float) -> None:
        """Rotate the stored keyring atomically (a concurrent rotation makes this one retry)."""
        import redis

        while True:
            with self._client.pipeline() as pipe:
                try:
                    pipe.watch(self._redis_key)  # type: ignore[no-untyped-call]
                    self._keys = _parse(pipe.get(self._redis_key))
                    self.rotate(now_s)
                    pipe.multi()
                    pipe.set(self._redis_key, self.to_json())
                    pipe.execute()
                    return
                except redis.WatchError:
                    continue

    def _fetch(self) -> list[_Key]:
        return _parse(self._client.get(self._redis_key))


def _read(path: Path) -> list[_Key]:
    return _parse(path.read_bytes())


def _parse(data: object) -> list[_Key]:
    if not isinstance(data, bytes | str):
        raise ValueError("no keyring stored")
    raw = json.loads(data)
    return [_Key(bytes.fromhex(k), None if r is None else float(r)) for k, r in raw]
