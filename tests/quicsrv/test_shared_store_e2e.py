"""Several server processes sharing one real Redis: a generation started on one continues
exactly on another (KV restore when the paused blob is shared, exact replay after a kill -9),
the newest attach wins across processes, and a TLS ticket is used once, wherever."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import QuicEvent, StreamDataReceived
from aioquic.tls import SessionTicket

import quicsrv_proto
from quicsrv.devcerts import DevCertPaths
from quicsrv_client import Client, GenerationEnded, ResumePosition, SessionStarted, TokenReceived
from tests.helpers import server_process

pytestmark = [pytest.mark.model, pytest.mark.asyncio, pytest.mark.slow]

PROMPT = "The three most important inventions of the last century are"
GREEDY = dict(max_tokens=48, ignore_eos=True)
SEEDED = dict(max_tokens=48, temperature=0.8, top_k=40, seed=11, ignore_eos=True)
WAIT_S = 60.0  # bounds a broken test; nothing waits for it to pass


@contextlib.asynccontextmanager
async def _servers(
    certs: DevCertPaths, tmp_path: Path, redis_url: str, n: int = 2
) -> AsyncIterator[list[tuple[object, int]]]:
    """``n`` quicsrv processes, own data directories, one Redis store."""
    async with contextlib.AsyncExitStack() as stack:
        started = []
        for i in range(n):
            started.append(
                await stack.enter_async_context(
                    server_process(
                        certs,
                        tmp_path / f"node-{i}",
                        extra=["--store", redis_url, "--threads", "1"],
                    )
                )
            )
        yield started


async def _run(port: int, ca: Path, **params) -> tuple[list[int], str]:
    async with Client("127.0.0.1", port, ca=ca) as c:
        result = await c.generate_text(PROMPT, **params)
    return list(result.token_ids), result.text


async def _start_and_cut(port: int, ca: Path, cut: int, **params):
    """Generate until token ``cut - 1``, then drop the connection; the position and tokens."""
    ids: list[int] = []
    text: list[str] = []
    client = Client("127.0.0.1", port, ca=ca)
    await client.connect()
    generation = client.generate(PROMPT, **params)
    async for event in generation:
        if isinstance(event, TokenReceived):
            ids.append(event.token_id)
            text.append(event.text)
            if len(ids) == cut:
                break
    return client, generation, ids, text


async def _resume(port: int, ca: Path, position: ResumePosition):
    ids: list[int] = []
    text: list[str] = []
    started: SessionStarted | None = None
    end: GenerationEnded | None = None
    async with Client("127.0.0.1", port, ca=ca) as c:
        async for event in c.resume_from(position):
            if isinstance(event, SessionStarted):
                started = event
            elif isinstance(event, TokenReceived):
                ids.append(event.token_id)
                text.append(event.text)
            elif isinstance(event, GenerationEnded):
                end = event
                text.append(event.text)
    assert started is not None and end is not None
    return started, ids, "".join(text), end


def _https(certs: DevCertPaths, port: int) -> httpx.AsyncClient:
    """httpx over TCP to the server on ``port``, trusting the dev CA."""
    from tests.http.helpers import tls_context

    return httpx.AsyncClient(
        base_url=f"https://localhost:{port}", verify=tls_context(certs), timeout=WAIT_S
    )


async def _until_shared(redis_url: str, session_id: str) -> None:
    """Until the paused session's KV blob is in Redis (the pause publishes it a moment after
    the connection closed): polls the condition itself, bounded."""
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        async with asyncio.timeout(WAIT_S):
            while not client.exists(f"quicsrv:s:{session_id}:kv"):
                await asyncio.sleep(0.02)
    finally:
        client.close()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_a_generation_cut_on_one_process_continues_exactly_on_another(
    certs, tmp_path, redis_url, params
):
    ca = certs.ca_cert
    async with _servers(certs, tmp_path, redis_url) as [(_a, port_a), (_b, port_b)]:
        reference = await _run(port_b, ca, **params)
        client, generation, ids, text = await _start_and_cut(port_a, ca, 20, **params)
        position = generation.position
        await client.close()  # the stream dies: A pauses the sequence and shares its KV
        assert isinstance(position, ResumePosition) and position.last_index == 19
        await _until_shared(redis_url, position.session_id)
        started, more, rest, end = await _resume(port_b, ca, position)
    assert started.resume_path == "kv-restore"  # A's blob, restored by B
    assert ids + more == reference[0]
    assert "".join(text) + rest == reference[1]
    assert end.reason is quicsrv_proto.EndReason.LENGTH


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_kill_9_of_the_owner_then_another_process_replays_exactly(
    certs, tmp_path, redis_url, params
):
    ca = certs.ca_cert
    async with _servers(certs, tmp_path, redis_url) as [(a, port_a), (_b, port_b)]:
        reference = await _run(port_b, ca, **params)
        client, generation, ids, text = await _start_and_cut(port_a, ca, 27, **params)
        a.send_signal(signal.SIGKILL)  # mid-generation: nothing gets to pause or save
        await asyncio.to_thread(a.wait, 30)
        position = generation.position
        await client.close()
        started, more, rest, end = await _resume(port_b, ca, position)
    assert started.resume_path == "replay"  # the KV cells died with A
    assert ids + more == reference[0]
    assert "".join(text) + rest == reference[1]


async def test_a_resume_on_another_process_takes_the_lease_and_supersedes_the_reader(
    certs, tmp_path, redis_url
):
    params = dict(max_tokens=400, ignore_eos=True)
    ca = certs.ca_cert
    async with _servers(certs, tmp_path, redis_url) as [(_a, port_a), (_b, port_b)]:
        reference = await _run(port_b, ca, **params)
        async with Client("127.0.0.1", port_a, ca=ca) as on_a:
            old = on_a.generate(PROMPT, **params)
            old_ids: list[int] = []
            async for event in old:  # reading stops here: A generates ahead, then pauses
                if isinstance(event, TokenReceived):
                    old_ids.append(event.token_id)
                    if len(old_ids) == 10:
                        break_position = old.position
                        break
            assert break_position is not None
            # The same position resumed on B: B takes the session over.
            started, new_ids, _text, end = await _resume(port_b, ca, break_position)
            # A's reader goes on: what A had confirmed, then superseded (A's next write was
            # refused by the lease check), never a token that disagrees with B's.
            old_end = None
            async with asyncio.timeout(WAIT_S):
                async for event in old:
                    if isinstance(event, TokenReceived):
                        old_ids.append(event.token_id)
                    elif isinstance(event, GenerationEnded):
                        old_end = event
    assert started.resume_path in ("kv-restore", "replay")
    assert end.reason is quicsrv_proto.EndReason.LENGTH
    assert old_ids[:10] + new_ids == reference[0]
    assert old_ids == reference[0][: len(old_ids)]
    assert old_end is not None and old_end.reason is quicsrv_proto.EndReason.SUPERSEDED
    assert len(old_ids) < len(reference[0])


class _QuietProtocol(QuicConnectionProtocol):
    """aioquic's protocol without wrapping every stream in an unused StreamReader/Writer."""

    def quic_event_received(self, event: QuicEvent) -> None:
        if not isinstance(event, StreamDataReceived):
            super().quic_event_received(event)


async def _ticket(port: int, ca: Path) -> SessionTicket:
    tickets: list[SessionTicket] = []
    async with connect(
        "127.0.0.1",
        port,
        configuration=_client_configuration(ca),
        create_protocol=_QuietProtocol,
        session_ticket_handler=tickets.append,
    ) as protocol:
        await protocol.ping()  # a round trip after the handshake: the ticket has arrived
    assert tickets
    return tickets[0]


def _client_configuration(ca: Path, ticket: SessionTicket | None = None) -> QuicConfiguration:
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    configuration.load_verify_locations(str(ca))
    configuration.server_name = "localhost"
    configuration.session_ticket = ticket
    return configuration


async def _resumed_with(port: int, ca: Path, ticket: SessionTicket) -> bool:
    """Connect presenting ``ticket``; whether the server resumed the TLS session with it."""
    configuration = _client_configuration(ca, ticket)
    async with connect(
        "127.0.0.1", port, configuration=configuration, create_protocol=_QuietProtocol
    ) as p:
        await p.ping()
        return bool(p._quic.tls.session_resumed)


async def test_a_ticket_from_one_process_is_accepted_once_by_any(certs, tmp_path, redis_url):
    ca = certs.ca_cert
    async with _servers(certs, tmp_path, redis_url) as [(_a, port_a), (_b, port_b)]:
        ticket = await _ticket(port_a, ca)
        assert await _resumed_with(port_b, ca, ticket)  # issued by A, honoured by B
        # Used: neither process accepts it again (a replayed first flight gets no 0-RTT).
        assert not await _resumed_with(port_a, ca, ticket)
        assert not await _resumed_with(port_b, ca, ticket)
        fresh = await _ticket(port_b, ca)
        assert await _resumed_with(port_a, ca, fresh)


async def test_an_sse_stream_cut_on_one_process_resumes_on_another(certs, tmp_path, redis_url):
    """The OpenAI API's resumable SSE over the shared store: a chat stream started on process
    A, cut, continued on process B by its Last-Event-ID (B takes the session over), and then
    stopped on A with DELETE (A takes it back): the text equals an uninterrupted run."""
    from tests.http.helpers import cut_and_resume, events_text

    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": "Name three rivers."}],
        "max_tokens": 32,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    async with _servers(certs, tmp_path, redis_url) as [(_a, port_a), (_b, port_b)]:
        async with _https(certs, port_a) as on_a, _https(certs, port_b) as on_b:
            cut = await cut_and_resume(
                on_a, "/v1/chat/completions", body, stop_after=6, resume_on=on_b
            )
        reference, before, after = cut.whole, cut.before, cut.after
        async with _https(certs, port_a) as on_a:
            stopped = await on_a.delete(f"/v1/streams/{cut.session}")
    assert events_text(reference) == events_text(before) + events_text(after)
    assert after[-1].data == "[DONE]"
    assert stopped.status_code == 200, stopped.text
    assert stopped.json()["status"] == "finished"


async def test_a_background_response_is_resumed_read_chained_and_deleted_on_any_process(
    certs, tmp_path, redis_url
):
    """The Responses API over the shared store, with the official SDK: a background response
    started on A and cut is read on B from ``starting_after`` (B takes it over), its stored
    object is read on A from Redis, A continues the conversation with
    ``previous_response_id``, and a deletion on B is seen on A."""
    import openai

    from tests.http.helpers import tls_context

    params = dict(
        model="SmolLM2-135M-Instruct.Q4_1",
        input="Name three rivers.",
        max_output_tokens=32,
        temperature=0,
    )

    def sdk(port: int) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"https://localhost:{port}/v1",
            api_key="unused",
            http_client=openai.DefaultAsyncHttpxClient(verify=tls_context(certs)),
            max_retries=0,
            timeout=WAIT_S,
        )

    async with _servers(certs, tmp_path, redis_url) as [(_a, port_a), (_b, port_b)]:
        async with sdk(port_a) as on_a, sdk(port_b) as on_b:
            whole = await on_a.responses.create(**params)
            stream = await on_a.responses.create(**params, background=True, stream=True)
            before = []
            async for event in stream:
                before.append(event)
                if len(before) == 9:
                    break
            await stream.close()
            response_id = before[0].response.id
            after = [
                event
                async for event in await on_b.responses.retrieve(
                    response_id, stream=True, starting_after=before[-1].sequence_number
                )
            ]
            stored = await on_a.responses.retrieve(response_id)
            follow_up = await on_a.responses.create(
                **{**params, "input": "And three seas?"}, previous_response_id=response_id
            )
            await on_b.responses.delete(response_id)
            with pytest.raises(openai.NotFoundError):
                await on_a.responses.retrieve(response_id)
    events = before + after
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == stored.output_text
    assert stored.status == whole.status
    assert follow_up.previous_response_id == response_id
    assert follow_up.usage.input_tokens > stored.usage.input_tokens + stored.usage.output_tokens


async def test_a_constrained_stream_cut_on_one_process_continues_exactly_on_another(
    certs, tmp_path, redis_url
):
    """Structured output over the shared store: the grammar travels with the record, and
    process B advances it over A's tokens before it goes on."""
    import json

    from tests.http.helpers import cut_and_resume, events_text

    schema = {
        "type": "object",
        "properties": {
            "rivers": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}
        },
        "required": ["rivers"],
        "additionalProperties": False,
    }
    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": "Name three rivers, as JSON."}],
        "max_tokens": 128,  # the schema bounds the answer well below
        "stream": True,
        "temperature": 0.7,
        "seed": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    }
    async with _servers(certs, tmp_path, redis_url) as [(_a, port_a), (_b, port_b)]:
        async with _https(certs, port_a) as on_a, _https(certs, port_b) as on_b:
            cut = await cut_and_resume(
                on_a, "/v1/chat/completions", body, stop_after=6, resume_on=on_b
            )
        reference, before, after = cut.whole, cut.before, cut.after
    assert events_text(before) + events_text(after) == events_text(reference)
    assert len(json.loads(events_text(reference))["rivers"]) <= 3
