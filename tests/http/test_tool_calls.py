"""Tool calls: which requests become a constrained call of a named function, and the call taken
out of the text as a pure function of it (so a resumed stream renders the same argument deltas).
The generic format (``auto``, ``required``) is tested in test_tool_format.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quicsrv.http.errors import ApiError
from quicsrv.http.tool_calls import CallText, ToolChoice, parse_tool_choice

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}

arguments_values = st.dictionaries(
    st.text(min_size=1, max_size=5),
    st.one_of(
        st.integers(),
        st.text(max_size=6),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    ),
    max_size=3,
)


def test_a_named_function_is_one_call_and_bad_tools_are_refused():
    named = parse_tool_choice([WEATHER, TIME], {"type": "function", "function": {"name": "time"}})
    assert isinstance(named, ToolChoice) and named.single == "time"
    assert json.loads(named.schema) == TIME["function"]["parameters"]
    assert parse_tool_choice([WEATHER], "none") is None
    assert parse_tool_choice(None, None) is None
    for tools, choice, param in [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([{"type": "web_search"}], "required", "tools[0]"),
        ([WEATHER, WEATHER], "required", "tools[1]"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "required", "tools[0]"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}], None, "tools[0]"),
        (None, "required", "tool_choice"),
    ]:
        with pytest.raises(ApiError) as refused:
            parse_tool_choice(tools, choice)
        assert refused.value.status == 400 and refused.value.param == param
    with pytest.raises(ApiError) as refused:
        parse_tool_choice([WEATHER], "auto", parallel="yes")
    assert refused.value.param == "parallel_tool_calls"


def test_the_flat_form_of_the_responses_api():
    flat = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
    choice = parse_tool_choice([flat], {"type": "function", "name": "weather"}, nested=False)
    assert choice is not None and choice.single == "weather"


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces, start = [], 0
    for point in points:
        pieces.append(text[start:point])
        start = point
    return [*pieces, text[start:]]


@given(
    arguments=arguments_values, cuts=st.lists(st.integers(0, 200), max_size=8), spaces=st.booleans()
)
def test_several_functions_stream_the_arguments_and_resume_anywhere(arguments, cuts, spaces):
    choice = ToolChoice(("weather", "time"), "")
    text = json.dumps({"name": "time", "arguments": arguments}, indent=1 if spaces else None)
    # The arguments as written inside the call (indented with it), without the call's brace.
    args_text = text[text.index('"arguments": ') + len('"arguments": ') :].rstrip()[:-1].rstrip()
    assert json.loads(args_text) == arguments
    pieces = _split(text, cuts)
    tail = pieces.pop()
    whole = CallText(choice)
    deltas = [whole.push(piece) for piece in pieces] + [whole.finish(tail)]
    assert whole.name == "time"
    assert "".join(deltas) == whole.arguments() == args_text
    for k in range(len(pieces) + 1):  # a stream resumed after piece k renders the same rest
        resumed = CallText(choice, "".join(pieces[:k]))
        rest = [resumed.push(piece) for piece in pieces[k:]] + [resumed.finish(tail)]
        assert rest == deltas[k:]


@given(arguments=arguments_values, cuts=st.lists(st.integers(0, 200), max_size=8))
def test_one_function_streams_the_text_as_its_arguments(arguments, cuts):
    choice = ToolChoice(("weather",), "")
    text = json.dumps(arguments)
    pieces = _split(text, cuts)
    tail = pieces.pop()
    call = CallText(choice)
    assert call.name == "weather"
    assert "".join([call.push(p) for p in pieces] + [call.finish(tail)]) == text
