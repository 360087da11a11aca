"""The raw engine ceiling: a bare ``llama_decode`` loop in this process, no server, no sampler.

The context is built by the engine's own :func:`~quicsrv.engine.llama.open_context` (same
``n_ctx``, ``n_batch``, ``n_seq_max``, threads, flash attention), so the only differences from
quicsrv are what quicsrv adds: scheduling, its sampler chain, framing, QUIC and the client.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np
from llama_cpp import _logger as llama_cpp_logger
from llama_cpp._internals import LlamaModel

from loadtest.bench.machine import CpuMeter
from loadtest.bench.servers import ServerSettings
from loadtest.bench.stats import PROMPTS
from quicsrv.engine.llama import open_context

__all__ = ["BEST_VARIANT", "RawResult", "end_of_generation_tokens", "measure_raw"]

#: The raw loop at the fastest settings measured (loadtest/bench/settings_sweep.py), exact or not.
BEST_VARIANT = "fastest: flash attention + unified KV"


@dataclass(frozen=True, slots=True, kw_only=True)
class RawResult:
    """``sequences`` prompts prefilled in one batch, then decoded together, greedy, EOS ignored."""

    sequences: int
    max_tokens: int
    wall_s: float
    """Prefill plus every decode step, the same work a server does for this load."""
    ttft_s: float
    """The prefill batch: after it every sequence has its first token."""
    decode_step_s: float
    """Mean time of one decode step (one token for each sequence)."""
    others_cpu_share: float = 0.0
    """CPU used by other processes during the run, as a share of the whole machine."""
    variant: str = ""
    """"": quicsrv's own settings; BEST_VARIANT: the fastest settings, exact or not."""
    round: int = -1
    """The round of server runs it ran beside (see ``LoadResult.round``); -1: none."""

    @property
    def tokens_per_s(self) -> float:
        return self.sequences * self.max_tokens / self.wall_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.sequences / self.decode_step_s


class _RawEngine:
    def __init__(self, settings: ServerSettings) -> None:
        self.model, self.context = open_context(settings.engine_settings())
        self.memory = llama_cpp.llama_get_memory(self.context.ctx)
        self.n_batch = settings.n_batch
        self.batch = llama_cpp.llama_batch_init(settings.n_batch, 0, 1)
        self.n_vocab = self.model.n_vocab()

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        self.context.close()  # type: ignore[no-untyped-call]
        self.model.close()  # type: ignore[no-untyped-call]

    def _decode(self, entries: Sequence[tuple[int, int, int, bool]]) -> None:
        """Decode (token, position, sequence, wants logits) entries in one ``llama_decode``."""
        batch = self.batch
        for i, (token, pos, seq_id, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        status = llama_cpp.llama_decode(self.context.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def _argmax(self, index: int) -> int:
        pointer = llama_cpp.llama_get_logits_ith(self.context.ctx, index)
        logits = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
        )
        return int(np.argmax(logits))

    def run(self, prompts: Sequence[str], max_tokens: int) -> RawResult:
        llama_cpp.llama_memory_clear(self.memory, True)
        tokenized = [self.model.tokenize(p.encode("utf-8"), True, True) for p in prompts]
        entries = [
            (token, pos, seq, pos == len(tokens) - 1)
            for seq, tokens in enumerate(tokenized)
            for pos, token in enumerate(tokens)
        ]
        if len(entries) > self.n_batch:
            raise ValueError(f"{len(entries)} prompt tokens do not fit one batch of {self.n_batch}")
        outputs = [i for i, entry in enumerate(entries) if entry[3]]
        start = time.perf_counter()
        self._decode(entries)
        last = [self._argmax(i) for i in outputs]
        first_token = time.perf_counter()
        positions = [len(tokens) for tokens in tokenized]
        for _ in range(max_tokens - 1):
            pairs = enumerate(zip(last, positions, strict=True))
            self._decode([(token, pos, seq, True) for seq, (token, pos) in pairs])
            last = [self._argmax(i) for i in range(len(prompts))]
            positions = [pos + 1 for pos in positions]
        end = time.perf_counter()
        return RawResult(
            sequences=len(prompts),
            max_tokens=max_tokens,
            wall_s=end - start,
            ttft_s=first_token - start,
            decode_step_s=(end - first_token) / max(1, max_tokens - 1),
        )


def measure_raw(
    settings: ServerSettings,
    sequence_counts: Iterable[int],
    max_tokens: int,
    *,
    before_each: Callable[[], object] = lambda: None,
    variant: str = "",
) -> list[RawResult]:
    """One warm-up, then one run per count, sequence i on ``PROMPTS[i % 16]``."""
    engine = _RawEngine(settings)
    try:
        engine.run(PROMPTS[:1], 4)
        results: list[RawResult] = []
        for n in sequence_counts:
            before_each()
            meter = CpuMeter([os.getpid()])
            result = engine.run([PROMPTS[i % len(PROMPTS)] for i in range(n)], max_tokens)
            results.append(
                dataclasses.replace(result, others_cpu_share=meter.stop(), variant=variant)
            )
        return results
    finally:
        engine.close()


def end_of_generation_tokens(settings: ServerSettings) -> list[int]:
    """Every token the model's vocabulary marks end-of-generation (for the SSE logit bias)."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    llama_cpp_logger.set_verbose(False)
    model = LlamaModel(path_model=str(settings.model_path), params=params, verbose=False)
    try:
        return [t for t in range(model.n_vocab()) if llama_cpp.llama_vocab_is_eog(model.vocab, t)]
    finally:
        model.close()  # type: ignore[no-untyped-call]
