"""The sessions this process runs or serves now, each made here, and forgotten once idle.

A session is live while a stream reads it or the engine holds its sequence; then it leaves
the table (its record stays in the store). Stores that settle appends later (a shared store)
report here, to the live copy of the record they settled.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial

from ..engine import Engine
from ..metrics import ServerMetrics, SessionFacts
from ..rate_limits import RateLimiter
from .admission import FairGate
from .inbox import LoopInbox
from .keys import KeyRing
from .kvstore import KVStore
from .record import SessionRecord
from .session import Session
from .settings import FlowSettings
from .store import AppendOutcome, SessionStore

__all__ = ["LiveSessions"]


class LiveSessions:
    """See the module docstring."""

    def __init__(
        self,
        *,
        engine: Engine,
        store: SessionStore,
        kv: KVStore,
        keys: KeyRing,
        flow: FlowSettings,
        gate: FairGate,
        metrics: ServerMetrics,
        rates: RateLimiter,
    ) -> None:
        self._engine = engine
        self._store = store
        self._kv = kv
        self._keys = keys
        self._flow = flow
        self._gate = gate
        self._metrics = metrics
        self._rates = rates
        self._table: dict[bytes, Session] = {}
        self._loop_inbox: LoopInbox | None = None
        store.on_appended = self._appended

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._table.values()))

    def __contains__(self, session_id: bytes) -> bool:
        return session_id in self._table

    def get(self, session_id: bytes) -> Session | None:
        return self._table.get(session_id)

    def facts(self) -> SessionFacts:
        """The sessions' state as the metrics show it."""
        live = list(self._table.values())
        kv, store = self._kv.usage(), self._store.usage()
        return SessionFacts(
            active=self._gate.active,
            queued=self._gate.queued,
            live=len(live),
            paused=sum(1 for s in live if s.paused.is_set() and not s.finished),
            stored=store.sessions,
            store_failures=store.failures,
            kv_bytes=(kv.memory_bytes, kv.disk_bytes),
            kv_blobs=(kv.memory_blobs, kv.disk_blobs),
            refusals=self._gate.refusals,
            slots=self._gate.limits.slots,
            queued_resumes=self._gate.queued - self._gate.queued_new,
            states=Counter(s.state.value for s in live),
            rate_limited=self._rates.refusals,
            rate_limit_clients=len(self._rates),
        )

    def make(self, record: SessionRecord) -> Session:
        """A session object for ``record``, not (yet) in the table: :meth:`add` it once it
        runs or is read. Its generated tokens are charged to its API key's rate limits (when
        it has a key; a new generation's opener may name other ones: :meth:`meter`)."""
        session = Session(
            record,
            engine=self._engine,
            store=self._store,
            kv=self._kv,
            keys=self._keys,
            flow=self._flow,
            loop=asyncio.get_running_loop(),
            inbox=self._inbox(),
            gate=self._gate,
            on_idle=self._forget,
            trace=self._metrics.trace(record.session_id, resumed=bool(record.generated)),
        )
        if record.owner:
            session.meter = self.meter(record.owner)
        return session

    def meter(self, quota_key: str) -> Callable[[int], None]:
        """What charges generated tokens to ``quota_key``'s rate limits."""
        return partial(self._rates.charge_tokens, quota_key)

    def add(self, session: Session) -> Session:
        self._table[session.session_id] = session
        return session

    def _inbox(self) -> LoopInbox:
        """The one inbox of the running loop, shared by every session (made on first use)."""
        loop = asyncio.get_running_loop()
        if self._loop_inbox is None or self._loop_inbox.loop is not loop:
            self._loop_inbox = LoopInbox(loop)
            self._engine.deliver_on(loop)
        return self._loop_inbox

    def _appended(self, record: SessionRecord, outcome: AppendOutcome, problem: str) -> None:
        session = self._table.get(record.session_id)
        if session is None or session.record is not record:
            return  # a copy handed over already
        if outcome is AppendOutcome.DURABLE:
            session.tokens_durable()
            return
        # TAKEN: another process resumed it, our copy is stale. FAILED: the reader may resume
        # once the store is back (the durable tokens are there).
        session.lose_ownership(
            None if outcome is AppendOutcome.TAKEN else "the session store failed; resume later"
        )
        self._store.remove(record.session_id)

    def _forget(self, session: Session) -> None:
        if self._table.get(session.session_id) is session:
            del self._table[session.session_id]
