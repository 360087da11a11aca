"""The engine worker process under fire: kill -9, a crashing canary, a hang, a crash loop.

Real model, real server, real QUIC on loopback. The faults the tests cannot cause from outside
(a native crash inside the canary or inside ``llama_decode``, a hang) come from the worker's
test-only ``QUICSRV_TEST_FAULT`` switch; a SIGKILL is the real thing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from quicsrv.config import CpuExtraBuffers
from quicsrv.engine import EngineUnavailable
from quicsrv.engine.restarts import Breaker
from quicsrv.engine.supervisor import WorkerEngine
from quicsrv.engine.worker import FAULT_ENV
from quicsrv.settings import engine_settings_for, supervisor_settings_for
from quicsrv_client import Client, GenerationEnded, ServerError, SessionStarted, TokenReceived
from quicsrv_proto import ErrorCode
from tests.helpers import running_server, uncached

#: A worker's replacement may take any time on a loaded machine; what these tests check is that
#: the server's output is exact after it, not the client's stall detection (test_access_e2e).
NO_STALL_CLOCK = None

pytestmark = [pytest.mark.model, pytest.mark.asyncio, pytest.mark.slow]

PROMPTS = [
    "The three most important inventions of the last century are",
    "Write a short poem about the sea:",
    "Explain how a bicycle works.",
    "List five fruits and their colours:",
]
MAX_TOKENS = 40


@dataclass
class Output:
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    end: GenerationEnded | None = None

    def take(self, event: object) -> None:
        if isinstance(event, TokenReceived):
            self.ids.append(event.token_id)
            self.text.append(event.text)
        elif isinstance(event, GenerationEnded):
            self.text.append(event.text)
            self.end = event

    @property
    def joined(self) -> str:
        return "".join(self.text)


def _engine(model_path: Path, **supervision: object) -> WorkerEngine:
    # Batch-invariant decoding: after a restart the replayed sequences meet other neighbours
    # in the batch than before, and only this mode makes that irrelevant on every CPU.
    settings = engine_settings_for(model_path, n_seq_max=4, max_queued=4, batch_invariant=True)
    return WorkerEngine(settings, supervisor_settings_for(**supervision))


@pytest.fixture(scope="module")
def worker_engine(model_path: Path) -> Iterator[WorkerEngine]:
    engine = _engine(model_path)
    yield engine
    engine.close()


async def _generate_all(port: int, ca: Path, params: dict, on_token=None) -> list[Output]:
    """The four prompts at once on one connection; ``on_token(stream, index)`` sees each token."""
    outputs = [Output() for _ in PROMPTS]
    async with Client("127.0.0.1", port, ca=ca, stall_timeout_s=NO_STALL_CLOCK) as client:

        async def one(i: int) -> None:
            async for event in client.generate(PROMPTS[i], **params):
                outputs[i].take(event)
                if on_token is not None and isinstance(event, TokenReceived):
                    on_token(i, event.index)

        await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    return outputs


async def _through_the_fault_then_again(engine, certs, prompt: str, max_tokens: int):
    """One generation that meets the armed fault, then the same one on the recovered engine:
    (what the first delivered, the second's result)."""
    params = dict(max_tokens=max_tokens, ignore_eos=True)
    async with running_server(engine, certs) as server:
        async with Client(
            "127.0.0.1", server.port, ca=certs.ca_cert, stall_timeout_s=NO_STALL_CLOCK
        ) as client:
            faulted = Output()
            async for event in client.generate(prompt, **params):
                faulted.take(event)
            return faulted, await client.generate_text(prompt, **params)


@pytest.mark.parametrize(
    "params",
    [dict(temperature=0.0), dict(temperature=0.8, top_k=40, top_p=0.95, seed=21)],
    ids=["greedy", "seeded"],
)
async def test_kill_9_of_the_worker_while_4_streams_generate_is_only_a_delay(
    worker_engine, certs, params
):
    params = dict(params, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = worker_engine
    restarts_before = engine.restarts
    async with running_server(engine, certs) as server:
        reference = await _generate_all(server.port, certs.ca_cert, params)
        # The server's loop reads the worker's steps itself (no supervisor-thread hop).
        assert engine.reading_loop is asyncio.get_running_loop()
        killed: list[int] = []

        def kill_once(stream: int, index: int) -> None:
            if stream == 0 and index == 11 and not killed:
                pid = engine.worker_pid
                assert pid is not None
                killed.append(pid)
                os.kill(pid, signal.SIGKILL)

        cut = await _generate_all(server.port, certs.ca_cert, params, on_token=kill_once)
        assert engine.reading_loop is asyncio.get_running_loop()  # and so it does after a restart
    assert killed and engine.worker_pid not in killed
    assert engine.restarts == restarts_before + 1
    assert "died of SIGKILL" in engine.deaths[-1]
    for got, want in zip(cut, reference, strict=True):
        assert got.ids == want.ids  # nothing lost, nothing repeated, the same tokens
        assert got.joined == want.joined
        assert uncached(got.end) == uncached(want.end)
        assert len(got.ids) == MAX_TOKENS


async def test_a_crashing_canary_brings_the_server_up_in_safe_mode(
    model_path, certs, monkeypatch, caplog
):
    monkeypatch.setenv(FAULT_ENV, "canary-crash")
    caplog.set_level(logging.WARNING, logger="quicsrv.engine")
    engine = await asyncio.to_thread(_engine, model_path, max_restarts=1)
    try:
        assert engine.cpu_extra_buffers is False
        assert engine.last_ready is not None and engine.last_ready.cpu_extra_buffers is False
        assert len(engine.deaths) == 1
        assert "SIGSEGV" in engine.deaths[0] and "canary" in engine.deaths[0]
        assert any("SAFE MODE" in r.getMessage() for r in caplog.records)
        async with running_server(engine, certs) as server:
            async with Client(
                "127.0.0.1", server.port, ca=certs.ca_cert, stall_timeout_s=NO_STALL_CLOCK
            ) as client:
                result = await client.generate_text(PROMPTS[0], max_tokens=8, ignore_eos=True)
        assert len(result.token_ids) == 8
    finally:
        await asyncio.to_thread(engine.close)


async def test_with_extra_buffers_forced_on_a_crashing_canary_is_a_clear_start_failure(
    model_path, monkeypatch
):
    monkeypatch.setenv(FAULT_ENV, "canary-crash")
    with pytest.raises(EngineUnavailable, match="SIGSEGV"):
        await asyncio.to_thread(
            _engine, model_path, cpu_extra_buffers=CpuExtraBuffers.ON, max_restarts=1
        )


async def test_a_hung_worker_is_detected_and_replaced(model_path, certs, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang:6")  # the first worker hangs at its 6th decode
    engine = await asyncio.to_thread(_engine, model_path, stall_timeout_s=3.0)
    try:
        hung, reference = await _through_the_fault_then_again(engine, certs, PROMPTS[1], 24)
        assert engine.restarts == 1
        # (On a CPU whose extra buffers crash, deaths[0] is the canary's: safe mode first.)
        assert "hung" in engine.deaths[-1] and "SIGKILL" not in engine.deaths[-1]
        assert hung.ids == list(reference.token_ids)
        assert hung.joined == reference.text
    finally:
        await asyncio.to_thread(engine.close)


async def test_a_failed_decode_restarts_the_worker_and_the_generation_goes_on(
    model_path, certs, monkeypatch
):
    monkeypatch.setenv(FAULT_ENV, "decode-error:5")  # the first worker's 5th decode raises
    engine = await asyncio.to_thread(_engine, model_path)
    try:
        failed, reference = await _through_the_fault_then_again(engine, certs, PROMPTS[0], 20)
        assert engine.restarts == 1
        assert "the engine thread failed" in engine.deaths[-1]
        assert failed.ids == list(reference.token_ids)
    finally:
        await asyncio.to_thread(engine.close)


async def test_two_kernel_faults_in_a_row_switch_to_safe_mode(
    model_path, certs, monkeypatch, cpu_extra_buffers
):
    if not cpu_extra_buffers:
        pytest.skip("this CPU's extra buffers crash in the canary: safe mode comes first")
    # Every worker with extra buffers on faults at its 3rd decode after the canary.
    monkeypatch.setenv(FAULT_ENV, "decode-crash:3")
    engine = await asyncio.to_thread(_engine, model_path)
    try:
        assert engine.cpu_extra_buffers is True
        crashed, reference = await _through_the_fault_then_again(engine, certs, PROMPTS[2], 16)
        assert engine.cpu_extra_buffers is False
        assert engine.restarts == 2
        assert all("SIGSEGV inside llama_decode" in d for d in engine.deaths)
        assert crashed.ids == list(reference.token_ids)
    finally:
        await asyncio.to_thread(engine.close)


async def test_a_crash_loop_ends_generations_with_engine_unavailable_and_opens_the_breaker(
    model_path, certs, tmp_path, monkeypatch
):
    monkeypatch.setenv(FAULT_ENV, "decode-abort:3")  # every worker aborts at its 3rd decode
    # One generation dying at the same token every time is what a poison looks like too
    # (test_breaker_e2e): here the strikes never convict, so the loop is the engine's.
    engine = await asyncio.to_thread(
        _engine,
        model_path,
        cpu_extra_buffers=CpuExtraBuffers.OFF,
        max_restarts=2,
        poison_strikes=10,
    )
    try:
        async with running_server(engine, certs) as server:
            async with Client(
                "127.0.0.1", server.port, ca=certs.ca_cert, stall_timeout_s=NO_STALL_CLOCK
            ) as client:
                received = Output()
                session = None
                with pytest.raises(ServerError) as failed:
                    async for event in client.generate(PROMPTS[3], max_tokens=16, ignore_eos=True):
                        received.take(event)
                        if isinstance(event, SessionStarted):
                            session = bytes.fromhex(event.session_id)
                assert failed.value.code == ErrorCode.ENGINE_UNAVAILABLE
                with pytest.raises(ServerError) as refused:
                    await client.generate_text(PROMPTS[0], max_tokens=4)
                assert refused.value.code == ErrorCode.ENGINE_UNAVAILABLE
                assert refused.value.http_status == 503
                # The breaker is open: refused with a hint, until a worker is tried again.
                hint = refused.value.retry_after_s
                assert hint is not None and 0 < hint <= 30.0
                not_ready = await client.get("/readyz")
                assert not_ready.status == 503 and "the breaker is open" in not_ready.text
            # The session is not lost: its tokens so far are recorded, resumable later.
            assert session is not None
            record = server.sessions.store.get(session)
            assert record is not None and record.end is None
            assert list(record.generated) == received.ids
        assert engine.failure is not None and "restarts" in engine.failure
        assert engine.breaker is Breaker.OPEN and engine.breaker_opens == 1
        assert len(engine.deaths) == 3
    finally:
        await asyncio.to_thread(engine.close)
