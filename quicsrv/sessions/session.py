"""One live session: the engine's sink, the canonical frame sequence, and the stream reading it.

A session outlives its streams. The engine sequence belongs to the session; a stream is only an
*attachment* that reads the session's frames from some token index on. Tokens are recorded (and
persisted) before any stream sees them, so any attachment, now or after a restart, gets the very
same frames. While the attached reader lags (its unacknowledged bytes past the high watermark, or
``max_tokens_ahead`` tokens generated beyond what it acknowledged, more for a reader whose
acknowledgements take long: :mod:`.flow`) the engine sequence is paused and its batch slot
freed; it runs again once the reader drains below the low watermark.

A session may also run *unattended* (a background response): while no stream reads it, a
stand-in reader takes every frame at once, so the generation runs to its end; a stream that
comes and goes meanwhile never pauses it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import quicsrv_proto
from quicsrv_proto import EndReason

from ..engine import (
    CannotReplay,
    Engine,
    EngineError,
    EngineUnavailable,
    FinishReason,
    PausedState,
    PrefillPlan,
    PromptTooLong,
    ResumePath,
    ResumePoint,
    SequenceHandle,
)
from .admission import FairGate, Place, Slot
from .flow import DeliveryMeter, tokens_ahead
from .generation import RequestRejected
from .inbox import LoopInbox
from .keys import KeyRing
from .kvstore import KVStore
from .lifecycle import (
    HOLDS_SEQUENCE,
    IDLE,
    STALE,
    SessionEvent,
    SessionState,
    allows,
    next_state,
)
from .record import SessionEnd, SessionRecord
from .settings import FlowSettings
from .snapshot import PrefixSigner
from .store import SessionStore
from .text import TextAssembler

if TYPE_CHECKING:
    from ..metrics import GenerationTrace

__all__ = ["Session", "StreamPort"]

#: The engine's allowance advances in steps of the tokens ahead / ALLOWANCE_STEPS.
ALLOWANCE_STEPS = 4

log = logging.getLogger(__name__)


class StreamPort(Protocol):
    """The transport's side of one response stream.

    It is handed frames, not bytes, so that each transport encodes them its own way (CBOR on
    the native stream, SSE events on the OpenAI one) without decoding anything back.
    """

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None: ...

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        """Several frames in one write (on QUIC, one HTTP/3 DATA frame); the stream goes on."""

    def sent_offset(self) -> int:
        """Stream bytes written so far."""

    def acked_offset(self) -> int:
        """Stream bytes the peer acknowledged without a gap."""


class _Unattended:
    """The reader of an unattended session while no stream reads it: takes every frame at
    once and drops it (the record keeps them), so the engine never waits."""

    def __init__(self) -> None:
        self._sent = 0

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None:
        self._sent += 1

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        self._sent += len(frames)

    def sent_offset(self) -> int:
        return self._sent

    def acked_offset(self) -> int:
        return self._sent


@dataclass(eq=False)
class _Attachment:
    port: StreamPort
    next_index: int  # the next token index to send
    acked_tokens: int  # tokens [0, acked_tokens) the reader holds or acknowledged
    # (tokens, stream offset, when written) of each write not yet acknowledged
    pending: deque[tuple[int, int, float]] = field(default_factory=deque)
    blocked: bool = False
    delivery: DeliveryMeter = field(default_factory=DeliveryMeter)  # rate and ACK delay (.flow)


class Session:
    """See the module docstring. Engine callbacks arrive on the engine thread; all else on
    the event loop. Its state moves only along :mod:`.lifecycle`'s table (``_transition``);
    the engine handle is live exactly in the states of ``HOLDS_SEQUENCE``."""

    def __init__(
        self,
        record: SessionRecord,
        *,
        engine: Engine,
        store: SessionStore,
        kv: KVStore,
        keys: KeyRing,
        flow: FlowSettings,
        loop: asyncio.AbstractEventLoop,
        inbox: LoopInbox,
        gate: FairGate,
        on_idle: Callable[[Session], None],
        trace: GenerationTrace,
    ) -> None:
        self.record = record
        self._engine = engine
        self._store = store
        self._kv = kv
        self._keys = keys
        self._flow = flow
        self._loop = loop
        self._inbox = inbox
        self._gate = gate
        self._on_idle = on_idle
        self._trace = trace  # metrics and spans of this object's life
        self._signer = PrefixSigner(
            record.snapshot(upto=0).header(), record.generated, flow.checkpoint_every_tokens
        )
        self._text = TextAssembler(record.spec.stop)
        self._texts = [self._text.push(engine.piece(t)) for t in record.generated]
        self._tail = self._end_tail() if record.end is not None else ""
        self._state = SessionState.ENDED if record.end is not None else SessionState.CREATED
        self._handle: SequenceHandle | None = None
        self._pump_posted = False  # a _pump waits in the inbox behind this burst's tokens
        self._attachment: _Attachment | None = None
        self._retry: asyncio.TimerHandle | None = None
        self._slot: Slot | None = None  # held while the engine runs (or is about to)
        self._restarting: asyncio.Task[None] | None = None
        self._in_line: asyncio.Task[None] | None = None  # a new generation waiting its turn
        self.client = ""
        """Who reads it now (an API key id, or a connection): its slots count against them."""
        self.resume_paths: list[ResumePath] = []
        self.pauses = 0
        self.paused = asyncio.Event()  # set while the engine sequence is paused (tests, stats)
        self.idle = asyncio.Event()  # set once nobody reads and the engine holds nothing
        # Set while the engine holds no sequence of this object (a shutdown waits for it).
        self.sequence_released = asyncio.Event()
        self.sequence_released.set()
        self._shutting_down = False  # no restart from now on: the server is going
        self.unattended = record.unattended
        """It runs to its end whether or not a stream reads it: a reader that leaves hands it
        to a stand-in (:meth:`run_unattended` starts one at once)."""

    @property
    def session_id(self) -> bytes:
        return self.record.session_id

    @property
    def finished(self) -> bool:
        return self.record.end is not None

    @property
    def attached(self) -> bool:
        """A stream reads it (the stand-in reader of an unattended session is none)."""
        attachment = self._attachment
        return attachment is not None and not isinstance(attachment.port, _Unattended)

    @property
    def stale(self) -> bool:
        """Another process owns the session now (or the store failed): this copy is stale."""
        return self._state in STALE

    @property
    def running(self) -> bool:
        return self._state not in IDLE

    @property
    def state(self) -> SessionState:
        """Where this object is in its lifecycle (tests, stats)."""
        return self._state

    @property
    def acknowledged_tokens(self) -> int:
        """Tokens the attached reader has acknowledged (0 when detached)."""
        return self._attachment.acked_tokens if self._attachment is not None else 0

    # --- lifecycle, on the event loop ---------------------------------------------------

    def start(self, slot: Slot, arrived_at: float | None = None) -> None:
        """Submit a new generation under ``slot`` (its request arrived at ``arrived_at``, on
        the loop's clock); raises EngineError (e.g. Overloaded) at once, the slot then given
        back."""
        self.client = slot.client
        self._slot = slot
        try:
            self._submit(None)
        except BaseException:
            self._release_slot()
            raise
        self._trace.started(len(self.record.spec.prompt_tokens), arrived_at)

    def enter_line(self, place: Place, *, arrived_at: float | None, timeout_s: float) -> None:
        """A new generation for which no slot was free: wait for ``place``'s turn (at most
        ``timeout_s``), then start as :meth:`start` does. Meanwhile a reader holds the session
        id and may leave and come back; a turn that comes while nobody reads goes to the next
        in line, and the reader's return restarts the session ahead of new requests."""
        self._transition(SessionEvent.QUEUED)
        self.client = place.client
        self._in_line = self._loop.create_task(self._wait_turn(place, arrived_at, timeout_s))

    def planned_resume_path(self) -> ResumePath | None:
        """How the next engine start will rebuild the KV cells (None: nothing to rebuild)."""
        if self.finished or self._state not in IDLE or not self.record.generated:
            return None
        if self._kv.has(self.session_id, len(self.record.generated)):
            return ResumePath.KV_RESTORE
        return ResumePath.REPREFILL if self._flow.inexact_reprefill else ResumePath.REPLAY

    def attach(self, port: StreamPort, from_index: int, client: str = "") -> None:
        """A stream of ``client`` reads this session's frames from token ``from_index`` on."""
        self._transition(SessionEvent.ATTACHED)
        if client:
            self.client = client
        old = self._attachment
        if old is not None:
            # The newest attach wins; the old reader is told why its stream ends here.
            old.port.send_frame(quicsrv_proto.End(reason=EndReason.SUPERSEDED), True)
        attachment = _Attachment(port=port, next_index=from_index, acked_tokens=from_index)
        self._attachment = attachment
        self.idle.clear()
        self._store.touch(self.record)
        if from_index == 0:
            port.send_frame(self._checkpoint(-1), False)
        self._pump()
        self._maybe_run()

    def run_unattended(self) -> None:
        """Run to the end with nobody reading (a background response): counted against its
        client's slots like any generation, stopped only by a cancel, a shutdown (the next
        process picks it up again) or its end."""
        self.unattended = self.record.unattended = True
        if self._attachment is None and not self.finished and not self.stale:
            self.attach(_Unattended(), len(self.record.generated))

    def detach(self, port: StreamPort, *, capture_kv: bool = True) -> None:
        """The stream went away: pause the engine (nobody reads) but keep the session; an
        unattended one goes on with its stand-in reader."""
        if self._attachment is None or self._attachment.port is not port:
            return
        if self.unattended and not (self.finished or self._shutting_down or self.stale):
            next_index, self._attachment = self._attachment.next_index, None
            self.attach(_Unattended(), next_index)
            return
        left = self._transition(SessionEvent.DETACHED)
        self._attachment = None
        self._store.touch(self.record)
        self._pause_sequence(left, capture_kv=capture_kv)
        self._stop_restarting()
        self._check_idle()

    def abandon(self) -> None:
        """Its stream went away before it was told the session id: stop spending compute
        (unless it runs unattended: then nobody needs to have been told)."""
        if self.unattended:
            return
        left = self._transition(SessionEvent.ABANDONED)
        self._pause_sequence(left, capture_kv=False)
        self._leave_line()
        self._check_idle()

    def cancel(self) -> None:
        """End the generation for good (an explicit stop, not a disconnect): the engine
        sequence and any saved KV are dropped, the record ends with ``cancelled`` at the tokens
        generated so far, and a reader gets the rest of them and then END(cancelled)."""
        if self.finished:
            return
        left = self._transition(SessionEvent.CANCELLED)
        if left in HOLDS_SEQUENCE and self._handle is not None:
            self._handle.cancel()  # its late tokens are dropped: the record has ended
        self._stop_restarting()
        self._leave_line()
        self._record_end(SessionEnd(EndReason.CANCELLED, len(self.record.generated)))
        self._pump()
        self._check_idle()

    def pause_for_shutdown(self) -> None:
        """The server is going: pause the sequence with its KV cells captured, for the next
        process to restore, and never restart it here. The reader stays attached and gets
        what is generated until the pause lands; :meth:`end_for_shutdown` tells it."""
        self._shutting_down = True
        left = self._transition(SessionEvent.SHUT_DOWN)
        self._pause_sequence(left, capture_kv=True)
        self._stop_restarting()
        self._leave_line()
        self._check_idle()  # a generation in line that nobody reads has nothing to wait for

    def end_for_shutdown(self) -> bool:
        """Tell the reader, if any, that the server is going: END(shutdown), which is no end
        (the session stays resumable from disk). Whether a stream was told."""
        attachment, self._attachment = self._attachment, None
        if attachment is not None and isinstance(attachment.port, _Unattended):
            attachment = None  # nobody to tell
        if attachment is not None:
            end = quicsrv_proto.End(
                reason=EndReason.SHUTDOWN,
                prompt_tokens=len(self.record.spec.prompt_tokens),
                completion_tokens=attachment.next_index,
                cached_tokens=self.record.cached_tokens,
            )
            attachment.port.send_frame(end, True)
        self._check_idle()
        return attachment is not None

    def tokens_durable(self) -> None:
        """The store confirmed more tokens (the Redis store, a batch later): send them."""
        if not self.stale:
            self._pump()

    def lose_ownership(self, failure: str | None = None) -> None:
        """This process may no longer write the session: another one took it over (the newest
        attach wins across processes too; the reader's stream ends with ``superseded``), or the
        shared store failed (``failure``: the reader gets ERROR(store_unavailable) and may
        resume). Generation stops; this object is stale from now on."""
        if self.stale:
            return
        left = self._transition(SessionEvent.OWNERSHIP_LOST)
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            frame: quicsrv_proto.Frame = (
                quicsrv_proto.End(reason=EndReason.SUPERSEDED)
                if failure is None
                else quicsrv_proto.Error(
                    code=quicsrv_proto.ErrorCode.STORE_UNAVAILABLE, message=failure
                )
            )
            attachment.port.send_frame(frame, True)
        self._pause_sequence(left, capture_kv=False)
        self._stop_restarting()
        self._leave_line()
        self._check_idle()

    def on_transport_progress(self) -> None:
        """Acknowledgements arrived: update the reader's position and the engine's allowance."""
        attachment = self._attachment
        if attachment is None:
            return
        acked = attachment.port.acked_offset()
        pending = attachment.pending
        written_at = None  # of the newest write this acknowledgement covers
        while pending and pending[0][1] <= acked:
            attachment.acked_tokens, _, written_at = pending.popleft()
        if written_at is not None:
            attachment.delivery.acknowledged(written_at, self._loop.time())
        unacked = attachment.port.sent_offset() - acked
        if unacked >= self._flow.high_watermark_bytes:
            attachment.blocked = True
        elif unacked <= self._flow.low_watermark_bytes:
            attachment.blocked = False
        if self._state in HOLDS_SEQUENCE and self._handle is not None:
            self._handle.allow(self._allowance(attachment))
        else:
            self._maybe_run()

    # --- the engine's TokenSink (engine thread) -----------------------------------------

    def token_generated(self, index: int, token_id: int, piece: bytes) -> None:
        self._to_loop(self._on_token, index, token_id, piece)

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self._to_loop(self._on_finished, reason, completion_tokens)

    def sequence_paused(self, state: PausedState) -> None:
        if state.kv_state is not None:
            # Stored here, on the engine thread: a spill to disk never blocks the event loop.
            self._kv.put(self.session_id, len(state.generated), state.kv_state)
        self._to_loop(self._on_paused, len(state.generated))

    def sequence_resumed(self, path: ResumePath) -> None:
        self._to_loop(self._on_resumed, path)

    def sequence_planned(self, plan: PrefillPlan) -> None:
        self._to_loop(self._on_planned, plan)

    def _to_loop(self, callback: Callable[..., None], *args: object) -> None:
        self._inbox.post(callback, *args)

    # --- engine events, on the loop -----------------------------------------------------

    def _on_token(self, index: int, token_id: int, piece: bytes) -> None:
        record = self.record
        if self.stale:
            return  # another process writes this session now
        if record.end is not None or index != len(record.generated):
            return  # a token decoded after a stop sequence matched: not part of the output
        self._store.append_token(record, token_id)  # persisted before anyone is sent it
        self._trace.token_recorded()
        self._texts.append(self._text.push(piece))
        if self._text.stopped:
            self._transition(SessionEvent.STOP_MATCHED)
            if self._handle is not None:
                self._handle.cancel()
            self._record_end(SessionEnd(EndReason.STOP, index + 1))
        # Once for all the tokens of a burst (a worker message may carry several steps):
        # behind them in the inbox, so the frames still leave in the same loop turn.
        if not self._pump_posted:
            self._pump_posted = True
            self._to_loop(self._posted_pump)

    def _posted_pump(self) -> None:
        self._pump_posted = False
        if self._attachment is not None:
            self._attachment.delivery.recorded(len(self.record.generated), self._loop.time())
        self._pump()

    def _on_planned(self, plan: PrefillPlan) -> None:
        record = self.record
        if self.stale or record.generated:
            return  # a resume: it follows the plan on record
        cold = plan.is_cold(record.spec.prefill_chunk)
        kept = None if cold and not plan.reused else plan
        if kept == record.prefill_plan:
            return
        record.prefill_plan = kept
        # Waited for (once per generation that reused cells, a small write): a crash after
        # the first token was sent but before the plan was on disk would replay the prompt
        # another way, and the continuation could differ from what the reader holds.
        self._store.save(record).result()

    def _on_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self._transition(_FINISH_EVENTS[reason])
        self._handle = None
        self._release_slot()
        if reason is FinishReason.FAILED:
            self._fail_reader("the engine failed and could not be restarted; resume later")
            return
        if reason is FinishReason.POISONED:
            self._fail_reader(
                "this generation crashed the engine worker again and again: it was stopped "
                "so that the others could go on"
            )
            return
        if self.finished:
            pass  # a stop sequence or a cancel ended it first; the engine's reason came late
        elif reason is FinishReason.LENGTH:
            self._record_end(SessionEnd(EndReason.LENGTH, completion_tokens))
        elif reason is FinishReason.EOS:
            self._record_end(SessionEnd(EndReason.EOS, completion_tokens))
        # CANCELLED follows a stop sequence (already recorded); SHUTDOWN leaves the session
        # resumable by the next server process.
        self._pump()
        self._check_idle()

    def _on_paused(self, n_generated: int) -> None:
        self._transition(SessionEvent.ENGINE_PAUSED)
        self._handle = None
        self._release_slot()
        if self.finished:
            # A pause that crossed the end (a stop, a cancel): its cells, stored on the engine
            # thread after the end discarded the session's, are of no use to anyone.
            self._kv.discard(self.session_id)
        self.pauses += 1
        self.paused.set()
        self._trace.paused()
        log.debug("session %s paused at %d tokens", self.session_id.hex(), n_generated)
        self._pump(progress=False)  # the pause checkpoint follows every recorded token
        attachment = self._attachment
        recorded = len(self.record.generated)
        # The engine may have run past the record (tokens after a stop sequence, or decoded by
        # a stale copy): those have no checkpoint, and signing one raised here before.
        if attachment is not None and attachment.next_index == recorded == n_generated:
            attachment.port.send_frame(self._checkpoint(n_generated - 1), False)
        self._maybe_run()
        self._check_idle()

    def _on_resumed(self, path: ResumePath) -> None:
        self.resume_paths.append(path)
        self._trace.resumed(path)
        log.info(
            "session %s resumed by %s at %d tokens",
            self.session_id.hex(),
            path.value,
            len(self.record.generated),
            extra={
                "event": "session_resumed",
                "session_id": self.session_id.hex(),
                "resume_path": path.value,
            },
        )

    # --- internals ----------------------------------------------------------------------

    def _transition(self, event: SessionEvent) -> SessionState:
        """Move along the lifecycle table (IllegalTransition off it); returns the state left,
        which decides the side effects that follow."""
        left = self._state
        self._state = next_state(left, event)
        if self._state in HOLDS_SEQUENCE:
            self.sequence_released.clear()
        else:
            self.sequence_released.set()
        return left

    def _pause_sequence(self, left: SessionState, *, capture_kv: bool) -> None:
        """Ask the engine to pause the sequence, if the state ``left`` held one."""
        if left in HOLDS_SEQUENCE and self._handle is not None:
            self._handle.pause(capture_kv=capture_kv)

    def _record_end(self, end: SessionEnd) -> None:
        if self.stale:
            return  # the process that owns the session now records its end
        self.record.end = end
        self._tail = self._end_tail()
        self._store.save(self.record)
        self._store.close_log(self.record)
        self._kv.discard(self.session_id)

    def _end_tail(self) -> str:
        assert self.record.end is not None
        return "" if self.record.end.reason is EndReason.STOP else self._text.finish()

    def _allowance(self, attachment: _Attachment) -> int:
        if attachment.blocked:
            return len(self.record.generated)  # pause at the next step
        # Moves in quarter-allowance steps, not per acknowledged token: with an engine worker
        # every change is a message that wakes it (and a thread here) mid-decode. A reader
        # keeping up still has 3/4 of the tokens ahead as headroom at the least.
        ahead = self._tokens_ahead(attachment)
        step = max(1, ahead // ALLOWANCE_STEPS)
        return (attachment.acked_tokens + ahead) // step * step

    def _tokens_ahead(self, attachment: _Attachment) -> int:
        delivery = attachment.delivery
        delay_s = self._flow.coalesce_s + delivery.ack_delay_s
        return tokens_ahead(self._flow.max_tokens_ahead, delivery.tokens_per_s, delay_s)

    def _maybe_run(self) -> None:
        """Start (or restart) the engine sequence if a reader is there and has room."""
        attachment = self._attachment
        if (
            attachment is None
            or self._shutting_down
            or not allows(self._state, SessionEvent.RESUME_QUEUED)
        ):
            return  # nobody to run for, or it runs, waits to, has ended or is stale
        room = self._allowance(attachment) - len(self.record.generated)
        # Hysteresis: a paused sequence restarts only once the reader has caught up by half
        # the allowance, so a slow reader costs one restore per half allowance rather than one
        # per token.
        if room < max(1, self._tokens_ahead(attachment) // 2):
            return
        self._transition(SessionEvent.RESUME_QUEUED)
        self._trace.restart_wanted()
        self._restarting = self._loop.create_task(self._restart())

    def _stop_restarting(self) -> None:
        """The reader left while the restart waited for a slot or the KV blob: give up (the
        event that called this has moved the state on already)."""
        task, self._restarting = self._restarting, None
        if task is not None and not task.done():
            task.cancel()

    def _leave_line(self) -> None:
        """Give up the new generation's place in line (the event that called this has moved
        the state on already)."""
        task, self._in_line = self._in_line, None
        if task is not None and not task.done():
            task.cancel()

    async def _wait_turn(self, place: Place, arrived_at: float | None, timeout_s: float) -> None:
        try:
            slot = await place.wait(timeout_s)
        except RequestRejected as exc:  # the queue wait ran out: nothing ran, nothing is lost
            self._in_line = None
            self._transition(SessionEvent.RESUME_DROPPED)
            self._fail_reader(str(exc), exc.code)
            return
        self._in_line = None
        if self._attachment is None:
            # Nobody reads (a proxy cut the stream while it waited): no compute for nobody.
            slot.release()
            self._transition(SessionEvent.RESUME_DROPPED)
            self._check_idle()
            return
        self._slot = slot
        try:
            self._submit(None)
        except EngineError as exc:
            self._transition(SessionEvent.RESUME_DROPPED)
            self._release_slot()
            self._engine_refused(exc)
            return
        self._trace.started(len(self.record.spec.prompt_tokens), arrived_at)

    def _engine_refused(self, exc: EngineError) -> None:
        """The engine refused a (re)start: fail the reader if it is down for good, else try
        again when it says."""
        if isinstance(exc, EngineUnavailable):
            self._fail_reader(str(exc))
            return
        if isinstance(exc, CannotReplay | PromptTooLong):  # this server's settings changed
            code = (
                quicsrv_proto.ErrorCode.PROMPT_TOO_LONG
                if isinstance(exc, PromptTooLong)
                else quicsrv_proto.ErrorCode.MODEL_CHANGED
            )
            self._fail_reader(str(exc), code)
            return
        retry = 1.0 if exc.retry_after_s is None else exc.retry_after_s
        log.info("session %s waits to start: %s", self.session_id.hex(), exc)
        self._retry = self._loop.call_later(retry, self._maybe_run)

    async def _restart(self) -> None:
        # A session coming back goes ahead of new requests, but waits its turn among the
        # other returning sessions (and under its reader's per-client cap).
        self._slot = await self._gate.acquire(self.client, resume=True)
        n_generated = len(self.record.generated)
        kv = None
        if n_generated:
            kv = await asyncio.to_thread(self._kv.get, self.session_id, n_generated)
        self._restarting = None
        if self._attachment is None or self.finished:
            self._transition(SessionEvent.RESUME_DROPPED)  # the reader left meanwhile
            self._release_slot()
            self._check_idle()
            return
        resume = None  # no token yet (it never ran): a plain start, prefill and all
        if n_generated:
            resume = ResumePoint(
                generated=tuple(self.record.generated),
                kv_state=kv,
                inexact_reprefill=self._flow.inexact_reprefill,
            )
        try:
            self._submit(resume)
        except EngineError as exc:
            self._transition(SessionEvent.RESUME_DROPPED)
            self._release_slot()
            self._engine_refused(exc)
            return
        self._kv.discard(self.session_id)  # the engine holds the cells now

    def _submit(self, resume: ResumePoint | None) -> None:
        record = self.record
        request = record.spec.request(
            resume=resume,
            prefill_plan=record.prefill_plan,
            cache_scope="" if self._flow.prefix_cache_shared else record.owner,
        )
        self._handle = self._engine.submit(request, self)
        self._transition(SessionEvent.SUBMITTED)
        self.paused.clear()
        self.idle.clear()
        attachment = self._attachment
        if attachment is not None:
            attachment.delivery.run_started()
        self._handle.allow(
            self._allowance(attachment)
            if attachment is not None
            else len(record.generated) + self._flow.max_tokens_ahead
        )

    def _release_slot(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()

    def _pump(self, *, progress: bool = True) -> None:
        """Write every frame the attached reader has not been sent yet (then, with
        ``progress``, update its flow-control state, which may restart the engine)."""
        attachment = self._attachment
        if attachment is None:
            return
        generated, texts = self.record.generated, self._texts
        every = self._flow.checkpoint_every_tokens
        # Only what the store holds durably goes out (the file store: every token at once).
        sendable = min(len(texts), self._store.durable_tokens(self.record))
        # A burst's frames leave in one write (one HTTP/3 DATA frame, one QUIC stream write),
        # at most a checkpoint interval of them, so a long replay is still acknowledged piece
        # by piece: the reader holds a chunk's tokens once the chunk's last byte is acked.
        chunk: list[quicsrv_proto.Frame] = []
        now = self._loop.time()
        while attachment.next_index < sendable:
            i = attachment.next_index
            chunk.append(quicsrv_proto.Token(index=i, token_id=generated[i], text=texts[i]))
            attachment.next_index = i + 1
            at_checkpoint = (i + 1) % every == 0
            if at_checkpoint:
                chunk.append(self._checkpoint(i))
            if at_checkpoint or i + 1 == sendable:
                attachment.port.send_frames(chunk)
                attachment.pending.append((i + 1, attachment.port.sent_offset(), now))
                chunk = []
        end = self.record.end
        if end is not None and attachment.next_index >= len(generated):
            frame_end = quicsrv_proto.End(
                reason=end.reason,
                prompt_tokens=len(self.record.spec.prompt_tokens),
                completion_tokens=end.completion_tokens,
                text=self._tail,
                cached_tokens=self.record.cached_tokens,
            )
            self._transition(SessionEvent.READER_ENDED)
            attachment.port.send_frame(frame_end, True)
            self._attachment = None
            self._store.touch(self.record)
            self._check_idle()
            return
        if progress:
            self.on_transport_progress()

    def _checkpoint(self, index: int) -> quicsrv_proto.Checkpoint:
        snapshot_hash = self._signer.mac(self._keys.current, index)
        return quicsrv_proto.Checkpoint(
            session_id=self.session_id, index=index, snapshot_hash=snapshot_hash
        )

    def _fail_reader(
        self,
        message: str,
        code: quicsrv_proto.ErrorCode = quicsrv_proto.ErrorCode.ENGINE_UNAVAILABLE,
    ) -> None:
        """End the reader's stream with ERROR(``code``); the session stays resumable (its
        tokens are on disk), so the client can come back once the engine is."""
        self._pump(progress=False)  # every recorded token first
        attachment, self._attachment = self._attachment, None
        if attachment is not None:
            self._transition(SessionEvent.READER_FAILED)
            error = quicsrv_proto.Error(code=code, message=message)
            attachment.port.send_frame(error, True)
        self._check_idle()

    def _check_idle(self) -> None:
        if self._attachment is None and self._state in IDLE:
            self._release_slot()
            if self._retry is not None:
                self._retry.cancel()
                self._retry = None
            self._store.close_log(self.record)
            self.idle.set()
            self._trace.closed(self.record.end.reason.value if self.record.end else "detached")
            self._on_idle(self)


# What each engine finish report is, for the lifecycle: the record ends only on a natural end.
_FINISH_EVENTS = {
    FinishReason.LENGTH: SessionEvent.ENGINE_COMPLETED,
    FinishReason.EOS: SessionEvent.ENGINE_COMPLETED,
    FinishReason.CANCELLED: SessionEvent.ENGINE_STOPPED,
    FinishReason.SHUTDOWN: SessionEvent.ENGINE_STOPPED,
    FinishReason.FAILED: SessionEvent.ENGINE_FAILED,
    FinishReason.POISONED: SessionEvent.ENGINE_FAILED,
}
