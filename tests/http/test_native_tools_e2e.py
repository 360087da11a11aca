"""End to end: native tool calls, the real server and model with ``chat_template_file`` set to
a Hermes-style template (``hermes_template.jinja``, in Qwen 2.5's style): the tools rendered by
the template, the calls generated as ``<tool_call>`` blocks and read back as OpenAI's calls.

One engine with that template for the module (a worker process: about 3 s to start), one
server per test. The default model was not trained on this template: what is checked is that
every answer is what the grammar allows (valid calls, or text) and that it streams, renders
and resumes as the generic format's do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from quicsrv.http.hermes_format import calls_text
from tests.helpers import running_server

from .helpers import openai_client, tcp_client
from .test_tools_e2e import (
    ASK_TOOL,
    GREEDY,
    SCHEMAS,
    TIME,
    WEATHER,
    _check_message,
    _cut_chat_resumes_exactly,
)

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

TEMPLATE = Path(__file__).with_name("hermes_template.jinja")


@pytest.fixture(scope="module")
def hermes_engine(model_path: Path, cpu_extra_buffers: bool) -> Iterator[object]:
    """The engine as ``quicsrv serve --chat-template-file hermes_template.jinja`` runs it."""
    from quicsrv.engine.supervisor import WorkerEngine
    from quicsrv.settings import engine_settings_for, supervisor_settings_for

    settings = engine_settings_for(
        model_path,
        n_seq_max=2,
        max_queued=8,
        chat_template_file=TEMPLATE,
        cpu_extra_buffers=cpu_extra_buffers,
    )
    engine = WorkerEngine(settings, supervisor_settings_for())
    yield engine
    engine.close()


async def test_required_and_named_calls_through_chat_completions(hermes_engine, certs):
    async with (
        running_server(hermes_engine, certs) as server,
        openai_client(server, certs) as client,
    ):
        params: dict[str, Any] = dict(
            model=server.app.router.model_id,
            messages=[{"role": "user", "content": "Get the weather in Paris and in Rome."}],
            tools=[WEATHER, TIME],
            max_tokens=120,
            **GREEDY,
        )
        required = await client.chat.completions.create(**params, tool_choice="required")
        named = await client.chat.completions.create(
            **params, tool_choice={"type": "function", "function": {"name": "get_time"}}
        )
        # The template rendered the tools: its tools section is in the prompt.
        plain = await client.chat.completions.create(
            model=params["model"], messages=params["messages"], max_tokens=1
        )
    message = required.choices[0].message
    assert _check_message(message, required.choices[0].finish_reason) == "calls"
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])
    assert required.usage.prompt_tokens > plain.usage.prompt_tokens + 100


async def test_auto_answers_in_text_or_calls_and_results_go_back(hermes_engine, certs):
    async with (
        running_server(hermes_engine, certs) as server,
        openai_client(server, certs) as client,
    ):
        model = server.app.router.model_id
        messages: list[Any] = [{"role": "user", "content": ASK_TOOL}]
        first = await client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], max_tokens=40, **GREEDY
        )
        choice = first.choices[0]
        _check_message(choice.message, choice.finish_reason)
        # A call and its result, then the model's next turn (text or calls again).
        function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": function}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
        ]
        second = await client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], max_tokens=40, **GREEDY
        )
    _check_message(second.choices[0].message, second.choices[0].finish_reason)
    # The template was shown the call and the result as its own blocks.
    shown = hermes_engine.render_chat(
        [
            {"role": "assistant", "content": calls_text([("get_weather", '{"city": "Paris"}')])},
            {"role": "tool", "content": "Sunny, 24 C"},
        ]
    )
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in shown
    )
    assert "<tool_response>\nSunny, 24 C\n</tool_response>" in shown


async def test_the_responses_api_returns_function_calls(hermes_engine, certs):
    flat = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    async with (
        running_server(hermes_engine, certs) as server,
        openai_client(server, certs) as client,
    ):
        response = await client.responses.create(
            model=server.app.router.model_id,
            input=ASK_TOOL,
            tools=flat,
            tool_choice="required",
            max_output_tokens=120,
            **GREEDY,
        )
    assert response.status == "completed" and response.output
    for item in response.output:
        assert item.type == "function_call" and item.call_id.startswith("call_")
        jsonschema.validate(json.loads(item.arguments), SCHEMAS[item.name])


async def test_a_cut_native_call_stream_resumes_exactly(hermes_engine, certs):
    async with running_server(hermes_engine, certs) as server, tcp_client(server, certs) as tcp:
        body = {
            "model": server.app.router.model_id,
            "messages": [{"role": "user", "content": ASK_TOOL}],
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_tokens": 40,
            "stream": True,
            **GREEDY,
        }
        await _cut_chat_resumes_exactly(tcp, body, "tool_calls")
