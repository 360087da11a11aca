"""End to end: ``tool_choice`` auto and required for a model whose chat template knows no
tools (the default SmolLM2-135M), in the generic format, through the real server and model.

A 135M model may answer in text or call: every answer must be one of the two as the schemas
allow (text, or calls of the offered functions with valid arguments), and a prompt that asks
for the tool by name gets a call (greedy). A cut stream is compared with the same request run
whole on this machine, with the session ids (which name the calls) made equal.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from tests.helpers import running_server

from .helpers import SseEvent, cut_and_resume, openai_client, tcp_client, tcp_stream

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK_TOOL = "Use the get_weather tool to get the weather in Paris."
ASK_TEXT = "Hello! What is 2+2?"
GREEDY = {"temperature": 0}


def _check_message(message: Any, finish: str) -> str:
    """The answer is text, or valid calls of the offered functions: which one."""
    if message.tool_calls:
        assert finish == "tool_calls" and message.content is None
        for call in message.tool_calls:
            assert call.id.startswith("call_") and call.function.name in SCHEMAS
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        return "calls"
    assert finish in ("stop", "length") and isinstance(message.content, str)
    return "text"


async def test_auto_answers_in_text_or_calls_streamed_or_not(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        model = server.app.router.model_id
        kinds = []
        for question in (ASK_TOOL, ASK_TEXT):
            params = dict(
                model=model,
                messages=[{"role": "user", "content": question}],
                tools=[WEATHER],
                max_tokens=60,
                **GREEDY,
            )
            whole = await client.chat.completions.create(**params)
            stream = await client.chat.completions.create(**params, stream=True)
            content, calls, finish = "", {}, None
            async for chunk in stream:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": call.id, "name": None, "args": ""})
                    entry["name"] = entry["name"] or call.function.name
                    entry["args"] += call.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            choice = whole.choices[0]
            kinds.append(_check_message(choice.message, choice.finish_reason))
            assert finish == choice.finish_reason
            # The stream says what the whole answer says.
            if choice.message.tool_calls:
                assert content == ""
                assert [(c["name"], c["args"]) for c in calls.values()] == [
                    (c.function.name, c.function.arguments) for c in choice.message.tool_calls
                ]
            else:
                assert calls == {} and content == choice.message.content
            # The tool list and the answer's shape were added to the prompt.
            plain = await client.chat.completions.create(
                model=model, messages=params["messages"], max_tokens=1
            )
            assert whole.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    # Asked for by name, the tool is called; asked for arithmetic, the model answers in text
    # (greedy; with a second tool offered, it calls one for "2+2" too).
    assert kinds == ["calls", "text"]


async def test_parallel_tool_calls_false_makes_one_call_and_required_always_calls(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        params = dict(
            model=server.app.router.model_id,
            messages=[{"role": "user", "content": "Get the weather in Paris and in Rome."}],
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=120,
            **GREEDY,
        )
        one = await client.chat.completions.create(**params, parallel_tool_calls=False)
        several = await client.chat.completions.create(**params)
    assert _check_message(one.choices[0].message, one.choices[0].finish_reason) == "calls"
    assert len(one.choices[0].message.tool_calls) == 1
    assert _check_message(several.choices[0].message, "tool_calls") == "calls"
    ids = [c.id for c in several.choices[0].message.tool_calls]
    assert len(set(ids)) == len(ids)


def _normalized(events: list[SseEvent], session: str, into: str) -> list[str]:
    """The events of another run of the same request as if they were of session ``into``
    (its id, its creation and completion times, which events repeat, and how much of its
    prompt the prefix cache held, which depends on what ran before)."""
    return [_CREATED.sub(r"\1:0", e.data.replace(session, into)) for e in events]


_CREATED = re.compile(r'("(?:created|created_at|completed_at|cached_tokens)"):\d+')


def _chat_session(events: list[SseEvent]) -> str:
    return str(events[0].json["id"]).removeprefix("chatcmpl-")


async def _cut_chat_resumes_exactly(
    tcp: httpx.AsyncClient, body: dict[str, Any], kind: str
) -> None:
    """A streamed chat completion cut after 5 events and resumed equals the uninterrupted one,
    and what came after the cut carries ``kind`` (``tool_calls`` or ``content``)."""
    cut = await cut_and_resume(tcp, "/v1/chat/completions", body, stop_after=5)
    whole = _normalized(cut.whole, _chat_session(cut.whole), cut.session)
    assert _normalized(cut.before + cut.after, cut.session, cut.session) == whole
    assert len(cut.before) == 5 and cut.after  # it was cut inside the answer
    assert any(kind in json.dumps(e.json) for e in cut.after if e.data != "[DONE]")


@pytest.mark.parametrize("question", [ASK_TOOL, ASK_TEXT], ids=["call", "text"])
async def test_a_cut_auto_chat_stream_resumes_exactly(engine, certs, question):
    async with running_server(engine, certs) as server, tcp_client(server, certs) as tcp:
        body = {
            "model": server.app.router.model_id,
            "messages": [{"role": "user", "content": question}],
            "tools": [WEATHER],
            "max_tokens": 60,
            "stream": True,
            **GREEDY,
        }
        await _cut_chat_resumes_exactly(
            tcp, body, "tool_calls" if question == ASK_TOOL else "content"
        )


@pytest.mark.parametrize("question", [ASK_TOOL, ASK_TEXT], ids=["call", "text"])
async def test_a_cut_auto_responses_stream_resumes_exactly(engine, certs, question):
    flat = [{"type": "function", **WEATHER["function"]}]
    async with running_server(engine, certs) as server, tcp_client(server, certs) as tcp:
        body = {
            "model": server.app.router.model_id,
            "input": question,
            "tools": flat,
            "max_output_tokens": 60,
            "stream": True,
            **GREEDY,
        }
        first, whole = await tcp_stream(tcp, "POST", "/v1/responses", json=body)
        cut, before = await tcp_stream(tcp, "POST", "/v1/responses", json=body, stop_after=4)
        session = cut.headers["quicsrv-session"]
        last = before[-1].json["sequence_number"]
        _, after = await tcp_stream(
            tcp, "GET", f"/v1/responses/resp_{session}?stream=true&starting_after={last}"
        )
        _, replay = await tcp_stream(tcp, "GET", f"/v1/responses/resp_{session}?stream=true")
    # The cut stream and its resume are byte for byte the replay of the whole response, and
    # (but for the session's id and time) the stream of the same request run again.
    assert [e.data for e in before + after] == [e.data for e in replay]
    expected = _normalized(whole, first.headers["quicsrv-session"], session)
    assert _normalized(replay, session, session) == expected
    events = [e.json for e in whole]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    output = events[-1]["response"]["output"]
    if question == ASK_TOOL:
        assert [o["type"] for o in output] == ["function_call"] * len(output) and output
        for call in output:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        deltas = [e["delta"] for e in events if e["type"].endswith("arguments.delta")]
        assert "".join(deltas) == "".join(o["arguments"] for o in output)
    else:
        [message] = output
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert message["type"] == "message" and message["content"][0]["text"] == "".join(deltas)


async def test_a_call_and_its_result_go_back_to_the_model(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        model = server.app.router.model_id
        messages: list[Any] = [{"role": "user", "content": ASK_TOOL}]
        first = await client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], max_tokens=60, **GREEDY
        )
        [call] = first.choices[0].message.tool_calls
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
        ]
        second = await client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], max_tokens=60, **GREEDY
        )
        response = await client.responses.create(
            model=model,
            input=ASK_TOOL,
            tools=[{"type": "function", **WEATHER["function"]}],
            max_output_tokens=60,
            **GREEDY,
        )
        [item] = response.output
        follow_up = await client.responses.create(
            model=model,
            previous_response_id=response.id,
            input=[{"type": "function_call_output", "call_id": item.call_id, "output": "Sunny"}],
            tools=[{"type": "function", **WEATHER["function"]}],
            max_output_tokens=60,
            **GREEDY,
        )
    _check_message(second.choices[0].message, second.choices[0].finish_reason)
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.call_id == "call_" + response.id.removeprefix("resp_")
    assert follow_up.status == "completed" and follow_up.output
    assert response.tool_choice == "auto" and response.parallel_tool_calls is True
