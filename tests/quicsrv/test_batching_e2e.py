"""Continuous batching through the server: concurrency, batch independence, overload."""

from __future__ import annotations

import asyncio

import pytest

from quicsrv.engine.llama import LlamaEngine
from quicsrv.settings import engine_settings_for
from quicsrv_client import Client, ServerError, SessionStarted
from quicsrv_proto import ErrorCode
from tests.helpers import running_server

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

PROMPTS = [f"Tell me a short fact about the number {n}." for n in range(8)]


async def _run_all(port: int, ca, max_tokens: int) -> list[tuple[int, ...]]:
    async with Client("127.0.0.1", port, ca=ca) as c:
        results = await asyncio.gather(
            *(c.generate_text(p, max_tokens=max_tokens, ignore_eos=True) for p in PROMPTS)
        )
    return [r.token_ids for r in results]


async def test_eight_concurrent_greedy_generations_complete(engine, certs):
    async with running_server(engine, certs) as server:
        outputs = await _run_all(server.port, certs.ca_cert, 48)
    assert [len(o) for o in outputs] == [48] * 8


async def test_batch_invariant_output_equals_single_stream_output(
    model_path, certs, cpu_extra_buffers
):
    engine = LlamaEngine(
        engine_settings_for(model_path, batch_invariant=True, cpu_extra_buffers=cpu_extra_buffers)
    )
    try:
        async with running_server(engine, certs) as server:
            together = await _run_all(server.port, certs.ca_cert, 32)
            async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
                alone = [
                    (await c.generate_text(p, max_tokens=32, ignore_eos=True)).token_ids
                    for p in PROMPTS
                ]
    finally:
        engine.close()
    assert together == alone


async def test_overloaded_error_and_the_server_stays_healthy(model_path, certs, cpu_extra_buffers):
    engine = LlamaEngine(
        engine_settings_for(
            model_path, n_seq_max=1, max_queued=1, cpu_extra_buffers=cpu_extra_buffers
        )
    )
    try:
        async with running_server(engine, certs) as server:
            gate = server.sessions.gate
            async with (
                Client("127.0.0.1", server.port, ca=certs.ca_cert) as c,
                Client("127.0.0.1", server.port, ca=certs.ca_cert) as other,
            ):
                first = c.generate(PROMPTS[0], max_tokens=1000, ignore_eos=True)
                # The response headers (SessionStarted) come once a request is admitted.
                assert isinstance(await first.__anext__(), SessionStarted)
                second = asyncio.create_task(
                    other.generate_text(PROMPTS[1], max_tokens=8, ignore_eos=True)
                )
                await gate.wait_until(lambda: gate.queued == 1)
                # One slot busy, the one queue place taken: a third client is refused.
                async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as third:
                    with pytest.raises(ServerError) as info:
                        await third.generate_text(PROMPTS[2], max_tokens=8)
                assert info.value.code == ErrorCode.OVERLOADED
                assert info.value.http_status == 503
                assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
                await first.aclose()
                assert len((await second).token_ids) == 8  # the queued one ran once freed
                ok = await c.generate_text(PROMPTS[3], max_tokens=8, ignore_eos=True)
        assert len(ok.token_ids) == 8
    finally:
        engine.close()
