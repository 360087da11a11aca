"""The Responses API's output for an answer in a tool format (:mod:`.tool_answers`):
a message, or one ``function_call`` item per call, and the events that stream them.

Whether the model answers in text or calls is known only a few tokens in, so the events are
not numbered by token as a message's are (:mod:`.responses_api`): they are numbered in the
order they come, ``0`` ``response.created``, ``1`` ``response.in_progress``, then as the text
unfolds: a message's ``output_item.added``, ``content_part.added`` and ``output_text.delta``\\ s
(one per token that adds text), or for each call ``output_item.added`` (with its name),
``function_call_arguments.delta``\\ s, ``function_call_arguments.done`` and
``output_item.done``; at the end the open item's closing events and ``response.completed`` (or
``response.incomplete``). The numbering is a pure function of the generated tokens, so a
resumed stream renders every event again from token 0 and writes only those after
``starting_after``: exactly the events the first stream had after it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import quicsrv_proto

from . import responses_api
from .errors import from_code
from .responses_api import ResponseView
from .responses_stream import error_bytes, event_bytes, stream_ended
from .tool_answers import answer_format, answer_parser, parse_answer
from .tool_calls import call_id
from .tool_format import GENERIC, ArgumentsDelta, CallStarted, Piece, TextDelta

__all__ = ["ToolAnswerEncoder", "generic", "response_object"]


def generic(view: ResponseView) -> bool:
    """Whether the response's answer is text or calls, in a tool format
    (:mod:`.tool_answers`: the generic one or the template's)."""
    return answer_format(view.fields) is not None


def response_object(view: ResponseView, *, announced: bool = False) -> dict[str, Any]:
    """The ``response`` object (:func:`.responses_api.response_object`), with a generic
    answer's output items and tools."""
    body = responses_api.response_object(view, announced=announced)
    if not generic(view):
        return body
    fields = view.fields
    body["tools"] = fields.get("tools", [])
    body["tool_choice"] = fields.get("tool_choice") or "auto"
    body["parallel_tool_calls"] = fields.get("parallel_tool_calls", True)
    if announced:
        return body
    answer = parse_answer(answer_format(fields) or GENERIC, view.text)
    if answer.calls:
        last = len(answer.calls) - 1
        body["output"] = [
            _call_item(view, i, name, arguments, done=i < last or view.end is not None)
            for i, (name, arguments) in enumerate(answer.calls)
        ]
    elif view.output_tokens or view.end is not None:
        body["output"] = [responses_api.message_item(view, answer.text)]
    return body


def _call_item(
    view: ResponseView, index: int, name: str, arguments: str, *, done: bool
) -> dict[str, Any]:
    status = "in_progress"
    if done:
        ended_short = view.end is not None and responses_api.status_of(view) != "completed"
        status = "incomplete" if ended_short and index == _last_call(view) else "completed"
    return {
        "id": _call_item_id(view.session_id, index),
        "type": "function_call",
        "call_id": call_id(view.session_id, index),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _last_call(view: ResponseView) -> int:
    return len(parse_answer(answer_format(view.fields) or GENERIC, view.text).calls) - 1


def _call_item_id(session_id: bytes, index: int) -> str:
    return responses_api.CALL_PREFIX + session_id.hex() + (f"_{index}" if index else "")


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ToolAnswerEncoder:
    """Turns one stream's frames into the events of a generic answer; see the module
    docstring. It reads the stream from token 0 (a resume too) and writes the events after
    ``after``."""

    def __init__(
        self,
        view: ResponseView,
        *,
        after: int = -1,
        ended_at: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._view = view
        # The record's end time, read when the END arrives (the record has it by then).
        self._ended_at = ended_at
        self._text = ""
        self._answer = answer_parser(answer_format(view.fields) or GENERIC)
        self._open: str | None = None  # "message", or "call" (the last one started)
        self._after = after
        self._next = 0  # the number the next event takes
        self.finished = False

    def encode_all(self, frames: Sequence[quicsrv_proto.Frame]) -> bytes:
        return b"".join([self.encode(frame) for frame in frames])

    def encode(self, frame: quicsrv_proto.Frame) -> bytes:
        if isinstance(frame, quicsrv_proto.Token):
            self._text += frame.text
            return self._write(self._pieces(self._answer.push(frame.text)))
        if isinstance(frame, quicsrv_proto.Checkpoint):
            if frame.index != -1:
                return b""
            announced = response_object(self._view, announced=True)
            return self._write(
                [
                    {"type": "response.created", "response": announced},
                    {"type": "response.in_progress", "response": announced},
                ]
            )
        if isinstance(frame, quicsrv_proto.End):
            return self._end(frame)
        if isinstance(frame, quicsrv_proto.Error):
            error = from_code(frame.code, frame.message, frame.retry_after_s)
            return self._error(error.code, error.message, error.retry_after_s)
        return b""

    def _pieces(self, pieces: Sequence[Piece]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        session_id = self._view.session_id
        for piece in pieces:
            if isinstance(piece, TextDelta):
                if self._open is None:
                    events += self._open_message()
                events.append(
                    {
                        "type": "response.output_text.delta",
                        "item_id": responses_api.message_id(session_id),
                        "output_index": 0,
                        "content_index": 0,
                        "delta": piece.text,
                        "logprobs": [],
                    }
                )
            elif isinstance(piece, CallStarted):
                if self._open == "call":
                    events += self._close_call(self._view, piece.index - 1, done=True)
                self._open = "call"
                item = _call_item(self._view, piece.index, piece.name, "", done=False)
                events.append(
                    {"type": "response.output_item.added", "output_index": piece.index}
                    | {"item": item}
                )
            elif isinstance(piece, ArgumentsDelta):
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": _call_item_id(session_id, piece.index),
                        "output_index": piece.index,
                        "delta": piece.text,
                    }
                )
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self._open = "message"
        item_id = responses_api.message_id(self._view.session_id)
        return [
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": responses_api.message_item(self._view, None),
            },
            {
                "type": "response.content_part.added",
                "item_id": item_id,
                "output_index": 0,
                "content_index": 0,
                "part": _text_part(""),
            },
        ]

    def _close_call(self, view: ResponseView, index: int, *, done: bool) -> list[dict[str, Any]]:
        name, arguments = self._answer.calls[index]
        item = _call_item(view, index, name, arguments, done=done)
        return [
            {
                "type": "response.function_call_arguments.done",
                "item_id": item["id"],
                "output_index": index,
                "name": name,
                "arguments": arguments,
            },
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]

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
        )
        events = self._pieces(self._answer.push(end.text))
        if self._open is None and not self._answer.calls:
            events += self._open_message()  # an empty (or cut short) text answer
        if self._open == "call":
            events += self._close_call(view, len(self._answer.calls) - 1, done=True)
        elif self._open == "message":
            text = self._answer.text
            item_id = responses_api.message_id(view.session_id)
            where = {"item_id": item_id, "output_index": 0, "content_index": 0}
            events += [
                {"type": "response.output_text.done"} | where | {"text": text, "logprobs": []},
                {"type": "response.content_part.done"} | where | {"part": _text_part(text)},
                {
                    "type": "response.output_item.done",
                    "output_index": 0,
                    "item": responses_api.message_item(view, text),
                },
            ]
        completed = responses_api.status_of(view) == "completed"
        final = "response.completed" if completed else "response.incomplete"
        events.append({"type": final, "response": response_object(view)})
        out = self._write(events)
        self.finished = True
        return out

    def _error(self, code: str, message: str, retry_after_s: float | None) -> bytes:
        self.finished = True
        # Numbered like the event that would have come next (see .responses_stream).
        return error_bytes(self._next, code, message, retry_after_s)

    def _write(self, events: list[dict[str, Any]]) -> bytes:
        out = []
        for event in events:
            sequence = self._next
            self._next += 1
            if sequence <= self._after:
                continue  # the client had this event before it reconnected
            out.append(event_bytes({"type": event["type"], "sequence_number": sequence} | event))
        return b"".join(out)
