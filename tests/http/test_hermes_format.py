"""Native tool calls for a Hermes-style chat template: the request's shape, the answer's
grammar, and the parser that reads text or calls out of the generated text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quicsrv.engine.tool_call_grammar import TOOL_CALL_BLOCKS
from quicsrv.http.hermes_format import HERMES, HermesParser, calls_text
from quicsrv.http.tool_answers import answer_format, parse_answer
from quicsrv.http.tool_calls import parse_tool_choice
from quicsrv.http.tool_chunks import chat_delta, chat_message
from quicsrv.http.tool_format import ArgumentsDelta, CallStarted, TextDelta, ToolFormat

TEMPLATE = Path(__file__).with_name("hermes_template.jinja")
SESSION = bytes(range(16))
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

ONE_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"<\\" \\u00e9"}}'
    "\n</tool_call>"
)
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}} \n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
TEXT = "Hello! <tool_call> is how I would call a tool, \\n but not now."


def _pieces_each_way(text: str) -> list[list[object]]:
    """The pieces of ``text`` read whole, and read one character at a time, merged."""
    whole = HermesParser().push(text)
    parser = HermesParser()
    single: list[object] = []
    for char in text:
        single.extend(parser.push(char))
    return [whole, single]


def _joined(pieces: list[object]) -> tuple[str, list[tuple[str, str]]]:
    text = "".join(p.text for p in pieces if isinstance(p, TextDelta))
    calls: list[tuple[str, str]] = []
    for piece in pieces:
        if isinstance(piece, CallStarted):
            assert piece.index == len(calls)
            calls.append((piece.name, ""))
        elif isinstance(piece, ArgumentsDelta):
            name, arguments = calls[piece.index]
            calls[piece.index] = (name, arguments + piece.text)
    return text, calls


@pytest.mark.parametrize("text", [ONE_CALL, TWO_CALLS, TEXT])
def test_every_prefix_releases_what_the_whole_text_does_and_never_takes_it_back(text) -> None:
    final = parse_answer(HERMES, text)
    for cut in range(len(text) + 1):
        head = HermesParser()
        released = head.push(text[:cut])
        rest = head.push(text[cut:])
        got_text, got_calls = _joined(released + rest)
        assert (got_text, got_calls) == (final.text, final.calls)
        # What a prefix released is a prefix of the whole answer's text and calls.
        early_text, early_calls = _joined(released)
        assert final.text.startswith(early_text)
        for (name, arguments), (final_name, final_arguments) in zip(
            early_calls, final.calls, strict=False
        ):
            assert name == final_name and final_arguments.startswith(arguments)
    whole, single = _pieces_each_way(text)
    assert _joined(whole) == _joined(single)


def test_calls_are_read_with_their_names_and_arguments() -> None:
    answer = parse_answer(HERMES, TWO_CALLS)
    assert answer.kind == "calls" and answer.text == ""
    assert answer.calls == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    one = parse_answer(HERMES, ONE_CALL)
    assert json.loads(one.calls[0][1]) == {"city": 'Paris "<" é'}


def test_a_text_answer_is_all_text_even_when_it_speaks_of_tool_calls() -> None:
    answer = parse_answer(HERMES, TEXT)
    assert answer.kind == "text" and answer.text == TEXT and answer.calls == []


def test_nothing_is_released_while_the_text_may_still_open_a_call() -> None:
    parser = HermesParser()
    assert parser.push("<tool_") == [] and parser.kind is None
    assert parser.push("x") == [TextDelta("<tool_x")] and parser.kind == "text"


def test_what_follows_the_calls_ends_the_answer() -> None:
    answer = parse_answer(HERMES, ONE_CALL + "\nand then some text")
    assert answer.done and len(answer.calls) == 1


def test_chat_completions_show_native_calls_as_the_generic_ones() -> None:
    message, calls = chat_message(SESSION, TWO_CALLS, HERMES)
    assert calls and [c["function"]["name"] for c in message["tool_calls"]] == [
        "get_weather",
        "get_time",
    ]
    assert message["tool_calls"][1]["id"] == "call_" + SESSION.hex() + "_1"
    delta = chat_delta(SESSION, HermesParser().push(ONE_CALL))
    assert delta["tool_calls"][0]["function"]["name"] == "get_weather"
    text, _ = chat_message(SESSION, TEXT, HERMES)
    assert text["content"] == TEXT


def test_earlier_calls_are_shown_as_the_template_shows_them() -> None:
    shown = calls_text([("get_weather", '{"city": "Oslo"}'), ("get_time", "")])
    assert shown == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert parse_answer(HERMES, shown).calls == [
        ("get_weather", '{"city": "Oslo"}'),
        ("get_time", "{}"),
    ]


@pytest.mark.parametrize(
    ("choice", "names", "text", "parallel"),
    [
        (None, ("get_weather", "get_time"), True, True),
        ("required", ("get_weather", "get_time"), False, True),
        ({"type": "function", "function": {"name": "get_time"}}, ("get_time",), False, False),
    ],
)
def test_a_hermes_template_gets_every_tool_and_a_grammar_of_blocks(
    choice, names, text, parallel
) -> None:
    tools = parse_tool_choice([WEATHER, TIME], choice, native=HERMES)
    assert isinstance(tools, ToolFormat)
    assert tools.answer == HERMES and tools.prompt == "" and tools.names == names
    listed = json.loads(tools.template_tools or "")
    assert [t["function"]["name"] for t in listed] == ["get_weather", "get_time"]
    spec = json.loads(tools.schema)[TOOL_CALL_BLOCKS]
    assert spec["text"] is text and spec["parallel"] is parallel
    assert answer_format({"answer": tools.answer}) == HERMES
    assert parse_tool_choice([WEATHER], "none", native=HERMES) is None


def test_without_a_tools_template_the_generic_format_stays() -> None:
    tools = parse_tool_choice([WEATHER], "auto")
    assert isinstance(tools, ToolFormat)
    assert tools.answer == "generic" and tools.template_tools is None and tools.prompt


@pytest.mark.model
def test_the_vocabulary_detects_a_hermes_template_and_the_grammar_takes_its_answers(
    model_path,
) -> None:
    from quicsrv.engine.vocab import Vocabulary
    from tests.engine.grammar_matcher import matches

    plain = Vocabulary.load(model_path)
    hermes = Vocabulary.load(model_path, TEMPLATE.read_text())
    try:
        assert plain.tool_call_format is None and hermes.tool_call_format == HERMES
        assert hermes.describe(model_path).chat_template == TEMPLATE.read_text()
        prompt = hermes.render_chat([{"role": "user", "content": "hi"}], [WEATHER])
        assert "<tools>" in prompt and '"get_weather"' in prompt
        auto = parse_tool_choice([WEATHER, TIME], "auto", native=HERMES)
        required = parse_tool_choice([WEATHER, TIME], "required", native=HERMES)
        assert isinstance(auto, ToolFormat) and isinstance(required, ToolFormat)
        auto_gbnf = hermes.grammar_for(auto.schema).gbnf
        required_gbnf = hermes.grammar_for(required.schema).gbnf
        compact = TWO_CALLS.replace("}} \n", "}}\n")
        for gbnf, text, allowed in [
            (auto_gbnf, compact, True),
            (auto_gbnf, "Hi there.", True),
            (auto_gbnf, "<b>no</b>", False),
            (required_gbnf, compact, True),
            (required_gbnf, "Hi there.", False),
            (required_gbnf, compact.replace("get_time", "get_date"), False),
        ]:
            assert matches(hermes, gbnf, text) is allowed, (text, allowed)
    finally:
        plain.close()
        hermes.close()


def test_a_client_cannot_ask_for_tool_call_blocks_as_its_response_format() -> None:
    from quicsrv.http.errors import ApiError
    from quicsrv.http.openai_api import parse_completion

    schema = {TOOL_CALL_BLOCKS: {"call": {}, "parallel": False, "text": True}}
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    with pytest.raises(ApiError) as refused:
        parse_completion(json.dumps(body).encode(), chat=True, model_id="m")
    assert refused.value.param == "response_format.json_schema.schema"
