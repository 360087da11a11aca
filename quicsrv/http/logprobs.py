"""Log-probabilities in the shapes of OpenAI's APIs, made from TOKEN frames.

The numbers are the engine's (:class:`~quicsrv.engine.TokenLogprobs`: the model's own
distribution, before temperature, penalties, filters and grammar, which is what OpenAI's
``logprobs`` report) as the session's token log keeps them, so a resumed stream carries the same
values, bit for bit, as the uninterrupted one. A token is named as OpenAI names it: its text,
or ``bytes:\\xNN...`` where its bytes are not whole UTF-8 on their own, with ``bytes`` the raw
bytes either way.

Two shapes:

- chat completions and the Responses API: one entry per token, ``{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}...]}`` (:func:`entry`);
- text completions (the legacy shape): parallel lists ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (a ``{token: logprob}`` object per token) and ``text_offset``
  (:class:`CompletionLogprobs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import quicsrv_proto

from ..engine import TokenLogprobs
from ..sessions.record import SessionRecord
from .errors import ApiError

__all__ = [
    "CompletionLogprobs",
    "Piece",
    "chat_logprobs",
    "completion_request",
    "entries",
    "entry",
    "recorded",
    "responses_request",
    "token_name",
]

Piece = Callable[[int], bytes]
"""A token id's bytes (the vocabulary)."""

#: What OpenAI answers for a token the model gives no probability at all (-inf).
_UNLIKELY = -9999.0


def token_name(piece: bytes) -> str:
    """A token as OpenAI names it: its text, or ``bytes:`` and its bytes escaped where they
    are not whole UTF-8 (a piece of a character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def _number(logprob: float | None) -> float:
    return _UNLIKELY if logprob is None or not math.isfinite(logprob) else logprob


def _alternative(token_id: int, logprob: float, piece: Piece) -> dict[str, Any]:
    raw = piece(token_id)
    return {"token": token_name(raw), "logprob": _number(logprob), "bytes": list(raw)}


def entry(
    token_id: int, logprob: float | None, top: Iterable[tuple[int, float]], piece: Piece
) -> dict[str, Any]:
    """One token's entry in chat completions' ``logprobs.content`` and the Responses API's
    ``logprobs``."""
    return _alternative(token_id, _number(logprob), piece) | {
        "top_logprobs": [_alternative(i, lp, piece) for i, lp in top]
    }


def entries(tokens: Iterable[quicsrv_proto.Token], piece: Piece) -> list[dict[str, Any]]:
    """The entries of TOKEN frames that carry log-probabilities."""
    return [entry(t.token_id, t.logprob, t.top_logprobs, piece) for t in tokens]


def chat_logprobs(tokens: Iterable[quicsrv_proto.Token], piece: Piece) -> dict[str, Any]:
    """A chat completion choice's (or chunk's) ``logprobs``: TOKEN frames' entries."""
    return {"content": entries(tokens, piece), "refusal": None}


def recorded(record: SessionRecord, piece: Piece) -> tuple[dict[str, Any], ...]:
    """The entries of a session record's tokens, from its token log (none if it keeps none)."""
    if record.logprobs is None:
        return ()
    return tuple(
        entry(token, lp.logprob, lp.top, piece)
        for token, lp in zip(record.generated, record.logprobs, strict=True)
    )


# --- what a request asks for ---------------------------------------------------------------


def completion_request(request: dict[str, Any], *, chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with; None: none asked for.
    Chat: ``logprobs`` true and ``top_logprobs`` 0-20 (OpenAI's rule: only with logprobs);
    text completions: ``logprobs`` itself, an integer (OpenAI stops at 5, llama-server and
    vLLM go further; here the chat bound)."""
    bound = quicsrv_proto.MAX_TOP_LOGPROBS
    if not chat:
        value = request.get("logprobs")
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= bound:
            raise _invalid(f"logprobs must be an integer from 0 to {bound}", "logprobs")
        return value
    wanted = _flag(request, "logprobs")
    top = request.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= bound:
        raise _invalid(f"top_logprobs must be an integer from 0 to {bound}", "top_logprobs")
    if not wanted:
        if top:
            raise _invalid("logprobs must be true when top_logprobs is given", "top_logprobs")
        return None
    return top


#: What ``include`` may name: the output text's log-probabilities, and encrypted reasoning
#: (there is never any: the output is the same with or without it).
_INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content")


def responses_request(request: dict[str, Any]) -> int | None:
    """How many alternatives each output token's log-probability comes with (``include``
    names ``message.output_text.logprobs``, or ``top_logprobs`` asks for some); None: none."""
    include = request.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or any(v not in _INCLUDES for v in include):
        raise _invalid(f"include may hold only {', '.join(_INCLUDES)}", "include")
    top = request.get("top_logprobs")
    bound = quicsrv_proto.MAX_TOP_LOGPROBS
    if top is not None and (
        not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= bound
    ):
        raise _invalid(f"top_logprobs must be an integer from 0 to {bound}", "top_logprobs")
    if "message.output_text.logprobs" in include or top:
        return top or 0
    return None


def _flag(request: dict[str, Any], name: str) -> bool:
    value = request.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _invalid(f"{name} must be a boolean", name)
    return value


def _invalid(message: str, param: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)


# --- what an answer shows ----------------------------------------------------------------


class CompletionLogprobs:
    """Text completions' ``logprobs`` object, built token by token; ``offset``: characters of
    text before the first token (a resumed stream's, or the echoed prompt's)."""

    __slots__ = ("_offset", "_piece", "text_offset", "token_logprobs", "tokens", "top_logprobs")

    def __init__(self, piece: Piece, offset: int = 0) -> None:
        self._piece = piece
        self._offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, logprob: float | None, top: dict[str, float] | None) -> None:
        """One token (``logprob`` None: the prompt's first, which nothing predicts)."""
        raw = self._piece(token_id)
        self.tokens.append(token_name(raw))
        self.token_logprobs.append(None if logprob is None else _number(logprob))
        self.top_logprobs.append(top)
        self.text_offset.append(self._offset)
        self._offset += len(raw.decode("utf-8", errors="replace"))

    def add_token(self, token: quicsrv_proto.Token) -> None:
        self.add(token.token_id, token.logprob, self._top(token.top_logprobs))

    def add_scored(self, token_id: int, logprobs: TokenLogprobs) -> None:
        self.add(token_id, logprobs.logprob, self._top(logprobs.top))

    def _top(self, alternatives: Iterable[tuple[int, float]]) -> dict[str, float]:
        # Two ids may share a text: the likelier one's value is kept, as OpenAI's object can.
        top: dict[str, float] = {}
        for token_id, logprob in alternatives:
            top.setdefault(token_name(self._piece(token_id)), _number(logprob))
        return top

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }

    def take(self) -> dict[str, Any]:
        """:meth:`body`, and start empty from where it ends (a stream's next chunk)."""
        body = self.body()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return body
