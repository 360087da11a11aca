"""The engine's sink of one session: its reports, made on the engine thread, handled on the loop.

Each report is one post to the loop's inbox (:mod:`.inbox`: one wake-up per burst, not one per
token) of the same-named method of the session, which runs on the loop. A paused sequence's KV
cells are stored here, on the engine thread, so that a spill to disk never blocks the loop.
"""

from __future__ import annotations

from ..engine import (
    FinishReason,
    PausedState,
    PrefillPlan,
    ResumePath,
    TokenLogprobs,
    TokenSink,
)
from .inbox import LoopInbox
from .kvstore import KVStore

__all__ = ["LoopSink"]


class LoopSink:
    """The :class:`~quicsrv.engine.TokenSink` the engine is handed for one session, the same
    across its restarts (the engine knows a generation by its sink)."""

    __slots__ = ("__weakref__", "_inbox", "_kv", "_session_id", "target")

    def __init__(self, *, inbox: LoopInbox, kv: KVStore, session_id: bytes) -> None:
        """``kv`` keeps the cells of session ``session_id``'s paused sequences."""
        self._inbox = inbox
        self._kv = kv
        self._session_id = session_id
        self.target: TokenSink | None = None
        """What handles the reports, on the loop: set from a submit on (while the engine may
        report), None once the session is idle, so that it and this sink hold no reference
        cycle and it goes as soon as nothing else holds it."""

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: TokenLogprobs | None
    ) -> None:
        target = self.target
        if target is not None:
            self._inbox.post(target.token_generated, index, token_id, piece, logprobs)

    def prompt_scored(
        self, logprobs: tuple[TokenLogprobs, ...], ended: tuple[int, TokenLogprobs] | None
    ) -> None:
        target = self.target
        if target is not None:
            self._inbox.post(target.prompt_scored, logprobs, ended)

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        target = self.target
        if target is not None:
            self._inbox.post(target.sequence_finished, reason, completion_tokens)

    def sequence_paused(self, state: PausedState) -> None:
        if state.kv_state is not None:
            self._kv.put(self._session_id, len(state.generated), state.kv_state)
            # The loop needs no cells: a blob posted there would live until the loop drains.
            state = PausedState(generated=state.generated, kv_state=None)
        target = self.target
        if target is not None:
            self._inbox.post(target.sequence_paused, state)

    def sequence_resumed(self, path: ResumePath) -> None:
        target = self.target
        if target is not None:
            self._inbox.post(target.sequence_resumed, path)

    def sequence_planned(self, plan: PrefillPlan) -> None:
        target = self.target
        if target is not None:
            self._inbox.post(target.sequence_planned, plan)
