"""The conversation's floor: llama.cpp in this process, with a perfect prefix cache by hand.

Each turn the whole history is rendered with quicsrv's own chat template code and tokenized as
quicsrv tokenizes it, then compared with the KV cells sequence 0 holds (the previous turn's
prompt and the answer it generated): the cells past the common prefix are dropped and only the
rest is prefilled. The time from that prefill's start to the first sampled token is the
incremental TTFT. For reference, every turn's whole history is also prefilled from nothing in
sequence 1 (the cold TTFT: what a server without a prefix cache pays), then dropped.

The context is :func:`~quicsrv.engine.llama.open_context`'s, so threads, batch, flash
attention and the split KV cache are quicsrv's. Decoding is greedy over every token,
end-of-generation included, as quicsrv's ``ignore_eos`` does it (it samples an end token and
goes on; its piece is empty text).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import replace

import llama_cpp

from loadtest.bench.conversation_report import RAW_COLD, RAW_INCREMENTAL, TurnResult
from loadtest.bench.conversation_script import common_prefix, history
from loadtest.bench.machine import CpuMeter
from loadtest.bench.raw import _RawEngine
from loadtest.bench.servers import ServerSettings
from quicsrv.engine.vocab import Vocabulary

__all__ = ["converse_raw"]

_CONVERSATION = 0
_COLD = 1
_WARM_UP = 2


class _Context(_RawEngine):
    """The raw loop's context (:class:`~loadtest.bench.raw._RawEngine`), able to prefill a
    run of tokens into one sequence from any position and to drop a sequence's cells."""

    def drop(self, seq_id: int, from_position: int = 0) -> None:
        """Forget ``seq_id``'s cells from ``from_position`` on."""
        if not llama_cpp.llama_memory_seq_rm(self.memory, seq_id, from_position, -1):
            raise RuntimeError(f"llama.cpp refused to drop cells {from_position}.. of {seq_id}")

    def prefill(self, tokens: Sequence[int], start: int, seq_id: int) -> int:
        """Decode ``tokens`` at positions ``start``... in batches of ``n_batch``; the argmax
        after the last."""
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset : offset + self.n_batch]
            last_chunk = offset + self.n_batch >= len(tokens)
            for i, token in enumerate(chunk):
                self.batch.token[i] = token
                self.batch.pos[i] = start + offset + i
                self.batch.n_seq_id[i] = 1
                self.batch.seq_id[i][0] = seq_id
                self.batch.logits[i] = last_chunk and i == len(chunk) - 1
            self.batch.n_tokens = len(chunk)
            status = llama_cpp.llama_decode(self.context.ctx, self.batch)
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status}")
        return self._argmax(self.batch.n_tokens - 1)


def _answer_text(vocabulary: Vocabulary, tokens: Sequence[int]) -> str:
    return b"".join(vocabulary.piece(t) for t in tokens).decode("utf-8", "replace")


def converse_raw(
    settings: ServerSettings, users: Sequence[str], max_tokens: int, repeat: int = 0
) -> list[TurnResult]:
    """One conversation over ``users``: per turn a raw incremental and a raw cold result.

    Run it in a process of its own (``loadtest.bench.isolated``): llama.cpp decodes slower in a
    process whose other threads have decoded before."""
    vocabulary = Vocabulary.load(settings.model_path)
    context = _Context(settings)
    meter = CpuMeter([os.getpid()])
    results: list[TurnResult] = []
    try:
        # First use pays for page faults and kernel selection; keep that out of turn 1.
        context.prefill(vocabulary.tokenize("Hello there.", add_special=True), 0, _WARM_UP)
        context.drop(_WARM_UP)
        cells: list[int] = []  # what sequence 0's KV cells hold, by position
        previous: list[int] = []  # the previous turn's prompt and its whole answer
        answers: list[str] = []
        for turn in range(len(users)):
            text = vocabulary.render_chat(history(users, answers, turn))
            tokens = vocabulary.tokenize(text, add_special=False)
            reusable = common_prefix(previous, tokens)
            # At least the last token is prefilled again: its logits give the first token.
            kept = min(common_prefix(cells, tokens), len(tokens) - 1)

            started = time.perf_counter()
            context.prefill(tokens, 0, _COLD)
            cold_s = time.perf_counter() - started
            context.drop(_COLD)

            context.drop(_CONVERSATION, kept)
            started = time.perf_counter()
            token = context.prefill(tokens[kept:], kept, _CONVERSATION)
            ttft_s = time.perf_counter() - started

            cells = list(tokens)
            answer = [token]
            while len(answer) < max_tokens:
                cells.append(token)
                token = context.prefill([token], len(cells) - 1, _CONVERSATION)
                answer.append(token)
            previous = [*tokens, *answer]
            answers.append(_answer_text(vocabulary, answer))
            incremental = TurnResult(
                system=RAW_INCREMENTAL,
                repeat=repeat,
                turn=turn + 1,
                ttft_s=ttft_s,
                prompt_tokens=len(tokens),
                reused_tokens=kept,
                reusable_tokens=reusable,
                completion_tokens=len(answer),
            )
            results.append(incremental)
            results.append(replace(incremental, system=RAW_COLD, ttft_s=cold_s, reused_tokens=0))
    finally:
        context.close()
        vocabulary.close()
    others = meter.stop()
    return [replace(r, others_cpu_share=others) for r in results]
