"""One session's engine sequence, what it waits on, and what the engine's answers mean.

:class:`Runner` holds the engine's handle of the sequence and the slot it runs under (or is
about to), a new generation's place in line, a restart waiting for a slot and its KV blob, and
the timer of a retry after the engine refused a (re)start; it gives each back when told. It
knows no reader and no lifecycle state: the session decides when to run and wait and, handed
the slot (or the resume point) once a wait is over, whether it is still wanted.

Pure answers: :func:`after_refusal`, what a refusal means (try again when the engine says, or
tell the reader with the wire code of :mod:`.errors`, since no retry helps); :data:`FINISHES`,
what each report of a sequence's end means for the lifecycle and the record.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from quicsrv_proto import EndReason, ErrorCode

from ..engine import (
    Engine,
    EngineError,
    FinishReason,
    PrefillPlan,
    ResumePath,
    ResumePoint,
    SequenceHandle,
    TokenSink,
)
from .admission import FairGate, Place, Slot
from .errors import RequestRejected, engine_error_code
from .kvstore import KVStore
from .lifecycle import SessionEvent
from .record import SessionRecord
from .settings import FlowSettings
from .sink import LoopSink

__all__ = [
    "DEFAULT_RETRY_S",
    "FINISHES",
    "Finish",
    "GiveUp",
    "Ready",
    "Retry",
    "Runner",
    "after_refusal",
]

#: A refused (re)start without the engine's hint is tried again after this long.
DEFAULT_RETRY_S = 1.0

# No retry changes these: the engine is down for good, or this server's settings changed since
# the session started (its prompt no longer fits, its recorded prefill plan cannot be followed).
_FOR_GOOD = frozenset(
    {ErrorCode.ENGINE_UNAVAILABLE, ErrorCode.MODEL_CHANGED, ErrorCode.PROMPT_TOO_LONG}
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Retry:
    """Try the (re)start again."""

    after_s: float
    """...this much later."""


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Tell the reader: it may resume once the engine (or the server's settings) is back."""

    code: ErrorCode
    message: str


def after_refusal(exc: EngineError) -> Retry | GiveUp:
    """What the engine refusing a session's (re)start with ``exc`` means for it."""
    code = engine_error_code(exc)
    if code in _FOR_GOOD:
        return GiveUp(code, str(exc))
    return Retry(DEFAULT_RETRY_S if exc.retry_after_s is None else exc.retry_after_s)


@dataclass(frozen=True, slots=True)
class Finish:
    """What the engine reporting a sequence's end means."""

    event: SessionEvent
    """For the lifecycle."""
    end: EndReason | None = None
    """The record ends so, unless it already has (None: it stays open, resumable)."""
    failure: str | None = None
    """The reader is told so (ERROR engine_unavailable): it may resume later."""


FINISHES: Mapping[FinishReason, Finish] = MappingProxyType(
    {
        FinishReason.LENGTH: Finish(SessionEvent.ENGINE_COMPLETED, end=EndReason.LENGTH),
        FinishReason.EOS: Finish(SessionEvent.ENGINE_COMPLETED, end=EndReason.EOS),
        # A stop sequence or a cancel, recorded already: the engine's report comes late.
        FinishReason.CANCELLED: Finish(SessionEvent.ENGINE_STOPPED),
        # The next server process picks the session up.
        FinishReason.SHUTDOWN: Finish(SessionEvent.ENGINE_STOPPED),
        FinishReason.FAILED: Finish(
            SessionEvent.ENGINE_FAILED,
            failure="the engine failed and could not be restarted; resume later",
        ),
        FinishReason.POISONED: Finish(
            SessionEvent.ENGINE_FAILED,
            failure="this generation crashed the engine worker again and again: it was "
            "stopped so that the others could go on",
        ),
    }
)
"""Each report of a sequence's end: the record ends only on a natural one."""


Ready = ResumePoint | GiveUp | None
"""A wait for a slot is over: the slot held, the sequence starts from scratch (None) or picks up
at a resume point; or a :class:`GiveUp`, the wait in line having run out."""


class Runner:
    """See the module docstring. On the event loop. Submits ``record``'s sequence to
    ``engine``, whose reports ``sink`` takes."""

    def __init__(
        self,
        record: SessionRecord,
        engine: Engine,
        sink: LoopSink,
        *,
        kv: KVStore,
        gate: FairGate,
        flow: FlowSettings,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._record = record
        self._engine = engine
        self._sink = sink
        self._kv = kv
        self._gate = gate
        self._flow = flow
        self._loop = loop
        self._handle: SequenceHandle | None = None  # live while the engine holds the sequence
        self._slot: Slot | None = None  # held while the engine runs (or is about to)
        self._in_line: asyncio.Task[None] | None = None  # a new generation waiting its turn
        self._restarting: asyncio.Task[None] | None = None
        self._retry: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        """The engine holds the sequence (it was submitted and has not been let go)."""
        return self._handle is not None

    def start(self, slot: Slot, submit: Callable[[ResumePoint | None], None]) -> None:
        """Run a new generation under ``slot`` at once, ``submit`` handing it to the engine;
        the slot goes back if that raises (EngineError: refused)."""
        self._slot = slot
        try:
            submit(None)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """The engine holds nothing (or never will): give the slot back."""
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()

    def submit(self, resume: ResumePoint | None, target: TokenSink) -> None:
        """Hand the engine the sequence (``resume``: where a restart picks it up) under the slot
        held, its reports going to ``target`` on the loop; raises EngineError when it
        refuses."""
        record = self._record
        request = record.spec.request(
            resume=resume,
            prefill_plan=record.prefill_plan,
            cache_scope="" if self._flow.prefix_cache_shared else record.owner,
            scored=record.prompt_logprobs is not None,
        )
        self._sink.target = target
        try:
            self._handle = self._engine.submit(request, self._sink)
        except BaseException:
            self._sink.target = None  # nothing will report
            raise

    def allow(self, n_tokens: int) -> None:
        """Let the running sequence generate ``n_tokens`` tokens in all."""
        if self._handle is not None:
            self._handle.allow(n_tokens)

    def pause(self, *, capture_kv: bool) -> None:
        """Ask the engine to pause the running sequence."""
        if self._handle is not None:
            self._handle.pause(capture_kv=capture_kv)

    def cancel(self) -> None:
        """Ask the engine to drop the running sequence."""
        if self._handle is not None:
            self._handle.cancel()

    def released(self) -> None:
        """The engine let the sequence go (it ended, or paused): the slot goes back."""
        self._handle = None
        self.release()

    def paused(self, n_generated: int, *, after_end: bool) -> None:
        """The engine paused the sequence after ``n_generated`` tokens, and let it go.
        ``after_end``: the record had ended first (a stop, a cancel), so the cells of the
        pause, stored on the engine thread after the end discarded the session's, are of no
        use to anyone."""
        self.released()
        if after_end:
            self.ended()
        log.debug("session %s paused at %d tokens", self._record.session_id.hex(), n_generated)

    def ended(self) -> None:
        """The record ended: nothing restarts, the cells kept for it go."""
        self._kv.discard(self._record.session_id)

    def resumed(self, path: ResumePath) -> None:
        """The engine has the sequence's cells back, rebuilt by ``path``."""
        session_id = self._record.session_id.hex()
        log.info(
            "session %s resumed by %s at %d tokens",
            session_id,
            path.value,
            len(self._record.generated),
            extra={"event": "session_resumed", "session_id": session_id, "resume_path": path.value},
        )

    def planned(self, plan: PrefillPlan) -> bool:
        """The engine computes a new generation's prompt cells as ``plan`` says: keep it with
        the record (a replay must follow it to be exact; a cold start needs none). Whether the
        record changed: it must then be on disk before the first token is sent, or a crash
        would replay the prompt another way, and the continuation could differ from what the
        reader holds. A resume follows the plan on record."""
        record = self._record
        if record.generated:
            return False
        kept = None if plan.is_cold(record.spec.prefill_chunk) and not plan.reused else plan
        if kept == record.prefill_plan:
            return False
        record.prefill_plan = kept
        return True

    def resume_path(self) -> ResumePath | None:
        """How a restart now would rebuild the KV cells (None: nothing to rebuild)."""
        n_generated = len(self._record.generated)
        if not n_generated:
            return None
        if self._kv.has(self._record.session_id, n_generated):
            return ResumePath.KV_RESTORE
        return ResumePath.REPREFILL if self._flow.inexact_reprefill else ResumePath.REPLAY

    def enter_line(self, place: Place, timeout_s: float, then: Callable[[Ready], None]) -> None:
        """Wait for ``place``'s turn, at most ``timeout_s``; then call ``then``, the slot held
        (``None``: a plain start), or told why not when the wait ran out."""
        self._in_line = self._loop.create_task(self._wait_turn(place, timeout_s, then))

    def leave_line(self) -> None:
        """Give up the place in line, if any."""
        task, self._in_line = self._in_line, None
        if task is not None and not task.done():
            task.cancel()

    def restart(self, client: str, then: Callable[[Ready], None]) -> None:
        """Wait for a slot of ``client``'s, then read the KV blob of the tokens generated (on a
        worker thread); then hand ``then`` where the sequence picks up, the slot held."""
        self._restarting = self._loop.create_task(self._restart(client, then))

    def stop_restarting(self) -> None:
        """Give up a restart still waiting for its slot or its KV blob."""
        task, self._restarting = self._restarting, None
        if task is not None and not task.done():
            task.cancel()

    def restarted(self) -> None:
        """The engine took the restart: it holds the cells now, a blob kept for them is stale."""
        self._kv.discard(self._record.session_id)

    def refused(self, exc: EngineError, retry: Callable[[], None]) -> GiveUp | None:
        """The engine refused to (re)start: ``retry`` is called when it says; or, where no retry
        helps, what to tell the reader."""
        answer = after_refusal(exc)
        if isinstance(answer, GiveUp):
            return answer
        log.info("session %s waits to start: %s", self._record.session_id.hex(), exc)
        self._retry = self._loop.call_later(answer.after_s, retry)
        return None

    def settle(self) -> None:
        """Nothing runs or waits for the session now: give the slot back, forget a retry, and
        take no report (none can come: the engine let the sequence go)."""
        self.release()
        self._sink.target = None
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None

    async def _wait_turn(
        self, place: Place, timeout_s: float, then: Callable[[Ready], None]
    ) -> None:
        try:
            self._slot = await place.wait(timeout_s)
        except RequestRejected as exc:  # the queue wait ran out: nothing ran, nothing is lost
            self._in_line = None
            then(GiveUp(exc.code, str(exc)))
            return
        self._in_line = None
        then(None)

    async def _restart(self, client: str, then: Callable[[Ready], None]) -> None:
        # A session coming back goes ahead of new requests, but waits its turn among the
        # other returning sessions (and under its reader's per-client cap).
        self._slot = await self._gate.acquire(client, resume=True)
        generated = self._record.generated
        kv = None
        if generated:
            kv = await asyncio.to_thread(self._kv.get, self._record.session_id, len(generated))
        self._restarting = None
        resume = None  # no token yet (it never ran): a plain start, prefill and all
        if generated:
            resume = ResumePoint(
                generated=tuple(generated),
                kv_state=kv,
                inexact_reprefill=self._flow.inexact_reprefill,
            )
        then(resume)
