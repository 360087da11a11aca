"""OpenAI's completion API, mapped onto a GENERATE, and its answers shaped the way OpenAI does.

Request side: :func:`parse_completion` checks a ``/v1/chat/completions`` or ``/v1/completions``
JSON body field by field and returns a :class:`CompletionRequest` (a ``quicsrv_proto.Generate``
plus how to answer). Which fields are accepted, and at which values, is :mod:`.field_policy`'s
one table: what the engine does, and the values of the rest that change nothing (``n: 1``,
``logit_bias: {}``, penalties 0, ``user``...); anything else, and every unknown field, is
refused with a 400 naming the parameter, so a client never believes a setting took effect when
it did not.
Extensions beside OpenAI's fields (llama-server's names): ``top_k``, ``min_p``,
``repeat_penalty``, ``ignore_eos``, and quicsrv's ``deadline_ms``.

Response side: chunk and body builders (``chat.completion.chunk``, ``text_completion``...),
fed by :mod:`.sse` for streams and by the router for ``stream: false``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import quicsrv_proto
from quicsrv_proto import EndReason
from quicsrv_proto.frames import CHAT_ROLES, MAX_SEED

from ..engine.tool_call_grammar import TOOL_CALL_BLOCKS
from . import field_policy, logprobs
from .errors import ApiError
from .file_parts import file_text
from .tool_answers import calls_text
from .tool_calls import CallText, ToolChoice, call_id, parse_tool_choice
from .tool_chunks import chat_message
from .tool_format import ToolFormat, with_tool_prompt

__all__ = [
    "DEFAULT_SAMPLING",
    "CompletionRequest",
    "chunk",
    "completion_body",
    "completion_id",
    "finish_reason",
    "parse_completion",
    "usage",
]

#: max_tokens when a request names none: OpenAI's 16 for text completions is too short to be
#: useful from a chat model, so both endpoints share one moderate default.
DEFAULT_MAX_TOKENS = 256

#: What sampling a request that names no setting gets: llama.cpp's defaults, as llama-server,
#: Ollama and LM Studio apply them, not OpenAI's temperature 1 with every token allowed, which a
#: small local model turns into noise that rarely ends (measured with the default model: the
#: Open Responses suite's answers ran to max_output_tokens in foreign scripts). A client that
#: names a value gets it; ``min_p`` and ``top_k`` are extensions an OpenAI client cannot name,
#: so they apply unless the request sets them.
DEFAULT_SAMPLING: dict[str, float] = {
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 40,
    "min_p": 0.05,
    "repeat_penalty": 1.0,
}

#: Extension of chat completions (the Responses API's name): ``auto`` drops the oldest turns of a
#: chat over the context budget instead of answering 413 ``prompt_too_long``.
_TRUNCATION = "truncation"

# OpenAI's newer name for the system role; the chat template knows only "system".
_ROLE_ALIASES = {"developer": "system"}


@dataclass(frozen=True, slots=True, kw_only=True)
class CompletionRequest:
    generate: quicsrv_proto.Generate
    """What the engine is asked to do."""
    chat: bool
    """``/v1/chat/completions`` (True) or ``/v1/completions``."""
    stream: bool
    """Answer with SSE chunks (True) or one JSON body."""
    include_usage: bool
    """``stream_options.include_usage``: a last chunk with the token counts."""
    tools: ToolChoice | ToolFormat | None = None
    """A function it must call (``tool_choice`` names one), or the tools it may call (the
    generic format: ``auto``, ``required``)."""
    echo: bool = False
    """Text completions: the answer starts with the prompt (with its tokens' log-probabilities
    where they are asked for)."""


def parse_completion(
    body: bytes, *, chat: bool, model_id: str, native_tools: str | None = None
) -> CompletionRequest:
    """Check a completion request body; raises :class:`ApiError` (400, or 404 for a model
    this server does not serve). ``native_tools``: the chat template's own tool-call format
    (``ModelInfo.tool_call_format``; None: tools the generic way)."""
    request = json_object(body)
    (field_policy.CHAT if chat else field_policy.COMPLETIONS).check(request)
    check_model(request, model_id)
    stream = optional(request, "stream", bool, False)
    options = request.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _invalid("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _invalid("stream_options takes only include_usage", "stream_options")
        include_usage = optional(
            options, "include_usage", bool, False, "stream_options.include_usage"
        )
    payload: dict[str, Any] = {"max_tokens": _max_tokens(request, chat)}
    if chat:
        payload["messages"] = _messages(request.get("messages"), native_tools)
    else:
        payload["prompt"] = _prompt(request.get("prompt"))
    payload |= sampling_payload(request)
    stop = _stop(request.get("stop"))
    if stop:
        payload["stop"] = stop
    payload["ignore_eos"] = optional(request, "ignore_eos", bool, False)
    top_logprobs = logprobs.completion_request(request, chat=chat)
    if top_logprobs is not None:
        payload["logprobs"] = top_logprobs
    echo = False if chat else optional(request, "echo", bool, False)
    if echo and top_logprobs is not None:
        if stream:
            raise _invalid(
                "echo with logprobs is answered whole: set stream to false",
                "echo",
                "unsupported_value",
            )
        payload["score_prompt"] = True
    tools = None
    if chat:
        schema = json_schema_of(request.get("response_format"), "response_format")
        tools = parse_tool_choice(
            request.get("tools"),
            request.get("tool_choice"),
            parallel=request.get("parallel_tool_calls"),
            native=native_tools,
        )
        if tools is not None:
            if schema is not None:
                raise _invalid(
                    "a tool call and a response_format cannot both shape the output",
                    "response_format",
                )
            schema = tools.schema
            if isinstance(tools, ToolFormat) and tools.template_tools is not None:
                payload["tools"] = tools.template_tools
            elif isinstance(tools, ToolFormat):
                payload["messages"] = with_tool_prompt(payload["messages"], tools.prompt)
        if schema is not None:
            payload["json_schema"] = schema
        truncation = optional(request, _TRUNCATION, str, "disabled")
        if truncation not in ("auto", "disabled"):
            raise _invalid("truncation must be 'auto' or 'disabled'", _TRUNCATION)
        payload["truncation"] = truncation
    try:
        generate = quicsrv_proto.Generate.from_payload(payload)
    except quicsrv_proto.ProtocolError as exc:  # the wire format's own bounds (lengths, ranges)
        raise _invalid(exc.message, None) from None
    return CompletionRequest(
        generate=generate,
        chat=chat,
        stream=stream,
        include_usage=include_usage,
        tools=tools,
        echo=echo,
    )


# --- responses ----------------------------------------------------------------------------


def completion_id(session_id: bytes, *, chat: bool) -> str:
    """The response ``id``: names the session, so a resumed stream keeps the same one."""
    return ("chatcmpl-" if chat else "cmpl-") + session_id.hex()


def finish_reason(reason: EndReason, *, tool_call: bool = False) -> str:
    """OpenAI's ``finish_reason``; a generation stopped by ``DELETE /v1/streams/...`` says
    ``cancelled`` (OpenAI has no word for it); a whole tool call, ``tool_calls``."""
    if reason is EndReason.LENGTH:
        return "length"
    if reason is EndReason.CANCELLED:
        return "cancelled"
    return "tool_calls" if tool_call else "stop"


def tool_call_delta(
    session_id: bytes, name: str | None, arguments: str, *, announce: bool
) -> dict[str, Any]:
    """A streamed chunk's ``tool_calls`` entry: the first says the call's id and name."""
    entry: dict[str, Any] = {"index": 0}
    if announce:
        entry |= {"id": call_id(session_id), "type": "function"}
    function: dict[str, Any] = {"arguments": arguments}
    if announce:
        function = {"name": name, **function}
    entry["function"] = function
    return entry


def usage(end: quicsrv_proto.End) -> dict[str, Any]:
    return {
        "prompt_tokens": end.prompt_tokens,
        "completion_tokens": end.completion_tokens,
        "total_tokens": end.prompt_tokens + end.completion_tokens,
        # OpenAI's name for prompt tokens served from its prompt cache.
        "prompt_tokens_details": {"cached_tokens": end.cached_tokens},
    }


def chunk(
    *,
    session_id: bytes,
    chat: bool,
    model: str,
    created: int,
    text: str | None,
    role: bool = False,
    finish: str | None = None,
    include_usage: bool = False,
    usage_counts: dict[str, int] | None = None,
    tool_call: dict[str, Any] | None = None,
    delta: dict[str, Any] | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed chunk. ``text`` None with ``usage_counts``: the last, choice-less chunk
    that carries the usage (OpenAI's ``stream_options.include_usage``). ``tool_call``: a
    ``tool_calls`` delta instead of content; ``delta``: the delta's fields, made elsewhere;
    ``logprobs``: the choice's (:mod:`.logprobs`), of the tokens whose text it carries."""
    body: dict[str, Any] = {
        "id": completion_id(session_id, chat=chat),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
    }
    if usage_counts is not None:
        body["choices"] = []
    elif chat:
        fields: dict[str, Any] = {}
        if role:
            fields["role"] = "assistant"
        if delta is not None:
            fields |= delta
        elif tool_call is not None:
            fields["tool_calls"] = [tool_call]
        elif text is not None:
            fields["content"] = text
        body["choices"] = [
            {"index": 0, "delta": fields, "logprobs": logprobs, "finish_reason": finish}
        ]
    else:
        body["choices"] = [
            {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        ]
    if include_usage:
        body["usage"] = usage_counts  # null on every chunk but the last, as OpenAI does
    return body


def completion_body(
    *,
    session_id: bytes,
    chat: bool,
    model: str,
    created: int,
    text: str,
    end: quicsrv_proto.End,
    tools: ToolChoice | ToolFormat | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole answer of a ``stream: false`` request (``tools``: a call of one function, or
    the generic format's text or calls; ``logprobs``: the choice's, :mod:`.logprobs`)."""
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": logprobs,
        "finish_reason": finish_reason(end.reason, tool_call=isinstance(tools, ToolChoice)),
    }
    if chat and isinstance(tools, ToolFormat):
        choice["message"], calls = chat_message(session_id, text, tools.answer)
        choice["finish_reason"] = finish_reason(end.reason, tool_call=calls)
    elif chat and isinstance(tools, ToolChoice):
        call = CallText(tools)
        call.finish(text)
        function = {"name": call.name or "", "arguments": call.arguments()}
        choice["message"] = {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [{"id": call_id(session_id), "type": "function", "function": function}],
        }
    elif chat:
        # OpenAI's schema requires refusal (null: this server never answers with one).
        choice["message"] = {"role": "assistant", "content": text, "refusal": None}
    else:
        choice["text"] = text
    return {
        "id": completion_id(session_id, chat=chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(end),
    }


def model_object(model_id: str, created: int) -> dict[str, Any]:
    """The model object (``GET /v1/models/{id}``, and each of ``GET /v1/models``)."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "quicsrv"}


def models_body(model_id: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model this server runs."""
    return {"object": "list", "data": [model_object(model_id, created)]}


# --- field checks (shared with the Responses API) ------------------------------------------


#: OpenAI's ``json_object`` mode: any JSON object.
JSON_OBJECT_SCHEMA = '{"type":"object"}'


def json_schema_of(value: object, param: str) -> str | None:
    """The JSON schema (as JSON text) an OpenAI output format asks for: chat completions'
    ``response_format`` and the Responses API's ``text.format`` (whose ``json_schema`` fields
    sit beside ``type`` instead of under ``json_schema``). None for plain text."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid(f"{param} must be an object with a type", param)
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return JSON_OBJECT_SCHEMA
    if kind != "json_schema":
        raise _invalid(f"{param}.type must be text, json_object or json_schema", f"{param}.type")
    spec = value["json_schema"] if "json_schema" in value else value
    where = f"{param}.json_schema" if "json_schema" in value else param
    if not isinstance(spec, dict) or set(spec) - {
        "type",
        "name",
        "description",
        "schema",
        "strict",
    }:
        raise _invalid(f"{where} takes name, description, schema and strict", where)
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise _invalid(f"{where}.name must be a string of 1 to 64 characters", f"{where}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid(f"{where}.strict must be a boolean", f"{where}.strict")
    schema = spec.get("schema")
    if not isinstance(schema, dict) or TOOL_CALL_BLOCKS in schema:  # (that one is the server's)
        raise _invalid(f"{where}.schema must be a JSON schema object", f"{where}.schema")
    # Enforced either way: every token is sampled under the schema's grammar, strict or not.
    return json.dumps(schema, separators=(",", ":"))


def check_model(request: dict[str, Any], model_id: str) -> None:
    """The request names the model this server serves (400 without one, 404 another)."""
    model = request.get("model")
    if not isinstance(model, str):
        raise _invalid(
            "you must provide a model parameter (a string)", "model", "missing_required_parameter"
        )
    if model != model_id:
        raise ApiError(
            404,
            f"The model `{model}` does not exist; this server serves `{model_id}`",
            code="model_not_found",
            param="model",
        )


def sampling_payload(request: dict[str, Any]) -> dict[str, Any]:
    """The GENERATE fields of OpenAI's sampling settings and quicsrv's extensions (``seed``,
    ``top_k``, ``min_p``, ``repeat_penalty``, ``deadline_ms``), checked."""
    payload: dict[str, Any] = {
        "temperature": _number(request, "temperature", 0.0, 2.0, DEFAULT_SAMPLING["temperature"]),
        "top_p": _number(request, "top_p", 0.0, 1.0, DEFAULT_SAMPLING["top_p"]),
    }
    if payload["top_p"] == 0.0:
        raise _invalid("top_p must be greater than 0", "top_p")
    seed = optional(request, "seed", int, None)
    if seed is not None:
        if seed < 0 or seed > MAX_SEED:
            raise _invalid("seed must be between 0 and 2^64 - 1", "seed")
        payload["seed"] = seed
    for name, lo, hi in (("min_p", 0.0, 1.0), ("repeat_penalty", 0.0, 10.0)):
        payload[name] = _number(request, name, lo, hi, DEFAULT_SAMPLING[name])
    top_k = optional(request, "top_k", int, int(DEFAULT_SAMPLING["top_k"]))
    if top_k < 0:
        raise _invalid("top_k must be 0 or more", "top_k")
    payload["top_k"] = top_k
    deadline_ms = optional(request, "deadline_ms", int, None)
    if deadline_ms is not None:
        payload["deadline_ms"] = deadline_ms
    return payload


def _invalid(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        raise _invalid("the request body is not valid JSON", None, "invalid_json") from None
    if not isinstance(value, dict):
        raise _invalid("the request body must be a JSON object", None, "invalid_json")
    return value


def optional(
    fields: dict[str, Any], name: str, kind: type, default: Any, param: str | None = None
) -> Any:
    value = fields.get(name)
    if value is None:
        return default
    # bool is an int in Python: an int field refuses true/false, a bool field refuses 0/1.
    if type(value) is not kind:
        raise _invalid(
            f"{param or name} must be {'a boolean' if kind is bool else 'an integer'}",
            param or name,
        )
    return value


def _number(request: dict[str, Any], name: str, lo: float, hi: float, default: float) -> float:
    value = request.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _invalid(f"{name} must be a number", name)
    if not lo <= value <= hi:
        raise _invalid(f"{name} must be between {lo:g} and {hi:g}", name)
    return float(value)


def _max_tokens(request: dict[str, Any], chat: bool) -> int:
    value = optional(request, "max_tokens", int, None)
    if chat:
        newer = optional(request, "max_completion_tokens", int, None)
        if newer is not None:
            if value is not None and value != newer:
                raise _invalid(
                    "max_tokens and max_completion_tokens disagree", "max_completion_tokens"
                )
            value = newer
    if value is None:
        return DEFAULT_MAX_TOKENS
    if value < 1:
        raise _invalid("max_tokens must be at least 1", "max_tokens")
    return int(value)


def _messages(value: object, native_tools: str | None = None) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _invalid(
            "messages must be a non-empty array", "messages", "missing_required_parameter"
        )
    messages = []
    for i, message in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid(f"{param} must be an object with role and content", param)
        _check_message_keys(message, param)
        role = message.get("role")
        role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in CHAT_ROLES:
            raise _invalid(
                f"{param}.role must be one of system, developer, user, assistant, tool",
                f"{param}.role",
                "unsupported_value",
            )
        assert isinstance(role, str)
        content = message.get("content")
        text = "" if content is None and role == "assistant" else message_text(content, param)
        calls = message.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise _invalid(f"{param}: only an assistant message has tool_calls", param)
            text += _calls_text(calls, f"{param}.tool_calls", native_tools)
        messages.append({"role": role, "content": text})
    return messages


#: The keys of a chat message: what it says, and (null or empty) what an assistant message
#: echoed from an answer carries besides.
_MESSAGE_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
_MESSAGE_NEUTRAL: dict[str, tuple[object, ...]] = {
    "refusal": (),
    "audio": (),
    "function_call": (),
    "annotations": ([],),
}


def _check_message_keys(message: dict[str, Any], param: str) -> None:
    """Refuse a key a chat message does not have, or a neutral one that is not (named)."""
    for key, value in message.items():
        if key in _MESSAGE_KEYS:
            continue
        allowed = _MESSAGE_NEUTRAL.get(key)
        if allowed is None:
            raise _invalid(
                f"{param}.{key}: unknown key in a message", f"{param}.{key}", "unknown_parameter"
            )
        if value is not None and value not in allowed:
            raise _invalid(
                f"{param}.{key} is not supported by this server (only null)",
                f"{param}.{key}",
                "unsupported_value",
            )


def _calls_text(calls: object, param: str, native_tools: str | None) -> str:
    """An assistant's earlier tool calls, as the text the model is shown them in
    (:func:`.tool_answers.calls_text`)."""
    if not isinstance(calls, list):
        raise _invalid(f"{param} must be an array", param)
    texts = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _invalid(f"{param}[{i}] must be a function call with a name", f"{param}[{i}]")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            raise _invalid(f"{param}[{i}].function.arguments must be a string", f"{param}[{i}]")
        texts.append((function["name"], arguments))
    return calls_text(native_tools, texts)


def message_text(
    value: object,
    param: str,
    *,
    part_types: frozenset[str] = frozenset({"text"}),
    file_types: frozenset[str] = frozenset({"file"}),
) -> str:
    """A message's text: a string, or an array of text parts (of ``part_types``) and file parts
    (of ``file_types``, read as text: :mod:`.file_parts`), joined; images and audio are
    refused since the model reads text only."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in file_types:
                assert isinstance(part, dict)
                # Chat completions nest a part's fields under its type; the Responses API not.
                fields = part.get(kind)
                parts.append(
                    file_text(fields if isinstance(fields, dict) else part, f"{param}.content[{i}]")
                )
                continue
            if not isinstance(kind, str) or kind not in part_types:
                raise _invalid(
                    f"{param}.content: only text and file parts are supported",
                    f"{param}.content",
                    "unsupported_value",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise _invalid(f"{param}.content: a text part needs text", f"{param}.content")
            parts.append(text)
        return "".join(parts)
    raise _invalid(
        f"{param}.content must be a string or an array of text parts", f"{param}.content"
    )


def _prompt(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        return value[0]
    if isinstance(value, list):
        raise _invalid(
            "prompt must be one string (batches and token arrays are not supported)",
            "prompt",
            "unsupported_value",
        )
    raise _invalid("you must provide a prompt (a string)", "prompt", "missing_required_parameter")


def _stop(value: object) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise _invalid("stop must be a non-empty string or an array of them", "stop")
    if len(value) > 4:  # OpenAI's limit
        raise _invalid("stop takes at most 4 sequences", "stop")
    return list(value)
