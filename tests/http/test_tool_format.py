"""The generic tool format without a model: the schema and prompt a request gets, the answer
read back out of any split of its text, and its chat chunks and Responses events, whose every
suffix after a cut must be exactly the tail of the uninterrupted stream."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quicsrv_proto
from quicsrv.engine.grammar import grammar_for_schema
from quicsrv.http.responses_api import ResponseView
from quicsrv.http.responses_tools import ToolAnswerEncoder, response_object
from quicsrv.http.sse import SseEncoder, StreamShape
from quicsrv.http.tool_calls import ToolChoice, parse_tool_choice
from quicsrv.http.tool_chunks import chat_delta, chat_message
from quicsrv.http.tool_format import (
    AnswerParser,
    ArgumentsDelta,
    CallStarted,
    TextDelta,
    ToolFormat,
    parse_answer,
    with_tool_prompt,
)
from quicsrv_proto import EndReason

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}
SESSION = bytes(range(16))
MAC_KEY = b"k" * 32

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
arguments_values = st.dictionaries(st.text(max_size=5), json_values, max_size=3)
calls_values = st.lists(
    st.tuples(st.sampled_from(["weather", "time"]), arguments_values), min_size=1, max_size=3
)
# Text with what JSON escapes: quotes, backslashes, controls, characters beyond the BMP.
texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=30)


def _calls_text(calls: list[tuple[str, Any]], indent: int | None, ascii_only: bool) -> str:
    answer = {"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}
    return json.dumps(answer, indent=indent, ensure_ascii=ascii_only)


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces, start = [], 0
    for point in points:
        pieces.append(text[start:point])
        start = point
    return [*pieces, text[start:]]


# --- which requests get the format ---------------------------------------------------------


def test_auto_and_required_are_the_generic_format_and_a_named_function_one_call():
    auto = parse_tool_choice([WEATHER, TIME], "auto")
    default = parse_tool_choice([WEATHER, TIME], None)
    required = parse_tool_choice([WEATHER, TIME], "required", parallel=False)
    named = parse_tool_choice([WEATHER, TIME], {"type": "function", "function": {"name": "time"}})
    assert isinstance(auto, ToolFormat) and auto == default and auto.parallel
    assert isinstance(required, ToolFormat) and required.required and not required.parallel
    assert isinstance(named, ToolChoice) and named.single == "time"
    assert parse_tool_choice([WEATHER], "none") is None
    # The prompt shows every function, its description and parameters, and the answer's shape.
    assert '"name": "weather"' in auto.prompt and "The weather in a city" in auto.prompt
    assert '"tool_calls"' in auto.prompt and '"response"' in auto.prompt
    assert '"response"' not in required.prompt and "exactly one call" in required.prompt


def test_the_schema_allows_text_or_calls_of_the_given_functions_only():
    auto = parse_tool_choice([WEATHER, TIME], "auto")
    required = parse_tool_choice([WEATHER, TIME], "required", parallel=False)
    assert isinstance(auto, ToolFormat) and isinstance(required, ToolFormat)
    schema, calls_only = json.loads(auto.schema), json.loads(required.schema)
    one = {"name": "weather", "arguments": {"city": "Brest"}}
    two = {"name": "time", "arguments": {}}
    for value in ({"response": "hi"}, {"tool_calls": [one]}, {"tool_calls": [one, two]}):
        jsonschema.validate(value, schema)
    for value in (
        {"response": 3},
        {"tool_calls": []},
        {"tool_calls": [{"name": "rain", "arguments": {}}]},
        {"tool_calls": [{"name": "weather", "arguments": {}}]},  # city is required
        {"tool_calls": [one], "response": "x"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    jsonschema.validate({"tool_calls": [one]}, calls_only)
    for value in ({"response": "hi"}, {"tool_calls": [one, two]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, calls_only)
    # The server's converter takes it (name before arguments in every call).
    calls = [line for line in grammar_for_schema(schema).gbnf.splitlines() if "name-kv" in line]
    calls = [line for line in calls if line.split(" ::= ")[0].endswith(("item-0", "item-1"))]
    assert len(calls) == 2 and all(re.search("name-kv .*arguments-kv", c) for c in calls)


def test_the_prompt_joins_the_system_message_or_makes_one():
    user = {"role": "user", "content": "hi"}
    assert with_tool_prompt([user], "P") == [{"role": "system", "content": "P"}, user]
    system = {"role": "system", "content": "be brief"}
    assert with_tool_prompt([system, user], "P") == [
        {"role": "system", "content": "be brief\n\nP"},
        user,
    ]


# --- the answer, read from any split of its text ---------------------------------------------


@given(text=texts, cuts=st.lists(st.integers(0, 120), max_size=8), spaces=st.booleans())
def test_a_text_answer_is_its_response_string_however_it_is_split(text, cuts, spaces):
    whole = json.dumps({"response": text}, indent=1 if spaces else None, ensure_ascii=spaces)
    pieces = _split(whole, cuts)
    parser = AnswerParser()
    out = [parser.push(p) for p in pieces]
    assert parser.kind == "text" and parser.text == text and not parser.calls
    assert "".join(d.text for ds in out for d in ds if isinstance(d, TextDelta)) == text
    for k in range(len(pieces) + 1):  # a stream resumed after piece k renders the same rest
        resumed = AnswerParser()
        resumed.push("".join(pieces[:k]))
        assert [resumed.push(p) for p in pieces[k:]] == out[k:]


@given(
    calls=calls_values,
    cuts=st.lists(st.integers(0, 300), max_size=10),
    indent=st.sampled_from([None, 1]),
    ascii_only=st.booleans(),
)
@settings(max_examples=200)
def test_calls_are_announced_by_name_and_their_arguments_streamed(calls, cuts, indent, ascii_only):
    whole = _calls_text(calls, indent, ascii_only)
    pieces = _split(whole, cuts)
    parser = AnswerParser()
    out = [parser.push(p) for p in pieces]
    assert parser.kind == "calls" and parser.done
    assert [name for name, _ in parser.calls] == [name for name, _ in calls]
    assert [json.loads(a) for _, a in parser.calls] == [a for _, a in calls]
    flat = [piece for pieces_out in out for piece in pieces_out]
    started = [p for p in flat if isinstance(p, CallStarted)]
    assert [(p.index, p.name) for p in started] == [(i, n) for i, (n, _) in enumerate(calls)]
    for i, (_, arguments) in enumerate(parser.calls):
        deltas = [p.text for p in flat if isinstance(p, ArgumentsDelta) and p.index == i]
        assert "".join(deltas) == arguments
        # Every delta comes after its call's announcement.
        first = next(
            j for j, p in enumerate(flat) if isinstance(p, ArgumentsDelta) and p.index == i
        )
        assert flat.index(started[i]) < first
    for k in range(len(pieces) + 1):
        resumed = AnswerParser()
        resumed.push("".join(pieces[:k]))
        assert [resumed.push(p) for p in pieces[k:]] == out[k:]


@given(whole=st.text(max_size=40), cuts=st.lists(st.integers(0, 40), max_size=5))
def test_no_text_makes_the_parser_fail(whole, cuts):
    parser = AnswerParser()
    for piece in _split(whole, cuts):
        parser.push(piece)
    assert parser.kind in (None, "text", "calls")


def test_a_lone_surrogate_becomes_the_replacement_character():
    assert parse_answer('{"response": "a\\ud83db\\udc00c"}').text == "a\ufffdb\ufffdc"
    assert parse_answer('{"response": "\\ud83d\\n"}').text == "\ufffd\n"


# --- chat completions ----------------------------------------------------------------------


def test_chat_deltas_and_message_name_each_call_by_the_session():
    parser = AnswerParser()
    delta = chat_delta(SESSION, parser.push('{"tool_calls": [{"name": "time", "arguments": {"a'))
    [entry] = delta["tool_calls"]
    assert entry == {
        "index": 0,
        "id": "call_" + SESSION.hex(),
        "type": "function",
        "function": {"name": "time", "arguments": '{"a'},
    }
    second = chat_delta(SESSION, parser.push('": 1}}, {"name": "weather", "arguments": {}}]}'))
    # A call's arguments that come with its announcement are in the same entry.
    assert second["tool_calls"] == [
        {"index": 0, "function": {"arguments": '": 1}'}},
        {
            "index": 1,
            "id": "call_" + SESSION.hex() + "_1",
            "type": "function",
            "function": {"name": "weather", "arguments": "{}"},
        },
    ]
    message, calls = chat_message(SESSION, '{"response": "Hi \\"you\\""}')
    text = {"role": "assistant", "content": 'Hi "you"', "refusal": None}
    assert (message, calls) == (text, False)


def _chat_frames(pieces: list[str], reason: EndReason) -> list[quicsrv_proto.Frame]:
    frames: list[quicsrv_proto.Frame] = [
        quicsrv_proto.Checkpoint(session_id=SESSION, index=-1, snapshot_hash=b"h" * 32)
    ]
    frames += [quicsrv_proto.Token(index=i, token_id=1, text=p) for i, p in enumerate(pieces)]
    end = quicsrv_proto.End(reason=reason, prompt_tokens=3, completion_tokens=len(pieces))
    return [*frames, end]


def _chat_events(data: bytes) -> list[tuple[str, str]]:
    blocks = data.decode().split("\n\n")[:-1]
    out = []
    for block in blocks:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines.get("id", ""), lines["data"]))
    return out


@given(calls=calls_values, cuts=st.lists(st.integers(0, 200), max_size=6), text=texts)
@settings(max_examples=50)
def test_a_chat_stream_resumed_after_any_event_ends_as_the_whole_one(calls, cuts, text):
    for whole_text in (_calls_text(calls, None, False), json.dumps({"response": text})):
        pieces = [p for p in _split(whole_text, cuts) if p]
        shape = StreamShape(
            session_id=SESSION,
            chat=True,
            include_usage=False,
            model="m",
            created=1,
            tool_answer="generic",
        )
        frames = _chat_frames(pieces, EndReason.EOS)
        whole = _chat_events(SseEncoder(shape, mac_key=MAC_KEY).encode_all(frames))
        assert whole[-1][1] == "[DONE]"
        finish = json.loads(whole[-2][1])["choices"][0]["finish_reason"]
        assert finish == ("tool_calls" if whole_text.startswith('{"tool_calls"') else "stop")
        for k in range(len(pieces) + 1):  # a cursor after token k - 1 (k = 0: the opening)
            after = k - 1
            resumed = SseEncoder(
                shape, mac_key=MAC_KEY, after=after, text_before="".join(pieces[:k])
            )
            tail = _chat_events(resumed.encode_all(frames[1 + k :]))
            ids = [i for i, _ in whole]
            first = next(
                (j for j, (i, _) in enumerate(whole) if i and _index(i) > after), len(whole) - 1
            )
            assert tail == whole[first:], (k, ids)


def _index(cursor: str) -> int:
    from quicsrv.http.cursor import decode_cursor

    return decode_cursor(cursor, [MAC_KEY]).index


# --- the Responses API ---------------------------------------------------------------------


FIELDS: dict[str, Any] = {
    "model": "m",
    "answer": "generic",
    "tools": [{"type": "function", "name": "time"}],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
}


def _view() -> ResponseView:
    return ResponseView(
        session_id=SESSION,
        created_at=1,
        fields=FIELDS,
        text="",
        input_tokens=0,
        cached_tokens=0,
        output_tokens=0,
        end=None,
    )


def _responses_events(data: bytes) -> list[dict[str, Any]]:
    events = []
    for block in data.decode().split("\n\n")[:-1]:
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        event = json.loads(lines["data"])
        assert lines["id"] == str(event["sequence_number"]) and lines["event"] == event["type"]
        events.append(event)
    return events


@given(
    calls=calls_values,
    cuts=st.lists(st.integers(0, 200), max_size=6),
    text=texts,
    reason=st.sampled_from([EndReason.EOS, EndReason.LENGTH]),
)
@settings(max_examples=50)
def test_responses_events_are_numbered_in_order_and_resume_after_any(calls, cuts, text, reason):
    for whole_text in (_calls_text(calls, None, False), json.dumps({"response": text})):
        pieces = [p for p in _split(whole_text, cuts) if p]
        frames = _chat_frames(pieces, reason)
        data = ToolAnswerEncoder(_view()).encode_all(frames)
        events = _responses_events(data)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]["response"]
        if whole_text.startswith('{"tool_calls"'):
            assert [(o["name"], json.loads(o["arguments"])) for o in final["output"]] == calls
            added = [e for e in events if e["type"] == "response.output_item.added"]
            assert [e["item"]["name"] for e in added] == [n for n, _ in calls]
        else:
            assert final["output"][0]["content"][0]["text"] == text
            deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
            assert "".join(deltas) == text
        assert final["tool_choice"] == "auto" and final["tools"] == FIELDS["tools"]
        for after in range(-1, len(events)):
            resumed = ToolAnswerEncoder(_view(), after=after).encode_all(frames)
            assert _responses_events(resumed) == events[after + 1 :]


def test_the_stored_object_shows_the_calls_made_so_far():
    view = ResponseView(
        session_id=SESSION,
        created_at=1,
        fields=FIELDS,
        text='{"tool_calls": [{"name": "time", "arguments": {}}, {"name": "time", "argu',
        input_tokens=0,
        cached_tokens=0,
        output_tokens=9,
        end=None,
    )
    body = response_object(view)
    assert [(o["call_id"], o["status"]) for o in body["output"]] == [
        ("call_" + SESSION.hex(), "completed"),
        ("call_" + SESSION.hex() + "_1", "in_progress"),
    ]
