"""``quicsrv serve --workers 2``: two processes on one port (SO_REUSEPORT) sharing Redis. A
generation hops between them, one new connection per hop, and stays exact; a kill -9 of the
worker that owns it changes nothing either."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import redis

from quicsrv_client import Client, GenerationEnded, ResumePosition, TokenReceived
from tests.helpers import server_process

pytestmark = [pytest.mark.model, pytest.mark.asyncio, pytest.mark.slow]

PROMPT = "A short story about a lighthouse keeper:"
PARAMS = dict(max_tokens=160, temperature=0.7, top_k=40, seed=3, ignore_eos=True)
HOP_TOKENS = 4
MAX_HOPS = 30  # each hop lands on either worker: both are seen long before (2^-29 otherwise)


def _owner_pid(client: redis.Redis, session_id: str) -> int:
    owner = client.get(f"quicsrv:s:{session_id}:lease")
    assert owner is not None
    return int(owner.decode().split(":")[1])  # host:pid:random


async def _hop(port: int, ca: Path, position: ResumePosition | None, n: int | None):
    """One new connection: start (or resume) and read ``n`` tokens (None: to the end)."""
    ids: list[int] = []
    async with Client("127.0.0.1", port, ca=ca) as c:
        generation = c.generate(PROMPT, **PARAMS) if position is None else c.resume_from(position)
        async for event in generation:
            if isinstance(event, TokenReceived):
                ids.append(event.token_id)
                if n is not None and len(ids) == n:
                    break
            elif isinstance(event, GenerationEnded):
                break
        return ids, generation.position, generation


async def test_a_generation_hops_between_workers_and_survives_a_kill_9(certs, tmp_path, redis_url):
    ca = certs.ca_cert
    client = redis.Redis.from_url(redis_url)
    extra = ["--store", redis_url, "--workers", "2"]
    async with server_process(certs, tmp_path, extra=extra) as (process, port):
        assert process.stdout is not None
        async with Client("127.0.0.1", port, ca=ca) as c:
            reference = list((await c.generate_text(PROMPT, **PARAMS)).token_ids)
        ids, position, _ = await _hop(port, ca, None, HOP_TOKENS)
        owners = {_owner_pid(client, position.session_id)}
        hops = 0
        while len(owners) < 2:
            hops += 1
            assert hops <= MAX_HOPS, "every connection reached the same worker"
            more, position, _ = await _hop(port, ca, position, HOP_TOKENS)
            ids += more
            owners.add(_owner_pid(client, position.session_id))

        # A reader on a new connection; the worker serving it (the owner now) is killed.
        reader = Client("127.0.0.1", port, ca=ca)
        await reader.connect()
        generation = reader.resume_from(position)
        async for event in generation:
            if isinstance(event, TokenReceived):
                ids.append(event.token_id)
                break
        position = generation.position
        victim = _owner_pid(client, position.session_id)
        os.kill(victim, signal.SIGKILL)
        await reader.close()
        rest, _, last = await _hop(port, ca, position, None)
        ids += rest
    assert ids == reference
    assert last.resume_path in ("replay", "kv-restore")
    assert hops >= 1 and len(owners) == 2
