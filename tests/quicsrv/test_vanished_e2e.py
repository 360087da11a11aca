"""A shutdown does not wait for a client that vanished without closing its connection (issue 46):
its session is paused with its KV cells saved and its stream ended with END(shutdown) like any
other, the wait for acknowledgements skips the peer that cannot answer, and the session resumes
exactly on the next server. The real model, real QUIC on loopback, two servers on one data
dir."""

from __future__ import annotations

import asyncio

import pytest

from quicsrv_client import Client, GenerationEnded, SessionStarted, TokenReceived
from quicsrv_proto import EndReason
from tests.helpers import running_server, session_settings

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

PROMPT = "The three most important inventions of the last century are"
OTHER = "Write a long story about a lighthouse keeper and the sea."
MAX_TOKENS = 48
GRACE_S = 60.0  # far more than the hand-over needs: what ended the wait is asserted


def vanish(client: Client) -> None:
    """The client's network goes away: nothing it sends leaves, nothing sent to it arrives, and
    no CONNECTION_CLOSE ever tells the server (a killed process, a cable pulled)."""
    protocol = client._protocol
    assert protocol is not None
    protocol.datagram_received = lambda data, addr: None  # type: ignore[method-assign]
    # Its datagrams are dropped at the socket, so its own timers still run (its close ends).
    protocol._transport.sendto = lambda data, addr=None: None  # type: ignore[union-attr]


async def test_a_shutdown_ends_a_vanished_clients_stream_at_once_and_it_resumes_exactly(
    engine, certs, tmp_path
):
    data_dir = tmp_path / "data"
    # A small allowance: the vanished reader's generation pauses itself a few tokens on.
    settings = dict(data_dir=data_dir, sessions=session_settings(data_dir, max_tokens_ahead=4))
    held: dict[int, int] = {}
    live_events: list[object] = []
    async with running_server(engine, certs, **settings) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            reference = await c.generate_text(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
        gone = Client("127.0.0.1", server.port, ca=certs.ca_cert)
        await gone.connect()
        generation = gone.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
        async for event in generation:
            if isinstance(event, TokenReceived):
                held[event.index] = event.token_id
                if len(held) >= 4 and generation.position is not None:
                    break
        position = generation.position
        assert position is not None
        vanish(gone)
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as live:
            async for event in live.generate(OTHER, max_tokens=1000, ignore_eos=True):
                live_events.append(event)
                if isinstance(event, TokenReceived) and event.index == 3:
                    shutting_down = asyncio.ensure_future(server.shutdown(GRACE_S))
            await shutting_down
        handed, drained = server.handed, server.drained
        await gone.aclose()

    assert handed is not None and drained is not None
    # Both streams were told END(shutdown); the live reader got it.
    assert handed.streams_told == 2 and handed.replay == 0
    end = live_events[-1]
    assert isinstance(end, GenerationEnded) and end.reason is EndReason.SHUTDOWN
    # The wait ended because the one peer left had gone quiet, not because the grace period ran
    # out: the live peer acknowledged, the vanished one (its stream 0) was not waited for.
    assert not drained.deadline_passed and drained.cut_short == 0
    assert [q.streams for q in drained.quiet] == [(0,)]
    assert drained.acknowledged >= 1
    # The vanished session's cells were captured and written, without any ACK from it.
    assert (data_dir / "kv" / f"{position.session_id}.kv").exists()

    async with running_server(engine, certs, **settings) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            resumed = c.resume_from(position)
            paths = []
            async for event in resumed:
                if isinstance(event, SessionStarted) and event.resume_path:
                    paths.append(event.resume_path)
                elif isinstance(event, TokenReceived):
                    held[event.index] = event.token_id
    assert paths == ["kv-restore"]
    assert [held[i] for i in range(len(held))] == list(reference.token_ids)
