"""Finding a session's record and making this process the one that runs it.

Whatever the store, a request about an existing session reads the record, has it checked by
its caller (:mod:`.authorization`), and only then takes the session over: with a shared store
that moves its lease here (the newest reader wins, across processes as within one), and the
record is read again as it stood at that instant. So a peer that cannot show what the check
asks for never moves a session. With the file store nothing needs moving: the record is this
process's already.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from quicsrv_proto import ErrorCode

from .errors import RequestRejected
from .kvstore import KVStore
from .live import LiveSessions
from .record import SessionRecord
from .session import Session
from .store import STORE_RETRY_AFTER_S, Found, SessionStore, StoreUnavailable

__all__ = ["Check", "Custody"]

log = logging.getLogger(__name__)

#: A caller's check of a record found in the store: returns the record it let through, or raises
#: RequestRejected. It is given this process's live session of it, when there is one.
Check = Callable[[SessionRecord | None, Session | None], SessionRecord]


class Custody:
    """See the module docstring."""

    def __init__(
        self,
        *,
        store: SessionStore,
        live: LiveSessions,
        kv: KVStore,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._live = live
        self._kv = kv
        self._clock = clock

    async def take(self, session_id: bytes, check: Check) -> tuple[Session | None, SessionRecord]:
        """Read ``session_id`` from the store, ``check`` it, then make sure this process owns
        it (a shared store's lease taken over, the record as it stood then checked again):
        this process's live session of it, if any, and its record."""
        found = await self.fetch(session_id)
        live = self._live.get(session_id)
        if live is not None and live.stale:
            live = None
        if live is not None and found is not None and found.owned_here:
            return live, check(live.record, live)
        record = check(None if found is None else found.record, None)
        if live is not None:
            # Written elsewhere since: stale. Stopped before the claim, so whatever it still had
            # on its way to the store lands before the claim reads the log.
            live.lose_ownership()
        assert found is not None  # check() refuses a missing record
        claimed = await self._guarded(session_id, self._store.claim)
        if claimed is None:
            raise RequestRejected(ErrorCode.SESSION_EXPIRED, "the session has expired")
        if claimed.record is not record:
            # The log only grows: what was checked is a prefix of what was claimed.
            record = check(claimed.record, None)
        if claimed.owner and not found.owned_here:
            log.info("session %s taken over from %s", session_id.hex(), claimed.owner)
        if not found.owned_here and record.generated and record.end is None:
            # A blob another process paused with, brought here before the answer names the
            # resume path (kv-restore); a big read, so off the loop.
            await asyncio.to_thread(self._kv.pull, session_id, len(record.generated))
        return None, record

    async def fetch(self, session_id: bytes) -> Found | None:
        """The record as the store holds it, without taking it over."""
        return await self._guarded(session_id, self._store.fetch)

    def current(
        self, session_id: bytes, record: SessionRecord | None, session: Session | None
    ) -> SessionRecord:
        """``record`` if it exists and has not expired; raises unknown/expired otherwise."""
        if record is None:
            if self._store.was_expired(session_id):
                raise RequestRejected(ErrorCode.SESSION_EXPIRED, "the session has expired")
            raise RequestRejected(ErrorCode.UNKNOWN_SESSION, "no such session")
        if session is None and record.expires_at_s <= self._clock():
            self.expire(record)
            raise RequestRejected(ErrorCode.SESSION_EXPIRED, "the session has expired")
        return record

    def expire(self, record: SessionRecord) -> None:
        # Only our copy: another process may have touched the session since (shared copies
        # expire with the session in Redis, or by age in the shared directory).
        self._kv.discard(record.session_id, shared=False)
        self._store.remove(record.session_id, expired=True)

    async def _guarded(
        self, session_id: bytes, read: Callable[[bytes], Awaitable[Found | None]]
    ) -> Found | None:
        try:
            return await read(session_id)
        except StoreUnavailable as exc:
            log.error("session %s: session store: %s", session_id.hex(), exc)
            raise RequestRejected(
                ErrorCode.STORE_UNAVAILABLE,
                "the session store cannot be reached",
                STORE_RETRY_AFTER_S,
            ) from None
