"""End to end: OpenAI's Responses API through the real server and model, with real clients.

The official ``openai`` SDK over TCP, niquests over HTTP/3. Texts are compared between two
runs on this machine (greedy), never against fixed strings.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import openai
import pytest

from quicsrv.apikeys import hash_key, new_key
from tests.helpers import running_server, session_settings

from .helpers import base_url, h3_session, h3_stream, openai_client

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

QUESTION = "Tell me a story about a lighthouse keeper and a storm."
GREEDY: dict[str, Any] = {"temperature": 0}


async def _model(server) -> str:
    return server.app.router.model_id


def _session_id(response_id: str) -> bytes:
    return bytes.fromhex(response_id.removeprefix("resp_"))


def _text(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def _read(stream: Any, *, stop_after: int | None = None) -> list[Any]:
    """Events of an SDK stream; with ``stop_after``, the connection is dropped after that
    many events (the cut a client sees when its network goes)."""
    events = []
    async for event in stream:
        events.append(event)
        if stop_after is not None and len(events) >= stop_after:
            await stream.close()
            break
    return events


async def _cut(server: Any, stream: Any, stop_after: int) -> tuple[list[Any], Any]:
    """:func:`_read` with a cut, and the server's session object, taken while the stream
    still reads it (once nobody does and nothing runs, the server lets go of it)."""
    events, session = [], None
    async for event in stream:
        events.append(event)
        if session is None:
            session = server.sessions.live(_session_id(event.response.id))
        if len(events) >= stop_after:
            await stream.close()
            break
    assert session is not None
    return events, session


async def test_a_background_stream_cut_runs_on_and_resumes_exactly_from_any_event(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        params = dict(model=await _model(server), input=QUESTION, max_output_tokens=40, **GREEDY)
        whole = await client.responses.create(**params)
        stream = await client.responses.create(**params, background=True, stream=True)
        first, session = await _cut(server, stream, 12)
        response_id = first[0].response.id
        assert session.unattended
        # Nobody reads it now, yet it runs to its end (idle is set only then).
        await asyncio.wait_for(session.idle.wait(), 120)
        assert session.record.end is not None and session.pauses == 0
        rest = await _read(
            await client.responses.retrieve(
                response_id, stream=True, starting_after=first[-1].sequence_number
            )
        )
        replay = await _read(await client.responses.retrieve(response_id, stream=True))
        middle = await _read(
            await client.responses.retrieve(response_id, stream=True, starting_after=5)
        )
        stored = await client.responses.retrieve(response_id)
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.sequence_number for e in replay] == list(range(len(events)))
    assert [e.type for e in replay] == [e.type for e in events]
    assert [e.sequence_number for e in middle] == list(range(6, len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert _text(events) == _text(replay) == whole.output_text == stored.output_text
    assert _text(replay[:6]) + _text(middle) == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text
    assert events[-1].response.id == response_id == stored.id
    assert events[-1].response.usage.output_tokens == stored.usage.output_tokens
    assert stored.status == events[-1].response.status == whole.status
    assert stored.background is True and whole.background is False


async def test_a_cut_foreground_stream_pauses_and_the_sdk_helper_replays_it_from_zero(
    engine, certs
):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        params = dict(model=await _model(server), input=QUESTION, max_output_tokens=32, **GREEDY)
        whole = await client.responses.create(**params)
        first, session = await _cut(server, await client.responses.create(**params, stream=True), 9)
        response_id = first[0].response.id
        await asyncio.wait_for(session.paused.wait(), 60)  # nobody reads: no compute spent
        assert session.record.end is None
        live = await client.responses.retrieve(response_id)
        assert live.status == "in_progress"
        helper_events = []
        async with client.responses.stream(response_id=response_id) as helper:
            async for event in helper:
                helper_events.append(event)
    assert [e.sequence_number for e in helper_events] == list(range(len(helper_events)))
    assert _text(helper_events) == whole.output_text
    assert _text(first) == whole.output_text[: len(_text(first))]


async def test_previous_response_id_continues_from_the_stored_tokens_and_reuses_their_cells(
    engine, certs
):
    notes = (
        "You keep a lighthouse. The lamp is lit at dusk, the lens is cleaned at dawn, the "
        "logbook records every ship that passes, and the fog horn sounds in fog. "
    ) * 3
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        params = dict(model=await _model(server), max_output_tokens=24, **GREEDY)
        one = await client.responses.create(
            **params, instructions=notes, input="When is the lens cleaned?"
        )
        two = await client.responses.create(
            **params, instructions=notes, input="And the lamp?", previous_response_id=one.id
        )
        three = await client.responses.create(
            **params, instructions=notes, input="Thank you.", previous_response_id=two.id
        )
        records = [server.sessions.store.get(_session_id(r.id)) for r in (one, two, three)]
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(
                **params, input="?", previous_response_id="resp_" + "00" * 16
            )
    assert two.previous_response_id == one.id and three.previous_response_id == two.id
    for before, after in zip(records, records[1:], strict=False):
        # The next prompt starts with the previous turn's own tokens, prompt and answer.
        head = (*before.spec.prompt_tokens, *before.generated)
        assert after.spec.prompt_tokens[: len(head)] == head
        assert len(after.spec.prompt_tokens) > len(head)
    for before, after in ((one, two), (two, three)):
        assert after.usage.input_tokens_details.cached_tokens > 0
        assert after.usage.input_tokens > before.usage.input_tokens + before.usage.output_tokens
    assert one.usage.input_tokens_details.cached_tokens == 0 or one.usage.input_tokens > 0


async def test_cancel_ends_a_paused_response_and_delete_forgets_it(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        params = dict(model=await _model(server), input=QUESTION, max_output_tokens=64, **GREEDY)
        first, session = await _cut(server, await client.responses.create(**params, stream=True), 8)
        response_id = first[0].response.id
        await asyncio.wait_for(session.paused.wait(), 60)
        generated = len(session.record.generated)
        cancelled = await client.responses.cancel(response_id)
        again = await client.responses.retrieve(response_id)
        rest = await _read(
            await client.responses.retrieve(
                response_id, stream=True, starting_after=first[-1].sequence_number
            )
        )
        await client.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response_id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(**params, previous_response_id=response_id)
    assert cancelled.status == again.status == "cancelled"
    assert cancelled.usage.output_tokens == generated == again.usage.output_tokens
    assert cancelled.output_text == again.output_text
    assert rest[-1].type == "response.incomplete" and rest[-1].response.status == "cancelled"
    assert _text(first + rest) == cancelled.output_text


async def test_another_key_can_neither_read_continue_cancel_nor_delete(engine, certs, tmp_path):
    alice, bob = new_key(), new_key()
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{hash_key(alice)} alice\n{hash_key(bob)} bob\n")
    async with running_server(engine, certs, api_keys_file=keys_file) as server:
        model = await _model(server)
        async with openai_client(server, certs, api_key=alice) as as_alice:
            mine = await as_alice.responses.create(
                model=model, input=QUESTION, max_output_tokens=8, **GREEDY
            )
        async with openai_client(server, certs, api_key=bob) as as_bob:
            attempts = [
                as_bob.responses.retrieve(mine.id),
                as_bob.responses.cancel(mine.id),
                as_bob.responses.delete(mine.id),
                as_bob.responses.create(
                    model=model, input="and?", max_output_tokens=8, previous_response_id=mine.id
                ),
            ]
            for attempt in attempts:
                with pytest.raises(openai.APIStatusError) as refused:
                    await attempt
                assert refused.value.status_code in (403, 404)
            with pytest.raises(openai.PermissionDeniedError):
                await as_bob.responses.retrieve(mine.id, stream=True)
        async with openai_client(server, certs, api_key=alice) as as_alice:
            still = await as_alice.responses.retrieve(mine.id)
    assert still.status == mine.status and still.output_text == mine.output_text


async def test_a_conversation_over_the_context_is_refused_unless_truncation_is_auto(engine, certs):
    max_tokens = engine.context_per_sequence - 400
    history: list[dict[str, str]] = []
    for i in range(12):
        history.append({"role": "user", "content": f"Tell me fact number {i} about lighthouses."})
        history.append({"role": "assistant", "content": f"Fact {i}: " + "a tall tower. " * 8})
    history.append({"role": "user", "content": "Which fact was the most surprising?"})
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        params = dict(
            model=await _model(server),
            instructions="You answer in one short sentence.",
            input=history,
            max_output_tokens=max_tokens,
            background=True,
        )
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.create(**params)
        assert refused.value.status_code == 413 and "truncation" in str(refused.value.message)
        started = await client.responses.create(**params, truncation="auto")
        cancelled = await client.responses.cancel(started.id)
    assert started.truncation == "auto" and started.status in ("queued", "in_progress")
    assert cancelled.status in ("cancelled", "completed", "incomplete")
    assert 0 < cancelled.usage.input_tokens <= engine.context_per_sequence - max_tokens


async def test_bad_requests_get_clear_errors(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        model = await _model(server)
        cases: list[tuple[dict[str, Any], str]] = [
            ({"tools": [{"type": "web_search"}]}, "tools[0]"),
            ({"reasoning": {"effort": "high"}}, "reasoning"),
            ({"background": True, "store": False}, "store"),
            ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
            ({"metadata": {"k" * 65: "v"}}, "metadata"),
            ({"truncation": "sometimes"}, "truncation"),
        ]
        for changes, param in cases:
            body = {"model": model, "input": "hi", **changes}
            with pytest.raises(openai.BadRequestError) as bad:
                await client.responses.create(**body)
            assert bad.value.body["param"] == param, changes
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_nothing")
        with pytest.raises(openai.BadRequestError):
            await client.responses.retrieve(
                "resp_" + "00" * 16, stream=True, extra_query={"starting_after": "-3"}
            )


async def test_niquests_over_http3_streams_resumes_and_reads_a_response(engine, certs):
    async with running_server(engine, certs) as server:
        url = base_url(server) + "/v1/responses"
        body = {"model": await _model(server), "input": QUESTION, "max_output_tokens": 24}
        async with h3_session(certs) as h3:
            response, events = await h3_stream(h3, "POST", url, json={**body, "stream": True})
            response_id = events[0].json["response"]["id"]
            tail_response, tail = await h3_stream(
                h3, "GET", f"{url}/{response_id}?stream=true&starting_after=10"
            )
            by_header, resumed = await h3_stream(
                h3, "GET", f"{url}/{response_id}?stream=true", headers={"last-event-id": "10"}
            )
            stored = await h3.get(f"{url}/{response_id}")
    assert response.http_version == tail_response.http_version == 30
    assert response.headers["content-type"] == "text/event-stream"
    numbers = [e.json["sequence_number"] for e in events]
    assert numbers == list(range(len(events))) and [e.id for e in events] == [
        str(n) for n in numbers
    ]
    assert [e.data for e in tail] == [e.data for e in events[11:]] == [e.data for e in resumed]
    assert by_header.status_code == 200
    final = events[-1].json["response"]
    assert stored.json()["output"] == final["output"] and stored.json()["usage"] == final["usage"]


async def test_a_background_response_left_unfinished_by_a_restart_finishes_after_it(engine, certs):
    with tempfile.TemporaryDirectory(prefix="quicsrv-test-") as scratch:
        data_dir = Path(scratch)

        def settings() -> Any:
            return session_settings(data_dir)

        # Long enough (no end of text) that the server is gone before the answer is done.
        params: dict[str, Any] = {
            "input": QUESTION,
            "max_output_tokens": 400,
            "extra_body": {"ignore_eos": True},
            **GREEDY,
        }
        async with running_server(engine, certs, data_dir=data_dir, sessions=settings()) as one:
            params["model"] = await _model(one)
            async with openai_client(one, certs) as client:
                stream = await client.responses.create(**params, background=True, stream=True)
                first = await _read(stream, stop_after=8)
        # The first server shut down (its sessions paused and handed over) before the end.
        response_id = first[0].response.id
        async with running_server(engine, certs, data_dir=data_dir, sessions=settings()) as two:
            session = two.sessions.live(_session_id(response_id))
            assert session is not None and session.unattended  # started again on its own
            await asyncio.wait_for(session.idle.wait(), 120)
            async with openai_client(two, certs) as client:
                stored = await client.responses.retrieve(response_id)
                rest = await _read(
                    await client.responses.retrieve(
                        response_id, stream=True, starting_after=first[-1].sequence_number
                    )
                )
    assert stored.output_text == _text(first + rest) and _text(first)
    assert stored.status == "incomplete" and stored.usage.output_tokens == 400
