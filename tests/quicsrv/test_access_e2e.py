"""Access and fair shares end to end: API keys, per-client limits, deadlines, stalled streams.

The real model, the real server, real QUIC on loopback.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from quicsrv.apikeys import hash_key, new_key
from quicsrv.sessions.lifecycle import SessionState
from quicsrv.transport import RunningServer
from quicsrv_client import (
    Client,
    GenerationEnded,
    Reconnected,
    ReconnectPolicy,
    ServerError,
    SessionStarted,
    StallTimeout,
    TokenReceived,
)
from quicsrv_proto import ErrorCode
from tests.helpers import running_server, session_settings

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

PROMPT = "Write a long story about a lighthouse keeper."
_LONG = 1500  # tokens: hog generations outlast every test step (context: 2048 a sequence)
_NEVER_PAUSE = 4096  # max_tokens_ahead past _LONG: flow control never pauses a generation


async def test_a_missing_or_wrong_key_gets_401_and_the_connection_goes_on(engine, certs):
    key = new_key()
    async with running_server(engine, certs, api_key=key) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert, api_key="") as c:
            for presented in (None, "qs_not-a-key", key[:-1]):
                c.api_key = presented
                with pytest.raises(ServerError) as info:
                    await c.generate_text("Hi", max_tokens=4)
                assert info.value.code == ErrorCode.UNAUTHORIZED
                assert info.value.http_status == 401
            c.api_key = key  # same connection: it survived the refusals
            result = await c.generate_text("Hi", max_tokens=4, ignore_eos=True)
        assert server.app.refusals == {ErrorCode.UNAUTHORIZED: 3}
    assert result.end.completion_tokens == 4


async def test_a_resume_needs_the_key_that_started_the_session(engine, certs, tmp_path: Path):
    alice, bob = new_key(), new_key()
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{hash_key(alice)} alice\n{hash_key(bob)} bob\n")
    async with running_server(engine, certs, api_keys_file=keys_file) as server:
        ca = certs.ca_cert
        async with Client("127.0.0.1", server.port, ca=ca, api_key=alice) as a:
            generation = a.generate(PROMPT, max_tokens=24, ignore_eos=True)
            async for event in generation:
                if isinstance(event, TokenReceived) and event.index == 7:
                    break
            await generation.aclose()
            position = generation.position
            assert position is not None
            async with Client("127.0.0.1", server.port, ca=ca, api_key=bob) as b:
                with pytest.raises(ServerError) as info:
                    async for _ in b.resume_from(position):
                        pass
                assert info.value.code == ErrorCode.SESSION_KEY_MISMATCH
                assert info.value.http_status == 403
            # The refusal cost the session nothing: its owner resumes it to the end.
            indices = []
            end = None
            async for event in a.resume_from(position):
                if isinstance(event, TokenReceived):
                    indices.append(event.index)
                elif isinstance(event, GenerationEnded):
                    end = event
    assert indices == list(range(position.last_index + 1, 24))
    assert end is not None and end.completion_tokens == 24


async def test_a_hog_connection_does_not_starve_another_client(engine, certs, tmp_path: Path):
    sessions = session_settings(tmp_path, max_active_per_client=2, max_queued_per_client=3)
    async with running_server(engine, certs, sessions=sessions) as server:
        ca = certs.ca_cert
        async with Client("127.0.0.1", server.port, ca=ca) as hog:
            started: asyncio.Queue[str] = asyncio.Queue()
            refused: list[ServerError] = []

            async def hog_one() -> None:
                try:
                    async for event in hog.generate(PROMPT, max_tokens=_LONG, ignore_eos=True):
                        if isinstance(event, SessionStarted):
                            await started.put(event.session_id)
                except ServerError as exc:
                    refused.append(exc)
                    await started.put("refused")

            tasks = [asyncio.create_task(hog_one()) for _ in range(10)]
            # 2 run and 3 queue under the hog's caps (each told its session at once); the
            # other 5 are refused at once.
            outcomes = [await started.get() for _ in range(10)]
            assert outcomes.count("refused") == 5
            assert {e.code for e in refused} == {ErrorCode.CLIENT_LIMIT}
            assert {e.http_status for e in refused} == {429}
            assert all(e.retry_after_s is not None and e.retry_after_s > 0 for e in refused)
            gate = server.sessions.gate
            assert gate.active == 2 and gate.queued == 3
            assert gate.refusals_by_code() == {ErrorCode.CLIENT_LIMIT: 5}
            assert server.app.refusals == {ErrorCode.CLIENT_LIMIT: 5}
            # A well-behaved client on another connection is served while the hog runs.
            async with Client("127.0.0.1", server.port, ca=ca) as polite:
                result = await polite.generate_text("Hi", max_tokens=8, ignore_eos=True)
            assert result.end.completion_tokens == 8
            assert gate.queued == 3  # the hog's queued requests are still waiting
            assert sum(not t.done() for t in tasks) == 5
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # Cancelled streams give their slots and places back.
        await gate.wait_until(lambda: gate.active == 0 and gate.queued == 0)


async def test_a_freed_slot_goes_to_another_clients_first_request_before_the_hogs_queue(
    engine, certs, tmp_path: Path
):
    # The hog may take every slot here, so the newcomer has to wait in the queue behind it.
    slots = engine.n_seq_max
    sessions = session_settings(
        tmp_path,
        max_active_per_client=slots,
        max_queued_per_client=3,
        max_tokens_ahead=_NEVER_PAUSE,  # unread streams keep their slots
    )
    async with running_server(engine, certs, sessions=sessions) as server:
        ca = certs.ca_cert
        gate = server.sessions.gate
        async with (
            Client("127.0.0.1", server.port, ca=ca) as hog,
            Client("127.0.0.1", server.port, ca=ca) as newcomer,
        ):
            running = [
                hog.generate(PROMPT, max_tokens=_LONG, ignore_eos=True) for _ in range(slots)
            ]
            for generation in running:
                assert isinstance(await generation.__anext__(), SessionStarted)
            hog_queued = [
                asyncio.create_task(hog.generate_text(PROMPT, max_tokens=4)) for _ in range(3)
            ]
            await gate.wait_until(lambda: gate.queued == 3)
            late = newcomer.generate("Hi", max_tokens=8, ignore_eos=True)
            first = asyncio.create_task(late.__anext__())
            await gate.wait_until(lambda: gate.queued == 4)  # queued last, behind the hog's 3
            started = await first  # told its session at once, while it waits in line
            assert isinstance(started, SessionStarted)
            session = server.sessions.live(bytes.fromhex(started.session_id))
            assert session is not None and session.state is SessionState.QUEUED
            await running[0].aclose()  # one slot comes free
            await gate.wait_until(lambda: gate.queued == 3)
            assert gate.queued_for(session.client) == 0  # the newcomer got it
            assert gate.queued == 3  # the hog's queued requests all still wait
            assert not any(t.done() for t in hog_queued)
            tokens = [e async for e in late if isinstance(e, TokenReceived)]
            assert len(tokens) == 8
            for generation in running[1:]:
                await generation.aclose()
            for task in hog_queued:
                task.cancel()
            await asyncio.gather(*hog_queued, return_exceptions=True)
        await gate.wait_until(lambda: gate.active == 0 and gate.queued == 0)


async def test_a_returning_session_goes_before_a_queued_new_request(engine, certs, tmp_path: Path):
    slots = engine.n_seq_max
    sessions = session_settings(
        tmp_path, max_active_per_client=slots, max_tokens_ahead=_NEVER_PAUSE
    )
    async with running_server(engine, certs, sessions=sessions) as server:
        ca = certs.ca_cert
        gate = server.sessions.gate
        async with (
            Client("127.0.0.1", server.port, ca=ca) as hog,
            Client("127.0.0.1", server.port, ca=ca) as newcomer,
        ):
            paused = hog.generate(PROMPT, max_tokens=_LONG, ignore_eos=True)
            async for event in paused:
                if isinstance(event, TokenReceived) and event.index == 3:
                    break
            await paused.aclose()
            position = paused.position
            assert position is not None
            await gate.wait_until(lambda: gate.active == 0)  # the session paused, slot freed
            running = [
                hog.generate(PROMPT, max_tokens=_LONG, ignore_eos=True) for _ in range(slots)
            ]
            for generation in running:
                assert isinstance(await generation.__anext__(), SessionStarted)
            # A new request from a client running nothing, then the hog's session comes back.
            fresh = asyncio.create_task(newcomer.generate_text("Hi", max_tokens=4))
            await gate.wait_until(lambda: gate.queued == 1)
            resumed = hog.resume_from(position)
            first = asyncio.create_task(resumed.__anext__())
            await gate.wait_until(lambda: gate.queued == 2)  # the session waits for a slot
            await running[0].aclose()  # one slot comes free: the returning session takes it
            await gate.wait_until(lambda: gate.queued == 1)
            assert gate.queued_new == 1 and not fresh.done()  # the new request still waits
            assert gate.active == slots
            await first
            await resumed.aclose()
            for generation in running[1:]:
                await generation.aclose()
            assert len((await fresh).token_ids) == 4
        await gate.wait_until(lambda: gate.active == 0 and gate.queued == 0)


async def test_a_request_that_cannot_start_in_time_gets_deadline_exceeded(
    engine, certs, tmp_path: Path
):
    sessions = session_settings(tmp_path, max_active_per_client=1, max_queue_wait_s=0.2)
    async with running_server(engine, certs, sessions=sessions) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            long = c.generate(PROMPT, max_tokens=_LONG, ignore_eos=True)
            async for event in long:
                if isinstance(event, TokenReceived):
                    break  # it runs and holds this client's only slot
            # Its own deadline, then the server's queue-wait bound.
            for deadline_ms in (50, None):
                with pytest.raises(ServerError) as info:
                    await c.generate_text("Hi", max_tokens=4, deadline_ms=deadline_ms)
                # Told in the stream it was given at once (with its session id), not as a
                # status: the place in line was taken before the wait.
                assert info.value.code == ErrorCode.DEADLINE_EXCEEDED
                assert info.value.http_status == 200
            gate = server.sessions.gate
            assert gate.queued == 0  # the places were given up
            await long.aclose()
            # The slot comes back and the next request starts.
            result = await c.generate_text("Hi", max_tokens=4, ignore_eos=True, deadline_ms=60_000)
    assert result.end.completion_tokens == 4


def _stall_stream_of(server: RunningServer, session_id: str) -> None:
    """Make the server stop writing this session's frames to its current stream, while the
    connection stays up (PINGs and ACKs flow): a stalled stream, as seen by the client."""
    session = server.sessions.live(bytes.fromhex(session_id))
    assert session is not None and session._attachment is not None
    port = session._attachment.port
    port.send_frame = lambda frame, end_stream: None  # type: ignore[method-assign]
    port.send_frames = lambda frames: None  # type: ignore[method-assign]


async def test_a_stalled_stream_is_resumed_and_the_output_is_exact(engine, certs):
    async with running_server(engine, certs) as server:
        ca = certs.ca_cert
        async with Client("127.0.0.1", server.port, ca=ca) as c:
            reference = await c.generate_text(PROMPT, max_tokens=40, ignore_eos=True)
        # The stall clock is set only while the injected stall holds: on a loaded machine any
        # other threshold could also trip on a slow token, and this test measures no speed.
        client = Client(
            "127.0.0.1",
            server.port,
            ca=ca,
            stall_timeout_s=None,
            reconnect=ReconnectPolicy(initial_delay_s=0.01),
        )
        texts: list[str] = []
        reconnects: list[Reconnected] = []
        async with client as c:
            generation = c.generate(PROMPT, max_tokens=40, ignore_eos=True)
            async for event in generation:
                if isinstance(event, TokenReceived):
                    texts.append(event.text)
                    if event.index == 5 and not reconnects:
                        assert generation.session_id is not None
                        _stall_stream_of(server, generation.session_id)
                        c.config = c.config.replace(stall_timeout_s=2.0)
                elif isinstance(event, Reconnected):
                    reconnects.append(event)
                    c.config = c.config.replace(stall_timeout_s=None)
                elif isinstance(event, GenerationEnded):
                    texts.append(event.text)
    assert len(reconnects) == 1
    assert "no event for 2 s" in reconnects[0].error
    assert "".join(texts) == reference.text


async def test_a_stall_without_auto_resume_is_a_clear_error(engine, certs):
    async with running_server(engine, certs) as server:
        async with Client(
            "127.0.0.1", server.port, ca=certs.ca_cert, stall_timeout_s=None, reconnect=None
        ) as c:
            generation = c.generate(PROMPT, max_tokens=200, ignore_eos=True)
            with pytest.raises(StallTimeout, match="connection is alive"):
                async for event in generation:
                    if isinstance(event, TokenReceived) and event.index == 3:
                        assert generation.session_id is not None
                        _stall_stream_of(server, generation.session_id)
                        # The clock runs from here only: slow tokens before cannot trip it.
                        c.config = c.config.replace(stall_timeout_s=2.0)
            position = generation.position
        assert position is not None and position.last_index >= 3
        # Nothing was lost: the session resumes from where the client stopped.
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            resumed = c.resume_from(position)
            first = None
            async for event in resumed:
                if isinstance(event, TokenReceived):
                    first = event.index
                    break
            await resumed.aclose()
    assert first == position.last_index + 1


async def test_without_keys_the_warning_names_the_bound_port(engine, certs, caplog):
    with caplog.at_level(logging.WARNING, logger="quicsrv"):
        async with running_server(engine, certs) as server:  # port 0: the OS picks
            port = server.port
    warnings = [r.getMessage() for r in caplog.records if "NO API KEY" in r.getMessage()]
    assert len(warnings) == 1
    assert f"anyone who reaches 127.0.0.1:{port} can generate" in warnings[0]
