"""Session records as files under the data dir: they survive a ``kill -9`` of the server.

Each session is two files under ``<dir>``: ``<id>.meta`` (canonical CBOR of the record's
metadata, replaced atomically when it changes) and ``<id>.tokens`` (its token log, appended
before the token is sent). So whatever a client has received is on disk, and the snapshot hash
it holds verifies against what a restarted server reads back.

Metadata saves and deletions (open, write, rename, unlink: each can wait on the disk) run in
order on the writer thread, never on the caller's (the event loop's) thread. Token appends stay
where they are called: one ``write(2)`` of a step's token to a page-cache file, and it must
precede the token's frame.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import cbor2

from quicsrv_proto import canonical_cbor

from ..engine import TokenLogprobs
from ..files import write_atomically
from .record import SessionRecord
from .store import AppendOutcome, Found, RecordIndex, SaveQueue, StoreUsage

__all__ = ["FileSessionStore"]

log = logging.getLogger(__name__)


class FileSessionStore:
    """A :class:`~.store.SessionStore` in a directory of this process's own: see the module
    docstring. Every append is durable when it returns, and nobody else can own a session, so
    :meth:`fetch` and :meth:`claim` answer from memory."""

    def __init__(
        self,
        directory: Path,
        *,
        ttl_s: float,
        max_sessions: int,
        max_disk_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        self._dir = directory
        self.ttl_s = ttl_s
        self._clock = clock
        self._index = RecordIndex(max_sessions=max_sessions, max_disk_bytes=max_disk_bytes)
        self._logs: dict[bytes, int] = {}  # open token-log descriptors of live sessions
        self._writes = SaveQueue()
        self.on_appended: Callable[[SessionRecord, AppendOutcome, str], None] | None = None
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._load()

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[SessionRecord]:
        return iter(self._index)

    def get(self, session: bytes) -> SessionRecord | None:
        return self._index.get(session)

    def was_expired(self, session: bytes) -> bool:
        return self._index.was_expired(session)

    def usage(self) -> StoreUsage:
        return self._index.usage()

    def has_room(self, evictable: Callable[[SessionRecord], bool]) -> bool:
        return self._index.make_room(evictable, self.remove)

    def add(self, record: SessionRecord) -> None:
        self._index.put(record)
        self.save(record)

    def touch(self, record: SessionRecord) -> None:
        self._index.touched(record, self._clock() + self.ttl_s)
        self.save(record)

    def durable_tokens(self, record: SessionRecord) -> int:
        return len(record.generated)  # each append is a write(2) before it returns

    def append_token(
        self, record: SessionRecord, token: int, logprobs: TokenLogprobs | None = None
    ) -> None:
        entry = record.add_token(token, logprobs)
        fd = self._logs.get(record.session_id)
        if fd is None:
            fd = os.open(
                self._tokens_path(record.session_id),
                os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                0o600,
            )
            self._logs[record.session_id] = fd
        # One write(2) of the entry: a kill -9 loses nothing the kernel already has.
        os.write(fd, entry)
        self._index.token_added(len(entry))

    def close_log(self, record: SessionRecord) -> None:
        fd = self._logs.pop(record.session_id, None)
        if fd is not None:
            os.close(fd)

    def save(self, record: SessionRecord) -> Future[None]:
        if self._index.get(record.session_id) is None:  # removed: writing would bring it back
            return self.flush()
        data = canonical_cbor(record.meta())
        self._index.meta_sized(record.session_id, len(data))
        return self._writes.save_latest(
            record.session_id,
            functools.partial(_write_or_log, self._meta_path(record.session_id), data),
        )

    def flush(self) -> Future[None]:
        return self._writes.flush()

    def remove(self, session: bytes, *, expired: bool = False) -> None:
        record = self._index.pop(session, expired=expired)
        if record is None:
            return
        self.close_log(record)
        self._writes.submit(_unlink_all, (self._meta_path(session), self._tokens_path(session)))

    def delete(self, session: bytes) -> None:
        self.remove(session)

    def expired(self, now_s: float) -> list[SessionRecord]:
        return self._index.expired(now_s)

    async def fetch(self, session: bytes) -> Found | None:
        record = self._index.get(session)
        return None if record is None else Found(record, owned_here=True)

    async def claim(self, session: bytes) -> Found | None:
        return await self.fetch(session)  # nobody else can own it

    def close(self) -> None:
        self._writes.shutdown()
        for fd in self._logs.values():
            os.close(fd)
        self._logs.clear()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def _meta_path(self, session: bytes) -> Path:
        return self._dir / f"{session.hex()}.meta"

    def _tokens_path(self, session: bytes) -> Path:
        return self._dir / f"{session.hex()}.tokens"

    def _load(self) -> None:
        for leftover in self._dir.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)
        loaded = []
        for path in self._dir.glob("*.meta"):
            try:
                meta = cbor2.loads(path.read_bytes())
                tokens_path = path.with_suffix(".tokens")
                raw = tokens_path.read_bytes() if tokens_path.exists() else b""
                record = SessionRecord.from_log(meta, raw)
            except Exception as exc:  # one bad file must not stop the server
                log.warning("ignoring unreadable session file %s: %s", path.name, exc)
                continue
            loaded.append((record, path.stat().st_size, len(raw)))
        for record, meta_bytes, token_bytes in sorted(loaded, key=lambda r: r[0].expires_at_s):
            self._index.put(record, token_bytes=token_bytes)
            self._index.meta_sized(record.session_id, meta_bytes)


def _write_or_log(path: Path, data: bytes) -> None:
    try:
        write_atomically(path, data)
    except OSError as exc:  # a full disk must not take the server down: the session lives on
        log.error("cannot write session file %s: %s", path.name, exc)


def _unlink_all(paths: tuple[Path, ...]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove session file %s: %s", path.name, exc)
