"""Paused KV blobs where every server process can reach them: Redis, or a shared directory.

With the Redis store a session may resume on another process (or node) than the one that paused
it. The local :class:`~.kvstore.KVStore` keeps serving its own process; this is the copy for the
others: a blob up to ``redis_max_bytes`` goes to Redis (``<prefix>s:<id>:kv``, expiring with the
session), a larger one to ``shared_dir`` (a path every process sees: one node's workers share
the data directory's ``kv-shared``; nodes would need a network file system), else nowhere, and
a resume elsewhere replays exactly instead. Both forms carry the same header as a spilled blob
(tokens covered, BLAKE3 checksum), so a stale or torn copy is never restored.

Calls block (a Redis round trip, a file read or write of megabytes): the KV store calls them on
its writer thread and the resume path on a worker thread, never on the event loop.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..files import write_atomically

if TYPE_CHECKING:
    import redis

__all__ = ["SharedKV"]

log = logging.getLogger(__name__)


class SharedKV:
    def __init__(
        self,
        client: redis.Redis,
        *,
        redis_max_bytes: int,
        shared_dir: Path | None,
        ttl_s: float,
        prefix: str = "quicsrv:",
    ) -> None:
        self._redis = client
        self._redis_max_bytes = redis_max_bytes
        self._dir = shared_dir
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._prefix = prefix
        if shared_dir is not None:
            shared_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def publish(self, session: bytes, packed: bytes) -> None:
        """Keep ``packed`` (header + blob) for other processes; replaces an older copy."""
        import redis

        try:
            if len(packed) <= self._redis_max_bytes:
                self._redis.set(self._key(session), packed, px=self._ttl_ms)
                self._unlink(session)
            elif self._dir is not None:
                self._write(session, packed)
                self._redis.delete(self._key(session))
        except (redis.RedisError, OSError) as exc:
            log.warning(
                "cannot share the KV blob of %s (resumes elsewhere replay): %s", session.hex(), exc
            )

    def fetch(self, session: bytes) -> bytes | None:
        """The packed blob another process published, if any (not yet checked)."""
        import redis

        try:
            data = self._redis.get(self._key(session))
        except redis.RedisError as exc:
            log.warning("cannot fetch the shared KV blob of %s: %s", session.hex(), exc)
            data = None
        if data is not None:
            return bytes(data)  # type: ignore[arg-type]
        if self._dir is None:
            return None
        try:
            return self._path(session).read_bytes()
        except OSError:
            return None

    def delete(self, session: bytes) -> None:
        """The engine holds the cells again (or the session ended): no copy is needed."""
        import redis

        try:
            self._redis.delete(self._key(session))
        except redis.RedisError:
            pass  # it expires with the session anyway
        self._unlink(session)

    def sweep(self, now_s: float | None = None) -> int:
        """Remove shared files older than the session TTL (left by a killed process)."""
        if self._dir is None:
            return 0
        now_s = time.time() if now_s is None else now_s
        removed = 0
        for path in self._dir.glob("*.kv"):
            try:
                if now_s - path.stat().st_mtime > self._ttl_ms / 1000:
                    path.unlink()
                    removed += 1
            except OSError:
                continue
        return removed

    def _key(self, session: bytes) -> str:
        return f"{self._prefix}s:{session.hex()}:kv"

    def _path(self, session: bytes) -> Path:
        assert self._dir is not None
        return self._dir / f"{session.hex()}.kv"

    def _unlink(self, session: bytes) -> None:
        if self._dir is not None:
            self._path(session).unlink(missing_ok=True)

    def _write(self, session: bytes, packed: bytes) -> None:
        write_atomically(self._path(session), packed)
