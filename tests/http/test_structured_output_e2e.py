"""End to end: JSON schemas enforced while sampling, through the real server and model.

The schemas bound every string (``maxLength``) and array (``maxItems``), so a 135M model cannot
loop inside one. Outputs are parsed and validated (jsonschema), never compared with fixed text;
a cut stream's joined text is compared with the same request run uninterrupted on this machine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from quicsrv_client import Client, GenerationEnded, TokenReceived
from tests.helpers import running_server

from .helpers import cut_and_resume, events_text, openai_client, tcp_client

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

KEEPER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["keeper", "sailor", "cook"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {
                "town": {"type": "string", "maxLength": 20},
                "lat": {"type": "number"},
            },
            "required": ["town", "lat"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills", "home"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe the lighthouse keeper of a small island as JSON."}]
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "keeper", "schema": KEEPER, "strict": True},
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a town",
        "parameters": {
            "type": "object",
            "properties": {
                "town": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["town", "unit"],
            "additionalProperties": False,
        },
    },
}
TIDE = {
    "type": "function",
    "function": {
        "name": "tide",
        "parameters": {
            "type": "object",
            "properties": {"harbour": {"type": "string", "maxLength": 20}},
            "required": ["harbour"],
            "additionalProperties": False,
        },
    },
}


class Keeper(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0)
    role: Literal["keeper", "sailor", "cook"]
    island: str = Field(max_length=20)


async def _model(server) -> str:
    return server.app.router.model_id


def _valid(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 5}], ids=["greedy", "seeded"]
)
async def test_chat_output_follows_the_schema(engine, certs, sampling):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        params = dict(model=await _model(server), messages=ASK, max_tokens=200, **sampling)
        answer = await client.chat.completions.create(**params, response_format=FORMAT)
        anything = await client.chat.completions.create(
            **params, response_format={"type": "json_object"}
        )
    assert answer.choices[0].finish_reason == "stop"
    _valid(answer.choices[0].message.content, KEEPER)
    # Any object: nothing bounds its strings, so it may run out of tokens mid-JSON (length).
    text, finish = anything.choices[0].message.content, anything.choices[0].finish_reason
    assert text.lstrip().startswith("{")
    assert finish == "length" or isinstance(json.loads(text), dict)


# Issue 45: declared integers beside bounded additional strings. Under the inherited converter
# nothing but an additional key without a comma could follow "b", so greedy decoding (asked for
# "the integers a and b") wrote '{ "a": 1, "b": 2000000000000000 "}  # JSON object with ...' into
# a key that never closed, to max_tokens (reported as not answering within 120 s under load).
MIXED = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "additionalProperties": {"type": "string", "maxLength": 20},
}


async def test_declared_and_additional_members_make_valid_json_through_the_server(engine, certs):
    mixed = {"type": "json_schema", "json_schema": {"name": "mixed", "schema": MIXED}}
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        answer = await client.chat.completions.create(
            model=await _model(server),
            messages=[
                {
                    "role": "user",
                    "content": "Write a JSON object with the integers a and b, and a note.",
                }
            ],
            max_tokens=200,
            temperature=0,
            response_format=mixed,
        )
    assert answer.choices[0].finish_reason == "stop"
    _valid(answer.choices[0].message.content, MIXED)


async def test_the_sdk_parses_into_a_pydantic_model(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        completion = await client.chat.completions.parse(
            model=await _model(server),
            messages=ASK,
            max_tokens=200,
            temperature=0,
            response_format=Keeper,
        )
    keeper = completion.choices[0].message.parsed
    assert isinstance(keeper, Keeper) and keeper.role in ("keeper", "sailor", "cook")


async def test_a_cut_constrained_sse_stream_resumes_exactly(engine, certs):
    async with running_server(engine, certs) as server:
        body = {
            "model": await _model(server),
            "messages": ASK,
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
            "response_format": FORMAT,
        }
        async with tcp_client(server, certs) as tcp:
            cut = await cut_and_resume(tcp, "/v1/chat/completions", body, stop_after=10)
    assert events_text(cut.before) + events_text(cut.after) == events_text(cut.whole)
    _valid(events_text(cut.whole), KEEPER)


async def _native(client: Client, *, kill_at: int | None = None, engine=None) -> str:
    parts: list[str] = []
    generation = client.stream(
        messages=ASK, max_tokens=200, temperature=0.8, seed=3, json_schema=KEEPER
    )
    async for event in generation:
        if isinstance(event, TokenReceived):
            parts.append(event.text)
            if event.index == kill_at:
                os.kill(engine.worker_pid, signal.SIGKILL)  # mid-JSON
        elif isinstance(event, GenerationEnded):
            parts.append(event.text)
    return "".join(parts)


async def test_native_constrained_generation_survives_a_cut_and_a_worker_kill(engine, certs):
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as client:
            whole = await _native(client)
            generation = client.stream(
                messages=ASK, max_tokens=200, temperature=0.8, seed=3, json_schema=KEEPER
            )
            first: list[str] = []
            async for event in generation:
                if isinstance(event, TokenReceived):
                    first.append(event.text)
                    if event.index == 12:
                        break
            rest: list[str] = []
            async for event in client.resume_from(generation.position):
                if isinstance(event, TokenReceived):
                    rest.append(event.text)
                elif isinstance(event, GenerationEnded):
                    rest.append(event.text)
            restarts = engine.restarts
            killed = await _native(client, kill_at=8, engine=engine)
    assert "".join(first) + "".join(rest) == whole
    _valid(whole, KEEPER)
    assert killed == whole and engine.restarts == restarts + 1


async def test_bad_and_oversized_schemas_are_refused_and_the_worker_lives_on(engine, certs):
    bad = [
        {"type": "string", "pattern": "(a"},
        {"type": "string", "maxLength": 100_000},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000},
        {"type": "object", "properties": {"x": {"$ref": "https://example.com/x.json"}}},
        {"type": "object", "not": {"type": "string"}},
        {"type": "object", "properties": {"x": {"type": "string"}}, "patternProperties": {}},
    ]
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        restarts = engine.restarts
        for schema in bad:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    model=await _model(server),
                    messages=ASK,
                    max_tokens=8,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": schema},
                    },
                )
            assert "json_schema" in str(refused.value.message), schema
        still = await client.chat.completions.create(
            model=await _model(server), messages=ASK, max_tokens=4
        )
    assert engine.restarts == restarts and still.choices[0].message.content is not None


async def test_a_named_tool_is_called_with_valid_arguments_streamed_or_not(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        params = dict(
            model=await _model(server),
            messages=[{"role": "user", "content": "What is the weather in Brest?"}],
            max_tokens=100,
            temperature=0,
            tools=[WEATHER, TIDE],
            tool_choice={"type": "function", "function": {"name": "weather"}},
        )
        whole = await client.chat.completions.create(**params)
        stream = await client.chat.completions.create(**params, stream=True)
        ids, names, deltas, finish = set(), set(), [], None
        async for chunk in stream:
            for call in chunk.choices[0].delta.tool_calls or []:
                if call.id:
                    ids.add(call.id)
                if call.function.name:
                    names.add(call.function.name)
                deltas.append(call.function.arguments or "")
            finish = chunk.choices[0].finish_reason or finish
        [call] = whole.choices[0].message.tool_calls
        follow_up = await client.chat.completions.create(
            model=params["model"],
            max_tokens=24,
            temperature=0,
            messages=[
                *params["messages"],
                whole.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
            ],
        )
    assert whole.choices[0].finish_reason == "tool_calls" == finish
    assert call.function.name == "weather" and names == {"weather"}
    _valid(call.function.arguments, WEATHER["function"]["parameters"])
    assert "".join(deltas) == call.function.arguments
    # One call per answer, its id named by its session (each request is a session of its own).
    assert len(ids) == 1 and call.id.startswith("call_") and next(iter(ids)).startswith("call_")
    assert follow_up.choices[0].message.content


async def test_required_picks_one_of_several_tools(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        answer = await client.chat.completions.create(
            model=await _model(server),
            messages=[{"role": "user", "content": "When is high tide in Brest harbour?"}],
            max_tokens=100,
            temperature=0,
            tools=[WEATHER, TIDE],
            tool_choice="required",
            parallel_tool_calls=False,
        )
    [call] = answer.choices[0].message.tool_calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIDE)}
    assert call.function.name in tools
    _valid(call.function.arguments, tools[call.function.name])


async def test_the_responses_api_text_format(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        response = await client.responses.create(
            model=await _model(server),
            input=ASK[0]["content"],
            max_output_tokens=200,
            temperature=0,
            text={"format": {"type": "json_schema", "name": "keeper", "schema": KEEPER}},
        )
    _valid(response.output_text, KEEPER)
    assert response.text.format.type == "json_schema"


async def test_a_cut_tool_call_stream_resumes_with_the_same_deltas(engine, certs):
    async with running_server(engine, certs) as server:
        body = {
            "model": await _model(server),
            "messages": [{"role": "user", "content": "When is high tide in Brest harbour?"}],
            "max_tokens": 100,
            "temperature": 0,
            "stream": True,
            "tools": [WEATHER, TIDE],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
        async with tcp_client(server, certs) as tcp:
            cut = await cut_and_resume(tcp, "/v1/chat/completions", body, stop_after=8)

    def calls(events: list[Any]) -> tuple[list[str], str]:
        names, arguments = [], []
        for event in events:
            if event.data == "[DONE]" or not event.json.get("choices"):
                continue
            for call in event.json["choices"][0]["delta"].get("tool_calls", []):
                if "name" in call["function"]:
                    names.append(call["function"]["name"])
                arguments.append(call["function"]["arguments"])
        return names, "".join(arguments)

    names, arguments = calls(cut.whole)
    cut_names, cut_arguments = calls(cut.before + cut.after)
    assert (cut_names, cut_arguments) == (names, arguments)
    assert len(names) == 1 and names[0] in ("weather", "tide")
    json.loads(arguments)


async def test_the_responses_api_calls_a_named_function_and_takes_its_output(engine, certs):
    flat = {"type": "function", **WEATHER["function"]}
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        params = dict(model=await _model(server), max_output_tokens=100, temperature=0)
        stream = await client.responses.create(
            **params,
            input="What is the weather in Brest?",
            tools=[flat],
            tool_choice={"type": "function", "name": "weather"},
            stream=True,
        )
        events = [event async for event in stream]
        call = events[-1].response.output[0]
        answer = await client.responses.create(
            **params,
            previous_response_id=events[-1].response.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert call.type == "function_call" and call.name == "weather"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments
    _valid(call.arguments, WEATHER["function"]["parameters"])
    assert events[-1].type == "response.completed" and answer.output_text


async def test_the_responses_api_lets_the_model_pick_one_of_several_functions(engine, certs):
    flat = [{"type": "function", **t["function"]} for t in (WEATHER, TIDE)]
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        stream = await client.responses.create(
            model=await _model(server),
            input="When is high tide in Brest harbour?",
            max_output_tokens=100,
            temperature=0,
            tools=flat,
            tool_choice="required",
            parallel_tool_calls=False,
            stream=True,
        )
        events = [event async for event in stream]
        stored = await client.responses.retrieve(events[-1].response.id)
    added = next(e for e in events if e.type == "response.output_item.added")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [call] = stored.output
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIDE)}
    # The generic format announces a call once its name is written.
    assert added.item.name == call.name == done.name and call.name in schemas
    assert deltas == done.arguments == call.arguments
    _valid(call.arguments, schemas[call.name])
    assert [e.sequence_number for e in events] == list(range(len(events)))


# Issue 45: every shape an object schema can take, generated greedy and seeded, each output
# validated. Values that could run on (strings, additional members) are bounded where the shape
# allows it; "any object" and `additionalProperties: true` bound nothing, which is the point.
OBJECT_SHAPES: dict[str, dict[str, Any]] = {
    "closed-by-default": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer"},
            "nickname": {"type": "string", "maxLength": 12},
        },
        "required": ["name", "age"],
    },
    "optional-then-any": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer"},
        },
        "required": ["name"],
        "additionalProperties": True,
    },
    "optional-then-schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "additionalProperties": {"type": "string", "maxLength": 20},
    },
    "any-object": {"type": "object"},
    "map": {"type": "object", "additionalProperties": {"type": "integer"}},
    "all-of": {
        "allOf": [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 24}},
                "required": ["name"],
            },
            {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]},
        ]
    },
    "nested": {
        "type": "object",
        "properties": {
            "keeper": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 24}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "lamps": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"colour": {"enum": ["white", "red", "green"]}},
                    "required": ["colour"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
        },
        "required": ["keeper", "lamps"],
        "additionalProperties": False,
    },
    "recursive": {
        "$ref": "#/$defs/node",
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["name"],
                "additionalProperties": False,
            }
        },
    },
}
# What each shape is asked for: the shapes that bound nothing get a question with a short answer
# (a 135M model asked to "describe" writes on to max_tokens, which no schema can forbid).
SHAPE_ASKS = {
    "map": (
        "Count the lamps of three lighthouses as a short JSON object of integers, "
        'like {"north": 2}.'
    ),
    "recursive": (
        "The lighthouse keeper Tom has two daughters, Ann and Bea, who have no children. Write "
        'this family tree as JSON: {"name": ..., "children": [...]}.'
    ),
}
SHAPE_ASK = "Give the name and age of a lighthouse keeper as a short JSON object."


async def test_every_object_shape_makes_valid_json_greedy_and_seeded(engine, certs):
    samplings = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "seed": 7}}
    slots = asyncio.Semaphore(8)

    async def one(client: openai.AsyncOpenAI, model: str, shape: str, sampling: str):
        async with slots:
            return await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": SHAPE_ASKS.get(shape, SHAPE_ASK)}],
                max_tokens=160,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": shape, "schema": OBJECT_SHAPES[shape]},
                },
                **samplings[sampling],
            )

    cases = [(shape, sampling) for shape in OBJECT_SHAPES for sampling in samplings]
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        model = await _model(server)
        answers = await asyncio.gather(*(one(client, model, *case) for case in cases))
    for (shape, sampling), answer in zip(cases, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (shape, sampling, choice.message.content)
        _valid(choice.message.content, OBJECT_SHAPES[shape])
