"""Where session records live: the one :class:`SessionStore` protocol, and what its two
implementations share.

Two stores implement it, as siblings: :class:`~.file_store.FileSessionStore` (files under the
data dir: one process) and :class:`~.redis_store.RedisSessionStore` (Redis: any process that
names it may resume any session). Callers never ask which one they hold: what may cross
processes (:meth:`SessionStore.fetch`, :meth:`SessionStore.claim`) is async for both, and the
file store answers it from memory at once.

Both keep an in-memory index of the records this process knows (:class:`RecordIndex`: bounded
in count and bytes, least recently touched first, with tombstones of expired ids) and write
metadata on one writer thread, in the order asked, a newer save of a session taking the place of
one still queued (:class:`SaveQueue`): never on the event loop's thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, TypeVar

from ..engine import TokenLogprobs
from .record import SessionRecord

__all__ = [
    "AppendOutcome",
    "Found",
    "RecordIndex",
    "SaveQueue",
    "SessionStore",
    "STORE_RETRY_AFTER_S",
    "StoreHealth",
    "StoreUnavailable",
    "StoreUsage",
]

log = logging.getLogger(__name__)

_TOMBSTONES = 65536

T = TypeVar("T")


class StoreUnavailable(Exception):
    """A shared store could not be reached (the message says why)."""


#: The retry hint of ``store_unavailable`` (a reader's ERROR, a refused resume): a shared
#: store's outage is asked about once a second (:meth:`SessionStore.probe`).
STORE_RETRY_AFTER_S = 1.0


class StoreHealth:
    """Whether a shared store answered its last call, for readiness: each call's outcome (any
    thread) sets it, and a change is one log line."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self.outage: str | None = None
        """Why the store could not be used at its last call; None: it answered."""
        self.failures = 0
        """Calls the store failed, in all (``quicsrv_store_failures_total``)."""

    def failed(self, why: object) -> None:
        with self._lock:
            self.failures += 1
            changed, self.outage = self.outage is None, f"{why}"
        if changed:
            log.warning("%s cannot be reached: %s", self._name, why)

    def answered(self) -> None:
        with self._lock:
            changed, self.outage = self.outage is not None, None
        if changed:
            log.info("%s answers again", self._name)


class AppendOutcome(Enum):
    """What became of a batch of a session's appended tokens (a shared store reports it)."""

    DURABLE = "durable"
    """They are stored: a crash of this process loses none of them."""
    TAKEN = "taken"
    """Another process owns the session now: this process's copy is stale."""
    FAILED = "failed"
    """The store failed: what was durable before still is."""


@dataclass(frozen=True, slots=True)
class Found:
    """A record as a store holds it, and whether this process owns it (for the file store,
    always: no other process writes its files)."""

    record: SessionRecord
    owned_here: bool
    owner: str = ""
    """Which process owned it when read ("" if none, or nobody else can)."""


@dataclass(frozen=True, slots=True)
class StoreUsage:
    sessions: int
    disk_bytes: int
    failures: int = 0
    """Operations a shared store failed since start (unreachable, or an error answer): the
    ``quicsrv_store_failures_total`` metric, which the store-unreachable alert watches."""

    def describe(self) -> str:
        return f"sessions {self.sessions} ({self.disk_bytes / 2**20:.2f} MiB on disk)"


class SessionStore(Protocol):
    """Every session this process knows, persisted, bounded in count and bytes, expired by TTL.

    Calls come from the event loop; the slow parts run on the store's own writer thread.
    """

    ttl_s: float
    on_appended: Callable[[SessionRecord, AppendOutcome, str], None] | None
    """Called on the loop once appended tokens are settled, when that is not at once (a shared
    store, a batch later): the outcome, and what went wrong ("" when durable)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[SessionRecord]:
        """The records this process knows (a file store: every one in its data dir)."""

    def get(self, session: bytes) -> SessionRecord | None:
        """This process's copy of a record (None: not known here)."""

    def was_expired(self, session: bytes) -> bool: ...

    def usage(self) -> StoreUsage: ...

    def has_room(self, evictable: Callable[[SessionRecord], bool]) -> bool:
        """Make room for one more session by evicting the stalest evictable ones."""

    def add(self, record: SessionRecord) -> None: ...

    def touch(self, record: SessionRecord) -> None:
        """The session was used: it expires ``ttl_s`` from now."""

    def durable_tokens(self, record: SessionRecord) -> int:
        """How many of the record's tokens a crash would not lose: only those may be sent."""

    def append_token(
        self, record: SessionRecord, token: int, logprobs: TokenLogprobs | None = None
    ) -> None:
        """Record a generated token (and its log-probabilities, where the session keeps them);
        call before the token is sent to anyone."""

    def close_log(self, record: SessionRecord) -> None:
        """Nothing more is appended for now (a file store closes its descriptor)."""

    def save(self, record: SessionRecord) -> Future[None]:
        """Have the record's metadata written, on the writer thread."""

    def flush(self) -> Future[None]:
        """Done when every save and removal asked for so far is done."""

    def remove(self, session: bytes, *, expired: bool = False) -> None:
        """Forget a record here (a shared store keeps its copy for other processes)."""

    def delete(self, session: bytes) -> None:
        """Forget a session for good, at its owner's request: a later lookup finds nothing."""

    def expired(self, now_s: float) -> list[SessionRecord]: ...

    async def fetch(self, session: bytes) -> Found | None:
        """Read a record, to check it or answer about it, without taking it over. Raises
        StoreUnavailable."""

    async def claim(self, session: bytes) -> Found | None:
        """Take the session over for this process (whoever owned it) and know the record as
        it stands at that instant; ``owner`` says who had it until then. Raises
        StoreUnavailable."""

    def outage(self) -> str | None:
        """Why the store cannot be used now, as its last call or probe found (None: it can;
        a file store always can)."""

    async def probe(self) -> None:
        """Ask the store whether it answers (a shared store: PING), for :meth:`outage`;
        never raises."""

    def close(self) -> None:
        """Finish the pending writes and let go of what is held open."""

    async def aclose(self) -> None:
        """:meth:`close`, from the event loop."""


class RecordIndex:
    """The records a process knows, least recently touched first, with their byte counts and
    the ids of those that expired (so a late resume hears "expired", not "unknown")."""

    def __init__(self, *, max_sessions: int, max_disk_bytes: int) -> None:
        self._max_sessions = max_sessions
        self._max_disk_bytes = max_disk_bytes
        self.records: OrderedDict[bytes, SessionRecord] = OrderedDict()
        self._meta_bytes: dict[bytes, int] = {}  # what each record's metadata takes (or soon)
        self._expired: OrderedDict[bytes, None] = OrderedDict()
        self.disk_bytes = 0

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[SessionRecord]:
        return iter(list(self.records.values()))

    def get(self, session: bytes) -> SessionRecord | None:
        return self.records.get(session)

    def owns(self, record: SessionRecord) -> bool:
        """Whether ``record`` is the copy indexed here (not a stale or removed one)."""
        return self.records.get(record.session_id) is record

    def was_expired(self, session: bytes) -> bool:
        return session in self._expired

    def usage(self) -> StoreUsage:
        return StoreUsage(sessions=len(self.records), disk_bytes=self.disk_bytes)

    def has_room(self) -> bool:
        return len(self.records) < self._max_sessions and self.disk_bytes < self._max_disk_bytes

    def make_room(
        self, evictable: Callable[[SessionRecord], bool], remove: Callable[[bytes], None]
    ) -> bool:
        """Evict (by ``remove``) the stalest ``evictable`` records until one more fits."""
        if self.has_room():
            return True  # the usual case, without a walk over every session
        for record in list(self.records.values()):
            if self.has_room():
                break
            if evictable(record):
                log.info("session store full: evicting session %s", record.session_id.hex())
                remove(record.session_id)
        return self.has_room()

    def put(self, record: SessionRecord, *, token_bytes: int = 0) -> None:
        """Index ``record`` (``token_bytes``: what its token log already takes)."""
        self.records[record.session_id] = record
        self.disk_bytes += token_bytes

    def touched(self, record: SessionRecord, expires_at_s: float) -> None:
        record.expires_at_s = expires_at_s
        self.records.move_to_end(record.session_id)

    def meta_sized(self, session: bytes, size: int) -> None:
        """The session's metadata takes ``size`` bytes now."""
        self.disk_bytes += size - self._meta_bytes.get(session, 0)
        self._meta_bytes[session] = size

    def token_added(self, entry_bytes: int) -> None:
        self.disk_bytes += entry_bytes

    def pop(self, session: bytes, *, expired: bool = False) -> SessionRecord | None:
        """Forget ``session`` here; with ``expired``, remember that it expired."""
        record = self.records.pop(session, None)
        if record is None:
            return None
        self.disk_bytes -= self._meta_bytes.pop(session, 0) + record.entry_bytes * len(
            record.generated
        )
        if expired:
            self._expired[session] = None
            while len(self._expired) > _TOMBSTONES:
                self._expired.popitem(last=False)
        return record

    def expired(self, now_s: float) -> list[SessionRecord]:
        return [r for r in self.records.values() if r.expires_at_s <= now_s]


class SaveQueue:
    """One writer thread, so that a store's writes happen in the order asked."""

    def __init__(self) -> None:
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-writer")
        self._lock = threading.Lock()
        self._queued: dict[bytes, tuple[Callable[[], None], Future[None]]] = {}

    def save_latest(self, session: bytes, write: Callable[[], None]) -> Future[None]:
        """Run ``write``, the newest metadata of ``session``. A write of the same session still
        waiting takes its place: a request saves its record up to four times, twice within one
        loop turn, and only the last of each pair needs the disk. The future is done once data
        as new as this is written."""
        with self._lock:  # held across submit: the writer cannot pop before we store
            queued = self._queued.get(session)
            if queued is not None:
                self._queued[session] = (write, queued[1])
                return queued[1]
            future = self._writer.submit(self._run_save, session)
            self._queued[session] = (write, future)
            return future

    def _run_save(self, session: bytes) -> None:
        with self._lock:
            write, _ = self._queued.pop(session)
        write()

    def submit(self, work: Callable[..., T], *args: object) -> Future[T]:
        """Run ``work(*args)`` after everything asked before."""
        return self._writer.submit(work, *args)

    def flush(self) -> Future[None]:
        """Done when everything asked so far is done."""
        return self._writer.submit(lambda: None)

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)
