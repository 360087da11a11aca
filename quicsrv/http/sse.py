"""A session's frames as OpenAI SSE events, each with a resumable ``id:`` cursor.

The session machinery hands every reader the same frame sequence (TOKEN..., END); here one
stream's frames become ``text/event-stream`` events (WHATWG HTML §9.2):

- the opening event (the session's first CHECKPOINT, index -1): the chat ``role`` chunk, or an
  empty text chunk, so the client holds a cursor before the first token;
- one event per TOKEN that carries text (a token that completes no UTF-8 character yet
  carries none: its text comes with a later one, so nothing is lost by skipping it);
- END: the finishing chunk (index = completion tokens), the usage chunk when asked for
  (index + 1), then ``data: [DONE]`` (no id: nothing follows it);
- nothing written for a while (``sse_keepalive_s``: in line for a slot, a long prefill): a
  comment line (:data:`KEEPALIVE_COMMENT`, written by the transport's port), so that no proxy's
  read timeout cuts a stream that is only waiting;
- an ERROR frame, or an END that is not the generation's end (``superseded``, ``shutdown``):
  an ``{"error": ...}`` event without an id, then the stream closes; the client resumes from
  the last id it saw.

A resumed stream is made with ``after`` = the cursor's index and skips every event at or before
it, so the events after a cursor are exactly those an uninterrupted stream had after it.
Other CHECKPOINTs carry native snapshot hashes and are not sent (the cursors replace them).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import quicsrv_proto
from quicsrv_proto import EndReason

from ..sessions.session import Session
from . import logprobs, openai_api
from .cursor import FLAG_CHAT, FLAG_USAGE, encode_cursor
from .errors import ApiError, from_code
from .logprobs import CompletionLogprobs, Piece
from .tool_answers import answer_parser
from .tool_calls import CallText, ToolChoice
from .tool_chunks import chat_delta

__all__ = [
    "KEEPALIVE_COMMENT",
    "CollectedAnswer",
    "CollectingPort",
    "SseEncoder",
    "StreamShape",
    "collect_answer",
]

DONE = b"data: [DONE]\n\n"
#: Written when the stream has been quiet for a while (in line for a slot, a long prefill): a
#: comment line, which every SSE parser skips (WHATWG HTML §9.2.6), for the proxies between.
#: No blank line after it: the OpenAI SDK's parser keeps the last event id and dispatches an
#: event on any blank line once it has one (the spec dispatches none without data), and then
#: fails on its empty data; the comment is a line of the next event instead.
KEEPALIVE_COMMENT = b": keep-alive\n"
# How long an SSE client waits before it resumes a stream the server ended for a restart: about
# the time a new process takes to start (the reconnect policy of the native client backs off
# from much less, and goes on for much longer).
RESTART_RETRY_S = 3.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamShape:
    """What every chunk of one completion stream says besides its text."""

    session_id: bytes
    """The session the stream reads."""
    chat: bool
    """Chat chunks (``delta``) or text-completion chunks (``text``)."""
    include_usage: bool
    """A usage chunk before ``[DONE]`` (``usage: null`` on the others)."""
    model: str
    """The served model's id."""
    created: int
    """When the session was created (Unix seconds): the same on a resumed stream."""
    tools: ToolChoice | None = None
    """The answer is a call of one of these functions (``tool_calls`` deltas, not content)."""
    tool_answer: str | None = None
    """The answer is text or calls, in this format (:mod:`.tool_answers`)."""
    echo: str = ""
    """Text completions' ``echo``: the prompt, the opening event's text."""

    @property
    def flags(self) -> int:
        return (FLAG_CHAT if self.chat else 0) | (FLAG_USAGE if self.include_usage else 0)


class SseEncoder:
    """Turns one stream's frames into SSE bytes; see the module docstring."""

    def __init__(
        self,
        shape: StreamShape,
        *,
        mac_key: bytes,
        after: int | None = None,
        text_before: str = "",
        piece: Piece | None = None,
    ) -> None:
        """``piece``: the vocabulary, where the tokens come with log-probabilities to show."""
        self.shape = shape
        # A tool call's deltas depend on the text before them: a resumed stream starts from
        # the text of the tokens it skips (``text_before``).
        self._call = None if shape.tools is None else CallText(shape.tools, text_before)
        self._answer = None if shape.tool_answer is None else answer_parser(shape.tool_answer)
        if self._answer is not None:
            self._answer.push(text_before)
        # The call's id and name go with its first event: a resumed stream had them already
        # if the name was known by then (one function: from the opening event on).
        self._announced = (
            after is not None and self._call is not None and self._call.name is not None
        )
        # One key per stream (read once, not per event): a rotation meanwhile is harmless, the
        # previous key verifies for the ring's grace period.
        self._mac_key = mac_key
        self._after = after
        # Tokens whose log-probabilities go with the next event that carries text (a token
        # that completes no character yet has none of its own).
        self._piece = piece
        self._scored: list[quicsrv_proto.Token] = []
        self._completion_logprobs = (
            None if piece is None or shape.chat else CompletionLogprobs(piece, len(text_before))
        )
        self.finished = False
        """The stream's last event was written (``[DONE]`` or an error)."""

    def encode_all(self, frames: Sequence[quicsrv_proto.Frame]) -> bytes:
        """The events ``frames`` make on this stream, as one write (a ``FrameEncoder``)."""
        return b"".join([self.encode(frame) for frame in frames])

    def encode(self, frame: quicsrv_proto.Frame) -> bytes:
        """The events ``frame`` makes on this stream (often none)."""
        if isinstance(frame, quicsrv_proto.Token):
            if frame.logprob is not None and self._answer is None and self._call is None:
                self._scored.append(frame)  # (a tool call's answer shows none, as OpenAI's)
            if self._answer is not None:
                delta = chat_delta(self.shape.session_id, self._answer.push(frame.text))
                return self._event(frame.index, text=None, delta=delta) if delta else b""
            if self._call is not None:
                return self._tool_event(frame.index, self._call.push(frame.text))
            if not frame.text:
                return b""
            return self._event(frame.index, text=frame.text, logprobs=self._take_logprobs())
        if isinstance(frame, quicsrv_proto.Checkpoint):
            if frame.index != -1:
                return b""
            if self._call is not None and self._call.name is not None:
                return self._tool_event(-1, "", role=True)  # one function: named at once
            if self._answer is not None:  # text or calls: not known yet
                return self._event(-1, text=None, role=True)
            return self._event(-1, text=self.shape.echo, role=True)
        if isinstance(frame, quicsrv_proto.End):
            return self._end(frame)
        if isinstance(frame, quicsrv_proto.Error):
            return self._error(from_code(frame.code, frame.message, frame.retry_after_s))
        return b""

    def _end(self, end: quicsrv_proto.End) -> bytes:
        if end.reason in (EndReason.SUPERSEDED, EndReason.SHUTDOWN):
            code = (
                quicsrv_proto.ErrorCode.SHUTTING_DOWN if end.reason is EndReason.SHUTDOWN else None
            )
            error = (
                from_code(
                    code,
                    "the server is restarting; resume with GET /v1/streams/{session} and "
                    "Last-Event-ID, your last event's id",
                    RESTART_RETRY_S,
                )
                if code is not None
                else ApiError(
                    409,
                    "another request resumed this stream; this one ends here",
                    code="superseded",
                )
            )
            return self._error(error)
        n = end.completion_tokens
        if self._answer is not None:
            delta = chat_delta(self.shape.session_id, self._answer.push(end.text))
            calls = bool(self._answer.calls)
            finish = openai_api.finish_reason(end.reason, tool_call=calls)
            out = self._event(n, text=None, finish=finish, delta=delta)
        elif self._call is not None:
            finish = openai_api.finish_reason(end.reason, tool_call=True)
            out = self._tool_event(n, self._call.finish(end.text), finish=finish)
        else:
            finish = openai_api.finish_reason(end.reason)
            logprobs = self._take_logprobs()
            out = self._event(n, text=end.text or None, finish=finish, logprobs=logprobs)
        if self.shape.include_usage:
            counts = openai_api.usage(end)
            out += self._event(n + 1, text=None, usage_counts=counts)
        self.finished = True
        return out + DONE

    def _take_logprobs(self) -> dict[str, Any] | None:
        """The ``logprobs`` of the tokens held since the last event that carried text (None
        where there are none: not asked for, or an answer that is a tool call)."""
        if not self._scored or self._piece is None:
            return None
        tokens, self._scored = self._scored, []
        if self._completion_logprobs is None:
            return logprobs.chat_logprobs(tokens, self._piece)
        for token in tokens:
            self._completion_logprobs.add_token(token)
        return self._completion_logprobs.take()

    def _error(self, error: ApiError) -> bytes:
        self.finished = True
        # No id: the client resumes from the last event that had one. ``retry:`` (WHATWG HTML
        # §9.2.6) says how long to wait first, when the server gave a hint.
        retry = b""
        if error.retry_after_s is not None:
            retry = b"retry: " + str(round(error.retry_after_s * 1000)).encode() + b"\n"
        return retry + b"data: " + json.dumps(error.payload()).encode() + b"\n\n"

    def _tool_event(
        self, index: int, arguments: str, *, role: bool = False, finish: str | None = None
    ) -> bytes:
        """A tool call's delta: its id and name with the first one (once the name is known)."""
        call = self._call
        assert call is not None
        announce = not self._announced and call.name is not None
        if not (arguments or announce or role or finish):
            return b""  # nothing new: the delta comes with a later token
        self._announced = self._announced or announce
        delta = None
        if arguments or announce:
            delta = openai_api.tool_call_delta(
                self.shape.session_id, call.name, arguments, announce=announce
            )
        return self._event(index, text=None, role=role, finish=finish, tool_call=delta)

    def _event(
        self,
        index: int,
        *,
        text: str | None,
        role: bool = False,
        finish: str | None = None,
        usage_counts: dict[str, int] | None = None,
        tool_call: dict[str, Any] | None = None,
        delta: dict[str, Any] | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        if self._after is not None and index <= self._after:
            return b""  # the client had this event before it reconnected
        shape = self.shape
        body = openai_api.chunk(
            session_id=shape.session_id,
            chat=shape.chat,
            model=shape.model,
            created=shape.created,
            text=text,
            role=role,
            finish=finish,
            include_usage=shape.include_usage,
            usage_counts=usage_counts,
            tool_call=tool_call,
            delta=delta,
            logprobs=logprobs,
        )
        cursor = encode_cursor(self._mac_key, shape.session_id, index, shape.flags)
        return b"id: " + cursor.encode() + b"\ndata: " + _compact(body) + b"\n\n"


def _compact(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectedAnswer:
    text: str
    """Every token's text and the END's held-back tail, joined."""
    end: quicsrv_proto.End
    """How the generation ended, with the token counts."""
    scored: tuple[quicsrv_proto.Token, ...] = ()
    """The tokens, where they came with log-probabilities."""


class CollectingPort:
    """The reader of a ``stream: false`` request: gathers the text in memory until END.

    It counts every frame as acknowledged at once, so it never pauses the engine: the whole
    answer is bounded by ``max_tokens`` anyway.
    """

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._scored: list[quicsrv_proto.Token] = []
        self._sent = 0
        self.answer: asyncio.Future[CollectedAnswer] = asyncio.get_running_loop().create_future()

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None:
        self._sent += 1
        if self.answer.done():
            return
        if isinstance(frame, quicsrv_proto.Token):
            self._parts.append(frame.text)
            if frame.logprob is not None:
                self._scored.append(frame)
        elif isinstance(frame, quicsrv_proto.End):
            if frame.reason in (EndReason.SUPERSEDED, EndReason.SHUTDOWN):
                self.answer.set_exception(
                    from_code(quicsrv_proto.ErrorCode.SHUTTING_DOWN, "the server is shutting down")
                )
            else:
                text = "".join(self._parts) + frame.text
                answer = CollectedAnswer(text=text, end=frame, scored=tuple(self._scored))
                self.answer.set_result(answer)
        elif isinstance(frame, quicsrv_proto.Error):
            self.answer.set_exception(from_code(frame.code, frame.message, frame.retry_after_s))

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        for frame in frames:
            self.send_frame(frame, False)

    def sent_offset(self) -> int:
        return self._sent

    def acked_offset(self) -> int:
        return self._sent


async def collect_answer(session: Session, client: str) -> CollectedAnswer:
    """The whole answer of a request that is not streamed, read by ``client``."""
    port = CollectingPort()
    session.attach(port, 0, client)
    try:
        return await port.answer
    except asyncio.CancelledError:
        # Nobody can resume a non-streamed answer: its peer never learned the session.
        session.cancel()
        raise
    finally:
        session.detach(port)
