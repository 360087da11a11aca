"""One generation's stream: engine tokens in, TOKEN/END/ERROR frames out.

Text deltas are UTF-8 safe (an incremental decoder holds back an incomplete character) and stop
sequences are matched on text, holding back any tail that could still become a match.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import secrets
from collections.abc import Callable

import proto
from proto import EndReason, ErrorCode

from ..engine import (
    Engine,
    EngineError,
    FinishReason,
    PromptTooLong,
    SamplingParams,
    SequenceHandle,
    SequenceRequest,
)

__all__ = ["GenerationStream", "RequestRejected", "build_request"]

log = logging.getLogger(__name__)

SendBytes = Callable[[bytes, bool], None]
"""Writes bytes to the stream; the flag ends the stream."""

_FINISH_TO_END = {
    FinishReason.LENGTH: EndReason.LENGTH,
    FinishReason.EOS: EndReason.EOS,
    FinishReason.CANCELLED: EndReason.CANCELLED,
    FinishReason.SHUTDOWN: EndReason.SHUTDOWN,
}


class RequestRejected(Exception):
    """A request the server refuses before any token, with its wire code."""

    def __init__(self, code: ErrorCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s

    def to_frame(self) -> proto.Error:
        return proto.Error(code=self.code, message=self.message, retry_after_s=self.retry_after_s)


def build_request(
    engine: Engine, frame: proto.Generate, *, max_tokens_limit: int
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


class GenerationStream:
    """Drives one generation and writes its frames through ``send``, on the event loop."""

    def __init__(
        self,
        *,
        engine: Engine,
        request: SequenceRequest,
        stop: tuple[str, ...],
        send: SendBytes,
        loop: asyncio.AbstractEventLoop,
        on_done: Callable[[GenerationStream], None],
    ) -> None:
        self._engine = engine
        self._request = request
        self._stop = stop
        self._send = send
        self._loop = loop
        self._on_done = on_done
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet sent: it may be the start of a stop sequence
        self._ended = False
        self._handle: SequenceHandle | None = None
        # 128 random bits: unguessable, so a session can only be named by whoever was told it.
        self.session_id = secrets.token_hex(16)

    @property
    def ended(self) -> bool:
        return self._ended

    def start(self) -> None:
        try:
            self._handle = self._engine.submit(self._request, self)
        except PromptTooLong as exc:
            raise RequestRejected(ErrorCode.PROMPT_TOO_LONG, str(exc)) from None
        except EngineError as exc:
            retry = getattr(exc, "retry_after_s", None)
            code = ErrorCode.OVERLOADED if retry is not None else ErrorCode.SHUTTING_DOWN
            raise RequestRejected(code, str(exc), retry) from None

    def cancel(self) -> None:
        """The peer went away: stop the engine; nothing more is sent."""
        self._ended = True
        if self._handle is not None:
            self._handle.cancel()
        self._on_done(self)

    def end_for_shutdown(self) -> None:
        """Server shutdown: tell the client, then stop the engine."""
        self._finish(EndReason.SHUTDOWN, self._completed)

    # TokenSink, called on the engine thread: hop to the event loop.
    def token_generated(self, index: int, token_id: int, piece: bytes) -> None:
        self._loop.call_soon_threadsafe(self._on_token, index, token_id, piece)

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self._loop.call_soon_threadsafe(self._finish, _FINISH_TO_END[reason], completion_tokens)

    _completed = 0

    def _on_token(self, index: int, token_id: int, piece: bytes) -> None:
        if self._ended:
            return
        self._completed = index + 1
        self._held += self._utf8.decode(piece)
        text, matched = self._release_text()
        self._send(
            proto.encode_frame(proto.Token(index=index, token_id=token_id, text=text)), False
        )
        if matched:
            self._finish(EndReason.STOP, self._completed)

    def _release_text(self) -> tuple[str, bool]:
        """Text safe to send now, and whether a stop sequence matched."""
        held = self._held
        hits = [held.find(s) for s in self._stop if s in held]
        if hits:
            self._held = ""
            return held[: min(hits)], True
        keep = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(held)), 0, -1):
                if held.endswith(stop[:length]):
                    keep = max(keep, length)
                    break
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def _finish(self, reason: EndReason, completion_tokens: int) -> None:
        if self._ended:
            return
        self._ended = True
        if self._handle is not None and reason in (EndReason.STOP, EndReason.SHUTDOWN):
            self._handle.cancel()
        tail = "" if reason is EndReason.STOP else self._held + self._utf8.decode(b"", final=True)
        end = proto.End(
            reason=reason,
            text=tail,
            prompt_tokens=len(self._request.prompt_tokens),
            completion_tokens=completion_tokens,
        )
        self._send(proto.encode_frame(end), True)
        self._on_done(self)
