"""Session records, token logs and leases in Redis, so any process sharing it can resume.

Keys, under a prefix (``quicsrv:`` by default), each expiring with its session (``PEXPIREAT``
the record's ``expires_at_s``, renewed whenever the record is saved):

* ``<p>s:<id>:meta``: canonical CBOR of the record without its tokens (the file store's
  ``.meta``);
* ``<p>s:<id>:tok``: the token log, 4 bytes a token, ``APPEND``-ed each step;
* ``<p>s:<id>:lease``: the id of the process that owns the session, expiring ``lease_s`` after
  its last write (``PX``).

One owner at a time: every write is a Lua script that first checks the lease. A process whose
lease was taken over (a resume reached another process: the newest attach wins, across
processes as within one) has its write refused, and its session ends its reader's stream with
``superseded`` and stops generating. A lease that expired (its owner died) is simply taken.

Durability without blocking the loop: the writes run on the store's one writer thread with
the sync client, in the order they were asked for; a resume's first read of a record, which
orders against nothing, is awaited on the loop through the asyncio client. Token appends of all
sessions are gathered and sent as one pipeline per batch; a token is *durable* once Redis
confirmed it, and :class:`Session` sends a reader only durable tokens, so whatever a client was
sent survives a ``kill -9`` of its server, exactly as with the file store's ``write(2)`` before
each send.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import cbor2
import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from quicsrv_proto import canonical_cbor

from ..engine import TokenLogprobs
from .record import SessionRecord
from .store import (
    AppendOutcome,
    Found,
    RecordIndex,
    SaveQueue,
    StoreHealth,
    StoreUnavailable,
    StoreUsage,
)

__all__ = ["DEFAULT_PREFIX", "RedisSessionStore", "connect", "connect_async", "process_owner_id"]

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "quicsrv:"
PROBE_TIMEOUT_S = 1.0  # a PING slower than this: the store counts as out

# KEYS: lease, meta, tokens. ARGV: owner, lease_ms, meta, expires_at_ms.
_SAVE = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'PXAT', ARGV[4])
redis.call('PEXPIREAT', KEYS[3], ARGV[4])
return 1
"""

# KEYS: lease, tokens. ARGV: owner, lease_ms, bytes already logged, new bytes, expires_at_ms.
# Returns 1, or 0 when another process owns the session, or -1 when the log is not the length
# this process believes (it lost the lease and the session moved on meanwhile).
_APPEND = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
if redis.call('STRLEN', KEYS[2]) ~= tonumber(ARGV[3]) then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('APPEND', KEYS[2], ARGV[4])
redis.call('PEXPIREAT', KEYS[2], ARGV[5])
return 1
"""

# KEYS: lease, meta, tokens. ARGV: owner, lease_ms. Take the session over, whoever owned it,
# and return what the record is at that instant: nothing else can append after the takeover.
_CLAIM = """
local meta = redis.call('GET', KEYS[2])
if not meta then return false end
local previous = redis.call('GET', KEYS[1]) or ''
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {meta, redis.call('GET', KEYS[3]) or '', previous}
"""

# KEYS: lease, meta, tokens. ARGV: expires_at_ms. A deletion: the record and its log go, and the
# lease names nobody's process until the session would have expired, so that a stale copy's
# late write (its owner check) cannot bring the record back.
_DELETE = """
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('SET', KEYS[1], 'deleted', 'PXAT', ARGV[1])
return 1
"""


def connect(url: str, *, timeout_s: float = 5.0, retries: int = 2) -> redis.Redis:
    """A sync client for ``redis://host:port/db`` (or ``unix:///path``); raises
    ``redis.RedisError`` when unreachable (checked once here, so a wrong URL fails at start-up,
    not at the first resume). ``retries`` with a short backoff ride out a Redis restart; the
    ticket store asks for none, since it blocks a handshake on the event loop."""
    client: redis.Redis = redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
    )
    client.ping()
    return client


def connect_async(url: str, *, timeout_s: float = 5.0, retries: int = 2) -> redis.asyncio.Redis:
    """An asyncio client for the same URL, for what the event loop awaits directly: reads that
    order against nothing this process writes (a resume's first look at a record). It connects
    on first use."""
    client: redis.asyncio.Redis = redis.asyncio.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=AsyncRetry(ExponentialBackoff(cap=0.5, base=0.05), retries),
    )
    return client


def process_owner_id() -> str:
    """Names this process in leases: host and pid for people, random bits for uniqueness."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass(slots=True)
class _PendingAppend:
    record: SessionRecord
    offset: int  # tokens logged (or on their way) before these
    data: bytearray
    expires_at_ms: int


class RedisSessionStore:
    """A :class:`~.store.SessionStore` whose records live in Redis: see the module docstring.

    Its in-memory index holds the records this process knows (started, resumed or claimed);
    Redis holds every process's. Removing a record forgets it here only: Redis expires it with
    its session, and another process may still own it.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        owner_id: str,
        lease_s: float,
        ttl_s: float,
        max_sessions: int,
        max_disk_bytes: int,
        clock: Callable[[], float],
        reader: redis.asyncio.Redis | None = None,
        prefix: str = DEFAULT_PREFIX,
    ) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._index = RecordIndex(max_sessions=max_sessions, max_disk_bytes=max_disk_bytes)
        self._writes = SaveQueue()
        self._redis = client
        self._reader = reader
        self.owner_id = owner_id
        self._lease_ms = max(1, int(lease_s * 1000))
        self._prefix = prefix
        self._save_script = client.register_script(_SAVE)
        self._append_script = client.register_script(_APPEND)
        self._claim_script = client.register_script(_CLAIM)
        self._delete_script = client.register_script(_DELETE)
        self._lock = threading.Lock()  # guards _pending: the loop adds, the writer takes
        self._pending: dict[bytes, _PendingAppend] = {}
        self._durable: dict[bytes, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health = StoreHealth("the session store (redis)")
        self.on_appended: Callable[[SessionRecord, AppendOutcome, str], None] | None = None

    # --- what the sessions ask (event loop) ---------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[SessionRecord]:
        """The records this process knows: none at start (nothing walks every record in
        Redis; a session goes on when someone reads it)."""
        return iter(self._index)

    def get(self, session: bytes) -> SessionRecord | None:
        return self._index.get(session)

    def was_expired(self, session: bytes) -> bool:
        return self._index.was_expired(session)

    def usage(self) -> StoreUsage:
        return dataclasses.replace(self._index.usage(), failures=self._health.failures)

    def has_room(self, evictable: Callable[[SessionRecord], bool]) -> bool:
        return self._index.make_room(evictable, self.remove)

    def add(self, record: SessionRecord) -> None:
        self._index.put(record)
        self.save(record)

    def durable_tokens(self, record: SessionRecord) -> int:
        return self._durable.get(record.session_id, len(record.generated))

    def append_token(
        self, record: SessionRecord, token: int, logprobs: TokenLogprobs | None = None
    ) -> None:
        session = record.session_id
        self._durable.setdefault(session, len(record.generated))
        entry = record.add_token(token, logprobs)
        self._index.token_added(len(entry))
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        with self._lock:
            pending = self._pending.get(session)
            first = not self._pending
            if pending is None:
                # Every earlier token is durable or in a batch the writer sends first.
                offset = len(record.generated) - 1
                pending = self._pending[session] = _PendingAppend(
                    record, offset, bytearray(), int(record.expires_at_s * 1000)
                )
            pending.data += entry
            pending.expires_at_ms = int(record.expires_at_s * 1000)
        if first:  # one batch job at a time gathers every session's tokens
            self._writes.submit(self._flush_appends)

    def close_log(self, record: SessionRecord) -> None:
        pass  # nothing held open

    def touch(self, record: SessionRecord) -> None:
        if self._index.owns(record):  # else a stale copy: not ours
            self._index.touched(record, self._clock() + self.ttl_s)
            self.save(record)

    def save(self, record: SessionRecord) -> Future[None]:
        if not self._index.owns(record):
            return self.flush()
        data = canonical_cbor(record.meta())
        self._index.meta_sized(record.session_id, len(data))
        return self._writes.save_latest(
            record.session_id,
            functools.partial(
                self._save_meta, record.session_id, data, int(record.expires_at_s * 1000)
            ),
        )

    def flush(self) -> Future[None]:
        return self._writes.flush()

    def remove(self, session: bytes, *, expired: bool = False) -> None:
        if self._index.pop(session, expired=expired) is not None:
            self._durable.pop(session, None)

    def delete(self, session: bytes) -> None:
        record = self._index.get(session)
        expires_at_ms = int((record.expires_at_s if record else self._clock() + self.ttl_s) * 1000)
        self.remove(session)
        self._writes.submit(self._delete, session, expires_at_ms)

    def expired(self, now_s: float) -> list[SessionRecord]:
        return self._index.expired(now_s)

    async def fetch(self, session: bytes) -> Found | None:
        """With the asyncio client, on the loop (nothing to order it against: whatever the
        check of it decides, the takeover that may follow goes through the writer thread, after
        this process's own writes); without one, on the writer thread."""
        try:
            if self._reader is None:
                return await asyncio.wrap_future(self._writes.submit(self._fetch, session))
            lease, meta, tokens = self._keys(session)
            raw_meta, raw_tokens, owner = await self._reader.mget([meta, tokens, lease])
        except redis.RedisError as exc:
            self._health.failed(exc)
            raise StoreUnavailable(str(exc)) from None
        self._health.answered()
        if raw_meta is None:
            return None
        return self._decode(raw_meta, raw_tokens or b"", owner or b"")

    async def claim(self, session: bytes) -> Found | None:
        """Take the lease over, whoever held it, read the record at that instant and know it
        here, replacing any older copy."""
        try:
            found = await asyncio.wrap_future(self._writes.submit(self._claim, session))
        except redis.RedisError as exc:
            self._health.failed(exc)
            raise StoreUnavailable(str(exc)) from None
        self._health.answered()
        if found is not None:
            record = found.record
            self.remove(record.session_id)
            self._index.put(record, token_bytes=record.entry_bytes * len(record.generated))
            self._durable[record.session_id] = len(record.generated)
        return found

    def outage(self) -> str | None:
        return self._health.outage

    async def probe(self) -> None:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                if self._reader is not None:
                    await self._reader.ping()
                else:
                    await asyncio.to_thread(self._redis.ping)
        except (redis.RedisError, OSError) as exc:  # TimeoutError is an OSError
            self._health.failed(str(exc) or f"no answer to PING in {PROBE_TIMEOUT_S:g} s")
            return
        self._health.answered()

    def close(self) -> None:
        self._writes.shutdown()
        self._redis.close()

    async def aclose(self) -> None:
        """:meth:`close`, and the asyncio client's connections too."""
        if self._reader is not None:
            await self._reader.aclose()
        await asyncio.to_thread(self.close)

    # --- the writer thread --------------------------------------------------------------

    def _keys(self, session: bytes) -> tuple[str, str, str]:
        base = f"{self._prefix}s:{session.hex()}"
        return f"{base}:lease", f"{base}:meta", f"{base}:tok"

    def _save_meta(self, session: bytes, data: bytes, expires_at_ms: int) -> None:
        lease, meta, tokens = self._keys(session)
        try:
            saved = self._save_script(
                keys=[lease, meta, tokens],
                args=[self.owner_id, self._lease_ms, data, expires_at_ms],
            )
        except redis.RedisError as exc:
            self._health.failed(exc)
            log.error("cannot save session %s to redis: %s", session.hex(), exc)
            return
        self._health.answered()
        if not saved:
            log.info("session %s is owned by another process: not saved", session.hex())

    def _delete(self, session: bytes, expires_at_ms: int) -> None:
        lease, meta, tokens = self._keys(session)
        try:
            self._delete_script(keys=[lease, meta, tokens], args=[expires_at_ms])
        except redis.RedisError as exc:
            self._health.failed(exc)
            log.error("cannot delete session %s from redis: %s", session.hex(), exc)
            return
        self._health.answered()

    def _flush_appends(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, {}
        if not batch:
            return
        sessions = list(batch)
        try:
            pipe = self._redis.pipeline(transaction=False)
            for session in sessions:
                pending = batch[session]
                lease, _, tokens = self._keys(session)
                self._append_script(
                    keys=[lease, tokens],
                    args=[
                        self.owner_id,
                        self._lease_ms,
                        pending.offset * pending.record.entry_bytes,
                        bytes(pending.data),
                        pending.expires_at_ms,
                    ],
                    client=pipe,
                )
            results: list[Any] = pipe.execute(raise_on_error=False)
        except redis.RedisError as exc:  # each session's append failed: counted below
            log.error("cannot append tokens to redis: %s", exc)
            results = [exc] * len(sessions)
        else:
            self._health.answered()
        settled: list[tuple[SessionRecord, AppendOutcome, str, int]] = []
        for session, result in zip(sessions, results, strict=True):
            pending = batch[session]
            outcome, problem = AppendOutcome.DURABLE, ""
            if isinstance(result, Exception):
                self._health.failed(result)
                log.error("token append of session %s failed: %s", session.hex(), result)
                outcome, problem = AppendOutcome.FAILED, f"the session store failed: {result}"
            elif result != 1:
                log.info("session %s was taken over by another process", session.hex())
                outcome, problem = AppendOutcome.TAKEN, "another process owns the session"
            done = pending.offset + len(pending.data) // pending.record.entry_bytes
            settled.append((pending.record, outcome, problem, done))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._appended, settled)

    def _fetch(self, session: bytes) -> Found | None:
        lease, meta, tokens = self._keys(session)
        raw_meta, raw_tokens, owner = self._redis.mget([meta, tokens, lease])
        if raw_meta is None:
            return None
        return self._decode(raw_meta, raw_tokens or b"", owner or b"")

    def _claim(self, session: bytes) -> Found | None:
        lease, meta, tokens = self._keys(session)
        found = self._claim_script(keys=[lease, meta, tokens], args=[self.owner_id, self._lease_ms])
        if not found:
            return None
        raw_meta, raw_tokens, owner = found
        return self._decode(raw_meta, raw_tokens, owner)

    def _decode(self, raw_meta: Any, raw_tokens: Any, owner: Any) -> Found:
        record = SessionRecord.from_log(cbor2.loads(bytes(raw_meta)), bytes(raw_tokens))
        owner = owner.decode() if isinstance(owner, bytes) else str(owner)
        return Found(record, owned_here=owner == self.owner_id, owner=owner)

    # --- back on the loop ---------------------------------------------------------------

    def _appended(self, settled: list[tuple[SessionRecord, AppendOutcome, str, int]]) -> None:
        for record, outcome, problem, done in settled:
            session = record.session_id
            if outcome is AppendOutcome.DURABLE and self._index.owns(record):
                self._durable[session] = max(self._durable.get(session, 0), done)
            if self.on_appended is not None:
                self.on_appended(record, outcome, problem)
