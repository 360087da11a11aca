"""A GENERATE checked against this server's limits and turned into an engine request."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence

import quicsrv_proto
from quicsrv_proto import ChatMessage, ErrorCode, Truncation

from ..engine import Engine, SamplingParams, SequenceRequest
from .overflow import fit_history

__all__ = ["INLINE_PROMPT_CHARS", "RequestRejected", "build_request", "prompt_chars"]

log = logging.getLogger(__name__)

#: A prompt up to this size is tokenized on the event loop (tens of microseconds), a longer one
#: on a thread (tokenizing takes about half a microsecond per character).
INLINE_PROMPT_CHARS = 256
_MESSAGE_OVERHEAD_CHARS = 32  # what a chat template adds around each message, roughly


class RequestRejected(Exception):
    """A request the server refuses before any token, with its wire code."""

    def __init__(self, code: ErrorCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


def prompt_chars(frame: quicsrv_proto.Generate) -> int:
    """About how many characters a GENERATE gives the tokenizer (a chat: its messages, each
    with its template overhead, so many empty messages do not pass for a short prompt)."""
    if frame.messages is not None:
        return sum(len(m.role) + len(m.content) + _MESSAGE_OVERHEAD_CHARS for m in frame.messages)
    return len(frame.prompt or "")


def build_request(
    engine: Engine, frame: quicsrv_proto.Generate, *, max_tokens_limit: int
) -> SequenceRequest:
    """Validate a GENERATE against this server's limits and tokenize its prompt."""
    if frame.max_tokens > max_tokens_limit:
        raise RequestRejected(
            ErrorCode.INVALID_FIELD,
            f"GENERATE.max_tokens {frame.max_tokens} exceeds this server's limit "
            f"{max_tokens_limit}",
        )
    budget = engine.context_per_sequence - frame.max_tokens
    if frame.messages is not None:
        tokens = _chat_tokens(engine, frame.messages)
        if len(tokens) > budget and frame.truncation is Truncation.AUTO:
            kept = fit_history(
                frame.messages,
                budget=budget,
                prompt_tokens=lambda messages: len(_chat_tokens(engine, messages)),
                content_tokens=lambda m: len(engine.tokenize(m.content, add_special=False)),
            )
            if kept is not None:
                log.info(
                    "truncation auto: %d of %d messages kept to fit %d tokens",
                    len(kept),
                    len(frame.messages),
                    budget,
                )
                tokens = _chat_tokens(engine, kept)
    else:
        assert frame.prompt is not None  # proto guarantees exactly one of the two
        tokens = engine.tokenize(frame.prompt, add_special=True)
    if len(tokens) > budget:
        hint = (
            " even with its oldest turns dropped (truncation auto keeps the system messages "
            "and the newest turn)"
            if frame.truncation is Truncation.AUTO
            else "; truncation 'auto' drops a chat's oldest turns instead"
            if frame.messages is not None
            else ""
        )
        raise RequestRejected(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt of {len(tokens)} tokens + max_tokens {frame.max_tokens} does not fit the "
            f"context of {engine.context_per_sequence} tokens{hint}",
        )
    seed = frame.seed if frame.seed is not None else int.from_bytes(_random_seed(), "little")
    return SequenceRequest(
        prompt_tokens=tuple(tokens),
        max_tokens=frame.max_tokens,
        sampling=SamplingParams(
            temperature=frame.temperature,
            top_p=frame.top_p,
            top_k=frame.top_k,
            min_p=frame.min_p,
            repeat_penalty=frame.repeat_penalty,
            seed=seed,
        ),
        ignore_eos=frame.ignore_eos,
    )


def _chat_tokens(engine: Engine, messages: Sequence[ChatMessage]) -> list[int]:
    text = engine.render_chat([{"role": m.role, "content": m.content} for m in messages])
    return engine.tokenize(text, add_special=False)


def _random_seed() -> bytes:
    return secrets.token_bytes(8)
