"""The Responses API without a model: the request checks, the ids, and the event stream, whose
every suffix (``starting_after``) must be exactly the tail of the uninterrupted stream."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quicsrv_proto
from quicsrv.http.errors import ApiError
from quicsrv.http.openai_api import DEFAULT_MAX_TOKENS, parse_completion
from quicsrv.http.responses_api import (
    FIRST_DELTA,
    ResponseView,
    first_token_after,
    from_response_id,
    parse_create,
    response_id,
)
from quicsrv.http.responses_stream import ResponseEncoder
from quicsrv_proto import ChatMessage, EndReason, ErrorCode

MODEL = "m"
SESSION = bytes(range(16))
FINISHING = [EndReason.EOS, EndReason.LENGTH, EndReason.STOP, EndReason.CANCELLED]
FIELDS: dict[str, Any] = {
    "model": MODEL,
    "instructions": "be brief",
    "max_output_tokens": 9,
    "metadata": {"k": "v"},
    "temperature": 0.5,
    "top_p": 1.0,
    "truncation": "disabled",
    "background": True,
    "store": True,
    "previous_response_id": None,
}


# --- the event stream ----------------------------------------------------------------------


def _view(*, end: EndReason | None = None, output_tokens: int = 0) -> ResponseView:
    return ResponseView(
        session_id=SESSION,
        created_at=1_700_000_000,
        fields=FIELDS,
        text="",
        input_tokens=0,
        cached_tokens=0,
        output_tokens=output_tokens,
        end=end,
    )


def _checkpoint(index: int) -> quicsrv_proto.Checkpoint:
    return quicsrv_proto.Checkpoint(session_id=SESSION, index=index, snapshot_hash=b"h" * 32)


def _frames(texts: list[str], end: quicsrv_proto.End, start: int = 0) -> list[quicsrv_proto.Frame]:
    """What the session sends a stream that starts at token ``start``: the opening checkpoint
    (at token 0 only), the tokens with a checkpoint after each second one, then the end."""
    frames: list[quicsrv_proto.Frame] = [_checkpoint(-1)] if start == 0 else []
    for i in range(start, len(texts)):
        frames.append(quicsrv_proto.Token(index=i, token_id=100 + i, text=texts[i]))
        if i % 2:
            frames.append(_checkpoint(i))  # a native snapshot: no event of its own
    return [*frames, end]


def _end(texts: list[str], reason: EndReason, tail: str) -> quicsrv_proto.End:
    return quicsrv_proto.End(
        reason=reason, prompt_tokens=7, completion_tokens=len(texts), text=tail, cached_tokens=3
    )


def _blocks(data: bytes) -> list[str]:
    # Only CR and LF end an SSE line (WHATWG HTML §9.2.6); str.splitlines would also split on
    # U+2028 and friends, which JSON leaves unescaped in the token text.
    assert b"\r" not in data
    text = data.decode()
    assert text.endswith("\n\n") or not text
    return text.split("\n\n")[:-1]


def _events(data: bytes) -> list[tuple[str | None, str, dict[str, Any]]]:
    """(``id``, ``event``, the data's JSON) of each event."""
    events = []
    for block in _blocks(data):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(fields) <= {"id", "event", "data", "retry"}
        events.append((fields.get("id"), fields["event"], json.loads(fields["data"])))
    return events


def _whole(texts: list[str], reason: EndReason, tail: str) -> bytes:
    encoder = ResponseEncoder(_view(), text_before="")
    data = encoder.encode_all(_frames(texts, _end(texts, reason, tail)))
    assert encoder.finished
    return data


def _resumed(texts: list[str], reason: EndReason, tail: str, after: int) -> bytes:
    """As ``GET /v1/responses/{id}?stream=true&starting_after=<after>`` of a response that is
    over: the record already holds the end, and the tokens before the first sent are text."""
    start = min(first_token_after(after), len(texts))
    encoder = ResponseEncoder(
        _view(end=reason, output_tokens=len(texts)),
        text_before="".join(texts[:start]),
        after=after,
    )
    data = encoder.encode_all(_frames(texts, _end(texts, reason, tail), start))
    assert encoder.finished
    return data


def _check_whole(data: bytes, texts: list[str], reason: EndReason, tail: str) -> None:
    """What any uninterrupted stream must say, whatever its tokens."""
    events = _events(data)
    numbers = [body["sequence_number"] for _, _, body in events]
    assert numbers == list(range(len(events)))  # gap-free: a resume skips nothing
    assert [event_id for event_id, _, _ in events] == [str(n) for n in numbers]
    assert [kind for _, kind, _ in events] == [body["type"] for _, _, body in events]
    # Every token has its own delta, at 4 + its index, even one that completes no character.
    for i, text in enumerate(texts):
        _, kind, body = events[FIRST_DELTA + i]
        assert (kind, body["delta"]) == ("response.output_text.delta", text)
    assert len(events) == FIRST_DELTA + len(texts) + (1 if tail else 0) + 4
    whole_text = "".join(texts) + tail
    deltas = [body["delta"] for _, kind, body in events if kind == "response.output_text.delta"]
    assert "".join(deltas) == whole_text
    done = [body for _, kind, body in events if kind == "response.output_text.done"]
    assert [body["text"] for body in done] == [whole_text]
    _, final_kind, final = events[-1]
    response = final["response"]
    assert response["output"][0]["content"][0]["text"] == whole_text
    assert response["usage"]["output_tokens"] == len(texts)
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 3
    if reason in (EndReason.EOS, EndReason.STOP):
        assert final_kind == "response.completed"
        assert (response["status"], response["incomplete_details"]) == ("completed", None)
    elif reason is EndReason.LENGTH:
        assert final_kind == "response.incomplete"
        assert response["status"] == "incomplete"
        assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    else:
        assert final_kind == "response.incomplete"
        assert response["status"] == "cancelled"


@settings(max_examples=60)
@given(
    texts=st.lists(st.text(max_size=4), max_size=7),
    reason=st.sampled_from(FINISHING),
    tail=st.text(max_size=3),
    data=st.data(),
)
def test_a_resumed_stream_is_exactly_the_tail_of_the_uninterrupted_one(
    texts: list[str], reason: EndReason, tail: str, data: st.DataObject
) -> None:
    """Events are numbered by token index, so ``starting_after`` = N on any process gives the
    events after N, byte for byte, whatever the tokens said."""
    whole = _whole(texts, reason, tail)
    _check_whole(whole, texts, reason, tail)
    last = FIRST_DELTA + len(texts) + (1 if tail else 0) + 3
    after = data.draw(st.integers(min_value=-1, max_value=last + 2), label="after")
    expected = b"".join(
        block.encode() + b"\n\n"
        for block in _blocks(whole)
        if json.loads(block.split("\ndata: ", 1)[1])["sequence_number"] > after
    )
    assert _resumed(texts, reason, tail, after) == expected


@pytest.mark.parametrize("reason", FINISHING)
def test_every_starting_after_of_one_stream(reason: EndReason) -> None:
    """Each cut of one stream with an empty token, non-ASCII and a held-back tail."""
    texts = ["Gr", "", "üß", "e\n", "日本", "\u2028🙂"]
    whole = _whole(texts, reason, "!")
    _check_whole(whole, texts, reason, "!")
    blocks = [block.encode() + b"\n\n" for block in _blocks(whole)]
    for after in range(-1, len(blocks) + 2):
        assert _resumed(texts, reason, "!", after) == b"".join(blocks[after + 1 :]), after


def test_no_tokens_and_no_tail() -> None:
    """An empty answer still opens, and closes with empty text."""
    events = _events(_whole([], EndReason.EOS, ""))
    assert [kind for _, kind, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[4][2]["text"] == ""


# --- streams that cannot go on -------------------------------------------------------------

_INTERRUPTIONS = [
    (
        quicsrv_proto.Error(code=ErrorCode.ENGINE_UNAVAILABLE, message="x"),
        "engine_unavailable",
        None,
    ),
    (
        quicsrv_proto.Error(code=ErrorCode.OVERLOADED, message="busy", retry_after_s=2.5),
        "overloaded",
        2500,
    ),
    (quicsrv_proto.End(reason=EndReason.SHUTDOWN), "shutting_down", 3000),
    (quicsrv_proto.End(reason=EndReason.SUPERSEDED), "superseded", None),
]


@pytest.mark.parametrize(("frame", "code", "retry_ms"), _INTERRUPTIONS)
@pytest.mark.parametrize(
    ("after", "before", "number"),
    [
        (-1, [], 0),  # nothing written yet
        (-1, [_checkpoint(-1)], 4),  # the opening events only
        (-1, [_checkpoint(-1), quicsrv_proto.Token(index=0, token_id=1, text="a")], 5),
        (2, [_checkpoint(-1)], 4),  # resumed inside the opening events
        (9, [], 10),  # resumed, nothing new yet
        (9, [quicsrv_proto.Token(index=6, token_id=1, text="a")], 11),
    ],
)
def test_an_interruption_is_one_error_event_numbered_like_the_next(
    frame: quicsrv_proto.Frame,
    code: str,
    retry_ms: int | None,
    after: int,
    before: list[quicsrv_proto.Frame],
    number: int,
) -> None:
    """The error is no part of the response: it has no ``id:`` (a client's Last-Event-ID stays
    on the last real event) and takes the number a resume's first event will have."""
    encoder = ResponseEncoder(_view(), text_before="", after=after)
    encoder.encode_all(before)
    data = encoder.encode(frame)
    assert encoder.finished
    (block,) = _blocks(data)
    lines = dict(line.split(": ", 1) for line in block.split("\n"))
    assert "id" not in lines and lines["event"] == "error"
    assert lines.get("retry") == (None if retry_ms is None else str(retry_ms))
    error = json.loads(lines["data"])
    assert error["type"] == "error" and error["param"] is None
    assert (error["code"], error["sequence_number"]) == (code, number)


def test_after_a_restart_the_resume_starts_with_the_errors_number() -> None:
    """The SHUTDOWN error says where to resume from, and resuming there loses nothing."""
    texts = ["a", "b", "c"]
    cut = ResponseEncoder(_view(), text_before="")
    received = _events(
        cut.encode_all(_frames(texts[:2], quicsrv_proto.End(reason=EndReason.SHUTDOWN)))
    )
    *events, (_, _, error) = received
    assert "starting_after" in error["message"]
    last = events[-1][2]["sequence_number"]
    assert error["sequence_number"] == last + 1
    rest = _events(_resumed(texts, EndReason.EOS, "", last))
    assert rest[0][2]["sequence_number"] == last + 1
    assert events + rest == _events(_whole(texts, EndReason.EOS, ""))


# --- requests ------------------------------------------------------------------------------


def _create(**fields: Any) -> Any:
    body = {"model": MODEL, "input": "hi", **fields}
    return parse_create(json.dumps(body).encode(), model_id=MODEL)


def _messages(request: Any) -> list[tuple[str, str]]:
    messages = request.generate.messages
    assert messages is not None
    return [(m.role, m.content) for m in messages]


def test_a_string_input_is_one_user_message_with_the_defaults() -> None:
    request = _create()
    assert request.input == (ChatMessage(role="user", content="hi"),)
    assert _messages(request) == [("user", "hi")]
    assert request.generate.max_tokens == DEFAULT_MAX_TOKENS
    assert (request.stream, request.background, request.store) == (False, False, True)
    assert request.instructions is None and request.previous_response_id is None
    assert request.fields == {
        "model": MODEL,
        "instructions": None,
        "max_output_tokens": DEFAULT_MAX_TOKENS,  # the limit that applies, echoed
        "metadata": {},
        "temperature": 0.8,  # llama-server's defaults (openai_api.DEFAULT_SAMPLING)
        "top_p": 0.95,
        "truncation": "disabled",
        "background": False,
        "store": True,
        "previous_response_id": None,
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "safety_identifier": None,
        "prompt_cache_key": None,
    }


def test_message_items_roles_parts_and_instructions() -> None:
    """Instructions come first as a system message; developer is system; parts are joined."""
    request = _create(
        instructions="sys",
        input=[
            {"role": "developer", "content": "be brief"},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                ],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "c"}], "id": "msg_1"},
            {"role": "system", "content": "s"},
        ],
    )
    assert _messages(request) == [
        ("system", "sys"),
        ("system", "be brief"),
        ("user", "ab"),
        ("assistant", "c"),
        ("system", "s"),
    ]
    assert request.instructions == "sys"
    assert [m.role for m in request.input] == ["system", "user", "assistant", "system"]


def test_the_fields_echo_what_was_asked() -> None:
    previous = response_id(SESSION)
    request = _create(
        metadata={"k": "v"},
        temperature=0.5,
        truncation="auto",
        background=True,
        store=True,
        previous_response_id=previous,
        max_output_tokens=7,
        stream=True,
    )
    assert request.stream and request.background and request.store
    assert request.previous_response_id == previous
    g = request.generate
    assert (g.max_tokens, g.temperature, g.truncation) == (7, 0.5, "auto")
    fields = request.fields
    assert fields["metadata"] == {"k": "v"}
    assert (fields["temperature"], fields["truncation"], fields["max_output_tokens"]) == (
        0.5,
        "auto",
        7,
    )
    assert (fields["background"], fields["store"]) == (True, True)
    assert fields["previous_response_id"] == previous


def test_neutral_values_and_metadata_at_its_bounds_are_accepted() -> None:
    request = _create(
        tools=[],
        tool_choice="auto",
        reasoning={},
        text={"format": {"type": "text"}},
        include=[],
        metadata={f"{i:064d}": "v" * 512 for i in range(16)},
    )
    assert len(request.fields["metadata"]) == 16


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages", "unknown_parameter"),
        (
            {"tools": [{"type": "function", "name": "f"}], "parallel_tool_calls": 1},
            "parallel_tool_calls",
            "unsupported_parameter",
        ),
        (
            {"tools": [{"type": "web_search"}], "tool_choice": "required"},
            "tools[0]",
            "unsupported_value",
        ),
        ({"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type", "invalid_value"),
        ({"text": {"verbosity": "high"}}, "text.verbosity", "unsupported_value"),
        ({"background": True, "store": False}, "store", "invalid_value"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]", "invalid_value"),
        ({"input": [{"type": "computer_call", "action": {}}]}, "input[0]", "unsupported_value"),
        (
            {"input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "x"}]},
            "input[1].role",
            "unsupported_value",
        ),
        ({"input": [{"content": "x"}]}, "input[0].role", "unsupported_value"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "a"},
                            {"type": "input_image", "image_url": "https://example.com/a.png"},
                        ],
                    }
                ]
            },
            "input[0].content",
            "unsupported_value",
        ),
        ({"input": []}, "input", "missing_required_parameter"),
        ({"input": 3}, "input", "missing_required_parameter"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "invalid_value"),
        ({"metadata": {"k" * 65: "v"}}, "metadata", "invalid_value"),
        ({"metadata": {"k": 1}}, "metadata", "invalid_value"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "invalid_value"),
        ({"truncation": "middle"}, "truncation", "invalid_value"),
        ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"max_output_tokens": True}, "max_output_tokens", "invalid_value"),
        ({"temperature": 3}, "temperature", "invalid_value"),
        ({"instructions": 5}, "instructions", "invalid_value"),
        ({"previous_response_id": 5}, "previous_response_id", "invalid_value"),
    ],
)
def test_a_bad_field_gets_400_naming_it(fields: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(ApiError) as caught:
        _create(**fields)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)
    assert json.loads(caught.value.body())["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"role": ["user"], "content": "x"}, "input[0].role"),
        ({"role": {"name": "user"}, "content": "x"}, "input[0].role"),
        ({"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}, "input[0].content"),
    ],
)
def test_an_unhashable_role_or_part_type_gets_400_not_a_crash(
    item: dict[str, Any], param: str
) -> None:
    """JSON can hold an array or object where a string belongs: a 400, never a TypeError that
    the router answers with 500 internal_error (as /v1/chat/completions already does)."""
    with pytest.raises(ApiError) as caught:
        _create(input=[item])
    assert (caught.value.status, caught.value.param) == (400, param)


def test_another_model_is_404() -> None:
    with pytest.raises(ApiError) as caught:
        _create(model="gpt-4o")
    assert (caught.value.status, caught.value.code, caught.value.param) == (
        404,
        "model_not_found",
        "model",
    )


# --- ids -----------------------------------------------------------------------------------


@given(session=st.binary(min_size=16, max_size=16))
def test_a_response_id_round_trips(session: bytes) -> None:
    text = response_id(session)
    assert text.startswith("resp_")
    assert from_response_id(text) == session


@pytest.mark.parametrize(
    "text",
    [
        "resp_xyz",
        "resp_" + "ab" * 15,
        "resp_" + "ab" * 17,
        "resp_" + SESSION.hex() + "0",
        "resp_" + SESSION.hex()[:-1] + "g",
        SESSION.hex(),
        "msg_" + SESSION.hex(),
        "resp_",
        "",
    ],
)
def test_an_id_this_server_cannot_have_issued_is_404(text: str) -> None:
    with pytest.raises(ApiError) as caught:
        from_response_id(text, "previous_response_id")
    error = caught.value
    assert (error.status, error.code, error.param) == (404, "not_found", "previous_response_id")


def test_earlier_calls_are_one_assistant_turn_shown_as_the_calls_json() -> None:
    """Consecutive function_call items are one assistant turn, each call as JSON on a line, as
    chat completions show an assistant's tool_calls."""
    calls = [
        {"type": "function_call", "call_id": "a", "name": "weather", "arguments": '{"city": "X"}'},
        {"type": "function_call", "call_id": "b", "name": "time", "arguments": ""},
    ]
    outputs = [
        {"type": "function_call_output", "call_id": "a", "output": "rain"},
        {"type": "function_call_output", "call_id": "b", "output": "noon"},
    ]
    request = _create(input=[{"role": "user", "content": "Weather and time?"}, *calls, *outputs])
    answer = '{"name": "weather", "arguments": {"city": "X"}}\n{"name": "time", "arguments": {}}'
    assert _messages(request) == [
        ("user", "Weather and time?"),
        ("assistant", answer),
        ("tool", "rain"),
        ("tool", "noon"),
    ]
    chat_calls = [
        {
            "id": c["call_id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for c in calls
    ]
    body = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "Weather and time?"},
            {"role": "assistant", "content": None, "tool_calls": chat_calls},
        ],
    }
    chat = parse_completion(json.dumps(body).encode(), chat=True, model_id=MODEL)
    assert chat.generate.messages is not None
    assert chat.generate.messages[1].content == answer
