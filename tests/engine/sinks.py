"""A TokenSink that records what one real engine sequence reports (model tests)."""

from __future__ import annotations

import threading

from quicsrv.engine import FinishReason, PausedState, PrefillPlan, ResumePath

__all__ = ["RecordingSink"]


class RecordingSink:
    """One sequence's tokens, pieces, plans and end; ``done`` once it finished or paused."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.pieces: list[bytes] = []
        self.plans: list[PrefillPlan] = []
        self.paths: list[ResumePath] = []
        self.done = threading.Event()
        self.reason: FinishReason | None = None
        self.completion_tokens: int | None = None

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        self.tokens.append(token_id)
        self.pieces.append(piece)

    def prompt_scored(self, logprobs: object, ended: object) -> None:
        pass  # never asked for here

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self.reason = reason
        self.completion_tokens = completion_tokens
        self.done.set()

    def sequence_paused(self, state: PausedState) -> None:
        self.done.set()

    def sequence_resumed(self, path: ResumePath) -> None:
        self.paths.append(path)

    def sequence_planned(self, plan: PrefillPlan) -> None:
        self.plans.append(plan)
