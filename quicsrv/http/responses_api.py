"""OpenAI's Responses API, mapped onto a session, and every object and event it answers with.

Request side: :func:`parse_create` checks a ``POST /v1/responses`` body field by field, as
:mod:`.openai_api` does for completions: which fields are accepted, and at which values, is
:mod:`.field_policy`'s (what the engine cannot honour, such as ``reasoning``, only at a value
that changes nothing). Input message items name any key that is not theirs.

Response side: :func:`response_object` has every field of OpenAI's ``Response`` and Open
Responses' ``ResponseResource``, in every event that carries it, the request's tools and
tool_choice from the first event on.

Everything a response says is a pure function of its session record (:class:`ResponseView`):
the ids (``resp_<session id>``, ``msg_<session id>``), the stored request fields and
``created_at``, the token ids, their text and the end. So any suffix of the event stream can be
rendered again, on any node, after any restart. Sequence numbers are fixed by the token index
(:func:`delta_sequence`):

====================  ==========================================================
``0``                 ``response.created``
``1``                 ``response.in_progress``
``2``                 ``response.output_item.added`` (the assistant message)
``3``                 ``response.content_part.added`` (its ``output_text`` part)
``4 + i``             ``response.output_text.delta`` of token ``i`` (its text,
                      possibly empty: a token that completes no character yet)
``4 + n``, ...        at the end (``n`` tokens): a last delta with the held-back
                      tail when there is one, ``response.output_text.done``,
                      ``response.content_part.done``, ``response.output_item.done``,
                      then ``response.completed`` (end of text, stop sequence),
                      ``response.incomplete`` (``max_output_tokens``; or a cancel,
                      with the response's ``status: cancelled``)
====================  ==========================================================

A response that calls a function (``tools`` with ``tool_choice`` naming one, or ``required``)
has a ``function_call`` item instead of a message: ``0`` created, ``1`` in_progress, ``2``
``response.output_item.added`` (the call; its ``name`` is null there when several functions
were offered, since the model has not chosen yet), **``3 + i``**
``response.function_call_arguments.delta`` of token ``i`` (empty while the model writes the
call's name: :class:`~.tool_calls.CallText`), then a tail delta if any,
``response.function_call_arguments.done`` (with the name), ``response.output_item.done`` and
the final event.

A stream that cannot go on (the server restarts, another reader took the response over, the
engine is down) ends with an ``error`` event numbered with the next event's number: it is not
part of the response, and a resume with ``starting_after`` = the last number received
continues exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import quicsrv_proto
from quicsrv_proto import ChatMessage, EndReason
from quicsrv_proto.frames import MAX_MESSAGES, MAX_PROMPT_CHARS

from ..sessions.record import SessionRecord
from . import field_policy, openai_api, tool_format
from .errors import ApiError
from .logprobs import Piece, recorded, responses_request
from .tool_answers import calls_text
from .tool_calls import CallText, ToolChoice, ToolFormat, call_id, parse_tool_choice

__all__ = [
    "FIRST_DELTA",
    "CreateRequest",
    "ResponseView",
    "delta_sequence",
    "from_response_id",
    "message_id",
    "parse_create",
    "response_id",
    "response_object",
]

KIND = "response"
"""``SessionRecord.api["kind"]`` of a session this API started."""
RESPONSE_PREFIX = "resp_"
MESSAGE_PREFIX = "msg_"
FIRST_DELTA = 4
"""The sequence number of token 0's delta: four events come before it."""
FIRST_CALL_DELTA = 3
"""The same for a function call (no content part)."""
CALL_PREFIX = "fc_"

_INPUT_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_FILE_PARTS = frozenset({"input_file"})


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateRequest:
    """A checked ``POST /v1/responses``."""

    generate: quicsrv_proto.Generate
    """Sampling and limits; its ``messages`` are this request's instructions and input only
    (the router puts a previous response's conversation in between)."""
    instructions: str | None
    input: tuple[ChatMessage, ...]
    stream: bool
    background: bool
    store: bool
    previous_response_id: str | None
    fields: dict[str, Any]
    """What the response object echoes (``instructions``, ``metadata``, ``temperature``...),
    stored with the session as it is."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseView:
    """What a response object is made of: the session record's fields, and its text."""

    session_id: bytes
    created_at: int
    fields: dict[str, Any]
    text: str
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    end: EndReason | None
    """None while it is generated (or waits to be)."""
    queued: bool = False
    """It waits in line for a slot."""
    completed_at: int | None = None
    """When it ended (None while it runs, or for a record that did not keep it)."""
    logprobs: tuple[dict[str, Any], ...] = ()
    """Its tokens' log-probabilities (``include: ["message.output_text.logprobs"]``)."""

    @property
    def calls(self) -> tuple[str, ...]:
        """The functions it calls one of (its output is a ``function_call``); () for a
        message."""
        names = self.fields.get("calls")
        return tuple(str(n) for n in names) if isinstance(names, list) else ()

    def call_parts(self) -> tuple[str | None, str]:
        """The call's name (None while unknown) and its arguments so far."""
        call = CallText(ToolChoice.from_stored(self.calls))
        if self.end is None:
            call.push(self.text)
        else:
            call.finish(self.text)
        return call.name, call.arguments()

    @classmethod
    def of(
        cls, record: SessionRecord, text: str, *, queued: bool = False, piece: Piece | None = None
    ) -> ResponseView:
        """``piece``: the vocabulary, to show the log-probabilities the record keeps."""
        scored = () if piece is None else recorded(record, piece)
        return cls(
            session_id=record.session_id,
            created_at=int(record.created_at_s),
            fields=_fields_of(record),
            text=text,
            input_tokens=len(record.spec.prompt_tokens),
            cached_tokens=record.cached_tokens,
            output_tokens=len(record.generated),
            end=None if record.end is None else record.end.reason,
            queued=queued,
            completed_at=ended_at(record),
            logprobs=scored,
        )


def is_response(record: SessionRecord) -> bool:
    """Whether the session was started by ``POST /v1/responses``."""
    return record.api is not None and record.api.get("kind") == KIND


def ended_at(record: SessionRecord) -> int | None:
    """When the record's generation ended (whole seconds), if it has and the record says."""
    if record.end is None or record.end.ended_at_s is None:
        return None
    return int(record.end.ended_at_s)


def _fields_of(record: SessionRecord) -> dict[str, Any]:
    api = record.api or {}
    fields = api.get("fields")
    return dict(fields) if isinstance(fields, dict) else {}


# --- ids -----------------------------------------------------------------------------------


def response_id(session_id: bytes) -> str:
    return RESPONSE_PREFIX + session_id.hex()


def message_id(session_id: bytes) -> str:
    return MESSAGE_PREFIX + session_id.hex()


def from_response_id(text: str, param: str | None = None) -> bytes:
    """The session a response id names; 404 for anything this server cannot have issued."""
    digits = text.removeprefix(RESPONSE_PREFIX)
    try:
        session_id = bytes.fromhex(digits) if digits != text else b""
    except ValueError:
        session_id = b""
    if session_id.hex() != digits:  # fromhex also reads upper case and spaces: not ours
        session_id = b""
    if len(session_id) != quicsrv_proto.SESSION_ID_BYTES:
        raise ApiError(
            404, f"Response with id '{text[:80]}' not found.", code="not_found", param=param
        )
    return session_id


def delta_sequence(index: int, *, call: bool = False) -> int:
    """The sequence number of token ``index``'s delta event (``call``: of a function call)."""
    return (FIRST_CALL_DELTA if call else FIRST_DELTA) + index


def first_token_after(starting_after: int, *, call: bool = False) -> int:
    """The first token whose delta comes after event ``starting_after``."""
    return max(0, starting_after + 1 - (FIRST_CALL_DELTA if call else FIRST_DELTA))


def call_item(view: ResponseView, *, announced: bool = False) -> dict[str, Any]:
    """The function call (``announced``: as at its start, before its arguments)."""
    status = status_of(view)
    done = not announced and view.end is not None
    if announced:
        name, arguments = (view.calls[0] if len(view.calls) == 1 else None), ""
    else:
        name, arguments = view.call_parts()
    return {
        "id": CALL_PREFIX + view.session_id.hex(),
        "type": "function_call",
        "call_id": call_id(view.session_id),
        "name": name,
        "arguments": arguments,
        "status": ("completed" if status == "completed" else "incomplete")
        if done
        else "in_progress",
    }


# --- objects -------------------------------------------------------------------------------


def status_of(view: ResponseView) -> str:
    if view.end is None:
        return "queued" if view.queued else "in_progress"
    if view.end is EndReason.CANCELLED:
        return "cancelled"
    if view.end is EndReason.LENGTH:
        return "incomplete"
    return "completed"


def message_item(view: ResponseView, text: str | None) -> dict[str, Any]:
    """The assistant message (``text`` None: as first announced, with no content yet)."""
    status = status_of(view)
    item_status = "completed" if status == "completed" else "in_progress"
    if status in ("incomplete", "cancelled"):
        item_status = "incomplete"
    return {
        "id": message_id(view.session_id),
        "type": "message",
        "role": "assistant",
        "status": item_status if text is not None else "in_progress",
        "content": [] if text is None else [_text_part(text, view.logprobs)],
    }


def _text_part(text: str, scored: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(scored)}


def response_object(view: ResponseView, *, announced: bool = False) -> dict[str, Any]:
    """The ``response`` object (``announced``: as at its start, before any output): every
    field of OpenAI's ``Response`` and Open Responses' ``ResponseResource``, in every event."""
    fields = view.fields
    status = "in_progress" if announced else status_of(view)
    body: dict[str, Any] = {
        "id": response_id(view.session_id),
        "object": "response",
        "created_at": view.created_at,
        "completed_at": view.completed_at if status == "completed" else None,
        "status": status,
        "background": fields.get("background", False),
        "error": None,
        "incomplete_details": None,
        "instructions": fields.get("instructions"),
        "max_output_tokens": fields.get("max_output_tokens", openai_api.DEFAULT_MAX_TOKENS),
        "max_tool_calls": None,
        "metadata": fields.get("metadata", {}),
        "model": fields.get("model", ""),
        "output": [],
        "parallel_tool_calls": fields.get("parallel_tool_calls", True),
        "previous_response_id": fields.get("previous_response_id"),
        "prompt_cache_key": fields.get("prompt_cache_key"),
        "reasoning": None,  # the model has no reasoning items, nor an effort to set
        "safety_identifier": fields.get("safety_identifier"),
        "service_tier": "default",
        "store": fields.get("store", True),
        "temperature": fields.get("temperature", openai_api.DEFAULT_SAMPLING["temperature"]),
        "top_p": fields.get("top_p", openai_api.DEFAULT_SAMPLING["top_p"]),
        # Neutral values only (field_policy): what was used.
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "top_logprobs": fields.get("top_logprobs", 0),
        "text": fields.get("text", {"format": {"type": "text"}, "verbosity": "medium"}),
        "tool_choice": fields.get("tool_choice", "auto"),
        "tools": fields.get("tools", []),
        "truncation": fields.get("truncation", "disabled"),
        "usage": None,
    }
    if announced:
        return body
    if view.calls:
        body["output"] = [call_item(view)]
    elif view.output_tokens or view.end is not None:
        body["output"] = [message_item(view, view.text)]
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    if view.end is not None:
        body["usage"] = usage(view)
    return body


def usage(view: ResponseView) -> dict[str, Any]:
    return {
        "input_tokens": view.input_tokens,
        # cached: prompt tokens whose KV cells were reused; nothing is billed for keeping the
        # others, so no token counts as a cache write.
        "input_tokens_details": {"cached_tokens": view.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": view.output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": view.input_tokens + view.output_tokens,
    }


def deleted_body(session_id: bytes) -> dict[str, Any]:
    return {"id": response_id(session_id), "object": "response.deleted", "deleted": True}


# --- events --------------------------------------------------------------------------------


def opening_events(view: ResponseView) -> list[dict[str, Any]]:
    """Events 0 to 3 (a function call: 0 to 2): before the first token."""
    announced = response_object(view, announced=True)
    item_id = message_id(view.session_id)
    opening = [
        {"type": "response.created", "sequence_number": 0, "response": announced},
        {"type": "response.in_progress", "sequence_number": 1, "response": announced},
    ]
    if view.calls:
        added = {"type": "response.output_item.added", "sequence_number": 2, "output_index": 0}
        return [*opening, added | {"item": call_item(view, announced=True)}]
    return [
        *opening,
        {
            "type": "response.output_item.added",
            "sequence_number": 2,
            "output_index": 0,
            "item": message_item(view, None),
        },
        {
            "type": "response.content_part.added",
            "sequence_number": 3,
            "item_id": item_id,
            "output_index": 0,
            "content_index": 0,
            "part": _text_part(""),
        },
    ]


def delta_event(
    session_id: bytes, sequence: int, delta: str, scored: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``scored``: the delta's tokens' log-probabilities (where they are asked for)."""
    return {
        "type": "response.output_text.delta",
        "sequence_number": sequence,
        "item_id": message_id(session_id),
        "output_index": 0,
        "content_index": 0,
        "delta": delta,
        "logprobs": scored or [],
    }


def call_delta_event(session_id: bytes, sequence: int, delta: str) -> dict[str, Any]:
    return {
        "type": "response.function_call_arguments.delta",
        "sequence_number": sequence,
        "item_id": CALL_PREFIX + session_id.hex(),
        "output_index": 0,
        "delta": delta,
    }


def _closing_call_events(view: ResponseView, tail: str) -> list[dict[str, Any]]:
    sequence = delta_sequence(view.output_tokens, call=True)
    events: list[dict[str, Any]] = []
    if tail:
        events.append(call_delta_event(view.session_id, sequence, tail))
        sequence += 1
    final = "response.completed" if status_of(view) == "completed" else "response.incomplete"
    item_id = CALL_PREFIX + view.session_id.hex()
    name, arguments = view.call_parts()
    for kind, body in (
        (
            "response.function_call_arguments.done",
            {"item_id": item_id, "output_index": 0, "name": name, "arguments": arguments},
        ),
        ("response.output_item.done", {"output_index": 0, "item": call_item(view)}),
        (final, {"response": response_object(view)}),
    ):
        events.append({"type": kind, "sequence_number": sequence} | body)
        sequence += 1
    return events


def closing_events(view: ResponseView, tail: str) -> list[dict[str, Any]]:
    """The events after the last token's delta (``view.text`` includes the text the end
    released; ``tail``: the delta that text makes, a function call's arguments' for a call)."""
    assert view.end is not None
    if view.calls:
        return _closing_call_events(view, tail)
    sequence = delta_sequence(view.output_tokens)
    events: list[dict[str, Any]] = []
    if tail:
        events.append(delta_event(view.session_id, sequence, tail))
        sequence += 1
    item_id = message_id(view.session_id)
    status = status_of(view)
    final = "response.completed" if status == "completed" else "response.incomplete"
    for kind, body in (
        ("response.output_text.done", {"text": view.text, "logprobs": list(view.logprobs)}),
        ("response.content_part.done", {"part": _text_part(view.text, view.logprobs)}),
        ("response.output_item.done", {"item": message_item(view, view.text)}),
        (final, {"response": response_object(view)}),
    ):
        event: dict[str, Any] = {"type": kind, "sequence_number": sequence}
        if kind != final:
            if kind != "response.output_item.done":
                event["item_id"] = item_id
                event["content_index"] = 0
            event["output_index"] = 0
        events.append(event | body)
        sequence += 1
    return events


def error_event(sequence: int, code: str, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "sequence_number": sequence,
        "code": code,
        "message": message,
        "param": None,
    }


# --- requests ------------------------------------------------------------------------------


def parse_create(body: bytes, *, model_id: str, native_tools: str | None = None) -> CreateRequest:
    """Check a ``POST /v1/responses`` body; raises :class:`ApiError` (400, 404 for a model this
    server does not serve). ``native_tools``: as :func:`.openai_api.parse_completion`'s."""
    request = openai_api.json_object(body)
    field_policy.RESPONSES.check(request)
    openai_api.check_model(request, model_id)
    stream = openai_api.optional(request, "stream", bool, False)
    background = openai_api.optional(request, "background", bool, False)
    store = openai_api.optional(request, "store", bool, True)
    if background and not store:
        raise _invalid("background responses must be stored: store cannot be false", "store")
    instructions = request.get("instructions")
    if instructions is not None and (
        not isinstance(instructions, str) or len(instructions) > MAX_PROMPT_CHARS
    ):
        raise _invalid(
            f"instructions must be a string of at most {MAX_PROMPT_CHARS} characters",
            "instructions",
        )
    previous = request.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _invalid("previous_response_id must be a string", "previous_response_id")
    items = _input(request.get("input"), native_tools)
    max_output_tokens = openai_api.optional(request, "max_output_tokens", int, None)
    if max_output_tokens is not None and max_output_tokens < 1:
        raise _invalid("max_output_tokens must be at least 1", "max_output_tokens")
    truncation = openai_api.optional(request, "truncation", str, "disabled")
    if truncation not in ("auto", "disabled"):
        raise _invalid("truncation must be 'auto' or 'disabled'", "truncation")
    metadata = field_policy.check_metadata(request.get("metadata"))
    text_format = _text_format(request.get("text"))
    schema = openai_api.json_schema_of(text_format, "text.format")
    tools = parse_tool_choice(
        request.get("tools"),
        request.get("tool_choice"),
        parallel=request.get("parallel_tool_calls"),
        nested=False,
        native=native_tools,
    )
    if tools is not None:
        if schema is not None:
            raise _invalid("a function call and text.format cannot both shape the output", "text")
        schema = tools.schema
    sampling = openai_api.sampling_payload(request)
    top_logprobs = responses_request(request)
    system_text = tool_format.system_text(instructions, tools)
    system = () if system_text is None else (ChatMessage(role="system", content=system_text),)
    payload: dict[str, Any] = {
        "max_tokens": max_output_tokens or openai_api.DEFAULT_MAX_TOKENS,
        "messages": [{"role": m.role, "content": m.content} for m in (*system, *items)],
        "truncation": truncation,
        "ignore_eos": openai_api.optional(request, "ignore_eos", bool, False),
        **sampling,
    }
    if schema is not None:
        payload["json_schema"] = schema
    if isinstance(tools, ToolFormat) and tools.template_tools is not None:
        payload["tools"] = tools.template_tools
    if top_logprobs is not None:
        payload["logprobs"] = top_logprobs
    try:
        generate = quicsrv_proto.Generate.from_payload(payload)
    except quicsrv_proto.ProtocolError as exc:  # the wire format's own bounds
        raise _invalid(exc.message, None) from None
    fields = {
        "model": model_id,
        "instructions": instructions,
        # The limit that applies: a response cut by the default says which one cut it.
        "max_output_tokens": payload["max_tokens"],
        "metadata": metadata,
        "temperature": sampling["temperature"],
        "top_p": sampling["top_p"],
        "truncation": truncation,
        "background": background,
        "store": store,
        "previous_response_id": previous,
        "text": {"format": text_format or {"type": "text"}, "verbosity": "medium"},
        "tools": echoed_tools(request.get("tools")),
        "tool_choice": request.get("tool_choice") or "auto",
        "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
        "safety_identifier": request.get("safety_identifier"),
        "prompt_cache_key": request.get("prompt_cache_key"),
    }
    if top_logprobs is not None:
        fields["top_logprobs"] = top_logprobs
    if isinstance(tools, ToolFormat):
        fields |= tool_format.fields(tools, fields["tools"], request.get("tool_choice"))
    elif tools is not None:
        fields["calls"] = list(tools.names)
    return CreateRequest(
        generate=generate,
        instructions=instructions,
        input=items,
        stream=stream,
        background=background,
        store=store,
        previous_response_id=previous,
        fields=fields,
    )


def echoed_tools(tools: object) -> list[dict[str, Any]]:
    """The function tools of a (checked) request as the response object lists them: every
    field of OpenAI's ``FunctionTool``. ``strict`` is true unless the request said false:
    either way every argument is sampled under the tool's schema (a grammar), which is what
    strict promises."""
    if not isinstance(tools, list):
        return []
    return [
        {
            "type": "function",
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
            "strict": tool.get("strict") is not False,
        }
        for tool in tools
        if isinstance(tool, dict)
    ]


def _invalid(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def _input(value: object, native_tools: str | None) -> tuple[ChatMessage, ...]:
    if isinstance(value, str):
        return (ChatMessage(role="user", content=value),)
    if not isinstance(value, list) or not value:
        raise _invalid(
            "input must be a string or a non-empty array of messages",
            "input",
            "missing_required_parameter",
        )
    if len(value) > MAX_MESSAGES:
        raise _invalid(f"input takes at most {MAX_MESSAGES} items", "input")
    messages: list[ChatMessage] = []
    calls: list[tuple[str, str]] = []  # consecutive function_call items: one assistant turn
    for i, item in enumerate(value):
        call = _function_call(item, f"input[{i}]")
        if call is not None:
            calls.append(call)
            continue
        if calls:
            messages.append(ChatMessage(role="assistant", content=calls_text(native_tools, calls)))
            calls = []
        messages.append(_input_message(item, f"input[{i}]"))
    if calls:
        messages.append(ChatMessage(role="assistant", content=calls_text(native_tools, calls)))
    return tuple(messages)


def _function_call(item: object, param: str) -> tuple[str, str] | None:
    """A ``function_call`` item's name and arguments; None for any other item."""
    if not isinstance(item, dict) or item.get("type") != "function_call":
        return None
    name, arguments = item.get("name"), item.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise _invalid(f"{param}: a function_call has a name and arguments", param)
    return name, arguments


def _input_message(item: object, param: str) -> ChatMessage:
    if not isinstance(item, dict):
        raise _invalid(f"{param} must be a message object", param)
    kind = item.get("type", "message")
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str) or not isinstance(item.get("call_id"), str):
            raise _invalid(f"{param}: a function_call_output has a call_id and an output", param)
        return ChatMessage(role="tool", content=output)
    if kind != "message":
        raise _invalid(
            f"{param}: items of type {str(kind)[:40]!r} are not supported (messages only)",
            param,
            "unsupported_value",
        )
    _check_message_keys(item, param)
    given = item.get("role")
    role = _INPUT_ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise _invalid(
            f"{param}.role must be one of user, assistant, system, developer",
            f"{param}.role",
            "unsupported_value",
        )
    text = openai_api.message_text(
        item.get("content"), param, part_types=_TEXT_PARTS, file_types=_FILE_PARTS
    )
    return ChatMessage(role=role, content=text)


#: What a message item says, and what an item echoed from an earlier response carries beside.
_MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status"})
#: Labels the model cannot be shown and that change nothing: Open Responses' ``phase`` of an
#: assistant message (its commentary, or its final answer).
_MESSAGE_NEUTRAL: dict[str, tuple[object, ...]] = {"phase": ("commentary", "final_answer")}


def _check_message_keys(item: dict[str, Any], param: str) -> None:
    for key, value in item.items():
        if key in _MESSAGE_KEYS:
            continue
        where = f"{param}.{str(key)[:40]}"
        if key not in _MESSAGE_NEUTRAL:
            raise _invalid(f"{where}: a message item has no such key", where, "unknown_parameter")
        if value is not None and value not in _MESSAGE_NEUTRAL[key]:
            raise _invalid(
                f"{where} must be one of {', '.join(map(str, _MESSAGE_NEUTRAL[key]))}",
                where,
                "unsupported_value",
            )


def _text_format(value: object) -> dict[str, Any] | None:
    """``text.format`` (``text`` may also carry ``verbosity``, which a small model cannot
    honour: only its neutral value)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        raise _invalid("text takes format (and verbosity: medium)", "text")
    if value.get("verbosity") not in (None, "medium"):
        raise _invalid(
            "text.verbosity other than medium is not supported",
            "text.verbosity",
            "unsupported_value",
        )
    text_format = value.get("format")
    if text_format is not None and not isinstance(text_format, dict):
        raise _invalid("text.format must be an object with a type", "text.format")
    return text_format


def compact(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
