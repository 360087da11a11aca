"""A shared store's outage end to end: Redis killed mid-generation, then started again, with an
append-only file (what Redis confirmed survives) and without (it comes back empty).

The real model and server (``--store`` on a Redis of the test's own), the native client with
its reconnect policy. While Redis is down the reader's stream ends with ERROR
``store_unavailable`` and a retry hint, resumes are refused the same way, and ``/readyz`` says
why; once it is back, the client finishes exactly the text an uninterrupted run gives when the
data survived, and is told ``unknown_session`` when it did not. The server serves on, with
nothing left running or held.
"""

from __future__ import annotations

import asyncio

import pytest

from quicsrv.sessions.manager import SessionManager
from quicsrv.transport import RunningServer
from quicsrv_client import (
    Client,
    GenerationEnded,
    Reconnected,
    ReconnectPolicy,
    ServerError,
    TokenReceived,
)
from quicsrv_proto import ErrorCode
from tests.helpers import running_server, session_settings
from tests.http.helpers import tcp_client
from tests.redis_server import RedisServer, redis_server

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

PROMPT = "The three most important inventions of the last century are"
# Long enough that Redis dies while the server still generates (at ~64-94 tokens/s here, the
# rest after KILL_AT takes over a second); short enough to cost a few seconds in all.
GREEDY = dict(max_tokens=96, ignore_eos=True)
KILL_AT = 4  # tokens received when Redis is killed
WAIT_S = 120.0  # bounds a broken test; nothing waits for it to pass
# Quick retries (the test waits for the second failed resume before it restarts Redis).
POLICY = ReconnectPolicy(max_attempts=50, initial_delay_s=0.01, max_delay_s=2.0)


_REFERENCE: list[int] = []


async def _reference(server: RunningServer, certs) -> list[int]:
    """The tokens of an uninterrupted run (greedy: the same on every server of this engine),
    generated once for both cases."""
    if not _REFERENCE:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            _REFERENCE.extend((await c.generate_text(PROMPT, **GREEDY)).token_ids)
    return list(_REFERENCE)


async def _readyz(server: RunningServer, certs) -> tuple[int, str]:
    async with tcp_client(server, certs) as http:
        answer = await http.get("/readyz")
    return answer.status_code, answer.text


async def _outage(
    server: RunningServer, certs, redis: RedisServer
) -> tuple[list[int], list[Reconnected], GenerationEnded | None, ServerError | None, str]:
    """One generation through a Redis kill at token KILL_AT and a restart once the client's
    second resume was refused; what the client saw and what /readyz said meanwhile."""
    ids: list[int] = []
    reconnects: list[Reconnected] = []
    end: GenerationEnded | None = None
    failure: ServerError | None = None
    readyz = ""
    async with Client("127.0.0.1", server.port, ca=certs.ca_cert, reconnect=POLICY) as client:
        try:
            async for event in client.generate(PROMPT, **GREEDY):
                if isinstance(event, TokenReceived):
                    ids.append(event.token_id)
                    if len(ids) == KILL_AT:
                        await asyncio.to_thread(redis.stop)  # SIGKILL
                elif isinstance(event, Reconnected):
                    reconnects.append(event)
                    if len(reconnects) == 2:  # one resume refused while Redis was down
                        status, text = await _readyz(server, certs)
                        readyz = f"{status} {text}"
                        await asyncio.to_thread(redis.restart)
                elif isinstance(event, GenerationEnded):
                    end = event
        except ServerError as exc:
            failure = exc
    return ids, reconnects, end, failure, readyz


async def _nothing_left(server: RunningServer) -> None:
    """Every slot given back and every session object gone from memory (bounded wait on the
    gate's own condition)."""
    sessions = server.sessions
    await sessions.gate.wait_until(lambda: sessions.gate.active == 0 and sessions.gate.queued == 0)
    async with asyncio.timeout(WAIT_S):
        for session in list(sessions._live):  # noqa: SLF001 - what is left is the point
            await session.idle.wait()
    assert sessions.facts().live == 0


@pytest.mark.parametrize("append_only", [True, False], ids=["aof", "no-persistence"])
async def test_a_redis_outage_mid_generation_is_ridden_out(engine, certs, tmp_path, append_only):
    with redis_server(append_only=append_only) as redis:
        sessions = SessionManager(engine, session_settings(tmp_path, store_url=redis.url))
        async with running_server(engine, certs, sessions=sessions, store=redis.url) as server:
            reference = await _reference(server, certs)
            async with asyncio.timeout(WAIT_S):
                ids, reconnects, end, failure, readyz = await _outage(server, certs, redis)
            # While Redis was down: the stream's ERROR and the refused resume, each with its
            # hint, became reconnects; /readyz said why the server could not serve.
            assert len(reconnects) >= 2, "the generation ended before Redis was killed"
            first, second = reconnects[:2]
            assert first.last_index >= KILL_AT - 1 and second.last_index == first.last_index
            assert "store_unavailable" in first.error and "store_unavailable" in second.error
            # The server's retry hint (1 s) over the policy's backoff (0.01 s, then 0.02 s).
            assert first.delay_s >= 1.0 and second.delay_s >= 1.0
            assert readyz.startswith("503 ") and "session store" in readyz, readyz
            if append_only:
                # What Redis confirmed survived: the generation finishes, exactly.
                assert failure is None and end is not None
                assert ids == reference
            else:
                # Redis came back empty: the session is gone, said so; nothing wrong was sent.
                assert end is None and failure is not None
                assert failure.code == ErrorCode.UNKNOWN_SESSION
                assert ids == reference[: len(ids)]
            await _nothing_left(server)
            # The server serves on, and says it is ready again.
            async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
                again = await c.generate_text(PROMPT, max_tokens=4, ignore_eos=True)
            assert list(again.token_ids) == reference[:4]
            assert await _readyz(server, certs) == (200, "ready\n")
