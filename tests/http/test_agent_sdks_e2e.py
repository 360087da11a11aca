"""End to end: agent frameworks run a tool loop against the real server and model, as they are.

The OpenAI Agents SDK (``openai-agents``) and LangChain (``langchain-openai``), each over the
Responses API and chat completions: the model (SmolLM2-135M, greedy) is asked to use a Python
function, calls it with ``tool_choice`` auto (the frameworks' default with tools; the default
model's template knows no tools, so this is the generic format), gets its result and answers.
The function records what it was called with, so a loop that never called it fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.helpers import running_server

from .helpers import base_url, openai_client, tls_context

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

QUESTION = "Use the get_weather tool to get the weather in Paris."
REPORT = "Sunny, 24 C"


class Weather:
    """The tool: what it was asked, and a fixed answer."""

    def __init__(self) -> None:
        self.cities: list[str] = []

    def __call__(self, city: str) -> str:
        self.cities.append(city)
        return REPORT


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_the_openai_agents_sdk_runs_a_tool_loop(engine, certs, api):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no export to OpenAI's servers
    weather = Weather()

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return weather(city)

    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        model_id = server.app.router.model_id
        model: Any = (
            agents.OpenAIResponsesModel(model=model_id, openai_client=client)
            if api == "responses"
            else agents.OpenAIChatCompletionsModel(model=model_id, openai_client=client)
        )
        agent = agents.Agent(
            name="weather",
            instructions="You answer questions about the weather.",
            tools=[get_weather],
            model=model,
            model_settings=agents.ModelSettings(temperature=0, max_tokens=60),
        )
        result = await agents.Runner.run(agent, QUESTION, max_turns=4)
    assert weather.cities and all(isinstance(c, str) and c for c in weather.cities)
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert outputs and outputs[0].output == REPORT
    assert isinstance(result.final_output, str)


@contextlib.asynccontextmanager
async def _http(certs) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(verify=tls_context(certs), timeout=120) as client:
        yield client


@pytest.mark.parametrize("responses", [True, False], ids=["responses", "chat_completions"])
async def test_langchain_runs_a_tool_loop(engine, certs, responses):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    weather = Weather()

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return weather(city)

    async with running_server(engine, certs) as server, _http(certs) as http:
        chat = langchain_openai.ChatOpenAI(
            model=server.app.router.model_id,
            base_url=base_url(server) + "/v1",
            api_key="unused",
            temperature=0,
            max_tokens=60,
            max_retries=0,
            http_async_client=http,
            use_responses_api=responses,
        )
        bound = chat.bind_tools([get_weather])  # tool_choice: the default, auto
        messages: list[Any] = [HumanMessage(QUESTION)]
        first = await bound.ainvoke(messages)
        messages.append(first)
        for call in first.tool_calls:
            messages.append(await get_weather.ainvoke(call))
        answer = await bound.ainvoke(messages)
    assert first.tool_calls and [c["name"] for c in first.tool_calls] == ["get_weather"] * len(
        first.tool_calls
    )
    assert weather.cities == [c["args"]["city"] for c in first.tool_calls]
    assert all(isinstance(m, ToolMessage) and m.content == REPORT for m in messages[2:])
    # The answer after the result: text, or another call (the loop goes on), never an error.
    assert answer.content or answer.tool_calls
