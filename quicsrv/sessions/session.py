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

The session drives :mod:`.lifecycle`'s table and acts on what its parts answer: which frames its
tokens become (:mod:`.transcript`), what its reader holds and how far the engine may run ahead of
it (:mod:`.reader`), and the slot, turn, restart and retry of its engine runs (:mod:`.runner`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import quicsrv_proto
from quicsrv_proto import EndReason

from ..engine import (
    Engine,
    EngineError,
    FinishReason,
    PausedState,
    PrefillPlan,
    ResumePath,
    ResumePoint,
)
from .admission import FairGate, Place, Slot
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
from .ports import StreamPort, UnattendedPort
from .reader import ReaderFlow
from .record import SessionEnd, SessionRecord
from .runner import FINISHES, GiveUp, Runner
from .settings import FlowSettings
from .store import SessionStore
from .transcript import Transcript

if TYPE_CHECKING:
    from ..metrics import GenerationTrace

__all__ = ["Session"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Attachment:
    port: StreamPort
    reader: ReaderFlow  # what was sent and acknowledged, and the allowance that follows


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
        self._store = store
        self._kv = kv
        self._flow = flow
        self._loop = loop
        self._inbox = inbox
        self._on_idle = on_idle
        self._trace = trace  # metrics and spans of this object's life
        self._transcript = Transcript(
            record, keys=keys, every=flow.checkpoint_every_tokens, piece=engine.piece
        )
        self._runner = Runner(
            record, engine=engine, sink=self, kv=kv, gate=gate, flow=flow, loop=loop
        )
        self._state = SessionState.ENDED if record.end is not None else SessionState.CREATED
        self._pump_posted = False  # a _pump waits in the inbox behind this burst's tokens
        self._attachment: _Attachment | None = None
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
        return attachment is not None and not isinstance(attachment.port, UnattendedPort)

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
        return self._attachment.reader.acked_tokens if self._attachment is not None else 0

    # --- lifecycle, on the event loop ---------------------------------------------------

    def start(self, slot: Slot, arrived_at: float | None = None) -> None:
        """Submit a new generation under ``slot`` (its request arrived at ``arrived_at``, on
        the loop's clock); raises EngineError (e.g. Overloaded) at once, the slot then given
        back."""
        self.client = slot.client
        self._runner.hold(slot)
        try:
            self._submit(None)
        except BaseException:
            self._runner.release()
            raise
        self._trace.started(len(self.record.spec.prompt_tokens), arrived_at)

    def enter_line(self, place: Place, *, arrived_at: float | None, timeout_s: float) -> None:
        """A new generation for which no slot was free: wait for ``place``'s turn (at most
        ``timeout_s``), then start as :meth:`start` does. Meanwhile a reader holds the session
        id and may leave and come back; a turn that comes while nobody reads goes to the next
        in line, and the reader's return restarts the session ahead of new requests."""
        self._transition(SessionEvent.QUEUED)
        self.client = place.client
        self._runner.enter_line(place, timeout_s, partial(self._turn_came, arrived_at=arrived_at))

    def planned_resume_path(self) -> ResumePath | None:
        """How the next engine start will rebuild the KV cells (None: nothing to rebuild)."""
        if self.finished or self._state not in IDLE:
            return None
        return self._runner.resume_path()

    def attach(self, port: StreamPort, from_index: int, client: str = "") -> None:
        """A stream of ``client`` reads this session's frames from token ``from_index`` on."""
        self._transition(SessionEvent.ATTACHED)
        if client:
            self.client = client
        old = self._attachment
        if old is not None:
            # The newest attach wins; the old reader is told why its stream ends here.
            old.port.send_frame(quicsrv_proto.End(reason=EndReason.SUPERSEDED), True)
        self._attachment = _Attachment(port, ReaderFlow(self._flow, from_index))
        self.idle.clear()
        self._store.touch(self.record)
        if from_index == 0:
            port.send_frame(self._transcript.checkpoint(-1), False)
        self._pump()
        self._maybe_run()

    def run_unattended(self) -> None:
        """Run to the end with nobody reading (a background response): counted against its
        client's slots like any generation, stopped only by a cancel, a shutdown (the next
        process picks it up again) or its end."""
        self.unattended = self.record.unattended = True
        if self._attachment is None and not self.finished and not self.stale:
            self.attach(UnattendedPort(), len(self.record.generated))

    def detach(self, port: StreamPort, *, capture_kv: bool = True) -> None:
        """The stream went away: pause the engine (nobody reads) but keep the session; an
        unattended one goes on with its stand-in reader."""
        if self._attachment is None or self._attachment.port is not port:
            return
        if self.unattended and not (self.finished or self._shutting_down or self.stale):
            next_index, self._attachment = self._attachment.reader.next_index, None
            self.attach(UnattendedPort(), next_index)
            return
        left = self._transition(SessionEvent.DETACHED)
        self._attachment = None
        self._store.touch(self.record)
        self._pause_sequence(left, capture_kv=capture_kv)
        self._runner.stop_restarting()
        self._check_idle()

    def abandon(self) -> None:
        """Its stream went away before it was told the session id: stop spending compute
        (unless it runs unattended: then nobody needs to have been told)."""
        if self.unattended:
            return
        left = self._transition(SessionEvent.ABANDONED)
        self._pause_sequence(left, capture_kv=False)
        self._runner.leave_line()
        self._check_idle()

    def cancel(self) -> None:
        """End the generation for good (an explicit stop, not a disconnect): the engine
        sequence and any saved KV are dropped, the record ends with ``cancelled`` at the tokens
        generated so far, and a reader gets the rest of them and then END(cancelled)."""
        if self.finished:
            return
        left = self._transition(SessionEvent.CANCELLED)
        if left in HOLDS_SEQUENCE:
            self._runner.cancel()  # its late tokens are dropped: the record has ended
        self._runner.stop_restarting()
        self._runner.leave_line()
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
        self._runner.stop_restarting()
        self._runner.leave_line()
        self._check_idle()  # a generation in line that nobody reads has nothing to wait for

    def end_for_shutdown(self) -> bool:
        """Tell the reader, if any, that the server is going: END(shutdown), which is no end
        (the session stays resumable from disk). Whether a stream was told."""
        attachment, self._attachment = self._attachment, None
        if attachment is not None and isinstance(attachment.port, UnattendedPort):
            attachment = None  # nobody to tell
        if attachment is not None:
            end = self._transcript.shutdown(attachment.reader.next_index)
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
        self._runner.stop_restarting()
        self._runner.leave_line()
        self._check_idle()

    def on_transport_progress(self) -> None:
        """Acknowledgements arrived: update the reader's position and the engine's allowance."""
        self._progress(self._loop.time())

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
        if self._transcript.add(piece):
            self._transition(SessionEvent.STOP_MATCHED)
            self._runner.cancel()
            self._record_end(SessionEnd(EndReason.STOP, index + 1))
        # Once for all the tokens of a burst (a worker message may carry several steps):
        # behind them in the inbox, so the frames still leave in the same loop turn.
        if not self._pump_posted:
            self._pump_posted = True
            self._to_loop(self._posted_pump)

    def _posted_pump(self) -> None:
        self._pump_posted = False
        if self._attachment is not None:
            delivery = self._attachment.reader.delivery
            delivery.recorded(len(self.record.generated), self._loop.time())
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
        finish = FINISHES[reason]
        self._transition(finish.event)
        self._runner.released()
        if finish.failure is not None:
            self._fail_reader(finish.failure)
            return
        if finish.end is not None and not self.finished:  # a stop or a cancel may have come first
            self._record_end(SessionEnd(finish.end, completion_tokens))
        self._pump()
        self._check_idle()

    def _on_paused(self, n_generated: int) -> None:
        self._transition(SessionEvent.ENGINE_PAUSED)
        self._runner.released()
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
        if attachment is not None and attachment.reader.next_index == recorded == n_generated:
            attachment.port.send_frame(self._transcript.checkpoint(n_generated - 1), False)
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
        if left in HOLDS_SEQUENCE:
            self._runner.pause(capture_kv=capture_kv)

    def _record_end(self, end: SessionEnd) -> None:
        if self.stale:
            return  # the process that owns the session now records its end
        self.record.end = end
        self._transcript.close()
        self._store.save(self.record)
        self._store.close_log(self.record)
        self._kv.discard(self.session_id)

    def _maybe_run(self) -> None:
        """Start (or restart) the engine sequence if a reader is there and has room."""
        attachment = self._attachment
        if (
            attachment is None
            or self._shutting_down
            or not allows(self._state, SessionEvent.RESUME_QUEUED)
        ):
            return  # nobody to run for, or it runs, waits to, has ended or is stale
        n_generated = len(self.record.generated)
        if not attachment.reader.has_room(n_generated):
            return
        self._transition(SessionEvent.RESUME_QUEUED)
        self._trace.restart_wanted()
        self._runner.restart(self.client, self._restart_ready)

    def _turn_came(self, turn: Slot | RequestRejected, *, arrived_at: float | None) -> None:
        """A new generation's wait in line is over (:meth:`enter_line`)."""
        if isinstance(turn, RequestRejected):  # it ran out: nothing ran, nothing is lost
            self._drop_start(GiveUp(turn.code, str(turn)))
            return
        self._runner.hold(turn)
        if self._start_if_read(None):
            self._trace.started(len(self.record.spec.prompt_tokens), arrived_at)

    def _restart_ready(self, resume: ResumePoint | None) -> None:
        """A restart has its slot, and the KV blob if one was kept (:meth:`_maybe_run`)."""
        if self._start_if_read(resume):
            self._runner.restarted()

    def _start_if_read(self, resume: ResumePoint | None) -> bool:
        """Submit under the slot held if a reader still waits for it; whether the engine took
        it (a refusal fails the reader where no retry helps, else it is tried again later)."""
        if self._attachment is None or self.finished:
            # The reader left meanwhile (or a proxy cut the stream while it waited in line):
            # no compute for nobody; the turn goes to the next in line.
            self._drop_start(None)
            return False
        try:
            self._submit(resume)
        except EngineError as exc:
            self._drop_start(self._runner.refused(exc, self._maybe_run))
            return False
        return True

    def _drop_start(self, give_up: GiveUp | None) -> None:
        """A (re)start that waited is given up; ``give_up``: the reader is told why."""
        self._transition(SessionEvent.RESUME_DROPPED)
        self._runner.release()
        if give_up is not None:
            self._fail_reader(give_up.message, give_up.code)
        else:
            self._check_idle()

    def _submit(self, resume: ResumePoint | None) -> None:
        self._runner.submit(resume)
        self._transition(SessionEvent.SUBMITTED)
        self.paused.clear()
        self.idle.clear()
        generated, attachment = len(self.record.generated), self._attachment
        if attachment is None:
            self._runner.allow(generated + self._flow.max_tokens_ahead)
            return
        attachment.reader.delivery.run_started()
        self._runner.allow(attachment.reader.allowance(generated))

    def _pump(self, *, progress: bool = True) -> None:
        """Write every frame the attached reader has not been sent yet (then, with
        ``progress``, update its flow-control state, which may restart the engine)."""
        attachment = self._attachment
        if attachment is None:
            return
        port, reader, record = attachment.port, attachment.reader, self.record
        # Only what the store holds durably goes out (the file store: every token at once).
        sendable = min(len(self._transcript), self._store.durable_tokens(record))
        # A burst's frames leave in one write (one HTTP/3 DATA frame, one QUIC stream write)
        # per checkpoint interval: the transcript's chunks.
        now = self._loop.time()
        for upto, frames in self._transcript.chunks(reader.next_index, sendable):
            port.send_frames(frames)
            reader.wrote(upto, port.sent_offset(), now)
        if record.end is not None and reader.next_index >= len(record.generated):
            self._transition(SessionEvent.READER_ENDED)
            port.send_frame(self._transcript.end(), True)
            self._attachment = None
            self._store.touch(record)
            self._check_idle()
            return
        if progress:
            self._progress(now)

    def _progress(self, now: float) -> None:
        attachment = self._attachment
        if attachment is None:
            return
        port, reader = attachment.port, attachment.reader
        reader.acknowledged(port.acked_offset(), port.sent_offset(), now)
        if self._state in HOLDS_SEQUENCE and self._runner.running:
            self._runner.allow(reader.allowance(len(self.record.generated)))
        else:
            self._maybe_run()

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
            self._runner.settle()
            self._store.close_log(self.record)
            self.idle.set()
            self._trace.closed(self.record.end.reason.value if self.record.end else "detached")
            self._on_idle(self)
