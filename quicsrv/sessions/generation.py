"""A GENERATE checked against this server's limits and turned into an engine request."""

from __future__ import annotations

import secrets

import quicsrv_proto
from quicsrv_proto import ErrorCode

from ..engine import Engine, SamplingParams, SequenceRequest

__all__ = ["INLINE_PROMPT_CHARS", "RequestRejected", "build_request", "prompt_chars"]

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
    if frame.messages is not None:
        text = engine.render_chat([{"role": m.role, "content": m.content} for m in frame.messages])
        tokens = engine.tokenize(text, add_special=False)
    else:
        assert frame.prompt is not None  # proto guarantees exactly one of the two
        tokens = engine.tokenize(frame.prompt, add_special=True)
    if len(tokens) + frame.max_tokens > engine.context_per_sequence:
        raise RequestRejected(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt of {len(tokens)} tokens + max_tokens {frame.max_tokens} does not fit the "
            f"context of {engine.context_per_sequence} tokens",
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


def _random_seed() -> bytes:
    return secrets.token_bytes(8)
