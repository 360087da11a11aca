"""A shutdown's hand-over: every live generation paused with its KV cells, and every record
and blob written where the next process reads them, before the readers are told to resume.

Nothing here waits for a reader: a pause is the engine's (its KV cells captured on the engine
side, the blob stored by the sink), the records and blobs are written by the store, and the END
frames are only handed to the streams. The grace period is for the pauses the engine is still
making; one that does not land in it is logged with what the engine was doing
(:func:`late_pause_reason`), and that session resumes by replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ..engine import EngineHealth
from .kvstore import KVStore
from .session import Session

__all__ = ["HandOver", "hand_over", "late_pause_reason"]

log = logging.getLogger(__name__)


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


def late_pause_reason(health: EngineHealth, state: str, tokens_since_asked: int) -> str:
    """Why the engine had not reported a session's pause when the grace period ran out, from
    the engine's health and what it did for the session (in ``state``) since it was asked."""
    if health.failure is not None:
        return f"the engine takes no work ({health.failure})"
    if health.restarting:
        return "the engine worker died and the next one is not running yet"
    if tokens_since_asked:
        return (
            f"the engine went on decoding it ({tokens_since_asked} tokens since the pause was "
            f"asked, session {state}): it had not reached the pause command yet"
        )
    return (
        f"the engine decoded nothing for it since the pause was asked (session {state}): its "
        "step is slow (a long prefill, a loaded machine) or stuck"
    )


async def hand_over(
    sessions: list[Session],
    *,
    kv: KVStore,
    persisted: Callable[[], Awaitable[None]],
    grace_s: float,
    engine_health: Callable[[], EngineHealth] = EngineHealth,
) -> HandOver:
    """After every session was paused for the shutdown: wait (up to ``grace_s``) for the pauses
    to land, write the records (``persisted``) and the KV cells where the next process reads
    them, then end every reader's stream with END(shutdown), which tells it to resume. A session
    whose pause did not land in time resumes by replay; the log says which and why
    (``engine_health``: how the engine is then)."""
    held = [s for s in sessions if not s.sequence_released.is_set()]
    asked = {s.session_id: len(s.record.generated) for s in held}
    if held:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(s.sequence_released.wait() for s in held)), grace_s
            )
    late = [s for s in held if not s.sequence_released.is_set()]
    if late:
        health = engine_health()
        for session in late:
            generated = len(session.record.generated)
            log.warning(
                "shutdown: the pause of session %s did not land in the %.1f s grace period "
                "(%d tokens recorded): %s; it resumes by replay",
                session.session_id.hex(),
                grace_s,
                generated,
                late_pause_reason(
                    health, session.state.value, generated - asked[session.session_id]
                ),
                extra={"event": "late_pause", "session_id": session.session_id.hex()},
            )
    await persisted()
    await asyncio.to_thread(kv.persist)
    saved = sum(
        kv.has(s.session_id, len(s.record.generated))
        for s in sessions
        if s.record.end is None and s.record.generated
    )
    told = sum(session.end_for_shutdown() for session in sessions)
    return HandOver(
        paused=len(held),
        kv_saved=saved,
        replay=len(late),
        streams_told=told,
    )
