"""Creating, finding, resuming and expiring sessions: what the transport asks of this package.

A resume is checked in an order that tells an unauthenticated peer nothing: unknown or expired
session first (the id alone is unguessable), then the snapshot hash (constant-time, every live
key), and only then what the hash holder may learn: model changed, index beyond the snapshot,
session busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

import quicsrv_proto
from quicsrv_proto import ErrorCode

from ..engine import Engine
from ..metrics import ServerMetrics
from .admission import AdmissionLimits, FairGate, Place, Slot
from .generation import (
    INLINE_PROMPT_CHARS,
    PreparedRequest,
    PriorTurn,
    RequestRejected,
    build_request,
    prompt_chars,
)
from .inbox import LoopInbox
from .keys import KeyRing, SharedKeyRing
from .kvstore import KVStore
from .lifecycle import ResumeConflict
from .redis_store import RedisSessionStore, connect, connect_async, process_owner_id
from .session import FlowSettings, Session
from .shared_kv import SharedKV
from .store import SessionEnd, SessionRecord, SessionStore
from .text import TextAssembler

__all__ = ["HandOver", "SessionManager", "SessionSettings"]

log = logging.getLogger(__name__)

KEYRING_KEY = "quicsrv:mac-keys"


@dataclass(frozen=True, slots=True, kw_only=True)
class HandOver:
    """What a shutdown left for the next process (logged at the end of the hand-over)."""

    paused: int
    """Generations the engine was running, paused for the hand-over."""
    kv_saved: int
    """Open sessions whose KV cells were saved: they resume by restoring them."""
    replay: int
    """Paused generations whose pause did not land in the grace period: they resume by replay."""
    streams_told: int
    """Reader streams ended with END(shutdown)."""

    def describe(self) -> str:
        return (
            f"{self.paused} generations paused, KV cells of {self.kv_saved} open sessions "
            f"saved, {self.replay} left to replay, {self.streams_told} streams told to resume"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionSettings:
    """Derived from :class:`quicsrv.config.ServerConfig` (``session_settings()``), which holds
    the defaults."""

    data_dir: Path
    ttl_s: float
    max_sessions: int
    max_disk_bytes: int
    kv_memory_budget_bytes: int
    kv_disk_budget_bytes: int
    max_tokens_limit: int
    on_conflict: ResumeConflict
    mac_key: bytes | None
    flow: FlowSettings
    max_active_per_client: int
    """0: three quarters of the engine's slots (at least 1), so one client never takes all."""
    max_queued_per_client: int
    """0: a quarter of the engine's queue (at least 1)."""
    max_queue_wait_s: float
    """A new request that cannot start within this long ends with ``deadline_exceeded``."""
    store_url: str
    """Where records, token logs and MAC keys live: "" (or "file"): under ``data_dir``;
    ``redis://host:port/db``: in Redis, shared by every process that names it."""
    lease_s: float
    """With Redis: how long a process owns a session after its last write to it."""
    kv_redis_max_bytes: int
    """With Redis: paused KV blobs up to this size are shared through Redis."""
    kv_shared_dir: Path | None
    """With Redis: larger blobs are shared here (None: not shared; a resume elsewhere replays)."""
    previous_key_ttl_s: float = 86400.0
    """How long a rotated-out MAC key still verifies (``quicsrv keys rotate`` sets its own)."""

    def admission_limits(self, engine: Engine) -> AdmissionLimits:
        slots, queue = engine.n_seq_max, engine.max_queued
        return AdmissionLimits(
            slots=slots,
            max_queued=queue,
            max_active_per_client=self.max_active_per_client or max(1, slots * 3 // 4),
            max_queued_per_client=self.max_queued_per_client or max(1, queue // 4),
        )


class SessionManager:
    def __init__(
        self,
        engine: Engine,
        settings: SessionSettings,
        *,
        clock: Callable[[], float] = time.time,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self._engine = engine
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.metrics.bind_sessions(self)
        self.settings = settings
        self._clock = clock
        self.redis: redis.Redis | None = None
        """The shared store's client (None: the file store)."""
        self.store: SessionStore
        if settings.store_url not in ("", "file"):
            self.redis = connect(settings.store_url)
            self.store = RedisSessionStore(
                self.redis,
                owner_id=process_owner_id(),
                lease_s=settings.lease_s,
                ttl_s=settings.ttl_s,
                max_sessions=settings.max_sessions,
                max_disk_bytes=settings.max_disk_bytes,
                clock=clock,
                reader=connect_async(settings.store_url),
            )
            self.store.on_appended = self._on_appended
        else:
            self.store = SessionStore(
                settings.data_dir / "sessions",
                ttl_s=settings.ttl_s,
                max_sessions=settings.max_sessions,
                max_disk_bytes=settings.max_disk_bytes,
                clock=clock,
            )
        if settings.mac_key is not None:
            self.keys = KeyRing.from_secret(settings.mac_key)
        elif self.redis is not None:
            self.keys = SharedKeyRing(
                self.redis, KEYRING_KEY, previous_key_ttl_s=settings.previous_key_ttl_s
            )
        else:
            self.keys = KeyRing.load_or_create(
                settings.data_dir / "mac-keys.json",
                previous_key_ttl_s=settings.previous_key_ttl_s,
            )
        shared_kv = None
        if self.redis is not None:
            shared_kv = SharedKV(
                self.redis,
                redis_max_bytes=settings.kv_redis_max_bytes,
                shared_dir=settings.kv_shared_dir,
                ttl_s=settings.ttl_s,
            )
        self.kv = KVStore(
            settings.data_dir / "kv",
            memory_budget_bytes=settings.kv_memory_budget_bytes,
            disk_budget_bytes=settings.kv_disk_budget_bytes,
            shared=shared_kv,
        )
        self._live: dict[bytes, Session] = {}
        self._shutting_down = False
        self._loop_inbox: LoopInbox | None = None
        self.gate = FairGate(settings.admission_limits(engine))

    @property
    def shared(self) -> bool:
        """Whether other processes share these sessions (resumes: :meth:`resume_shared`)."""
        return isinstance(self.store, RedisSessionStore)

    def live(self, session_id: bytes) -> Session | None:
        """The session's live object, if it runs or is attached (tests and stats)."""
        return self._live.get(session_id)

    def live_sessions(self) -> list[Session]:
        """Every session running or read now (metrics)."""
        return list(self._live.values())

    def usage(self) -> str:
        return (
            f"{self.store.usage().describe()}, {len(self._live)} live, {self.kv.usage().describe()}"
        )

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
    ) -> Session:
        """A new generation, from a GENERATE to a session whose record is on disk: the one way
        every front end opens one. Checks and tokenizes it (a long prompt off the loop), takes
        ``client``'s place in line for a slot, starts it for ``owner`` (the API key id, or "")
        or leaves it waiting its fair turn (:meth:`Session.enter_line`, bounded from
        ``arrived_at``, the loop's clock), and returns once its record is on disk, so that
        whoever learns the session id can resume it, even after a kill -9 of this process.
        Raises RequestRejected or EngineError for what is known at once (a bad request, the
        client's or the server's queue full, an engine refusal); what happens in line reaches
        the session's reader.

        Cancelling it (its peer went away) gives back what it holds: its place in line, its
        slot, or the compute of the session it started (which stays resumable).

        A front end may continue a stored chat turn (``prior``), keep its own fields with the
        record (``api``: made from the prepared request, saved with the record's first write)
        and have the session run to its end with nobody reading (``unattended``).
        """
        prepared = await self.prepare_off_loop(frame, prior)
        if self._shutting_down:
            raise RequestRejected(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
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

    async def prepare_off_loop(
        self, frame: quicsrv_proto.Generate, prior: PriorTurn | None = None
    ) -> PreparedRequest:
        """:meth:`prepare` on a thread, except for a short prompt: tokenizing one takes tens
        of microseconds, the trip to a thread and back a millisecond or more of the time to
        first token (measured on 2 busy cores). A long one would hold up every other stream."""
        if prompt_chars(frame) <= INLINE_PROMPT_CHARS and prior is None and not frame.json_schema:
            return self.prepare(frame)
        return await asyncio.to_thread(self.prepare, frame, prior)

    def queue_wait_s(self, deadline_ms: int | None, arrived_at: float) -> float:
        """How much longer a new request may wait for a slot: the server's
        ``max_queue_wait_s`` and the request's ``deadline_ms``, both from its arrival."""
        bound_s = self.settings.max_queue_wait_s
        if deadline_ms is not None:
            bound_s = min(bound_s, deadline_ms / 1000)
        return max(0.0, bound_s - (asyncio.get_running_loop().time() - arrived_at))

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
        timeout_s = self.queue_wait_s(frame.deadline_ms, arrived_at)
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
        request = prepared.sequence
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
            prompt_tokens=request.prompt_tokens,
            sampling=request.sampling,
            max_tokens=request.max_tokens,
            stop=frame.stop,
            ignore_eos=request.ignore_eos,
            prefill_chunk=self._engine.prefill_chunk,
            created_at_s=now,
            expires_at_s=now + self.settings.ttl_s,
            owner=owner,
            api=api,
            unattended=unattended,
            grammar=prepared.grammar,
        )
        session = self._session(record)
        begin(session)  # an engine refusal goes to the caller as it is
        self.store.add(record)
        self._live[record.session_id] = session
        if unattended:
            session.run_unattended()
        return session

    async def persisted(self) -> None:
        """Until every session record write asked for so far is on disk."""
        await asyncio.wrap_future(self.store.flush())

    # --- resumes ------------------------------------------------------------------------

    def resume(
        self,
        frame: quicsrv_proto.ResumeStream,
        header_session: bytes | None,
        *,
        key_id: str | None = None,
    ) -> Session:
        """Check a RESUME_STREAM; the caller then attaches at ``frame.last_index + 1``.

        ``key_id``: the API key the request presented (None on an open server); a session
        started with a key resumes only with that key.
        """
        session = self._live.get(frame.session_id)
        record = session.record if session is not None else self.store.get(frame.session_id)
        self._check_resume(frame, header_session, record, session, key_id)
        assert record is not None
        if session is None:
            session = self._session(record)
            self._live[frame.session_id] = session
        return session

    async def resume_shared(
        self,
        frame: quicsrv_proto.ResumeStream,
        header_session: bytes | None,
        *,
        key_id: str | None = None,
    ) -> Session:
        """:meth:`resume` with the Redis store: the record is read from Redis, checked, and
        only then taken over (its lease moved here), so a peer that cannot show the snapshot
        hash never moves a session. A copy of it still live here but owned elsewhere meanwhile
        is stale: it is handed over and replaced."""

        def check(record: SessionRecord | None) -> None:
            self._check_resume(frame, header_session, record, None, key_id)

        return await self._take_over(
            frame.session_id, check, lambda: self.resume(frame, header_session, key_id=key_id)
        )

    async def reattach_anywhere(
        self, session_id: bytes, from_index: int, *, key_id: str | None = None
    ) -> Session:
        """:meth:`reattach`, taking the session over from another process when the store is
        shared (an SSE reader may reconnect to any of them)."""
        if not self.shared:
            return self.reattach(session_id, from_index, key_id=key_id)

        def check(record: SessionRecord | None) -> None:
            record = self._require_current(session_id, record, None)
            self._check_admit(None, record, _reattach_index(record, from_index), key_id)

        return await self._take_over(
            session_id, check, lambda: self.reattach(session_id, from_index, key_id=key_id)
        )

    async def cancel_anywhere(self, session_id: bytes, *, key_id: str | None = None) -> SessionEnd:
        """:meth:`cancel`, taking the session over first when the store is shared."""
        if self.shared:

            def check(record: SessionRecord | None) -> None:
                _check_owner(self._require_current(session_id, record, None), key_id)

            await self._take_over(session_id, check, lambda: self._find(session_id)[0])
        return self.cancel(session_id, key_id=key_id)

    async def _take_over(
        self,
        session_id: bytes,
        check: Callable[[SessionRecord | None], None],
        here: Callable[[], Session | None],
    ) -> Session:
        """Read ``session_id`` from Redis, ``check`` it, then claim its lease for this process
        (``here()`` when this process owns it already). ``check`` raises to refuse."""
        store = self.store
        assert isinstance(store, RedisSessionStore)
        try:
            fetched = await store.fetch(session_id)
            live = self._live.get(session_id)
            if live is not None and not live.handed_over:
                if fetched is not None and fetched.owner == store.owner_id:
                    session = here()
                    if session is not None:
                        return session
            check(fetched.record if fetched is not None else None)
            if live is not None and not live.handed_over:
                # Written elsewhere since: stale. Stopped before the claim, so whatever it
                # still had on its way to Redis lands before the claim reads the log.
                live.hand_over()
            claimed = await asyncio.wrap_future(store.claim(session_id))
        except redis.RedisError as exc:
            raise _store_unreachable(session_id, exc) from None
        if claimed is None:
            raise RequestRejected(ErrorCode.SESSION_EXPIRED, "the session has expired")
        # The log only grows: what was checked above is a prefix of what was claimed.
        check(claimed.record)
        if claimed.owner and claimed.owner != store.owner_id:
            log.info("session %s taken over from %s", session_id.hex(), claimed.owner)
        store.adopt(claimed.record)
        if claimed.record.generated and claimed.record.end is None:
            # A blob another process paused with, brought here before the answer names the
            # resume path (kv-restore); a big read, so off the loop.
            await asyncio.to_thread(self.kv.pull, session_id, len(claimed.record.generated))
        session = self._session(claimed.record)
        self._live[session_id] = session
        return session

    def _check_resume(
        self,
        frame: quicsrv_proto.ResumeStream,
        header_session: bytes | None,
        record: SessionRecord | None,
        session: Session | None,
        key_id: str | None,
    ) -> None:
        if header_session is not None and header_session != frame.session_id:
            raise RequestRejected(
                ErrorCode.INVALID_FIELD, "the quicsrv-session header and RESUME_STREAM disagree"
            )
        record = self._require_current(frame.session_id, record, session)
        # The hash names a prefix the server persisted before telling anyone its hash, so a
        # hash index past what is recorded cannot be genuine.
        hash_index = frame.checkpoint_index
        valid = hash_index < len(record.generated) and record.snapshot(upto=hash_index + 1).verify(
            self.keys.verifying_keys(self._clock()), hash_index, frame.snapshot_hash
        )
        if not valid:
            raise RequestRejected(
                ErrorCode.HASH_MISMATCH, "the snapshot hash does not verify for this session"
            )
        self._check_admit(session, record, frame.last_index + 1, key_id)

    def reattach(self, session_id: bytes, from_index: int, *, key_id: str | None = None) -> Session:
        """Like :meth:`resume`, for a caller that already authenticated ``session_id`` and
        ``from_index`` by other means (an SSE cursor's MAC): every check but the hash.
        ``from_index`` may equal the recorded token count (nothing to replay, wait for more
        or only the END); past it, on an ended session, it means the reader had every token.
        """
        session, record = self._find(session_id)
        self._check_admit(session, record, _reattach_index(record, from_index), key_id)
        if session is None:
            session = self._session(record)
            self._live[record.session_id] = session
        return session

    async def lookup(self, session_id: bytes, *, key_id: str | None = None) -> SessionRecord:
        """The record of ``session_id`` as it stands, to read, not to run: this process's copy
        when it owns the session, else (a shared store) what Redis holds. Raises unknown,
        expired or key mismatch."""
        if self.shared:
            live = self._live.get(session_id)
            if live is None or live.handed_over:
                store = self.store
                assert isinstance(store, RedisSessionStore)
                try:
                    fetched = await store.fetch(session_id)
                except redis.RedisError as exc:
                    raise _store_unreachable(session_id, exc) from None
                record = self._require_current(
                    session_id, fetched.record if fetched is not None else None, None
                )
                _check_owner(record, key_id)
                return record
        _, record = self._find(session_id)
        _check_owner(record, key_id)
        return record

    def text_of(self, record: SessionRecord, upto: int | None = None) -> str:
        """The text of a record's answer: of its first ``upto`` tokens, as a stream sent it
        (what a stop sequence may still match held back), or else all of it."""
        text = TextAssembler(record.stop)
        tokens = record.generated if upto is None else record.generated[:upto]
        parts = [text.push(self._engine.piece(token)) for token in tokens]
        if upto is None and record.end is not None:
            parts.append(text.finish())
        return "".join(parts)

    async def delete_anywhere(self, session_id: bytes, *, key_id: str | None = None) -> None:
        """Stop a session if it runs and forget it for good (its owner asked): its record,
        token log and saved KV cells go, from the shared store too."""
        await self.cancel_anywhere(session_id, key_id=key_id)
        self.store.delete(session_id)
        self.kv.discard(session_id)
        await self.persisted()

    def run_unattended_again(self) -> int:
        """Start again the unattended sessions (background responses) that the previous
        process left unfinished in this data dir; how many. (With the shared store a session
        goes on when someone reads it: no process walks every record in Redis.)"""
        if self.shared:
            return 0
        started = 0
        for record in self.store:
            if record.unattended and record.end is None and record.session_id not in self._live:
                if record.model_digest != self._engine.model_digest:
                    continue
                session = self._session(record)
                self._live[record.session_id] = session
                session.run_unattended()
                started += 1
        return started

    def cancel(self, session_id: bytes, *, key_id: str | None = None) -> SessionEnd:
        """End a generation for good (an explicit stop): the engine sequence and its saved KV
        go, a reader gets the tokens so far and END(cancelled). A finished session is left as
        it is. Returns how the session ended; raises unknown/expired/key mismatch."""
        session, record = self._find(session_id)
        _check_owner(record, key_id)
        if record.end is None:
            if session is None:  # paused on disk, nobody reading: end the record all the same
                session = self._session(record)
            session.cancel()
        assert record.end is not None
        return record.end

    def _find(self, session_id: bytes) -> tuple[Session | None, SessionRecord]:
        """The live session (if any) and record of ``session_id``; raises unknown/expired."""
        session = self._live.get(session_id)
        record = session.record if session is not None else self.store.get(session_id)
        return session, self._require_current(session_id, record, session)

    def _require_current(
        self, session_id: bytes, record: SessionRecord | None, session: Session | None
    ) -> SessionRecord:
        """``record`` if it exists and has not expired; raises unknown/expired otherwise."""
        if record is None:
            if self.store.was_expired(session_id):
                raise RequestRejected(ErrorCode.SESSION_EXPIRED, "the session has expired")
            raise RequestRejected(ErrorCode.UNKNOWN_SESSION, "no such session")
        if session is None and record.expires_at_s <= self._clock():
            self._expire(record)
            raise RequestRejected(ErrorCode.SESSION_EXPIRED, "the session has expired")
        return record

    def _check_admit(
        self,
        session: Session | None,
        record: SessionRecord,
        from_index: int,
        key_id: str | None,
    ) -> None:
        """The checks only an authenticated resumer may learn the outcome of."""
        _check_owner(record, key_id)
        if record.model_digest != self._engine.model_digest:
            raise RequestRejected(
                ErrorCode.MODEL_CHANGED, "the server runs a different model than the session's"
            )
        if from_index > len(record.generated):
            raise RequestRejected(
                ErrorCode.INDEX_BEYOND_SNAPSHOT,
                f"last_index {from_index - 1} is beyond the snapshot "
                f"({len(record.generated)} tokens)",
            )
        if session is not None and session.attached:
            if self.settings.on_conflict is ResumeConflict.REFUSE:
                raise RequestRejected(
                    ErrorCode.SESSION_BUSY, "another stream is reading this session"
                )

    # --- upkeep -------------------------------------------------------------------------

    def sweep(self) -> int:
        """Remove expired sessions that nobody reads, from memory and disk."""
        expired = [r for r in self.store.expired(self._clock()) if r.session_id not in self._live]
        for record in expired:
            self._expire(record)
        return len(expired)

    async def run_sweeper(self, interval_s: float) -> None:
        """Expire sessions every ``interval_s``; log the store's usage whenever it changed."""
        logged = ""
        while True:
            await asyncio.sleep(interval_s)  # a periodic chore, not synchronisation
            if isinstance(self.keys, SharedKeyRing):  # a rotation by another process
                await asyncio.to_thread(self.keys.refresh)
                await asyncio.to_thread(self.kv.sweep_shared)
            removed = self.sweep()
            usage = self.usage()
            if usage != logged or removed:
                log.info("store usage: %s (expired %d)", usage, removed)
                logged = usage

    def shutdown(self) -> None:
        """Pause every engine sequence with its KV cells captured, never to restart here; no
        generation opens from now on. :meth:`hand_over` finishes the job."""
        self._shutting_down = True
        for session in list(self._live.values()):
            session.pause_for_shutdown()

    async def hand_over(self, grace_s: float) -> HandOver:
        """After :meth:`shutdown`: wait (up to ``grace_s``) for the pauses to land, write the
        records and the KV cells where the next process reads them (the data dir, or the
        shared store), then end every reader's stream with END(shutdown), which tells it to
        resume. A session whose pause did not land in time resumes by replay."""
        sessions = list(self._live.values())
        held = [s for s in sessions if not s.sequence_released.is_set()]
        if held:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(s.sequence_released.wait() for s in held)), grace_s
                )
        await self.persisted()
        await asyncio.to_thread(self.kv.persist)
        saved = sum(
            self.kv.has(s.session_id, len(s.record.generated))
            for s in sessions
            if s.record.end is None and s.record.generated
        )
        told = sum(session.end_for_shutdown() for session in sessions)
        return HandOver(
            paused=len(held),
            kv_saved=saved,
            replay=sum(not s.sequence_released.is_set() for s in held),
            streams_told=told,
        )

    def close(self) -> None:
        self.store.close()
        self.kv.close()

    async def aclose(self) -> None:
        """:meth:`close` from the event loop (the shared store's asyncio client closes too)."""
        if isinstance(self.store, RedisSessionStore):
            await self.store.aclose()
            self.kv.close()
            return
        self.close()

    def _expire(self, record: SessionRecord) -> None:
        # Only our copy: another process may have touched the session since (shared copies
        # expire with the session in Redis, or by age in the shared directory).
        self.kv.discard(record.session_id, shared=False)
        self.store.remove(record.session_id, expired=True)

    def _session(self, record: SessionRecord) -> Session:
        return Session(
            record,
            engine=self._engine,
            store=self.store,
            kv=self.kv,
            keys=self.keys,
            flow=self.settings.flow,
            loop=asyncio.get_running_loop(),
            inbox=self._inbox(),
            gate=self.gate,
            on_idle=self._forget,
            trace=self.metrics.trace(record.session_id, resumed=bool(record.generated)),
        )

    def _inbox(self) -> LoopInbox:
        """The one inbox of the running loop, shared by every session (made on first use)."""
        loop = asyncio.get_running_loop()
        if self._loop_inbox is None or self._loop_inbox.loop is not loop:
            self._loop_inbox = LoopInbox(loop)
            self._engine.deliver_on(loop)
        return self._loop_inbox

    def _on_appended(self, record: SessionRecord, problem: str | None) -> None:
        session = self._live.get(record.session_id)
        if session is None or session.record is not record:
            return  # a copy handed over already
        if problem is None:
            session.tokens_durable()
        elif problem == "taken":  # another process resumed it: our copy is stale
            session.hand_over()
            self.store.remove(record.session_id)
        else:  # the reader may resume once Redis is back: the durable tokens are there
            session.hand_over(failure="the session store failed; resume later")
            self.store.remove(record.session_id)

    def _forget(self, session: Session) -> None:
        if self._live.get(session.session_id) is session:
            del self._live[session.session_id]


def _store_unreachable(session_id: bytes, exc: redis.RedisError) -> RequestRejected:
    """What a request that needed Redis gets when it cannot be reached (logged here)."""
    log.error("session %s: redis: %s", session_id.hex(), exc)
    return RequestRejected(ErrorCode.STORE_UNAVAILABLE, "the session store cannot be reached")


def _check_owner(record: SessionRecord, key_id: str | None) -> None:
    """A session started with an API key is read, resumed or stopped only with that key."""
    if key_id is not None and record.owner and not _same(key_id, record.owner):
        raise RequestRejected(
            ErrorCode.SESSION_KEY_MISMATCH, "the session was started with another API key"
        )


def _reattach_index(record: SessionRecord, from_index: int) -> int:
    """Past the last token of an ended session means the reader had every token: only the
    END is left to send, from the recorded count."""
    return min(from_index, len(record.generated)) if record.end is not None else from_index


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
