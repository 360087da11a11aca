"""End to end, through the real server and model: whole Responses objects in every event, the
neutral fields accepted, the model object, and clear answers to unknown endpoints and to a
WebSocket upgrade (issue 41)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from tests.helpers import running_server

from .helpers import base_url, openai_client, tcp_client, tls_context
from .test_responses_objects import check_resource

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


async def _websocket_upgrade(server: Any, certs: Any, path: str) -> tuple[int, dict[str, Any]]:
    """An HTTP/1.1 WebSocket upgrade (RFC 6455 §4.1) of ``path``: the status and JSON body."""
    reader, writer = await asyncio.open_connection("localhost", server.port, ssl=tls_context(certs))
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
        "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
    body = await reader.readexactly(int(headers[b"content-length"]))
    writer.close()
    return status, json.loads(body)


async def test_models_unknown_endpoints_and_websocket_upgrades_get_clear_answers(engine, certs):
    async with running_server(engine, certs) as server:
        model = server.app.router.model_id
        async with tcp_client(server, certs) as tcp:
            listed = (await tcp.get("/v1/models")).json()["data"][0]
            one = await tcp.get(f"/v1/models/{model}")
            other = await tcp.get("/v1/models/gpt-4")
            compact = await tcp.post("/v1/responses/compact", json={"model": model})
            nope = await tcp.get("/v1/nope")
            upgrade = await _websocket_upgrade(server, certs, "/v1/responses")
            after = await tcp.get(f"/v1/models/{model}")  # the server goes on
        async with openai_client(server, certs) as client:
            retrieved = await client.models.retrieve(model)
            with pytest.raises(openai.NotFoundError) as caught:
                await client.models.retrieve("gpt-4")
    assert one.status_code == 200 and one.json() == listed
    assert retrieved.id == model and caught.value.code == "model_not_found"
    assert (other.status_code, other.json()["error"]["code"]) == (404, "model_not_found")
    for answer in (compact, nope):
        error = answer.json()["error"]
        assert (answer.status_code, error["code"]) == (404, "unknown_endpoint")
        assert "not found" not in error["message"]  # not "Response with id 'compact' not found"
    status, body = upgrade
    assert (status, body["error"]["code"]) == (400, "websocket_not_supported")
    assert body["error"]["type"] == "invalid_request_error"
    assert after.status_code == 200


async def test_a_called_function_streams_whole_objects_with_the_requests_tools(engine, certs):
    """The default max_output_tokens, echoed: the call ends long before it."""
    async with running_server(engine, certs) as server:
        model = server.app.router.model_id
        request: dict[str, Any] = {
            "model": model,
            "input": [
                {"type": "message", "role": "user", "content": "Weather in Oslo?"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": "Let me see.",
                    "phase": "commentary",
                },
                {"type": "message", "role": "user", "content": "Go on."},
            ],
            "tools": [WEATHER],
            "tool_choice": "required",
            "temperature": 0,
            # Neutral: accepted, and the answer is the same as without them.
            "prompt_cache_key": "conversation-1",
            "safety_identifier": "user-hash",
            "context_management": None,
            "service_tier": "auto",
            "store": True,
        }
        async with tcp_client(server, certs) as tcp:
            async with tcp.stream("POST", "/v1/responses", json={**request, "stream": True}) as r:
                assert r.status_code == 200
                events = [
                    json.loads(line.removeprefix("data: "))
                    async for line in r.aiter_lines()
                    if line.startswith("data: ")
                ]
            final = events[-1]["response"]
            stored = (await tcp.get(f"/v1/responses/{final['id']}")).json()
    carrying = [e["response"] for e in events if "response" in e]
    assert [e["type"] for e in events if "response" in e] == [
        "response.created",
        "response.in_progress",
        "response.completed",
    ]
    for response in (*carrying, stored):
        check_resource(response)
        assert response["tools"] == [{**WEATHER, "strict": True}]
        assert response["tool_choice"] == "required"
        assert response["max_output_tokens"] == 256
        assert response["prompt_cache_key"] == "conversation-1"
        assert response["safety_identifier"] == "user-hash"
    assert final["output"][0]["type"] == "function_call"
    assert json.loads(final["output"][0]["arguments"])["city"]
    assert isinstance(final["completed_at"], int) and final["completed_at"] >= final["created_at"]
    assert stored["completed_at"] == final["completed_at"]  # from the record, on every read


async def test_chat_accepts_neutral_fields_and_answers_refusal_null(engine, certs):
    async with running_server(engine, certs) as server:
        model = server.app.router.model_id
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "metadata": {},
            "store": True,
            "prompt_cache_key": "k",
            "safety_identifier": "s",
            "service_tier": "default",
            "parallel_tool_calls": True,
        }
        async with tcp_client(server, certs) as tcp:
            answer = await tcp.post(base_url(server) + "/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None


#: The requests of the Open Responses compliance suite's tests in scope (its
#: src/lib/compliance-tests.ts at loadtest.bench.open_responses.SUITE_COMMIT), each answer
#: checked against the whole ResponseResource. One after another (the suite sends them at once):
#: six answers of up to 256 tokens at once could pass the client's timeout on a busy machine.
SUITE_INPUTS: dict[str, Any] = {
    "basic-response": [
        {"type": "message", "role": "user", "content": "Say hello in exactly 3 words."}
    ],
    "streaming-response": [{"type": "message", "role": "user", "content": "Count from 1 to 5."}],
    "system-prompt": [
        {
            "type": "message",
            "role": "system",
            "content": "You are a pirate. Always respond in pirate speak.",
        },
        {"type": "message", "role": "user", "content": "Say hello."},
    ],
    "multi-turn": [
        {"type": "message", "role": "user", "content": "My name is Alice."},
        {
            "type": "message",
            "role": "assistant",
            "content": "Hello Alice! Nice to meet you. How can I help you today?",
        },
        {"type": "message", "role": "user", "content": "What is my name?"},
    ],
}


async def _suite_post(tcp: Any, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/responses as the suite does; a stream's final response, with every event's
    response checked on the way."""
    if not body.get("stream"):
        answer = await tcp.post("/v1/responses", json=body)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())
    async with tcp.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        events = [
            json.loads(line.removeprefix("data: "))
            async for line in r.aiter_lines()
            if line.startswith("data: ")
        ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        if "response" in event:
            check_resource(event["response"])
        if "item" in event and event["item"]["type"] == "function_call":
            assert isinstance(event["item"]["name"], str)
    return dict(events[-1]["response"])


async def test_the_compliance_suites_requests_in_scope_pass(engine, certs):
    """What ``make compliance-open-responses`` checks, without bun or the download: the same
    requests, each answer a whole ResponseResource with the status the test wants."""
    async with running_server(engine, certs) as server:
        model = server.app.router.model_id
        weather = {
            **WEATHER,
            "parameters": {
                **WEATHER["parameters"],
                "properties": {"location": {"type": "string", "maxLength": 20}},
                "required": ["location"],
            },
        }

        async def previous_response_id(tcp: Any) -> dict[str, Any]:
            first = await _suite_post(
                tcp,
                {
                    "model": model,
                    "input": "Remember this code word: papaya. Reply with only OK.",
                    "stream": False,
                },
            )
            check_resource(first)
            return await _suite_post(
                tcp,
                {
                    "model": model,
                    "previous_response_id": first["id"],
                    "input": "What code word did I ask you to remember?",
                    "stream": False,
                },
            )

        async def function_call_roundtrip(tcp: Any) -> dict[str, Any]:
            first = await _suite_post(
                tcp,
                {
                    "model": model,
                    "input": "Use the weather tool to get the temperature in San Francisco.",
                    "tools": [weather],
                    "tool_choice": {"type": "function", "name": weather["name"]},
                    "stream": False,
                },
            )
            check_resource(first)
            call = next(item for item in first["output"] if item["type"] == "function_call")
            return await _suite_post(
                tcp,
                {
                    "model": model,
                    "previous_response_id": first["id"],
                    "input": [
                        {
                            "type": "function_call_output",
                            "call_id": call["call_id"],
                            "output": "64 degrees and clear",
                        }
                    ],
                    "stream": False,
                },
            )

        async with tcp_client(server, certs) as tcp:
            answers = [
                await _suite_post(
                    tcp,
                    {"model": model, "input": items, "stream": name == "streaming-response"},
                )
                for name, items in SUITE_INPUTS.items()
            ]
            answers += [await previous_response_id(tcp), await function_call_roundtrip(tcp)]
    for answer in answers:
        check_resource(answer)
        assert answer["output"] and answer["output"][0]["type"] == "message"
        # The suite also wants "completed": the small default model, at the suite's sampling
        # (temperature 1), sometimes runs on to the 256-token default instead (the bench's
        # table says which). Then the object must say so, whole.
        if answer["status"] != "completed":
            assert answer["status"] == "incomplete"
            assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
            assert answer["usage"]["output_tokens"] == answer["max_output_tokens"] == 256
            assert answer["completed_at"] is None
        else:
            assert answer["completed_at"] >= answer["created_at"]
