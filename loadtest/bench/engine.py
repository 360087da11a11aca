"""quicsrv's own engine in this process, with no server or transport: where does the time go?

Between the raw ``llama_decode`` loop and quicsrv over QUIC sit two layers; timing the
:class:`~quicsrv.engine.llama.LlamaEngine` alone (tokens stamped on its worker thread) splits the
gap into the engine's share (scheduling, sampler, callbacks) and the server's (sessions, frames,
HTTP/3, QUIC, the client).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable

from loadtest.bench.machine import CpuMeter
from loadtest.bench.servers import ServerSettings
from loadtest.bench.stats import PROMPTS, LoadResult, StreamResult, summarise
from quicsrv.config import ServerConfig
from quicsrv.engine import FinishReason, SamplingParams, SequenceRequest
from quicsrv.engine.llama import LlamaEngine

__all__ = ["ENGINE", "measure_engine", "run_streams"]

ENGINE = "quicsrv engine, in-process"
WAIT_S = 300.0


class _Sink:
    """Stamps each token into a :class:`StreamResult` on the engine thread."""

    def __init__(self, result: StreamResult) -> None:
        self.result = result
        self.done = threading.Event()

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        self.result.token_times_s.append(time.perf_counter())

    def prompt_scored(self, logprobs: object, ended: object) -> None:
        pass  # never asked for here

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self.result.finish = str(reason)
        self.done.set()

    # Never paused or resumed here; ``object`` keeps these in step with the sink protocol.
    def sequence_paused(self, state: object) -> None:
        self.result.finish = "paused"
        self.done.set()

    def sequence_resumed(self, path: object) -> None:
        pass

    def sequence_planned(self, plan: object) -> None:
        pass


def run_streams(
    engine: LlamaEngine,
    streams: int,
    max_tokens: int,
    *,
    logprobs: int | None = None,
    grammar: str | None = None,
) -> tuple[float, list[StreamResult]]:
    """``streams`` greedy generations of ``max_tokens`` at once (``logprobs``: each token's
    log-probability with that many alternatives; ``grammar``: GBNF each is sampled under)."""
    requests = [
        SequenceRequest(
            prompt_tokens=tuple(engine.tokenize(PROMPTS[i % len(PROMPTS)], add_special=True)),
            max_tokens=max_tokens,
            sampling=SamplingParams(),
            ignore_eos=True,
            logprobs=logprobs,
            grammar=grammar,
        )
        for i in range(streams)
    ]
    started = time.perf_counter()
    sinks = []
    for request in requests:
        sink = _Sink(StreamResult(expected_tokens=max_tokens, started_s=time.perf_counter()))
        engine.submit(request, sink)
        sinks.append(sink)
    for sink in sinks:
        if not sink.done.wait(WAIT_S):
            sink.result.finish = "timeout"
    return started, [sink.result for sink in sinks]


def measure_engine(
    settings: ServerSettings,
    loads: Iterable[int],
    max_tokens: int,
    repeats: int,
    *,
    prefill_chunk: int | None = None,
    before_each: Callable[[], object] = lambda: None,
) -> list[LoadResult]:
    """Every load ``repeats`` times against one engine built like ``quicsrv serve`` builds it."""
    # ``quicsrv serve`` takes its chunk from ServerConfig, whatever EngineSettings defaults to.
    chunk = ServerConfig().prefill_chunk_tokens if prefill_chunk is None else prefill_chunk
    engine = LlamaEngine(settings.engine_settings(prefill_chunk=chunk))
    try:
        run_streams(engine, 1, 4)
        results: list[LoadResult] = []
        for streams in loads:
            for _ in range(repeats):
                before_each()
                meter = CpuMeter([os.getpid()])
                started, seen = run_streams(engine, streams, max_tokens)
                results.append(summarise(ENGINE, max_tokens, started, seen, meter.stop()))
        return results
    finally:
        engine.close()
