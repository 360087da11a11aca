"""A generation that keeps killing the engine worker, and a crash loop the engine recovers from.

Real model, real server, real QUIC on loopback; the faults come from the worker's test-only
``QUICSRV_TEST_FAULT`` switch: ``poison:TEXT`` aborts every worker that holds a prompt with TEXT,
``decode-abort:N:M`` aborts the workers before incarnation M at their N-th decode.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from quicsrv.config import CpuExtraBuffers
from quicsrv.engine.restarts import Breaker
from quicsrv.engine.worker import FAULT_ENV
from quicsrv_client import Client, GenerationEnded, ServerError
from quicsrv_proto import ErrorCode
from tests.helpers import running_server, uncached
from tests.quicsrv.test_metrics_e2e import parse, value
from tests.quicsrv.test_worker_e2e import NO_STALL_CLOCK, PROMPTS, Output, _engine

pytestmark = [pytest.mark.model, pytest.mark.asyncio, pytest.mark.slow]

POISON = "zebracorn"
POISONED_PROMPT = f"Describe the {POISON} in one paragraph:"
MAX_TOKENS = 16


async def _run(client: Client, prompt: str, params: dict) -> Output | ServerError:
    output = Output()
    try:
        async for event in client.generate(prompt, **params):
            output.take(event)
    except ServerError as exc:
        return exc
    return output


async def test_a_poison_generation_fails_alone_while_its_neighbours_finish_exactly(
    model_path, certs, monkeypatch, caplog
):
    monkeypatch.setenv(FAULT_ENV, f"poison:{POISON}")
    caplog.set_level(logging.WARNING, logger="quicsrv.engine")
    engine = await asyncio.to_thread(_engine, model_path, cpu_extra_buffers=CpuExtraBuffers.OFF)
    neighbours = PROMPTS[:3]
    params = dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    try:
        # All four at once on one connection: the poison shares the neighbours' batches.
        async with running_server(engine, certs, max_active_per_client=4) as server:
            async with Client(
                "127.0.0.1", server.port, ca=certs.ca_cert, stall_timeout_s=NO_STALL_CLOCK
            ) as client:
                reference = await asyncio.gather(*(_run(client, p, params) for p in neighbours))
                assert engine.worker_deaths == 0  # no poison among them
                *cut, poisoned = await asyncio.gather(
                    *(_run(client, p, params) for p in [*neighbours, POISONED_PROMPT])
                )
                # Refused from now on (while its session object lives), the others carry on.
                again = await client.generate_text(PROMPTS[3], max_tokens=4, ignore_eos=True)
    finally:
        await asyncio.to_thread(engine.close)
    assert isinstance(poisoned, ServerError) and poisoned.code == ErrorCode.ENGINE_UNAVAILABLE
    assert "crashed the engine worker again and again" in str(poisoned)
    for got, want in zip(cut, reference, strict=True):
        assert isinstance(got, Output) and isinstance(want, Output)
        assert got.ids == want.ids  # the same tokens, nothing lost, nothing repeated
        assert got.joined == want.joined
        assert uncached(got.end) == uncached(want.end) and len(got.ids) == MAX_TOKENS
    assert len(again.token_ids) == 4
    assert engine.poisoned_generations == 1
    # Convicted on its second death alone, or on its trial after dying with the others twice.
    assert 2 <= engine.worker_deaths <= 3
    assert all("SIGABRT" in death for death in engine.deaths)
    assert engine.breaker is Breaker.CLOSED and engine.failure is None
    assert sum("POISON" in r.getMessage() for r in caplog.records) == 1


async def test_a_crash_loop_opens_the_breaker_which_half_opens_and_closes(
    model_path, certs, monkeypatch, caplog
):
    # Workers 0, 1 and 2 abort at their 3rd decode: 0 and 1 are a crash loop (one restart
    # allowed), 2 is the first half-open try, 3 recovers.
    monkeypatch.setenv(FAULT_ENV, "decode-abort:3:3")
    caplog.set_level(logging.WARNING, logger="quicsrv.engine")
    engine = await asyncio.to_thread(
        _engine,
        model_path,
        cpu_extra_buffers=CpuExtraBuffers.OFF,
        max_restarts=1,
        breaker_cooldown_s=0.2,
        breaker_probation_steps=4,
        poison_strikes=10,  # the loop is the engine's, not one generation's
    )
    params = dict(max_tokens=12, ignore_eos=True)
    try:
        async with running_server(engine, certs) as server:
            async with Client(
                "127.0.0.1", server.port, ca=certs.ca_cert, stall_timeout_s=NO_STALL_CLOCK
            ) as client:
                refusals: list[ServerError] = []
                async with asyncio.timeout(120):
                    while True:  # what a client does: retry when the server's hint says
                        outcome = await _run(client, PROMPTS[1], params)
                        if isinstance(outcome, Output):
                            break
                        assert outcome.code == ErrorCode.ENGINE_UNAVAILABLE
                        refusals.append(outcome)
                        await asyncio.sleep(outcome.retry_after_s or 0)
                ready = await client.get("/readyz")
                samples = parse((await client.get("/metrics")).text)
    finally:
        await asyncio.to_thread(engine.close)
    assert len(outcome.ids) == 12 and isinstance(outcome.end, GenerationEnded)
    assert len(refusals) >= 2  # the crash loop's generation, and the half-open try's
    assert engine.breaker is Breaker.CLOSED and engine.failure is None
    assert engine.breaker_opens == 2 and engine.worker_deaths == 3
    opened = [r.getMessage() for r in caplog.records if "BREAKER OPEN" in r.getMessage()]
    assert len(opened) == 2
    assert "refused for 0.2s" in opened[0] and "refused for 0.4s" in opened[1]  # doubled
    assert any("breaker CLOSED" in r.getMessage() for r in caplog.records)
    assert ready.status == 200
    assert value(samples, "quicsrv_engine_breaker_state") == 0
    assert value(samples, "quicsrv_engine_breaker_opens_total") == 2
    assert value(samples, "quicsrv_engine_worker_deaths_total") == 3
