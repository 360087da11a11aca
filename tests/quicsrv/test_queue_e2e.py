"""End to end: a generation that waits in line for a slot is never silent and never lost.

The test holds every engine slot itself (through the server's gate), so a new request must
wait in line; then the real model, the real server, real clients: the SSE one over TCP, the
native one over QUIC. Texts are compared with an uninterrupted run of the same request.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from quicsrv.sessions.admission import Slot
from quicsrv.sessions.lifecycle import SessionState
from quicsrv.transport import RunningServer
from quicsrv_client import CheckpointReceived, Client, SessionStarted, TokenReceived
from tests.helpers import running_server, session_settings
from tests.http.helpers import events_text, parse_sse, tcp_client, tcp_stream

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

PROMPT = "Once upon a time"


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


async def test_an_sse_stream_in_line_has_its_session_at_once_keeps_alive_and_resumes_after_a_cut(
    engine, certs, tmp_path: Path
):
    body = {
        "model": "",
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sessions = session_settings(tmp_path)
    async with running_server(engine, certs, sessions=sessions, sse_keepalive_s=0.05) as server:
        body["model"] = server.app.router.model_id
        gate = server.sessions.gate
        async with tcp_client(server, certs) as tcp, _every_slot_taken(server) as slots:
            lines: list[str] = []
            async with tcp.stream("POST", "/v1/completions", json=body) as response:
                session_id = response.headers["quicsrv-session"]
                async for line in response.aiter_lines():
                    lines.append(line)
                    if lines.count(": keep-alive") == 2:
                        break  # the proxy between gives up here: the stream is cut
            session = server.sessions.live(bytes.fromhex(session_id))
            assert session is not None and session.state is SessionState.QUEUED
            assert response.status_code == 200 and gate.queued == 1
            opening = parse_sse(lines)
            assert opening[0].id is not None and opening[0].json["choices"][0]["text"] == ""
            assert [e for e in opening if e.data and e.data != "{}"] == opening[:1]
            # The cut cost the place nothing: the client comes back while it still waits.
            resumed = tcp.stream(
                "GET", f"/v1/streams/{session_id}", headers={"last-event-id": opening[0].id}
            )
            async with resumed as stream:
                assert stream.status_code == 200
                after: list[str] = []
                async for line in stream.aiter_lines():
                    after.append(line)
                    if line == ": keep-alive" and slots:  # still in line, and kept alive
                        assert gate.queued == 1 and session.state is SessionState.QUEUED
                        for slot in slots:
                            slot.release()  # the turn comes
                        slots.clear()
            assert gate.queued == 0
        async with tcp_client(server, certs) as tcp:
            _, reference = await tcp_stream(tcp, "POST", "/v1/completions", json=body)
    events = parse_sse(after)
    assert events_text(reference) == events_text(opening) + events_text(events)
    assert events[-1].data == "[DONE]" and opening[0].id not in {e.id for e in events}


async def test_a_native_generation_in_line_is_started_at_once_and_resumes_after_a_cut(
    engine, certs, tmp_path: Path
):
    async with running_server(engine, certs, sessions=session_settings(tmp_path)) as server:
        gate = server.sessions.gate
        ca = certs.ca_cert
        async with Client("127.0.0.1", server.port, ca=ca) as client:
            reference = await client.generate_text(PROMPT, max_tokens=12, ignore_eos=True)
            async with _every_slot_taken(server) as slots:
                waiting = client.generate(PROMPT, max_tokens=12, ignore_eos=True)
                started = await waiting.__anext__()
                assert isinstance(started, SessionStarted)  # before the wait...
                checkpoint = await waiting.__anext__()
                assert isinstance(checkpoint, CheckpointReceived) and checkpoint.index == -1
                await waiting.aclose()  # cut while in line
                position = waiting.position
                assert position is not None and position.last_index == -1
                session = server.sessions.live(bytes.fromhex(started.session_id))
                assert session is not None and session.state is SessionState.QUEUED
                assert gate.queued == 1  # the place is kept
                resumed = client.resume_from(position)
                assert isinstance(await resumed.__anext__(), SessionStarted)
                assert session.attached and session.state is SessionState.QUEUED
                for slot in slots:
                    slot.release()  # the turn comes, to the reader that came back
                tokens = [e async for e in resumed if isinstance(e, TokenReceived)]
    assert [t.index for t in tokens] == list(range(12))
    assert [t.token_id for t in tokens] == list(reference.token_ids)
