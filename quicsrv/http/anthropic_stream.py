"""A session's frames as Anthropic's Messages stream: named SSE events, each with a resumable
``id:`` cursor.

The events (Anthropic's "Streaming messages"): ``message_start`` (the message, its content
empty), then each content block's ``content_block_start``, ``content_block_delta``\\ s
(``text_delta``, or ``input_json_delta`` for a tool's input as generated) and
``content_block_stop``, then ``message_delta`` (``stop_reason``, ``stop_sequence`` and the
cumulative ``usage``) and ``message_stop``. Each is written as ``event: <type>``, ``id:
<cursor>`` and ``data: <json>``.

Whether the answer is text or tool uses is known only a few tokens in when the model may choose
(the generic format), and one token may close a tool use and open the next; so events are not
numbered by token, as chat chunks are, but in the order they come, 0 being ``message_start``.
The numbering is a pure function of the generated tokens: a resumed stream renders every event
again from token 0 (cheap: no JSON is made for an event that is not sent) and writes only
those after the cursor's number, exactly those the first stream had after it. A plain text
answer or one tool's input opens its block with ``message_start``'s frame; a generic answer
opens a block when its first piece comes (an answer with no piece gets an empty text block, as
its ``stream: false`` body has).

Nothing written for a while (in line for a slot, a long prefill): a ``ping`` event without an
id (:data:`PING`, written by the transport's port). A stream that cannot go on (a restart, a
newer reader, the engine down) ends with an ``error`` event in Anthropic's shape, without an
id, after a ``retry:`` line when the server has a hint: the client resumes from the last id
it saw.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import quicsrv_proto
from quicsrv_proto import EndReason

from . import anthropic_api
from .anthropic_api import MessageShape
from .cursor import FLAG_MESSAGES, encode_cursor
from .errors import ApiError, anthropic_payload, from_code
from .sse import RESTART_RETRY_S
from .tool_answers import answer_parser
from .tool_calls import CallText
from .tool_format import ArgumentsDelta, CallStarted, Piece, TextDelta

__all__ = ["PING", "MessageEncoder", "error_bytes"]

#: Anthropic's keep-alive event: no id (a resume goes on from the last event that had one).
PING = b'event: ping\ndata: {"type":"ping"}\n\n'


class MessageEncoder:
    """Turns one stream's frames into Anthropic's events; see the module docstring. It reads
    the stream from token 0 (a resume too) and writes the events numbered after ``after``."""

    def __init__(
        self,
        shape: MessageShape,
        *,
        mac_key: bytes,
        after: int = -1,
        stop_sequence: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._shape = shape
        # One key per stream (read once, not per event): the previous key verifies for the
        # ring's grace period.
        self._mac_key = mac_key
        self._after = after
        # Which stop sequence matched: read from the record when a STOP arrives.
        self._stop_sequence = stop_sequence
        self._call = None if shape.tools is None else CallText(shape.tools)
        self._answer = None if shape.tool_answer is None else answer_parser(shape.tool_answer)
        self._open: int | None = None  # the content block open, by index
        self._next = 0  # the number the next event takes
        self.finished = False
        """The stream's last event was written (``message_stop`` or an error)."""

    def encode_all(self, frames: Sequence[quicsrv_proto.Frame]) -> bytes:
        """The events ``frames`` make on this stream, as one write (a ``FrameEncoder``)."""
        return b"".join([self.encode(frame) for frame in frames])

    def encode(self, frame: quicsrv_proto.Frame) -> bytes:
        """The events ``frame`` makes on this stream (often none)."""
        if isinstance(frame, quicsrv_proto.Token):
            return self._write(self._token(frame.text))
        if isinstance(frame, quicsrv_proto.Checkpoint):
            return self._write(self._opening()) if frame.index == -1 else b""
        if isinstance(frame, quicsrv_proto.End):
            return self._end(frame)
        if isinstance(frame, quicsrv_proto.Error):
            return self._error(from_code(frame.code, frame.message, frame.retry_after_s))
        return b""

    def _opening(self) -> list[dict[str, Any]]:
        shape = self._shape
        start = anthropic_api.message_object(
            shape,
            content=[],
            stop=None,
            stop_sequence=None,
            counts=anthropic_api.start_usage(shape),
        )
        events: list[dict[str, Any]] = [{"type": "message_start", "message": start}]
        if self._call is not None:  # one tool, named: its block opens at once
            events.append(
                self._start(0, anthropic_api.tool_use_block(shape, 0, self._call.name or "", {}))
            )
        elif self._answer is None:
            events.append(self._start(0, {"type": "text", "text": ""}))
        return events

    def _token(self, text: str) -> list[dict[str, Any]]:
        if self._answer is not None:
            return self._pieces(self._answer.push(text))
        if self._call is not None:
            arguments = self._call.push(text)
            return [_json_delta(0, arguments)] if arguments else []
        return [_text_delta(0, text)] if text else []

    def _pieces(self, pieces: Sequence[Piece]) -> list[dict[str, Any]]:
        """A generic answer's pieces: a text block, or one tool use block per call."""
        events: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, TextDelta):
                if self._open is None:
                    events.append(self._start(0, {"type": "text", "text": ""}))
                events.append(_text_delta(0, piece.text))
            elif isinstance(piece, CallStarted):
                events += self._stop()
                block = anthropic_api.tool_use_block(self._shape, piece.index, piece.name, {})
                events.append(self._start(piece.index, block))
            elif isinstance(piece, ArgumentsDelta):
                events.append(_json_delta(piece.index, piece.text))
        return events

    def _start(self, index: int, block: dict[str, Any]) -> dict[str, Any]:
        self._open = index
        return {"type": "content_block_start", "index": index, "content_block": block}

    def _stop(self) -> list[dict[str, Any]]:
        index, self._open = self._open, None
        return [] if index is None else [{"type": "content_block_stop", "index": index}]

    def _end(self, end: quicsrv_proto.End) -> bytes:
        if end.reason is EndReason.SHUTDOWN:
            return self._error(
                from_code(
                    quicsrv_proto.ErrorCode.SHUTTING_DOWN,
                    "the server is restarting; resume with GET /v1/streams/{session} and "
                    "Last-Event-ID, your last event's id",
                    RESTART_RETRY_S,
                )
            )
        if end.reason is EndReason.SUPERSEDED:
            return self._error(
                ApiError(
                    409,
                    "another request resumed this stream; this one ends here",
                    code="superseded",
                )
            )
        if self._answer is not None:
            events = self._pieces(self._answer.push(end.text))
            if self._open is None and not self._answer.calls:
                events.append(self._start(0, {"type": "text", "text": ""}))
            tool_use = bool(self._answer.calls)
        elif self._call is not None:
            tail = self._call.finish(end.text)
            events = [_json_delta(0, tail)] if tail else []
            tool_use = True
        else:
            events = [_text_delta(0, end.text)] if end.text else []
            tool_use = False
        events += self._stop()
        reason = anthropic_api.stop_reason(end.reason, tool_use=tool_use)
        matched = self._stop_sequence() if end.reason is EndReason.STOP else None
        events += [
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": matched, "stop_details": None},
                "usage": anthropic_api.usage(end),
            },
            {"type": "message_stop"},
        ]
        out = self._write(events)
        self.finished = True
        return out

    def _error(self, error: ApiError) -> bytes:
        self.finished = True
        return error_bytes(error)

    def _write(self, events: list[dict[str, Any]]) -> bytes:
        out = []
        shape = self._shape
        for event in events:
            number = self._next
            self._next += 1
            if number <= self._after:
                continue  # the client had this event before it reconnected
            cursor = encode_cursor(self._mac_key, shape.session_id, number, FLAG_MESSAGES)
            out.append(
                b"event: "
                + str(event["type"]).encode()
                + b"\nid: "
                + cursor.encode()
                + b"\ndata: "
                + _compact(event)
                + b"\n\n"
            )
        return b"".join(out)


def error_bytes(error: ApiError) -> bytes:
    """The ``error`` event of a stream that cannot go on: no id, ``retry:`` (WHATWG HTML
    §9.2.6) when the server said how long to wait."""
    retry = b""
    if error.retry_after_s is not None:
        retry = b"retry: " + str(round(error.retry_after_s * 1000)).encode() + b"\n"
    return retry + b"event: error\ndata: " + _compact(anthropic_payload(error)) + b"\n\n"


def _text_delta(index: int, text: str) -> dict[str, Any]:
    return {
        "type": "content_block_delta",
        "index": index,
        "delta": {"type": "text_delta", "text": text},
    }


def _json_delta(index: int, partial: str) -> dict[str, Any]:
    return {
        "type": "content_block_delta",
        "index": index,
        "delta": {"type": "input_json_delta", "partial_json": partial},
    }


def _compact(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
