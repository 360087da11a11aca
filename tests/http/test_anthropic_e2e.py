"""End to end: Anthropic's Messages API through the real server and model, with real clients.

The official ``anthropic`` SDK and httpx over TCP, niquests over HTTP/3. Texts and events are
compared between two runs on this machine (greedy), never against fixed strings: two runs are
two sessions, so their ids (and how much of the prompt the prefix cache held) are made equal
first. The SDK this suite runs has no ``temperature`` argument: it goes in ``extra_body``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from quicsrv.apikeys import hash_key, new_key
from quicsrv.sessions.admission import Slot
from quicsrv.transport import RunningServer
from tests.helpers import running_server, server_process

from .helpers import (
    SseEvent,
    anthropic_client,
    base_url,
    cut_and_resume,
    h3_session,
    h3_stream,
    parse_sse,
    tcp_client,
    tcp_stream,
    tls_context,
)

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

QUESTION = "Tell me a story about a lighthouse keeper and a storm."
ASK_TOOL = "Use the get_weather tool to get the weather in Paris."
GREEDY: dict[str, Any] = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
    },
}
VERSION = {"anthropic-version": "2023-06-01"}
# Long enough (over one 64-token block) for the prefix cache to keep it.
NOTES = (
    "You tell short stories about the sea. Notes for the night shift at the lighthouse: the "
    "lamp is lit at dusk, the lens is cleaned at dawn, the logbook records every ship that "
    "passes, the fog horn sounds every thirty seconds in fog, and the keeper checks the oil "
    "twice a night."
)


def _model(server: RunningServer) -> str:
    return server.app.router.model_id


def _session_id(message_id: str) -> bytes:
    return bytes.fromhex(message_id.removeprefix("msg_"))


def _session_of(events: list[SseEvent]) -> str:
    return str(events[0].json["message"]["id"]).removeprefix("msg_")


# Two runs of one request differ in their session (the ids, the cursors) and in how much of the
# prompt the prefix cache held (which depends on what ran before).
_CACHED = re.compile(r'"(input_tokens|cache_read_input_tokens)":\d+')


def _normalized(events: list[SseEvent], session: str) -> list[tuple[str | None, str]]:
    """(event, data) of each event but the keep-alives, as if of session "S" and with no
    cache."""
    return [
        (e.event, _CACHED.sub(r'"\1":0', e.data.replace(session, "S"))) for e in _numbered(events)
    ]


def _numbered(events: list[SseEvent]) -> list[SseEvent]:
    """The events of the stream proper: a ``ping`` (no id) comes whenever the stream was quiet
    for ``sse_keepalive_s`` (a worker restarting, a loaded machine), so not at fixed places."""
    return [e for e in events if e.event != "ping"]


def _blocks(message: anthropic.types.Message) -> list[tuple[str, Any]]:
    """A message's content without its ids (two runs are two sessions)."""
    return [
        (b.type, b.text if b.type == "text" else (b.name, b.input))  # type: ignore[union-attr]
        for b in message.content
    ]


async def test_the_sdk_streams_and_not_the_same_message_and_counts_its_prompt(engine, certs):
    async with running_server(engine, certs) as server, anthropic_client(server, certs) as client:
        params: dict[str, Any] = dict(
            model=_model(server),
            max_tokens=32,
            system=NOTES,
            messages=[{"role": "user", "content": QUESTION}],
            extra_body=GREEDY,
        )
        raw = await client.messages.with_raw_response.create(**params)
        whole = await raw.parse()
        async with client.messages.stream(**params) as stream:
            texts = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        events = [event async for event in await client.messages.create(**params, stream=True)]
        counted = await client.messages.count_tokens(
            model=params["model"], system=params["system"], messages=params["messages"]
        )
        record = server.sessions.store.get(_session_id(whole.id))
        assert record is not None
    assert raw.headers["quicsrv-session"] == whole.id.removeprefix("msg_")
    assert whole.type == "message" and whole.role == "assistant" and whole.model == params["model"]
    assert _blocks(final) == _blocks(whole) and "".join(texts) == whole.content[0].text  # type: ignore[union-attr]
    assert whole.stop_reason == final.stop_reason and whole.stop_reason in (
        "end_turn",
        "max_tokens",
    )
    assert final.usage.output_tokens == whole.usage.output_tokens <= 32
    prompt = len(record.spec.prompt_tokens)
    assert counted.input_tokens == prompt
    for usage in (whole.usage, final.usage):
        assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == prompt
        assert usage.cache_creation_input_tokens == 0
    # The same prompt again: the prefix cache held all but the last position of it.
    assert (final.usage.cache_read_input_tokens or 0) > 0
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}


async def test_a_tool_loop_tool_use_then_its_result_then_text(engine, certs):
    async with running_server(engine, certs) as server, anthropic_client(server, certs) as client:
        params: dict[str, Any] = dict(
            model=_model(server), max_tokens=60, tools=[WEATHER], extra_body=GREEDY
        )
        messages: list[Any] = [{"role": "user", "content": ASK_TOOL}]
        first = await client.messages.create(
            **params, messages=messages, tool_choice={"type": "any"}
        )
        async with client.messages.stream(
            **params, messages=messages, tool_choice={"type": "any"}
        ) as stream:
            streamed = await stream.get_final_message()
        uses = [b for b in first.content if b.type == "tool_use"]
        messages += [
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": u.id, "content": "Sunny, 24 C"}
                    for u in uses
                ],
            },
        ]
        counted = await client.messages.count_tokens(
            model=params["model"], messages=messages, tools=[WEATHER]
        )
        auto = await client.messages.create(**params, messages=messages)
        final = await client.messages.create(
            **params, messages=messages, tool_choice={"type": "none"}
        )
        named = await client.messages.create(
            **params,
            messages=[{"role": "user", "content": "Brest"}],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
        auto_record = server.sessions.store.get(_session_id(auto.id))
        assert auto_record is not None
    assert first.stop_reason == "tool_use" and uses and len(uses) == len(first.content)
    for use in uses:
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER["input_schema"])
    assert _blocks(streamed) == _blocks(first) and streamed.stop_reason == "tool_use"
    # The result went back to the model: text, or (auto) another valid use.
    assert counted.input_tokens == len(auto_record.spec.prompt_tokens)
    for block in auto.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, WEATHER["input_schema"])
            assert auto.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text"] and final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason in ("end_turn", "max_tokens")
    [use] = named.content
    assert use.type == "tool_use" and use.name == "get_weather" and named.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER["input_schema"])


@pytest.mark.parametrize("question", [QUESTION, ASK_TOOL], ids=["text", "tool"])
async def test_a_cut_stream_resumed_by_last_event_id_is_the_uninterrupted_one(
    engine, certs, question
):
    async with running_server(engine, certs) as server:
        body: dict[str, Any] = {
            "model": _model(server),
            "max_tokens": 48,
            "messages": [{"role": "user", "content": question}],
            "stream": True,
            **GREEDY,
        }
        if question == ASK_TOOL:
            body["tools"] = [WEATHER]  # auto: the model chooses, so blocks open as it does
        async with tcp_client(server, certs, http2=True, **VERSION) as tcp:
            cut = await cut_and_resume(tcp, "/v1/messages", body, stop_after=6)
            first_id = cut.before[0].id
            _, replay = await tcp_stream(
                tcp, "GET", f"/v1/streams/{cut.session}", headers={"last-event-id": first_id}
            )
        async with h3_session(certs) as h3:
            url = f"{base_url(server)}/v1/streams/{cut.session}?last_event_id={cut.last_id}"
            _, after_h3 = await h3_stream(h3, "GET", url)
    assert len(_numbered(cut.before)) == 6 and cut.after
    joined = cut.before + cut.after
    assert _normalized(joined, cut.session) == _normalized(cut.whole, _session_of(cut.whole))
    # Ids included: the same events, on the same stream, whatever carried the resume.
    assert _numbered(replay) == _numbered(joined[1:])
    assert _numbered(after_h3) == _numbered(cut.after)
    assert [e.event for e in joined][-2:] == ["message_delta", "message_stop"]
    if question == ASK_TOOL:
        assert any(e.json.get("delta", {}).get("type") == "input_json_delta" for e in joined)


async def test_a_stream_rides_out_a_worker_kill_9_and_resumes_after_one(engine, certs):
    async with running_server(engine, certs) as server:
        body: dict[str, Any] = {
            "model": _model(server),
            "max_tokens": 40,
            "messages": [{"role": "user", "content": QUESTION}],
            "stream": True,
            **GREEDY,
        }
        restarts = engine.restarts
        async with tcp_client(server, certs, **VERSION) as tcp:
            _, reference = await tcp_stream(tcp, "POST", "/v1/messages", json=body)
            killed: list[SseEvent] = []
            lines: list[str] = []
            async with tcp.stream("POST", "/v1/messages", json=body) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
                    if line == "" and len(_numbered(parse_sse(lines))) == 8 and not killed:
                        killed.append(parse_sse(lines)[-1])
                        os.kill(engine.worker_pid, signal.SIGKILL)  # mid-answer
            through = parse_sse([*lines, ""])
            cut, before = await tcp_stream(tcp, "POST", "/v1/messages", json=body, stop_after=7)
            session = cut.headers["quicsrv-session"]
            os.kill(engine.worker_pid, signal.SIGKILL)  # while nobody reads it
            _, after = await tcp_stream(
                tcp, "GET", f"/v1/streams/{session}", headers={"last-event-id": before[-1].id}
            )
    expected = _normalized(reference, _session_of(reference))
    assert _normalized(through, _session_of(through)) == expected
    assert _normalized(before + after, session) == expected
    assert engine.restarts >= restarts + 2


@pytest.mark.slow
async def test_a_stream_resumes_across_a_server_restart_by_last_event_id(certs, tmp_path):
    data_dir = tmp_path / "data"
    cut_at = 10
    async with contextlib.AsyncExitStack() as stack:
        process, port = await stack.enter_async_context(server_process(certs, data_dir))
        base = f"https://127.0.0.1:{port}"
        async with httpx.AsyncClient(
            base_url=base, verify=tls_context(certs), timeout=60, headers=VERSION
        ) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            body = {
                "model": model,
                "max_tokens": 96,
                "messages": [{"role": "user", "content": QUESTION}],
                "ignore_eos": True,
                "stream": True,
                **GREEDY,
            }
            _, reference = await tcp_stream(http, "POST", "/v1/messages", json=body)
            lines: list[str] = []
            restarted = None
            async with http.stream("POST", "/v1/messages", json=body) as response:
                session = response.headers["quicsrv-session"]
                async for line in response.aiter_lines():
                    lines.append(line)
                    if line == "" and len(_numbered(parse_sse(lines))) == cut_at and not restarted:
                        # SIGTERM, and the new process starts on the same port and data dir.
                        process.send_signal(signal.SIGTERM)
                        restarted = asyncio.ensure_future(
                            stack.enter_async_context(server_process(certs, data_dir, port))
                        )
        before = parse_sse([*lines, ""])
        assert restarted is not None
        await restarted
        error = before[-1]
        assert error.event == "error" and error.id is None
        assert error.json["error"]["details"]["error_code"] == "shutting_down"
        last = [e.id for e in before if e.id is not None][-1]
        async with httpx.AsyncClient(
            base_url=base, verify=tls_context(certs), timeout=60, headers=VERSION
        ) as http:
            _, after = await tcp_stream(
                http, "GET", f"/v1/streams/{session}", headers={"last-event-id": last}
            )
    assert _normalized(before[:-1] + after, session) == _normalized(
        reference, _session_of(reference)
    )


@contextlib.asynccontextmanager
async def _every_slot_taken(server: RunningServer) -> AsyncIterator[list[Slot]]:
    """Every engine slot held by other clients for the block (or until given back)."""
    gate = server.sessions.gate
    slots = [await gate.acquire(f"another client {n}") for n in range(gate.limits.slots)]
    try:
        yield slots
    finally:
        for slot in slots:
            slot.release()


async def test_a_stream_in_line_keeps_alive_with_ping_events_the_sdk_skips(engine, certs):
    async with running_server(engine, certs, sse_keepalive_s=0.05) as server:
        params: dict[str, Any] = dict(
            model=_model(server),
            max_tokens=8,
            messages=[{"role": "user", "content": QUESTION}],
            extra_body=GREEDY,
        )
        async with anthropic_client(server, certs) as client:
            whole = await client.messages.create(**params)
            async with (
                tcp_client(server, certs, **VERSION) as tcp,
                _every_slot_taken(server) as slots,
            ):
                lines: list[str] = []
                body = {**params.pop("extra_body"), **params, "stream": True}
                async with tcp.stream("POST", "/v1/messages", json=body) as response:
                    async for line in response.aiter_lines():
                        lines.append(line)
                        if lines.count("event: ping") == 2 and slots:
                            for slot in slots:
                                slot.release()  # the turn comes
                            slots.clear()
            streamed = await client.messages.create(**params, extra_body=GREEDY, stream=True)
            types = [event.type async for event in streamed]
    events = parse_sse([*lines, ""])
    pings = [e for e in events if e.event == "ping"]
    assert len(pings) >= 2 and all(e.id is None and e.json == {"type": "ping"} for e in pings)
    text = "".join(e.json["delta"]["text"] for e in events if e.event == "content_block_delta")
    assert text == whole.content[0].text  # type: ignore[union-attr]
    assert "ping" not in types


async def test_bad_requests_get_anthropic_errors_over_tcp_and_http3(engine, certs):
    async with running_server(engine, certs, max_request_bytes=4096) as server:
        model = _model(server)
        ok = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
        cases: list[tuple[str, str, dict[str, Any] | bytes, int, str, dict[str, str]]] = [
            (
                "POST",
                "/v1/messages",
                {k: v for k, v in ok.items() if k != "max_tokens"},
                400,
                "invalid_request_error",
                {},
            ),
            (
                "POST",
                "/v1/messages",
                {**ok, "model": "claude-opus-4-1"},
                404,
                "not_found_error",
                {},
            ),
            (
                "POST",
                "/v1/messages",
                {**ok, "messages": [{"role": "user", "content": [image]}]},
                400,
                "invalid_request_error",
                {},
            ),
            ("POST", "/v1/messages", {**ok, "system": "x" * 5000}, 413, "request_too_large", {}),
            ("POST", "/v1/messages", b"{not json", 400, "invalid_request_error", {}),
            ("POST", "/v1/messages", ok, 400, "invalid_request_error", {"anthropic-version": "1"}),
            ("POST", "/v1/messages/count_tokens", ok, 400, "invalid_request_error", {}),
            ("GET", "/v1/messages", b"", 405, "invalid_request_error", {}),
            ("POST", "/v1/messages/batches", ok, 404, "not_found_error", {}),
        ]
        async with tcp_client(server, certs) as tcp, h3_session(certs) as h3:
            for method, path, body, status, kind, headers in cases:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                for label, response in [
                    ("tcp", await tcp.request(method, path, content=content, headers=headers)),
                    (
                        "h3",
                        await h3.request(
                            method, base_url(server) + path, data=content, headers=headers
                        ),
                    ),
                ]:
                    assert response.status_code == status, (label, path, body)
                    payload = response.json()
                    assert payload["type"] == "error" and payload["error"]["type"] == kind
                    assert payload["error"]["message"] and payload["error"]["details"]["error_code"]
            still = await tcp.post("/v1/messages", json=ok)
        async with anthropic_client(server, certs) as client:
            with pytest.raises(anthropic.NotFoundError) as unknown:
                await client.messages.create(**{**ok, "model": "claude-opus-4-1"})
            with pytest.raises(anthropic.BadRequestError) as bad:
                await client.messages.create(
                    **{**ok, "messages": [{"role": "user", "content": [image]}]}
                )
            with pytest.raises(anthropic.APIStatusError) as large:
                await client.messages.create(**{**ok, "system": "x" * 5000})
    assert still.status_code == 200 and still.json()["type"] == "message"
    assert unknown.value.type == "not_found_error" and unknown.value.error_code == "model_not_found"
    assert bad.value.error_code == "unsupported_value"
    assert large.value.status_code == 413 and large.value.type == "request_too_large"


async def test_keys_guard_messages_and_a_stream_resumes_only_with_its_own_key(
    engine, certs, tmp_path
):
    alice, bob = new_key(), new_key()
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{hash_key(alice)} alice\n{hash_key(bob)} bob\n")
    async with running_server(engine, certs, api_keys_file=keys_file) as server:
        body = {
            "model": _model(server),
            "max_tokens": 8,
            "messages": [{"role": "user", "content": QUESTION}],
            "stream": True,
        }
        async with anthropic_client(server, certs, api_key="wrong") as client:
            with pytest.raises(anthropic.AuthenticationError) as wrong:
                await client.messages.create(**{**body, "stream": False})
        async with anthropic_client(server, certs, api_key=alice) as client:
            mine = await client.messages.create(**{**body, "stream": False})
        async with tcp_client(server, certs, **{"x-api-key": alice}, **VERSION) as as_alice:
            started, events = await tcp_stream(as_alice, "POST", "/v1/messages", json=body)
            path = f"/v1/streams/{started.headers['quicsrv-session']}"
            cursor = events[0].id
            assert cursor is not None
            _, own = await tcp_stream(as_alice, "GET", path, headers={"last-event-id": cursor})
        async with tcp_client(server, certs, **{"x-api-key": bob}, **VERSION) as as_bob:
            by_bob = await as_bob.get(path, headers={"last-event-id": cursor})
            stopped_by_bob = await as_bob.delete(path)
        async with tcp_client(server, certs, **VERSION) as anonymous:
            no_key = await anonymous.post("/v1/messages", json=body)
            counted = await anonymous.post("/v1/messages/count_tokens", json={})
    assert wrong.value.status_code == 401 and wrong.value.type == "authentication_error"
    assert mine.content and _numbered(own) == _numbered(events[1:])
    assert by_bob.status_code == 403
    assert by_bob.json()["error"]["type"] == "permission_error"
    assert by_bob.json()["error"]["details"]["error_code"] == "session_key_mismatch"
    assert stopped_by_bob.status_code == 403
    for response in (no_key, counted):
        assert response.status_code == 401 and response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "authentication_error"


async def test_niquests_over_http3_streams_and_counts(engine, certs):
    async with running_server(engine, certs) as server:
        url = base_url(server) + "/v1/messages"
        body: dict[str, Any] = {
            "model": _model(server),
            "max_tokens": 24,
            "messages": [{"role": "user", "content": QUESTION}],
            **GREEDY,
        }
        async with h3_session(certs) as h3:
            response, events = await h3_stream(h3, "POST", url, json={**body, "stream": True})
            whole = await h3.post(url, json=body)
            counted = await h3.post(
                url + "/count_tokens", json={"model": body["model"], "messages": body["messages"]}
            )
    assert response.http_version == whole.http_version == counted.http_version == 30
    assert response.headers["content-type"] == "text/event-stream"
    text = "".join(e.json["delta"]["text"] for e in events if e.event == "content_block_delta")
    message = whole.json()
    assert text == message["content"][0]["text"]
    usage = message["usage"]
    assert counted.json() == {
        "input_tokens": usage["input_tokens"] + usage["cache_read_input_tokens"]
    }


# --- the README's examples -----------------------------------------------------------------

_README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_examples() -> tuple[list[str], list[str]]:
    """The Python and the shell examples of the README's Anthropic section."""
    text = _README.read_text()
    section = text.split("\n### The Anthropic Messages API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(python|sh)\n(.*?)```", section, flags=re.S)
    return [b for kind, b in blocks if kind == "python"], [b for kind, b in blocks if kind == "sh"]


async def test_the_readme_examples_run(engine, certs, tmp_path):
    python, shell = _readme_examples()
    assert python and shell
    async with running_server(engine, certs) as server:
        model = _model(server)

        def localized(code: str) -> str:
            return (
                code.replace("https://localhost:4433", base_url(server))
                .replace("certs/ca.pem", str(certs.ca_cert))
                .replace("SmolLM2-135M-Instruct.Q4_1", model)
            )

        for code in python:
            namespace: dict[str, Any] = {}
            try:
                await asyncio.to_thread(
                    exec, compile(localized(code), "README.md", "exec"), namespace
                )
            finally:
                if isinstance(namespace.get("client"), anthropic.Anthropic):
                    namespace["client"].close()  # the example leaves it open, as a script may
        for script in shell:
            process = await asyncio.create_subprocess_exec(
                "bash",
                "-eu",  # not pipefail: `curl | head` cuts the stream on purpose
                "-c",
                localized(script),
                cwd=tmp_path,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(process.communicate(), 300)
            assert process.returncode == 0, (script, out.decode(), err.decode())
        events = parse_sse((tmp_path / "first.txt").read_text().splitlines() + [""])
        rest = parse_sse((tmp_path / "rest.txt").read_text().splitlines() + [""])
    assert events[0].event == "message_start" and rest[-1].event == "message_stop"
