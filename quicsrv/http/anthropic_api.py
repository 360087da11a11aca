"""Anthropic's Messages API, mapped onto a GENERATE, and its answers shaped the way Anthropic's
are.

Request side: :func:`parse_create` checks a ``POST /v1/messages`` body and returns a
:class:`MessagesRequest` (a ``quicsrv_proto.Generate`` and how to answer); :func:`parse_count`
checks a ``POST /v1/messages/count_tokens`` body and returns the GENERATE whose prompt it
counts. Which fields are accepted, and at which values, is :mod:`.field_policy`'s (``MESSAGES``,
``COUNT_TOKENS``); the blocks inside messages are checked here, each refused by its path
(``messages[1].content[0]``). The conversation becomes the chat the model's template renders:
``system`` first, a user's text, each ``tool_result`` as a ``tool`` message, an assistant's text
and its ``tool_use`` blocks as the calls it generated (:func:`.tool_answers.calls_text`, as the
other APIs show earlier calls). Tools go through the same machinery as chat completions and
the Responses API (:func:`.tool_calls.parse_tool_choice`): ``tool_choice`` ``auto`` and
``any`` are the generic format's ``auto`` and ``required``, ``{"type": "tool", "name"}`` a named
function (its input generated under its schema), ``none`` no tools.

Response side: everything a message says is a function of its session record
(:class:`MessageShape` and the generated text): ids (``msg_<session>``, ``toolu_<session>``,
``_<i>`` after it for a second call on), content blocks, ``stop_reason``, ``usage``.
``usage.input_tokens`` counts the prompt tokens computed, ``cache_read_input_tokens`` those
whose KV cells the prefix cache held (together: the prompt, as Anthropic sums them);
nothing is ever written to a cache on request, so ``cache_creation_input_tokens`` is 0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import quicsrv_proto
from quicsrv_proto import EndReason
from quicsrv_proto.frames import MAX_MESSAGES

from ..sessions.record import SessionRecord
from . import field_policy, openai_api
from .errors import ApiError
from .tool_answers import answer_format, calls_text, parse_answer
from .tool_calls import CallText, ToolChoice, parse_tool_choice
from .tool_format import ToolFormat, with_tool_prompt

__all__ = [
    "KIND",
    "OLDEST_VERSION",
    "MessageShape",
    "MessagesRequest",
    "check_version",
    "is_message",
    "message_body",
    "message_id",
    "parse_count",
    "parse_create",
    "stop_reason",
    "tool_use_id",
    "usage",
]

KIND = "message"
"""``SessionRecord.api["kind"]`` of a session this API started."""
MESSAGE_PREFIX = "msg_"
TOOL_USE_PREFIX = "toolu_"
OLDEST_VERSION = "2023-06-01"
"""The oldest ``anthropic-version`` served: the Messages API's first. A later date is served
the same shapes (each version since only added fields and events a client may ignore)."""
_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}$")
#: Anthropic's sampling bounds (narrower than OpenAI's 0-2).
MAX_TEMPERATURE = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagesRequest:
    """A checked ``POST /v1/messages``."""

    generate: quicsrv_proto.Generate
    """What the engine is asked to do."""
    stream: bool
    """Answer with Anthropic's SSE events (True) or one ``message`` body."""
    tools: ToolChoice | ToolFormat | None
    """A tool it must use (``tool_choice: {"type": "tool"}``), the tools it may use (``auto``,
    ``any``: the generic format), or none."""

    def api(self) -> dict[str, Any]:
        """What the session record keeps, so that a resumed stream renders alike."""
        api: dict[str, Any] = {"kind": KIND}
        if isinstance(self.tools, ToolFormat):
            api["answer"] = self.tools.answer
        elif self.tools is not None:
            api["tools"] = self.tools.stored()
        return api


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageShape:
    """What every event and body of one message says besides its content."""

    session_id: bytes
    """The session the message is."""
    model: str
    """The served model's id."""
    prompt_tokens: int
    """The prompt's length in tokens."""
    tools: ToolChoice | None = None
    """The answer is the input of this one tool (the whole text is its input)."""
    tool_answer: str | None = None
    """The answer is text or tool uses, in this format (:mod:`.tool_answers`)."""

    @classmethod
    def of(cls, record: SessionRecord, model: str) -> MessageShape:
        api = record.api or {}
        names = api.get("tools")
        return cls(
            session_id=record.session_id,
            model=model,
            prompt_tokens=len(record.spec.prompt_tokens),
            tools=None if names is None else ToolChoice.from_stored(names),
            tool_answer=answer_format(api),
        )


def is_message(record: SessionRecord) -> bool:
    """Whether the session was started by ``POST /v1/messages``."""
    return record.api is not None and record.api.get("kind") == KIND


# --- requests ------------------------------------------------------------------------------


def check_version(headers: Mapping[bytes, bytes]) -> None:
    """``anthropic-version``: absent (curl), or a date from :data:`OLDEST_VERSION` on."""
    value = headers.get(b"anthropic-version")
    if value is None:
        return
    version = value.decode("latin-1").strip()
    if not _VERSION.match(version) or version < OLDEST_VERSION:
        raise ApiError(
            400,
            f"anthropic-version {version[:40]!r} is not supported: this server speaks "
            f"{OLDEST_VERSION} and later dates",
            code="unsupported_version",
            param="anthropic-version",
        )


def parse_create(body: bytes, *, model_id: str, native_tools: str | None = None) -> MessagesRequest:
    """Check a ``POST /v1/messages`` body; raises :class:`ApiError` (400, or 404 for a model
    this server does not serve). ``native_tools``: as :func:`.openai_api.parse_completion`'s."""
    request = openai_api.json_object(body)
    field_policy.MESSAGES.check(request)
    openai_api.check_model(request, model_id)
    max_tokens = request.get("max_tokens")
    if max_tokens is None:
        raise _invalid("max_tokens: Field required", "max_tokens", "missing_required_parameter")
    if type(max_tokens) is not int or max_tokens < 1:
        raise _invalid("max_tokens must be an integer, at least 1", "max_tokens")
    _check_metadata(request.get("metadata"))
    temperature = request.get("temperature")
    if isinstance(temperature, int | float) and temperature > MAX_TEMPERATURE:
        raise _invalid("temperature must be between 0 and 1", "temperature")
    messages, tools = _conversation(request, native_tools)
    payload: dict[str, Any] = {
        "max_tokens": max_tokens,
        "messages": messages,
        **openai_api.sampling_payload(request),
        "ignore_eos": openai_api.optional(request, "ignore_eos", bool, False),
    }
    stop = _stop_sequences(request.get("stop_sequences"))
    if stop:
        payload["stop"] = stop
    truncation = openai_api.optional(request, "truncation", str, "disabled")
    if truncation not in ("auto", "disabled"):
        raise _invalid("truncation must be 'auto' or 'disabled'", "truncation")
    payload["truncation"] = truncation
    if tools is not None:
        payload["json_schema"] = tools.schema
    if isinstance(tools, ToolFormat) and tools.template_tools is not None:
        payload["tools"] = tools.template_tools
    return MessagesRequest(
        generate=_generate(payload),
        stream=openai_api.optional(request, "stream", bool, False),
        tools=tools,
    )


def parse_count(
    body: bytes, *, model_id: str, native_tools: str | None = None
) -> quicsrv_proto.Generate:
    """Check a ``POST /v1/messages/count_tokens`` body: the GENERATE whose prompt is counted
    (the same prompt :func:`parse_create` makes of the same fields)."""
    request = openai_api.json_object(body)
    field_policy.COUNT_TOKENS.check(request)
    openai_api.check_model(request, model_id)
    messages, tools = _conversation(request, native_tools)
    payload: dict[str, Any] = {"max_tokens": 1, "messages": messages}
    if isinstance(tools, ToolFormat) and tools.template_tools is not None:
        payload["tools"] = tools.template_tools
    return _generate(payload)


def _generate(payload: dict[str, Any]) -> quicsrv_proto.Generate:
    try:
        return quicsrv_proto.Generate.from_payload(payload)
    except quicsrv_proto.ProtocolError as exc:  # the wire format's own bounds (lengths, ranges)
        raise _invalid(exc.message, None) from None


def _conversation(
    request: dict[str, Any], native: str | None
) -> tuple[list[dict[str, str]], ToolChoice | ToolFormat | None]:
    """The chat the template renders (``system``, then the messages, the tool prompt added to
    the system message when the answer is in the generic format), and the tools."""
    tools = _tools(request.get("tools"), request.get("tool_choice"), native)
    messages = _messages(request.get("messages"), native)
    system = _system(request.get("system"))
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    if isinstance(tools, ToolFormat) and tools.template_tools is None:
        messages = with_tool_prompt(messages, tools.prompt)
    return messages, tools


def _check_metadata(value: object) -> None:
    """Anthropic's ``metadata``: ``user_id`` only (it labels the request)."""
    if value is None:
        return
    if not isinstance(value, dict) or set(value) - {"user_id"}:
        raise _invalid("metadata takes only user_id", "metadata")
    user = value.get("user_id")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise _invalid("metadata.user_id must be a string of at most 256 characters", "metadata")


def _stop_sequences(value: object) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise _invalid("stop_sequences must be an array of non-empty strings", "stop_sequences")
    return list(value)


def _system(value: object) -> str | None:
    """``system``: a string or text blocks (joined as Anthropic reads them, one after the
    other)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(_text_block(block, f"system[{i}]") for i, block in enumerate(value))
    raise _invalid("system must be a string or an array of text blocks", "system")


# --- tools ---------------------------------------------------------------------------------

#: A custom tool's keys: what the prompt and the grammar are made of, and what changes nothing
#: here (``strict``: every input is generated under its schema anyway; ``cache_control``: the
#: prefix cache keeps every prefix; ``type: "custom"``, the only kind served).
_TOOL_KEYS = frozenset({"name", "description", "input_schema", "type", "cache_control", "strict"})


def _tools(tools: object, choice: object, native: str | None) -> ToolChoice | ToolFormat | None:
    """Anthropic's ``tools`` and ``tool_choice`` on the machinery every API shares."""
    functions: list[dict[str, Any]] | None = None
    if tools is not None:
        if not isinstance(tools, list):
            raise _invalid("tools must be an array of tools", "tools")
        functions = [_function(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    named: object = None
    parallel: bool | None = None
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in (
            "auto",
            "any",
            "tool",
            "none",
        ):
            raise _invalid(
                "tool_choice must be an object whose type is auto, any, tool or none",
                "tool_choice",
            )
        kind = choice["type"]
        allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
        if set(choice) - allowed:
            raise _invalid(f"tool_choice of type {kind} takes {sorted(allowed)}", "tool_choice")
        disable = choice.get("disable_parallel_tool_use")
        if disable is not None and not isinstance(disable, bool):
            raise _invalid("disable_parallel_tool_use must be a boolean", "tool_choice")
        parallel = None if disable is None else not disable
        named = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        if kind == "tool":
            named = {"type": "function", "name": choice.get("name")}
    return parse_tool_choice(functions, named, parallel=parallel, nested=False, native=native)


def _function(tool: object, where: str) -> dict[str, Any]:
    """A custom tool as the flat function the shared machinery reads."""
    if not isinstance(tool, dict):
        raise _invalid(f"{where} must be a tool object", where)
    if tool.get("type") not in (None, "custom"):
        raise _invalid(
            f"{where}: tools of type {str(tool['type'])[:60]!r} are not supported (custom tools "
            "only: this server runs no tool itself)",
            f"{where}.type",
            "unsupported_value",
        )
    for key in tool:
        if key not in _TOOL_KEYS:
            raise _invalid(
                f"{where}.{key}: a tool has no such key", f"{where}.{key}", "unknown_parameter"
            )
    if not isinstance(tool.get("input_schema"), dict):
        raise _invalid(f"{where}.input_schema must be a JSON schema object", where)
    if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
        raise _invalid(f"{where}.strict must be a boolean", where)
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool["input_schema"],
    }


# --- messages ------------------------------------------------------------------------------

#: Each block's keys, and those that carry nothing for this model (null, or as listed): a
#: cache breakpoint (every prefix is cached), no citations, a direct caller.
_BLOCK_KEYS = {
    "text": frozenset({"type", "text"}),
    "tool_use": frozenset({"type", "id", "name", "input"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error"}),
}
_BLOCK_NEUTRAL: dict[str, tuple[object, ...] | None] = {
    "cache_control": None,  # any breakpoint
    "citations": ([],),
    "caller": ({"type": "direct"},),
}
_BLOCKS_OF = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


def _messages(value: object, native: str | None) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _invalid(
            "messages: a non-empty array of messages is required",
            "messages",
            "missing_required_parameter",
        )
    if len(value) > MAX_MESSAGES:
        raise _invalid(f"messages takes at most {MAX_MESSAGES} messages", "messages")
    chat: list[dict[str, str]] = []
    calls: set[str] = set()  # the tool_use ids of the assistant message before
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid(f"{where} must be an object with role and content", where)
        for key in message:
            if key not in ("role", "content"):
                raise _invalid(
                    f"{where}.{key}: a message has no such key",
                    f"{where}.{key}",
                    "unknown_parameter",
                )
        role = message.get("role")
        if role not in _BLOCKS_OF:
            raise _invalid(f"{where}.role must be user or assistant", f"{where}.role")
        assert isinstance(role, str)
        if role == "assistant" and i == len(value) - 1:
            raise _invalid(
                f"{where}: a last assistant message (a prefill to continue) is not supported: "
                "the model starts its own turn",
                where,
                "unsupported_value",
            )
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            calls = set()
            continue
        if not isinstance(content, list):
            raise _invalid(f"{where}.content must be a string or an array of blocks", where)
        turn, calls = _blocks(role, content, f"{where}.content", calls, native)
        chat += turn
    return chat


def _blocks(
    role: str, blocks: list[Any], where: str, previous_calls: set[str], native: str | None
) -> tuple[list[dict[str, str]], set[str]]:
    """One message's blocks as chat messages: text gathered, a tool result each a ``tool``
    message, an assistant's tool uses shown as the calls it generated. Returns them and the
    tool use ids this message made (a tool result answers one of the message before)."""
    chat: list[dict[str, str]] = []
    texts: list[str] = []
    calls: set[str] = set()
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in _BLOCKS_OF[role]:
            raise _invalid(
                f"{at}: blocks of type {str(kind)[:40]!r} are not supported in a {role} "
                f"message (only {' and '.join(_BLOCKS_OF[role])}: the model reads text)",
                f"{at}.type",
                "unsupported_value",
            )
        assert isinstance(block, dict)
        _check_keys(block, _BLOCK_KEYS[str(kind)], at)
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            texts.append(_tool_use_text(block, at, native))
            calls.add(block["id"])
        else:
            if texts:
                chat.append({"role": role, "content": "\n".join(texts)})
                texts = []
            chat.append({"role": "tool", "content": _tool_result_text(block, at, previous_calls)})
    if texts or not chat:
        chat.append({"role": role, "content": "\n".join(texts)})
    return chat, calls


def _check_keys(block: dict[str, Any], keys: frozenset[str], at: str) -> None:
    for key, value in block.items():
        if key in keys:
            continue
        if key not in _BLOCK_NEUTRAL:
            raise _invalid(
                f"{at}.{key}: the block has no such key", f"{at}.{key}", "unknown_parameter"
            )
        allowed = _BLOCK_NEUTRAL[key]
        if value is not None and allowed is not None and value not in allowed:
            raise _invalid(
                f"{at}.{key} is not supported by this server", f"{at}.{key}", "unsupported_value"
            )


def _text_block(block: object, at: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise _invalid(f"{at} must be a text block", at, "unsupported_value")
    _check_keys(block, _BLOCK_KEYS["text"], at)
    text = block.get("text")
    if not isinstance(text, str):
        raise _invalid(f"{at}.text must be a string", f"{at}.text")
    return text


def _tool_use_text(block: dict[str, Any], at: str, native: str | None) -> str:
    """An earlier tool use, as the call the model generated (the other APIs show calls so)."""
    name, tool_id, given = block.get("name"), block.get("id"), block.get("input")
    if not isinstance(name, str) or not isinstance(tool_id, str) or not isinstance(given, dict):
        raise _invalid(f"{at}: a tool_use block has an id, a name and an input object", at)
    return calls_text(native, [(name, json.dumps(given, ensure_ascii=False))])


def _tool_result_text(block: dict[str, Any], at: str, calls: set[str]) -> str:
    tool_id = block.get("tool_use_id")
    if not isinstance(tool_id, str) or tool_id not in calls:
        raise _invalid(
            f"{at}.tool_use_id must name a tool_use block of the assistant message before",
            f"{at}.tool_use_id",
        )
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_text_block(part, f"{at}.content[{k}]") for k, part in enumerate(content))
    else:
        raise _invalid(f"{at}.content must be a string or an array of text blocks", at)
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise _invalid(f"{at}.is_error must be a boolean", f"{at}.is_error")
    # The model reads text only: an error result says it is one.
    return f"Error: {text}" if is_error else text


def _invalid(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


# --- responses -----------------------------------------------------------------------------


def message_id(session_id: bytes) -> str:
    """The message ``id``: names the session, so a resumed stream says the same."""
    return MESSAGE_PREFIX + session_id.hex()


def tool_use_id(session_id: bytes, index: int = 0) -> str:
    """Tool use ``index``'s id: named by the session, so a resume replays the same ids."""
    return TOOL_USE_PREFIX + session_id.hex() + (f"_{index}" if index else "")


def stop_reason(reason: EndReason, *, tool_use: bool) -> str:
    """Anthropic's ``stop_reason``; a generation stopped by ``DELETE /v1/streams/...`` says
    ``cancelled`` (quicsrv's word, as its chat completions' ``finish_reason``: Anthropic has
    none for it)."""
    if reason is EndReason.LENGTH:
        return "max_tokens"
    if reason is EndReason.STOP:
        return "stop_sequence"
    if reason is EndReason.CANCELLED:
        return "cancelled"
    return "tool_use" if tool_use else "end_turn"


def start_usage(shape: MessageShape) -> dict[str, int]:
    """``message_start``'s usage: the prompt, before anyone knows how much of it was cached
    (``message_delta`` says, cumulatively, as Anthropic's do)."""
    return {
        "input_tokens": shape.prompt_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }


def usage(end: quicsrv_proto.End) -> dict[str, int]:
    """The final usage (see the module docstring)."""
    return {
        "input_tokens": end.prompt_tokens - end.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": end.cached_tokens,
        "output_tokens": end.completion_tokens,
    }


def message_object(
    shape: MessageShape,
    *,
    content: list[dict[str, Any]],
    stop: str | None,
    stop_sequence: str | None,
    counts: dict[str, int],
) -> dict[str, Any]:
    """The ``message`` object (``stop`` None: as ``message_start`` announces it)."""
    return {
        "id": message_id(shape.session_id),
        "type": "message",
        "role": "assistant",
        "model": shape.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": stop_sequence,
        "stop_details": None,  # no refusal classifier here: nothing to say of any stop
        "usage": counts,
    }


def tool_use_block(
    shape: MessageShape, index: int, name: str, given: dict[str, Any]
) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": tool_use_id(shape.session_id, index),
        "name": name,
        "input": given,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool use's ``input`` from the JSON its arguments were generated as ({} while it is
    not a whole object: a use cut by ``max_tokens``)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_body(
    shape: MessageShape, text: str, end: quicsrv_proto.End, stop_sequence: str | None
) -> dict[str, Any]:
    """The whole answer of a ``stream: false`` request (``text``: the generated text)."""
    content: list[dict[str, Any]] = []
    if shape.tools is not None:
        call = CallText(shape.tools)
        call.finish(text)
        content = [tool_use_block(shape, 0, call.name or "", tool_input(call.arguments()))]
    elif shape.tool_answer is not None:
        answer = parse_answer(shape.tool_answer, text)
        content = [
            tool_use_block(shape, i, name, tool_input(arguments))
            for i, (name, arguments) in enumerate(answer.calls)
        ]
        text = answer.text
    if not content:
        content = [{"type": "text", "text": text}]
    used = content[0]["type"] == "tool_use"
    reason = stop_reason(end.reason, tool_use=used)
    return message_object(
        shape,
        content=content,
        stop=reason,
        stop_sequence=stop_sequence if reason == "stop_sequence" else None,
        counts=usage(end),
    )
