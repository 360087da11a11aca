"""Anthropic's Messages API without a model: the request checks, the error shape, and the event
stream, whose every suffix (from any event's id) must be exactly the tail of the uninterrupted
stream, and which the official SDK's own accumulator turns into the ``stream: false`` body."""

from __future__ import annotations

import json
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given, settings
from hypothesis import strategies as st

import quicsrv_proto
from quicsrv.http import anthropic_api
from quicsrv.http.anthropic_api import MessageShape, parse_count, parse_create
from quicsrv.http.anthropic_stream import PING, MessageEncoder
from quicsrv.http.cursor import decode_cursor
from quicsrv.http.errors import ApiError, anthropic_payload, anthropic_status, from_code
from quicsrv.http.tool_calls import ToolChoice
from quicsrv.sessions.text import TextAssembler
from quicsrv_proto import EndReason, ErrorCode

MODEL = "m"
KEY = b"k" * 32
SESSION = bytes(range(16))
WEATHER = {
    "name": "get_weather",
    "description": "Get the weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME = {**WEATHER, "name": "get_time", "description": "Get the time in a city"}
CALLS = (
    '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"city": "Rome \\"the eternal\\""}}]}'
)


# --- the event stream ----------------------------------------------------------------------


def _shape(**changes: Any) -> MessageShape:
    return MessageShape(**{"session_id": SESSION, "model": MODEL, "prompt_tokens": 7, **changes})


def _frames(texts: list[str], end: quicsrv_proto.End) -> list[quicsrv_proto.Frame]:
    frames: list[quicsrv_proto.Frame] = [
        quicsrv_proto.Checkpoint(session_id=SESSION, index=-1, snapshot_hash=b"h" * 32)
    ]
    for i, text in enumerate(texts):
        frames.append(quicsrv_proto.Token(index=i, token_id=100 + i, text=text))
        if i % 2:  # a native snapshot: no event of its own
            frames.append(
                quicsrv_proto.Checkpoint(session_id=SESSION, index=i, snapshot_hash=b"h" * 32)
            )
    return [*frames, end]


def _end(texts: list[str], reason: EndReason = EndReason.EOS, tail: str = "") -> quicsrv_proto.End:
    return quicsrv_proto.End(
        reason=reason, prompt_tokens=7, completion_tokens=len(texts), text=tail, cached_tokens=3
    )


def _events(data: bytes) -> list[tuple[str | None, str | None, dict[str, Any]]]:
    """(id, event name, data) of each event."""
    events = []
    for block in data.decode().split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((fields.get("id"), fields.get("event"), json.loads(fields["data"])))
    return events


def _stream(shape: MessageShape, frames: list[quicsrv_proto.Frame], after: int = -1) -> bytes:
    encoder = MessageEncoder(shape, mac_key=KEY, after=after, stop_sequence=lambda: "END")
    return encoder.encode_all(frames)


def _accumulated(events: list[tuple[str | None, str | None, dict[str, Any]]]) -> dict[str, Any]:
    """The message the SDK's own stream helper makes of the events."""
    snapshot = None
    buffers: dict[int, bytes] = {}
    for _, _, data in events:
        # The helper reads a raw event dict too (it constructs the model itself).
        raw: Any = data
        snapshot = accumulate_event(event=raw, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot is not None
    return snapshot.to_dict()


def test_a_text_stream_is_anthropic_s_sequence_with_cursors_numbering_its_events() -> None:
    texts = ["Hel", "", "lo"]
    end = _end(texts, EndReason.LENGTH, tail="!")
    events = _events(_stream(_shape(), _frames(texts, end)))
    names = [name for _, name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(name == data["type"] for _, name, data in events)
    cursors = [decode_cursor(i, [KEY]) for i, _, _ in events if i is not None]
    assert [c.index for c in cursors] == list(range(len(events)))
    assert all(c.messages and not c.chat and c.session_id == SESSION for c in cursors)
    start = events[0][2]["message"]
    assert start["id"] == "msg_" + SESSION.hex() and start["content"] == []
    assert start["stop_reason"] is None and start["usage"]["input_tokens"] == 7
    deltas = [d["delta"]["text"] for _, n, d in events if n == "content_block_delta"]
    assert deltas == ["Hel", "lo", "!"]
    delta = events[-2][2]
    assert delta["delta"] == {
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "stop_details": None,
    }
    assert delta["usage"] == {
        "input_tokens": 4,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 3,
        "output_tokens": 3,
    }


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (EndReason.EOS, ("end_turn", None)),
        (EndReason.STOP, ("stop_sequence", "END")),
        (EndReason.LENGTH, ("max_tokens", None)),
        (EndReason.CANCELLED, ("cancelled", None)),
    ],
)
def test_stop_reasons(reason: EndReason, expected: tuple[str, str | None]) -> None:
    texts = ["a", "b"]
    events = _events(_stream(_shape(), _frames(texts, _end(texts, reason))))
    assert tuple(events[-2][2]["delta"].values())[:2] == expected
    body = anthropic_api.message_body(_shape(), "ab", _end(texts, reason), "END")
    assert (body["stop_reason"], body["stop_sequence"]) == expected


_CHUNKS = st.lists(st.integers(1, 9), min_size=1, max_size=40)


def _split(text: str, sizes: list[int]) -> list[str]:
    parts, at = [], 0
    for size in sizes:
        parts.append(text[at : at + size])
        at += size
    return [*parts[:-1], parts[-1] + text[at:]] if at < len(text) else [p for p in parts if p]


@settings(max_examples=60, deadline=None)
@given(sizes=_CHUNKS, answer=st.sampled_from(["calls", "text", "named", "plain"]))
def test_every_suffix_is_the_tail_and_the_sdk_accumulates_the_unstreamed_body(
    sizes: list[int], answer: str
) -> None:
    if answer == "calls":
        shape, text = _shape(tool_answer="generic"), CALLS
    elif answer == "text":
        shape, text = _shape(tool_answer="generic"), '{"response": "Hi \\"there\\" \\u00e9!"}'
    elif answer == "named":
        shape = _shape(tools=ToolChoice(("get_weather",), ""))
        text = '{"city": "Paris", "days": [1, 2]}'
    else:
        shape, text = _shape(), "Once upon a time"
    texts = _split(text, sizes)
    frames = _frames(texts, _end(texts))
    whole = _stream(shape, frames)
    events = _events(whole)
    for after in range(-1, len(events)):
        assert _events(_stream(shape, frames, after)) == events[after + 1 :]
    streamed = _accumulated(events)
    body = anthropic_api.message_body(shape, "".join(texts), _end(texts), None)
    assert streamed == body
    kinds = [block["type"] for block in body["content"]]
    expected = {"calls": ["tool_use", "tool_use"], "named": ["tool_use"]}
    assert kinds == expected.get(answer, ["text"])
    if answer == "calls":
        assert body["stop_reason"] == "tool_use"
        assert [b["input"] for b in body["content"]] == [
            {"city": "Paris"},
            {"city": 'Rome "the eternal"'},
        ]
        assert [b["id"] for b in body["content"]] == [
            "toolu_" + SESSION.hex(),
            "toolu_" + SESSION.hex() + "_1",
        ]


def test_a_generic_answer_with_nothing_in_it_is_one_empty_text_block() -> None:
    texts = ['{"resp']
    events = _events(
        _stream(_shape(tool_answer="generic"), _frames(texts, _end(texts, EndReason.LENGTH)))
    )
    assert [n for _, n, _ in events][1:] == [
        "content_block_start",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    body = anthropic_api.message_body(_shape(tool_answer="generic"), texts[0], _end(texts), None)
    assert body["content"] == [{"type": "text", "text": ""}]


def test_a_restart_ends_the_stream_with_an_error_event_without_id() -> None:
    frames = _frames(["a"], quicsrv_proto.End(reason=EndReason.SHUTDOWN))
    data = _stream(_shape(), frames)
    *_, last = data.decode().split("\n\n")[:-1]
    assert last.startswith("retry: 3000\nevent: error\ndata: ")
    error = json.loads(last.split("data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["details"]["error_code"] == "shutting_down"
    assert "id: " not in last
    assert PING == b'event: ping\ndata: {"type":"ping"}\n\n'


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (ErrorCode.UNAUTHORIZED, 401, "authentication_error"),
        (ErrorCode.SESSION_KEY_MISMATCH, 403, "permission_error"),
        (ErrorCode.UNKNOWN_SESSION, 404, "not_found_error"),
        (ErrorCode.PROMPT_TOO_LONG, 400, "invalid_request_error"),
        (ErrorCode.CLIENT_LIMIT, 429, "rate_limit_error"),
        (ErrorCode.RATE_LIMIT_EXCEEDED, 429, "rate_limit_error"),
        (ErrorCode.OVERLOADED, 529, "overloaded_error"),
        (ErrorCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (ErrorCode.ENGINE_UNAVAILABLE, 503, "api_error"),
        (ErrorCode.INTERNAL_ERROR, 500, "api_error"),
        (ErrorCode.SESSION_EXPIRED, 410, "invalid_request_error"),
    ],
)
def test_every_refusal_has_anthropic_s_status_and_type(
    code: ErrorCode, status: int, kind: str
) -> None:
    error = from_code(code, "why")
    assert anthropic_status(error) == status
    assert anthropic_payload(error) == {
        "type": "error",
        "error": {"type": kind, "message": "why", "details": {"error_code": code.slug}},
    }


def test_a_body_over_the_limit_is_request_too_large() -> None:
    from quicsrv.http.router import request_too_large

    payload = anthropic_payload(request_too_large(10))
    assert payload["error"]["type"] == "request_too_large"
    assert anthropic_status(request_too_large(10)) == 413


# --- requests ------------------------------------------------------------------------------

OK: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 16,
    "messages": [{"role": "user", "content": "hi"}],
}


def _create(**changes: Any) -> anthropic_api.MessagesRequest:
    return parse_create(json.dumps({**OK, **changes}).encode(), model_id=MODEL)


def _refused(**changes: Any) -> ApiError:
    body = {k: v for k, v in {**OK, **changes}.items() if v is not ...}
    with pytest.raises(ApiError) as refused:
        parse_create(json.dumps(body).encode(), model_id=MODEL)
    return refused.value


def _chat(request: anthropic_api.MessagesRequest) -> list[tuple[str, str]]:
    assert request.generate.messages is not None
    return [(m.role, m.content) for m in request.generate.messages]


def test_a_conversation_with_a_tool_loop_becomes_the_chat_the_template_renders() -> None:
    request = _create(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        tools=[WEATHER],
        tool_choice={"type": "auto"},
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look.", "citations": None},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
        stop_sequences=["\n\n"],
        temperature=0,
        top_k=5,
        seed=3,
        metadata={"user_id": "u1"},
        thinking={"type": "disabled"},
    )
    chat = _chat(request)
    assert chat[0][0] == "system"
    assert chat[0][1].startswith("Be brief.\n\nYou have access to these tools")
    assert chat[1:] == [
        ("user", "Weather in Paris?"),
        ("assistant", 'Let me look.\n{"name": "get_weather", "arguments": {"city": "Paris"}}'),
        ("tool", "Sunny"),
        ("user", "And tomorrow?"),
    ]
    assert request.api() == {"kind": "message", "answer": "generic"}
    assert request.generate.json_schema is not None and request.generate.stop == ("\n\n",)
    assert request.generate.top_k == 5 and request.generate.seed == 3


def test_tool_choice_maps_onto_the_shared_machinery() -> None:
    required = _create(tools=[WEATHER, TIME], tool_choice={"type": "any"}).tools
    assert required is not None and getattr(required, "required", False)
    one = _create(
        tools=[WEATHER, TIME], tool_choice={"type": "any", "disable_parallel_tool_use": True}
    ).tools
    assert one is not None and not getattr(one, "parallel", True)
    named = _create(tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "get_time"})
    assert named.tools == ToolChoice(
        ("get_time",), json.dumps(TIME["input_schema"], separators=(",", ":"))
    )
    assert named.api() == {"kind": "message", "tools": ["get_time"]}
    none = _create(tools=[WEATHER], tool_choice={"type": "none"})
    assert none.tools is None and none.generate.json_schema is None


@pytest.mark.parametrize(
    ("changes", "status", "code", "param"),
    [
        ({"max_tokens": ...}, 400, "missing_required_parameter", "max_tokens"),
        ({"max_tokens": 0}, 400, "invalid_value", "max_tokens"),
        ({"model": "claude-opus-4"}, 404, "model_not_found", "model"),
        ({"temperature": 1.5}, 400, "invalid_value", "temperature"),
        ({"bogus": 1}, 400, "unknown_parameter", "bogus"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 2048}},
            400,
            "unsupported_parameter",
            "thinking",
        ),
        ({"metadata": {"user_id": "u", "other": 1}}, 400, "invalid_value", "metadata"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "unsupported_value",
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}],
                    }
                ]
            },
            400,
            "unsupported_value",
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "hi", "mood": 1}]}
                ]
            },
            400,
            "unknown_parameter",
            "messages[0].content[0].mood",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}
                ]
            },
            400,
            "invalid_value",
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "Hel"},
                ]
            },
            400,
            "unsupported_value",
            "messages[1]",
        ),
        (
            {"messages": [{"role": "system", "content": "hi"}]},
            400,
            "invalid_value",
            "messages[0].role",
        ),
        ({"messages": []}, 400, "missing_required_parameter", "messages"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            400,
            "unsupported_value",
            "tools[0].type",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
            400,
            "invalid_value",
            "tool_choice",
        ),
        ({"tool_choice": {"type": "any"}}, 400, "invalid_value", "tool_choice"),
        ({"stop_sequences": "x"}, 400, "invalid_value", "stop_sequences"),
    ],
)
def test_bad_requests_are_refused_naming_the_field(
    changes: dict[str, Any], status: int, code: str, param: str
) -> None:
    error = _refused(**changes)
    assert (error.status, error.code, error.param) == (status, code, param)


def test_count_tokens_reads_the_same_prompt_and_refuses_max_tokens() -> None:
    fields = {"model": MODEL, "system": "s", "tools": [WEATHER], "messages": OK["messages"]}
    counted = parse_count(json.dumps(fields).encode(), model_id=MODEL)
    created = _create(**fields)
    assert counted.messages == created.generate.messages
    with pytest.raises(ApiError) as refused:
        parse_count(json.dumps({**fields, "max_tokens": 3}).encode(), model_id=MODEL)
    assert refused.value.param == "max_tokens"


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        (None, True),
        (b"2023-06-01", True),
        (b"2026-10-21", True),
        (b"2023-01-01", False),
        (b"v1", False),
    ],
)
def test_anthropic_version(version: bytes | None, ok: bool) -> None:
    headers: dict[bytes, bytes] = {} if version is None else {b"anthropic-version": version}
    if ok:
        anthropic_api.check_version(headers)
    else:
        with pytest.raises(ApiError) as refused:
            anthropic_api.check_version(headers)
        assert refused.value.code == "unsupported_version"


def test_the_stop_sequence_that_matched_is_the_earliest_found() -> None:
    text = TextAssembler(("lo", "el", "x"))
    assert text.push(b"He") == "H" and text.matched is None
    assert text.push(b"llo") == "" and text.stopped and text.matched == "el"
