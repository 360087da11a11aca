"""A shutdown's hand-over: every live generation paused with its KV cells, and every record
and blob written where the next process reads them, before the readers are told to resume."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from .kvstore import KVStore
from .session import Session

__all__ = ["HandOver", "hand_over"]


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


async def hand_over(
    sessions: list[Session],
    *,
    kv: KVStore,
    persisted: Callable[[], Awaitable[None]],
    grace_s: float,
) -> HandOver:
    """After every session was paused for the shutdown: wait (up to ``grace_s``) for the pauses
    to land, write the records (``persisted``) and the KV cells where the next process reads
    them, then end every reader's stream with END(shutdown), which tells it to resume. A session
    whose pause did not land in time resumes by replay."""
    held = [s for s in sessions if not s.sequence_released.is_set()]
    if held:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(s.sequence_released.wait() for s in held)), grace_s
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
        replay=sum(not s.sequence_released.is_set() for s in held),
        streams_told=told,
    )
