"""One live session: the driver of its lifecycle, between the engine and the stream reading it.

A session outlives its streams. The engine sequence belongs to the session; a stream is only an
*attachment* that reads the session's frames from some token index on. Tokens are recorded (and
persisted) before any stream sees them, so any attachment, now or after a restart, gets the very
same frames. While the attached reader lags, the engine sequence is paused and its batch slot
freed; it runs again once the reader has caught up. A session may also run *unattended* (a
background response): while no stream reads it, a stand-in reader takes every frame at once, so
the generation runs to its end; a stream that comes and goes meanwhile never pauses it.

The session moves only along :mod:`.lifecycle`'s table, acting on what its parts answer: which
frames tokens become (:mod:`.transcript`), how far the engine may run ahead of the reader
(:mod:`.reader`), what the engine sequence waits on and what the engine's answers mean
(:mod:`.runner`). The engine's reports come to it on the loop, through a :class:`~.sink.LoopSink`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import quicsrv_proto
from quicsrv_proto import EndReason, ErrorCode

from ..engine import (
    Engine,
    EngineError,
    FinishReason,
    PausedState,
    PrefillPlan,
    ResumePath,
    ResumePoint,
    TokenLogprobs,
)
from .admission import FairGate, Place, Slot
from .attachment import Attachment, StreamPort, UnattendedPort
from .inbox import LoopInbox
from .keys import KeyRing
from .kvstore import KVStore
from .lifecycle import HOLDS_SEQUENCE, IDLE, STALE, SessionEvent, SessionState, allows, next_state
from .reader import ReaderFlow
from .record import SessionEnd, SessionRecord
from .runner import FINISHES, GiveUp, Ready, Runner
from .settings import FlowSettings
from .sink import LoopSink
from .store import SessionStore
from .transcript import Transcript

if TYPE_CHECKING:
    from ..metrics import GenerationTrace

__all__ = ["Session"]


class Session:
    """See the module docstring. On the event loop, its TokenSink methods too (the engine is
    handed a LoopSink). Its state moves only along :mod:`.lifecycle`'s table
    (``_transition``); the engine holds a sequence exactly in the states of ``HOLDS_SEQUENCE``."""

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
        self.session_id = record.session_id
        self._store = store
        self._flow = flow
        self._loop = loop
        self._inbox = inbox
        self._on_idle = on_idle
        self._trace = trace  # metrics and spans of this object's life
        every = flow.checkpoint_every_tokens
        self._transcript = Transcript(record, keys=keys, every=every, piece=engine.piece)
        sink = LoopSink(inbox=inbox, kv=kv, session_id=record.session_id)
        self._runner = Runner(record, engine, sink, kv=kv, gate=gate, flow=flow, loop=loop)
        self._state = SessionState.ENDED if record.end is not None else SessionState.CREATED
        self._pump_posted = False  # a _pump waits in the inbox behind this burst's tokens
        self._attachment: Attachment | None = None
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
    def finished(self) -> bool:
        return self.record.end is not None

    @property
    def attached(self) -> bool:
        """A stream reads it (the stand-in reader of an unattended session is none)."""
        return self._attachment is not None and not self._attachment.stand_in

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

    # --- lifecycle -----------------------------------------------------------------------

    def start(self, slot: Slot, arrived_at: float | None = None) -> None:
        """Submit a new generation under ``slot`` (its request arrived at ``arrived_at``, on
        the loop's clock); raises EngineError (e.g. Overloaded) at once, the slot then given
        back."""
        self.client = slot.client
        self._runner.start(slot, self._submit)
        self._trace.started(len(self.record.spec.prompt_tokens), arrived_at)

    def enter_line(self, place: Place, *, arrived_at: float | None, timeout_s: float) -> None:
        """A new generation for which no slot was free: wait for ``place``'s turn (at most
        ``timeout_s``), then start as :meth:`start` does. Meanwhile a reader holds the session
        id and may leave and come back; a turn that comes while nobody reads goes to the next
        in line, and the reader's return restarts the session ahead of new requests."""
        self._transition(SessionEvent.QUEUED)
        self.client = place.client
        started = partial(self._trace.started, len(self.record.spec.prompt_tokens), arrived_at)
        self._runner.enter_line(place, timeout_s, partial(self._ready, started=started))

    def planned_resume_path(self) -> ResumePath | None:
        """How the next engine start will rebuild the KV cells (None: nothing to rebuild)."""
        return None if self.finished or self._state not in IDLE else self._runner.resume_path()

    def attach(self, port: StreamPort, from_index: int, client: str = "") -> None:
        """A stream of ``client`` reads this session's frames from token ``from_index`` on."""
        self._transition(SessionEvent.ATTACHED)
        self.client = client or self.client
        # The newest attach wins; the old reader is told why its stream ends here.
        self._end_stream(self._transcript.superseded())
        self._attachment = Attachment(port, ReaderFlow(self._flow, from_index))
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
        self._halt(left, capture_kv=capture_kv, keep_place=True)

    def abandon(self) -> None:
        """Its stream went away before it was told the session id: stop spending compute
        (unless it runs unattended: then nobody needs to have been told)."""
        if self.unattended:
            return
        if self._transition(SessionEvent.ABANDONED) in HOLDS_SEQUENCE:
            self._runner.pause(capture_kv=False)
        self._runner.leave_line()  # no reader yet, so no queued restart to give up
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
        what is generated until the pause lands; :meth:`end_for_shutdown` tells it. A
        generation in line that nobody reads has nothing to wait for."""
        self._shutting_down = True
        self._halt(self._transition(SessionEvent.SHUT_DOWN), capture_kv=True)

    def end_for_shutdown(self) -> bool:
        """Tell the reader, if any, that the server is going: END(shutdown), which is no end
        (the session stays resumable from disk). Whether a stream was told."""
        attachment = self._attachment
        sent = 0 if attachment is None else attachment.reader.next_index
        told = self._end_stream(self._transcript.shutdown(sent))
        self._check_idle()
        return told

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
        self._end_stream(self._transcript.superseded(failure))
        self._halt(left, capture_kv=False)

    def on_transport_progress(self) -> None:
        """Acknowledgements arrived: update the reader's position and the engine's allowance."""
        self._progress(self._loop.time())

    # --- the engine's reports, on the loop (TokenSink, through the LoopSink) ---------------

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: TokenLogprobs | None
    ) -> None:
        record = self.record
        if self.stale:
            return  # another process writes this session now
        if record.end is not None or index != len(record.generated):
            return  # a token decoded after a stop sequence matched: not part of the output
        self._store.append_token(record, token_id, logprobs)  # persisted before it is sent
        self._trace.token_recorded()
        if self._transcript.add(piece):
            self._transition(SessionEvent.STOP_MATCHED)
            self._runner.cancel()
            self._record_end(SessionEnd(EndReason.STOP, index + 1))
        # Once for all the tokens of a burst (a worker message may carry several steps):
        # behind them in the inbox, so the frames still leave in the same loop turn.
        if not self._pump_posted:
            self._pump_posted = True
            self._inbox.post(self._posted_pump)

    def prompt_scored(
        self, logprobs: tuple[TokenLogprobs, ...], ended: tuple[int, TokenLogprobs] | None
    ) -> None:
        if self.stale:
            return
        self.record.prompt_logprobs, self.record.ended_by = logprobs, ended
        self._store.save(self.record)

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
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

    def sequence_paused(self, state: PausedState) -> None:
        """(Its KV cells, if captured, were stored by the sink, on the engine thread.)"""
        n_generated = len(state.generated)
        self._transition(SessionEvent.ENGINE_PAUSED)
        self._runner.paused(n_generated, after_end=self.finished)
        self.pauses += 1
        self.paused.set()
        self._trace.paused()
        self._pump(progress=False)  # the pause checkpoint follows every recorded token
        if self._attachment is not None:
            self._attachment.paused(self._transcript, n_generated)
        self._maybe_run()
        self._check_idle()

    def sequence_resumed(self, path: ResumePath) -> None:
        self.resume_paths.append(path)
        self._trace.resumed(path)
        self._runner.resumed(path)

    def sequence_planned(self, plan: PrefillPlan) -> None:
        if not self.stale and self._runner.planned(plan):
            # Waited for (once per generation that reused cells): see Runner.planned.
            self._store.save(self.record).result()

    # --- internals -----------------------------------------------------------------------

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

    def _halt(self, left: SessionState, *, capture_kv: bool, keep_place: bool = False) -> None:
        """Pause the sequence if the state ``left`` ran one, give up a queued restart and (but
        with ``keep_place``) the place in line; then see whether anything is left."""
        if left in HOLDS_SEQUENCE:
            self._runner.pause(capture_kv=capture_kv)
        self._runner.stop_restarting()
        if not keep_place:
            self._runner.leave_line()
        self._check_idle()

    def _record_end(self, end: SessionEnd) -> None:
        if self.stale:
            return  # the process that owns the session now records its end
        if end.ended_at_s is None:
            end = dataclasses.replace(end, ended_at_s=time.time())
        self.record.end = end
        self._transcript.close()
        self._store.save(self.record)
        self._store.close_log(self.record)
        self._runner.ended()

    def _maybe_run(self) -> None:
        """Start (or restart) the engine sequence if a reader is there and has room."""
        attachment = self._attachment
        if attachment is None or self._shutting_down:
            return  # nobody to run for, or the server is going
        if not allows(self._state, SessionEvent.RESUME_QUEUED):
            return  # it runs, waits to, has ended or is stale
        if attachment.reader.has_room(len(self.record.generated)):
            self._transition(SessionEvent.RESUME_QUEUED)
            self._trace.restart_wanted()
            self._runner.restart(self.client, partial(self._ready, started=self._runner.restarted))

    def _ready(self, ready: Ready, *, started: Callable[[], None]) -> None:
        """A wait for a slot is over (a new generation's turn in line, or a restart's slot and
        KV blob): run, the slot held, if a reader still waits for it; then ``started()``."""
        if isinstance(ready, GiveUp):
            self._drop_start(ready)
        elif self._attachment is None or self.finished:
            # The reader left meanwhile (or a proxy cut the stream while it waited in line):
            # no compute for nobody; the slot goes to the next in line.
            self._drop_start(None)
        else:
            try:
                self._submit(ready)
            except EngineError as exc:
                self._drop_start(self._runner.refused(exc, self._maybe_run))
            else:
                started()

    def _drop_start(self, give_up: GiveUp | None) -> None:
        """A (re)start that waited is given up; ``give_up``: the reader is told why."""
        self._transition(SessionEvent.RESUME_DROPPED)
        self._runner.release()
        if give_up is not None:
            self._fail_reader(give_up.message, give_up.code)
        else:
            self._check_idle()

    def _submit(self, resume: ResumePoint | None) -> None:
        self._runner.submit(resume, self)
        self._transition(SessionEvent.SUBMITTED)
        self.paused.clear()
        self.idle.clear()
        generated, attachment = len(self.record.generated), self._attachment
        if attachment is None:
            self._runner.allow(generated + self._flow.max_tokens_ahead)
        else:
            attachment.reader.delivery.run_started()
            self._runner.allow(attachment.reader.allowance(generated))

    def _posted_pump(self) -> None:
        self._pump_posted = False
        if self._attachment is not None:
            self._attachment.reader.delivery.recorded(len(self.record.generated), self._loop.time())
        self._pump()

    def _pump(self, *, progress: bool = True) -> None:
        """Write every frame the attached reader has not been sent yet (then, with
        ``progress``, update its flow-control state, which may restart the engine)."""
        attachment = self._attachment
        if attachment is None:
            return
        record, now = self.record, self._loop.time()
        # Only what the store holds durably goes out (the file store: every token at once).
        sendable = min(len(self._transcript), self._store.durable_tokens(record))
        attachment.send(self._transcript, sendable, now)
        if record.end is not None and attachment.reader.next_index >= len(record.generated):
            self._transition(SessionEvent.READER_ENDED)
            self._end_stream(self._transcript.end())
            self._store.touch(record)
            self._check_idle()
        elif progress:
            self._progress(now)

    def _progress(self, now: float) -> None:
        attachment = self._attachment
        if attachment is None:
            return
        attachment.acknowledged(now)
        if self._state in HOLDS_SEQUENCE and self._runner.running:
            self._runner.allow(attachment.reader.allowance(len(self.record.generated)))
        else:
            self._maybe_run()

    def _fail_reader(self, message: str, code: ErrorCode = ErrorCode.ENGINE_UNAVAILABLE) -> None:
        """End the reader's stream with ERROR(``code``); the session stays resumable (its
        tokens are on disk), so the client can come back once the engine is."""
        self._pump(progress=False)  # every recorded token first
        if self._attachment is not None:
            self._transition(SessionEvent.READER_FAILED)
            self._end_stream(quicsrv_proto.Error(code=code, message=message))
        self._check_idle()

    def _end_stream(self, frame: quicsrv_proto.Frame) -> bool:
        """Detach the reader, its stream ending with ``frame``; whether a stream was told (the
        stand-in of an unattended session is no one to tell)."""
        attachment, self._attachment = self._attachment, None
        return attachment is not None and attachment.end(frame)

    def _check_idle(self) -> None:
        if self._attachment is None and self._state in IDLE:
            self._runner.settle()
            self._store.close_log(self.record)
            self.idle.set()
            self._trace.closed(self.record.end.reason.value if self.record.end else "detached")
            self._on_idle(self)
