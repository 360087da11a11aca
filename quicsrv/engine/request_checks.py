"""What an engine refuses at the door: a request it could never run, or never run exactly, and
one more sequence past its slots and its queue. Called before a request is queued, by the
in-process engine (:mod:`.llama`) and by the worker's front (:mod:`.supervisor`), so that both
refuse the same requests the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._api import CannotReplay, EngineError, Overloaded, PrefillPlan, PromptTooLong, SequenceRequest

if TYPE_CHECKING:
    from .llama import EngineSettings

__all__ = ["check_admission", "check_request"]


def check_request(settings: EngineSettings, request: SequenceRequest) -> int:
    """Refuse what an engine with ``settings`` could never run; returns the prefill chunk."""
    if not request.prompt_tokens:
        raise PromptTooLong("the prompt is empty after tokenization")
    chunk = request.prefill_chunk or settings.prefill_chunk
    if not 0 < chunk <= settings.n_batch - settings.n_seq_max:
        # A chunk must always fit beside every decoding sequence's token, so prompts are cut
        # the same way whatever else is running: an exact replay depends on it.
        raise EngineError(
            f"prefill chunk {chunk} must be in 1..n_batch - n_seq_max "
            f"({settings.n_batch - settings.n_seq_max})"
        )
    plan = request.prefill_plan
    if plan is not None and not _plan_fits(plan, len(request.prompt_tokens), settings):
        raise CannotReplay(
            "this generation's prompt was computed in steps this server's prefill settings no "
            "longer allow (n_batch - n_seq_max), so it cannot be continued exactly"
        )
    budget = len(request.prompt_tokens) + request.max_tokens
    if budget > settings.context_per_sequence:
        raise PromptTooLong(
            f"prompt ({len(request.prompt_tokens)} tokens) + max_tokens "
            f"({request.max_tokens}) exceeds the per-sequence context of "
            f"{settings.context_per_sequence} tokens"
        )
    return chunk


def _plan_fits(plan: PrefillPlan, n_prompt: int, settings: EngineSettings) -> bool:
    start = 0
    for segment in plan.segments:
        if segment.end <= start or not 0 < segment.step <= settings.n_batch - settings.n_seq_max:
            return False
        start = segment.end
    return start == n_prompt


def check_admission(settings: EngineSettings, admitted: int) -> None:
    """Refuse one more sequence past the slots and the queue, with a retry hint."""
    limit = settings.n_seq_max + settings.max_queued
    if admitted >= limit:
        raise Overloaded(
            f"{admitted} generations active or queued (limit {limit})", retry_after_s=1.0
        )
