"""A session's frames as the Responses API's SSE events (see :mod:`.responses_api` for the
numbering).

Each event is written as ``id: <sequence number>``, ``event: <type>`` and ``data: <json>``: the
``id`` lets a browser's EventSource come back with ``Last-Event-ID``, which
``GET /v1/responses/{id}?stream=true`` reads like ``starting_after``. A stream made with
``after`` = N skips every event numbered N or less, so the events after N are exactly those an
uninterrupted stream had after N. Unlike chat completions there is no ``[DONE]``: the final
``response.*`` event ends the stream.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import quicsrv_proto
from quicsrv_proto import EndReason

from . import logprobs, responses_api
from .errors import from_code
from .logprobs import Piece
from .responses_api import ResponseView
from .sse import RESTART_RETRY_S
from .tool_calls import CallText, ToolChoice

__all__ = ["ResponseEncoder", "error_bytes", "event_bytes", "stream_ended"]


class ResponseEncoder:
    """Turns one stream's frames into Responses API events; see the module docstring."""

    def __init__(
        self,
        view: ResponseView,
        *,
        text_before: str,
        after: int = -1,
        ended_at: Callable[[], int | None] = lambda: None,
        piece: Piece | None = None,
        logprobs_of: Callable[[], tuple[dict[str, Any], ...]] = tuple,
    ) -> None:
        """``piece``, ``logprobs_of``: where the tokens' log-probabilities are asked for, the
        vocabulary, and the record's whole list (read when the END arrives)."""
        self._view = view
        self._piece = piece
        self._logprobs_of = logprobs_of
        # The record's end time, read when the END arrives (the record has it by then).
        self._ended_at = ended_at
        self._text = text_before  # what the tokens before the first one sent here say
        # A function call's argument deltas depend on the text before them.
        self._call = (
            CallText(ToolChoice.from_stored(view.calls), text_before) if view.calls else None
        )
        self._after = after
        self._next = after + 1  # the number the next event would take
        self.finished = False

    def encode_all(self, frames: Sequence[quicsrv_proto.Frame]) -> bytes:
        return b"".join([self.encode(frame) for frame in frames])

    def encode(self, frame: quicsrv_proto.Frame) -> bytes:
        if isinstance(frame, quicsrv_proto.Token):
            self._text += frame.text
            session_id = self._view.session_id
            if self._call is not None:
                sequence = responses_api.delta_sequence(frame.index, call=True)
                delta = self._call.push(frame.text)
                return self._write(responses_api.call_delta_event(session_id, sequence, delta))
            sequence = responses_api.delta_sequence(frame.index)
            scored = None
            if self._piece is not None and frame.logprob is not None:
                scored = logprobs.entries((frame,), self._piece)
            return self._write(responses_api.delta_event(session_id, sequence, frame.text, scored))
        if isinstance(frame, quicsrv_proto.Checkpoint):
            if frame.index != -1:
                return b""
            return b"".join(self._write(e) for e in responses_api.opening_events(self._view))
        if isinstance(frame, quicsrv_proto.End):
            return self._end(frame)
        if isinstance(frame, quicsrv_proto.Error):
            error = from_code(frame.code, frame.message, frame.retry_after_s)
            return self._error(error.code, error.message, error.retry_after_s)
        return b""

    def _end(self, end: quicsrv_proto.End) -> bytes:
        if (stream_only := stream_ended(end.reason)) is not None:
            return self._error(*stream_only)
        view = dataclasses.replace(
            self._view,
            text=self._text + end.text,
            input_tokens=end.prompt_tokens,
            cached_tokens=end.cached_tokens,
            output_tokens=end.completion_tokens,
            end=end.reason,
            completed_at=self._ended_at(),
            logprobs=self._logprobs_of() if self._piece is not None else (),
        )
        tail = end.text if self._call is None else self._call.finish(end.text)
        out = b"".join(self._write(e) for e in responses_api.closing_events(view, tail))
        self.finished = True
        return out

    def _error(self, code: str, message: str, retry_after_s: float | None) -> bytes:
        self.finished = True
        # Numbered like the event that would have come next: it is no part of the response,
        # and a resume from the last number received goes on from there.
        return error_bytes(self._next, code, message, retry_after_s)

    def _write(self, event: dict[str, Any]) -> bytes:
        sequence = int(event["sequence_number"])
        if sequence <= self._after:
            return b""  # the client had this event before it reconnected
        self._next = sequence + 1
        return event_bytes(event)


def stream_ended(reason: EndReason) -> tuple[str, str, float | None] | None:
    """The error event (code, message, retry) that ends a stream whose generation goes on
    (a restart, or a newer stream resuming it); None for an END that ends the response."""
    if reason is EndReason.SHUTDOWN:
        message = (
            "the server is restarting; resume with GET /v1/responses/{id}?stream=true"
            "&starting_after=<the last sequence_number received>"
        )
        return quicsrv_proto.ErrorCode.SHUTTING_DOWN.slug, message, RESTART_RETRY_S
    if reason is EndReason.SUPERSEDED:
        return "superseded", "another request resumed this response", None
    return None


def event_bytes(event: dict[str, Any]) -> bytes:
    """One numbered event as SSE: its number is the event's id (``Last-Event-ID``)."""
    return (
        b"id: "
        + str(event["sequence_number"]).encode()
        + b"\nevent: "
        + str(event["type"]).encode()
        + b"\ndata: "
        + _compact(event)
        + b"\n\n"
    )


def error_bytes(sequence: int, code: str, message: str, retry_after_s: float | None) -> bytes:
    """The ``error`` event numbered ``sequence``, with a ``retry:`` line when there is one."""
    event = responses_api.error_event(sequence, code, message)
    retry = b""
    if retry_after_s is not None:
        retry = b"retry: " + str(round(retry_after_s * 1000)).encode() + b"\n"
    return retry + b"event: error\ndata: " + _compact(event) + b"\n\n"


def _compact(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
