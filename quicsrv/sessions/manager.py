"""Creating, finding, resuming and expiring sessions: what the front ends ask of this package.

One way in for each: :meth:`SessionManager.open_generation` for a new generation;
:meth:`~SessionManager.resume` (a RESUME_STREAM and its snapshot hash),
:meth:`~SessionManager.reattach` (a caller that authenticated the session id and index another
way, an SSE cursor's MAC), :meth:`~SessionManager.cancel`, :meth:`~SessionManager.delete` and
:meth:`~SessionManager.lookup` for the rest. Whichever store holds the sessions, each of those
reads the record from it, checks it (:mod:`.authorization`), and only then takes the session
over for this process (a shared store moves its lease here), so a peer that cannot show what
the check asks for never moves a session.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import quicsrv_proto
from quicsrv_proto import ErrorCode

from ..engine import Engine
from ..metrics import ServerMetrics, SessionFacts
from ..rate_limits import Quota, RateLimiter
from .admission import FairGate, Place, Slot
from .authorization import check_admit, check_hash, check_owner, reattach_index
from .custody import Custody
from .errors import RequestRejected
from .generation import (
    INLINE_PROMPT_CHARS,
    PreparedRequest,
    PriorTurn,
    build_request,
    prepare_off_loop,
    prompt_chars,
    prompt_length,
)
from .handover import HandOver, hand_over
from .live import LiveSessions
from .persistence import Persistence, open_persistence
from .record import SessionEnd, SessionRecord
from .session import Session
from .settings import SessionSettings
from .store import STORE_RETRY_AFTER_S
from .text import TextAssembler

__all__ = ["SessionManager"]

log = logging.getLogger(__name__)


class SessionManager:
    """See the module docstring. ``persistence``: the store, key ring and KV store (default:
    opened from ``settings``); ``metrics``: the server's instruments (default: a registry of
    its own); ``rates``: the clients' rate-limit buckets (default: on the monotonic clock)."""

    def __init__(
        self,
        engine: Engine,
        settings: SessionSettings,
        *,
        persistence: Persistence | None = None,
        clock: Callable[[], float] = time.time,
        metrics: ServerMetrics | None = None,
        rates: RateLimiter | None = None,
    ) -> None:
        self._engine = engine
        self.settings = settings
        self._clock = clock
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._persistence = (
            persistence if persistence is not None else open_persistence(settings, clock=clock)
        )
        self.store = self._persistence.store
        self.keys = self._persistence.keys
        self.kv = self._persistence.kv
        self.gate = FairGate(settings.admission_limits(engine))
        self.rates = rates if rates is not None else RateLimiter()
        """Every client's requests and generated tokens per minute (:mod:`quicsrv.rate_limits`)."""
        self._live = LiveSessions(
            engine=engine,
            store=self.store,
            kv=self.kv,
            keys=self.keys,
            flow=settings.flow,
            gate=self.gate,
            metrics=self.metrics,
            rates=self.rates,
        )
        self._custody = Custody(store=self.store, live=self._live, kv=self.kv, clock=clock)
        self.accepting = True
        """Whether generations open and resume here: until the hand-over begins."""

    @property
    def engine(self) -> Engine:
        """The engine the sessions run on (the token endpoints read its vocabulary)."""
        return self._engine

    def live(self, session_id: bytes) -> Session | None:
        """The session's live object, if it runs or is attached (tests and stats)."""
        return self._live.get(session_id)

    def usage(self) -> str:
        return (
            f"{self.store.usage().describe()}, {len(self._live)} live, {self.kv.usage().describe()}"
        )

    def check_accepting(self) -> None:
        """Raise ``shutting_down`` once the hand-over began: the one place that says it."""
        if not self.accepting:
            raise RequestRejected(ErrorCode.SHUTTING_DOWN, "the server is shutting down")

    def facts(self) -> SessionFacts:
        """The state the metrics show, read at each scrape."""
        return self._live.facts()

    # --- new generations ----------------------------------------------------------------

    async def open_generation(
        self,
        frame: quicsrv_proto.Generate,
        *,
        client: str,
        owner: str,
        arrived_at: float,
        prior: PriorTurn | None = None,
        api: Callable[[PreparedRequest], dict[str, Any]] | None = None,
        unattended: bool = False,
        quota: Quota | None = None,
    ) -> Session:
        """A new generation, from a GENERATE to a session whose record is on disk: the one way
        every front end opens one. Spends a request of ``quota``'s rate limits (raises
        RateLimited when they are spent: nothing else is done), checks and tokenizes it (a
        long prompt off the loop), takes ``client``'s place in line for a slot, starts it for
        ``owner`` (the API key id, or "") or leaves it waiting its fair turn
        (:meth:`Session.enter_line`, bounded from ``arrived_at``, the loop's clock), and
        returns once its record is on disk, so that whoever learns the session id can resume
        it, even after a kill -9 of this process.
        Raises RequestRejected or EngineError for what is known at once (a bad request, the
        client's or the server's queue full, an engine refusal); what happens in line reaches
        the session's reader.

        Cancelling it (its peer went away) gives back what it holds: its place in line, its
        slot, or the compute of the session it started (which stays resumable).

        A front end may continue a stored chat turn (``prior``), keep its own fields with the
        record (``api``: made from the prepared request, saved with the record's first write)
        and have the session run to its end with nobody reading (``unattended``).
        """
        if quota is not None:
            self.rates.admit(quota)
        prepared = await prepare_off_loop(self.prepare, frame, prior)
        self.check_accepting()
        place = self.gate.queue(client)
        try:
            session = self._open(
                frame,
                prepared,
                place,
                owner=owner,
                arrived_at=arrived_at,
                api=None if api is None else api(prepared),
                unattended=unattended,
            )
        except BaseException:
            place.leave()
            raise
        if quota is not None and quota.key != session.record.owner:
            # Before any token: they reach the session through the loop, after this returns.
            session.meter = self._live.meter(quota.key)
        try:
            await self.persisted()
        except asyncio.CancelledError:
            session.abandon()
            raise
        return session

    def prepare(
        self, frame: quicsrv_proto.Generate, prior: PriorTurn | None = None
    ) -> PreparedRequest:
        """Check a GENERATE against the limits and tokenize its prompt (rendering the chat
        template first): the slow, pure part of a start, safe to run on any thread."""
        return build_request(
            self._engine, frame, max_tokens_limit=self.settings.max_tokens_limit, prior=prior
        )

    def start(
        self,
        frame: quicsrv_proto.Generate,
        request: PreparedRequest | None = None,
        *,
        slot: Slot,
        owner: str = "",
        arrived_at: float | None = None,
        api: dict[str, Any] | None = None,
        unattended: bool = False,
    ) -> Session:
        """Validate, record and submit a GENERATE under ``slot`` (``request``: its
        :meth:`prepare` result, made here when not given; ``owner``: the API key id that
        started it; ``arrived_at``: when the request arrived, on the loop's clock, for the
        time to first token); raises RequestRejected or the engine's EngineError (the front
        end maps either to its wire code), the slot then given back."""
        try:
            return self._record(
                frame,
                request,
                owner,
                lambda session: session.start(slot, arrived_at),
                api=api,
                unattended=unattended,
            )
        except BaseException:
            slot.release()
            raise

    def _open(
        self,
        frame: quicsrv_proto.Generate,
        request: PreparedRequest,
        place: Place,
        *,
        owner: str,
        arrived_at: float,
        api: dict[str, Any] | None,
        unattended: bool,
    ) -> Session:
        """Start the generation at once if ``place`` has its slot, else leave it in line."""
        slot = place.take()
        if slot is not None:
            return self.start(
                frame,
                request,
                slot=slot,
                owner=owner,
                arrived_at=arrived_at,
                api=api,
                unattended=unattended,
            )
        timeout_s = self.settings.queue_wait_s(
            frame.deadline_ms, asyncio.get_running_loop().time() - arrived_at
        )
        if unattended and frame.deadline_ms is None:
            # Nobody waits on a background response: it waits its turn as long as it lives.
            timeout_s = self.settings.ttl_s
        return self._record(
            frame,
            request,
            owner,
            lambda session: session.enter_line(place, arrived_at=arrived_at, timeout_s=timeout_s),
            api=api,
            unattended=unattended,
        )

    def _record(
        self,
        frame: quicsrv_proto.Generate,
        prepared: PreparedRequest | None,
        owner: str,
        begin: Callable[[Session], None],
        *,
        api: dict[str, Any] | None = None,
        unattended: bool = False,
    ) -> Session:
        """A new session for ``frame``, begun by ``begin`` (which may refuse by raising),
        then recorded in the store and the live table."""
        if prepared is None:
            prepared = self.prepare(frame)
        if not self.store.has_room(lambda r: r.session_id not in self._live):
            raise RequestRejected(
                ErrorCode.OVERLOADED,
                "the session store is full of live sessions",
                self.gate.retry_after_s(self.gate.active, self.gate.limits.slots),
            )
        now = self._clock()
        record = SessionRecord(
            # 128 random bits: unguessable, so a session can only be named by whoever was told.
            session_id=secrets.token_bytes(quicsrv_proto.SESSION_ID_BYTES),
            model_digest=self._engine.model_digest,
            spec=prepared.spec,
            created_at_s=now,
            expires_at_s=now + self.settings.ttl_s,
            owner=owner,
            api=api,
            unattended=unattended,
        )
        session = self._live.make(record)
        begin(session)  # an engine refusal goes to the caller as it is
        self.store.add(record)
        self._live.add(session)
        if unattended:
            session.run_unattended()
        return session

    async def persisted(self) -> None:
        """Until every session record write asked for so far is on disk."""
        await asyncio.wrap_future(self.store.flush())

    # --- what exists: resume, reattach, stop, read, forget -------------------------------

    async def resume(
        self,
        frame: quicsrv_proto.ResumeStream,
        header_session: bytes | None,
        *,
        key_id: str | None = None,
    ) -> Session:
        """Check a RESUME_STREAM and take the session for this process; the caller then
        attaches at ``frame.last_index + 1``. ``key_id``: the API key the request presented
        (None on an open server); a session started with a key resumes only with that key."""

        def check(record: SessionRecord | None, session: Session | None) -> SessionRecord:
            record = self._custody.current(frame.session_id, record, session)
            check_hash(frame, header_session, record, self.keys.verifying_keys(self._clock()))
            self._admit(record, session, frame.last_index + 1, key_id)
            return record

        return self._run_here(*await self._custody.take(frame.session_id, check))

    async def reattach(
        self, session_id: bytes, from_index: int, *, key_id: str | None = None
    ) -> Session:
        """Like :meth:`resume`, for a caller that already authenticated ``session_id`` and
        ``from_index`` by other means (an SSE cursor's MAC): every check but the hash.
        ``from_index`` may equal the recorded token count (nothing to replay, wait for more
        or only the END); past it, on an ended session, it means the reader had every token.
        """

        def check(record: SessionRecord | None, session: Session | None) -> SessionRecord:
            record = self._custody.current(session_id, record, session)
            self._admit(record, session, reattach_index(record, from_index), key_id)
            return record

        return self._run_here(*await self._custody.take(session_id, check))

    async def cancel(self, session_id: bytes, *, key_id: str | None = None) -> SessionEnd:
        """End a generation for good (an explicit stop): the engine sequence and its saved KV
        go, a reader gets the tokens so far and END(cancelled). A finished session is left as
        it is. Returns how the session ended; raises unknown/expired/key mismatch."""

        def check(record: SessionRecord | None, session: Session | None) -> SessionRecord:
            record = self._custody.current(session_id, record, session)
            check_owner(record, key_id)
            return record

        session, record = await self._custody.take(session_id, check)
        if record.end is None:
            if session is None:  # paused, nobody reading: end the record all the same
                session = self._live.make(record)
            session.cancel()
        assert record.end is not None
        return record.end

    async def delete(self, session_id: bytes, *, key_id: str | None = None) -> None:
        """Stop a session if it runs and forget it for good (its owner asked): its record,
        token log and saved KV cells go, from a shared store too."""
        await self.cancel(session_id, key_id=key_id)
        self.store.delete(session_id)
        self.kv.discard(session_id)
        await self.persisted()

    async def lookup(self, session_id: bytes, *, key_id: str | None = None) -> SessionRecord:
        """The record of ``session_id`` as it stands, to read, not to run: this process's copy
        when it runs the session, else what the store holds. Raises unknown, expired or key
        mismatch."""
        live = self._live.get(session_id)
        if live is not None and not live.stale:
            record = live.record
        else:
            found = await self._custody.fetch(session_id)
            record = self._custody.current(
                session_id, None if found is None else found.record, None
            )
        check_owner(record, key_id)
        return record

    def piece(self, token_id: int) -> bytes:
        """A token's bytes, in the served model's vocabulary."""
        return self._engine.piece(token_id)

    def text_of(self, record: SessionRecord, upto: int | None = None) -> str:
        """The text of a record's answer: of its first ``upto`` tokens, as a stream sent it
        (what a stop sequence may still match held back), or else all of it."""
        text = TextAssembler(record.spec.stop)
        tokens = record.generated if upto is None else record.generated[:upto]
        parts = [text.push(self._engine.piece(token)) for token in tokens]
        if upto is None and record.end is not None:
            parts.append(text.finish())
        return "".join(parts)

    def matched_stop(self, record: SessionRecord) -> str | None:
        """The stop sequence that ended a record's text (None: none did, or not yet)."""
        text = TextAssembler(record.spec.stop)
        for token in record.generated:
            text.push(self._engine.piece(token))
            if text.stopped:
                break
        return text.matched

    async def count_prompt_tokens(self, frame: quicsrv_proto.Generate) -> int:
        """How many tokens the prompt of ``frame`` would be as a generation's (its chat
        template applied), without starting one; a long prompt is tokenized off the loop."""
        if prompt_chars(frame) <= INLINE_PROMPT_CHARS:
            return prompt_length(self._engine, frame)
        return await asyncio.to_thread(prompt_length, self._engine, frame)

    def run_unattended_again(self) -> int:
        """Start again the unattended sessions (background responses) that the previous
        process left unfinished in this store; how many. (A shared store knows none at start:
        there a session goes on when someone reads it, no process walks every record.)"""
        started = 0
        for record in self.store:
            if record.unattended and record.end is None and record.session_id not in self._live:
                if record.model_digest != self._engine.model_digest:
                    continue
                session = self._run_here(None, record)
                session.run_unattended()
                started += 1
        return started

    def _run_here(self, session: Session | None, record: SessionRecord) -> Session:
        """The live session of ``record`` (made if there is none yet)."""
        return session if session is not None else self._live.add(self._live.make(record))

    def _admit(
        self, record: SessionRecord, session: Session | None, from_index: int, key_id: str | None
    ) -> None:
        check_admit(
            record,
            from_index=from_index,
            key_id=key_id,
            model_digest=self._engine.model_digest,
            read_elsewhere=session is not None and session.attached,
            on_conflict=self.settings.on_conflict,
        )

    # --- upkeep -------------------------------------------------------------------------

    def sweep(self) -> int:
        """Remove expired sessions that nobody reads, from memory and disk."""
        expired = [r for r in self.store.expired(self._clock()) if r.session_id not in self._live]
        for record in expired:
            self._custody.expire(record)
        return len(expired)

    async def run_sweeper(self, interval_s: float) -> None:
        """Expire sessions every ``interval_s``, logging the store's usage whenever it
        changed; and ask the store whether it answers every :data:`STORE_RETRY_AFTER_S`
        (``/readyz`` says so while a shared store is out, even with no traffic)."""
        async with asyncio.TaskGroup() as chores:
            chores.create_task(self._sweep_every(interval_s))
            chores.create_task(self._probe_every(STORE_RETRY_AFTER_S))

    async def _probe_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)  # a periodic chore, not synchronisation
            await self.store.probe()

    async def _sweep_every(self, interval_s: float) -> None:
        logged = ""
        while True:
            await asyncio.sleep(interval_s)  # a periodic chore, not synchronisation
            await asyncio.to_thread(self._refresh_shared)
            removed = self.sweep()
            usage = self.usage()
            if usage != logged or removed:
                log.info("store usage: %s (expired %d)", usage, removed)
                logged = usage

    def _refresh_shared(self) -> None:
        """What other processes may have changed: a rotation of a shared key ring, and old
        shared KV files left by killed processes (blocking)."""
        self.keys.refresh()
        self.kv.sweep_shared()

    def shutdown(self) -> None:
        """Pause every engine sequence with its KV cells captured, never to restart here; no
        generation opens from now on. :meth:`hand_over` finishes the job."""
        self.accepting = False
        for session in list(self._live):
            session.pause_for_shutdown()

    async def hand_over(self, grace_s: float) -> HandOver:
        """After :meth:`shutdown`: give every session to the next process (:mod:`.handover`)."""
        return await hand_over(
            list(self._live),
            kv=self.kv,
            persisted=self.persisted,
            grace_s=grace_s,
            engine_health=self._engine.health,
        )

    def close(self) -> None:
        self._persistence.close()

    async def aclose(self) -> None:
        """:meth:`close` from the event loop (a shared store's asyncio client closes too)."""
        await self._persistence.aclose()
