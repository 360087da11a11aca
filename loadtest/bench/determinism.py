"""Does a sequence's output depend on what else is in its batch?

Two parts. **Through the engine**: each prompt decoded alone, then in bursts submitted together
(whose prompts the engine prefills in shared ``llama_decode`` calls), and in bursts that arrive
while other sequences decode; greedy and seeded; short prompts (one piece each) and long ones
(pieces of 64, and tails past 256 positions); with the default engine and ``batch_invariant``.
It counts sequences whose tokens differ from their solo run (and, apart, those whose first
token does: it comes from the prompt's logits alone), and times the aggregate rate.
**Cells** (``--no-cells`` skips it): straight on llama.cpp, the KV cells and logits of a prompt
computed alone against the same prompt computed beside others, compared byte for byte, for each
way of sharing a call that :mod:`quicsrv.engine.pieces` allows and for the ways it forbids (the
forbidden ones are expected to differ: that is why they are forbidden).

Run: ``.venv/bin/python -m loadtest.bench.determinism [--max-tokens 32] [--no-cells]``.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt

from loadtest.bench.stats import PROMPTS
from quicsrv.engine import (
    FinishReason,
    PausedState,
    ResumePath,
    SamplingParams,
    SequenceRequest,
    default_model_path,
)
from quicsrv.engine.llama import EngineSettings, LlamaEngine, open_context
from quicsrv.engine.placement import KvCells
from quicsrv.settings import engine_settings_for, probe_cpu_extra_buffers

LONG_PROMPTS = [
    " ".join(PROMPTS[i:] + PROMPTS[:i]) + " " + " ".join(PROMPTS[i : i + 5]) for i in range(4)
] + [
    " ".join(PROMPTS[i:] + PROMPTS[:i]) * 2 + " " + " ".join(PROMPTS[i : i + 10]) for i in range(4)
]
"""Four of 150-152 tokens (pieces of 64, 64 and a tail of 22-24) and four of 298-302 (their
tails past 256 positions). Past 256 cells a *decoded* token's way depends on its neighbours
(see :mod:`quicsrv.engine.pieces`): those four may differ after their first token, which comes
from their prompt's logits alone (counted apart)."""


class _Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.done = threading.Event()

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        self.tokens.append(token_id)

    def prompt_scored(self, logprobs: object, ended: object) -> None:
        pass  # never asked for here

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self.done.set()

    def sequence_paused(self, state: PausedState) -> None:
        self.done.set()  # never asked for here; ending the wait beats hanging on it

    def sequence_resumed(self, path: ResumePath) -> None:
        pass

    def sequence_planned(self, plan: object) -> None:
        pass


def _request(
    engine: LlamaEngine, prompt: str, max_tokens: int, seed: int | None
) -> SequenceRequest:
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.8, seed=seed)
    return SequenceRequest(
        prompt_tokens=tuple(engine.tokenize(prompt, add_special=True)),
        max_tokens=max_tokens,
        sampling=sampling,
        ignore_eos=True,
        cache_scope=f"run {time.monotonic_ns()}",  # no prefix-cache hit between runs
    )


def _run(
    engine: LlamaEngine,
    prompts: list[str],
    max_tokens: int,
    seeds: list[int | None],
    beside: int = 0,
) -> list[list[int]]:
    """The prompts submitted together; ``beside``: that many other sequences decode already."""
    others = [_Sink() for _ in range(beside)]
    handles = [
        engine.submit(_request(engine, PROMPTS[i], 1000, None), sink)
        for i, sink in enumerate(others)
    ]
    for sink in others:
        while not sink.tokens and not sink.done.wait(0.01):
            pass
    sinks = [_Sink() for _ in prompts]
    for prompt, seed, sink in zip(prompts, seeds, sinks, strict=True):
        engine.submit(_request(engine, prompt, max_tokens, seed), sink)
    for sink in sinks:
        sink.done.wait()
    for handle in handles:
        handle.cancel()
    for sink in others:
        sink.done.wait()
    return [sink.tokens for sink in sinks]


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def measure(settings: EngineSettings, max_tokens: int) -> dict[str, object]:
    engine = LlamaEngine(settings)
    try:
        result: dict[str, object] = {"batch_invariant": settings.batch_invariant}
        for label, prompts in (("short", PROMPTS), ("long", LONG_PROMPTS)):
            for sampling in ("greedy", "seeded"):
                seeds: list[int | None] = [
                    None if sampling == "greedy" else 1000 + i for i in range(len(prompts))
                ]
                solo = [
                    _run(engine, [p], max_tokens, [s])[0]
                    for p, s in zip(prompts, seeds, strict=True)
                ]
                for beside in (0, 3):
                    together: list[list[int]] = []
                    elapsed = 0.0
                    for group in range(0, len(prompts), 8 - beside):
                        part = slice(group, group + 8 - beside)
                        start = time.perf_counter()
                        together += _run(engine, prompts[part], max_tokens, seeds[part], beside)
                        elapsed += time.perf_counter() - start
                    firsts = [_first_divergence(a, b) for a, b in zip(solo, together, strict=True)]
                    # (which prompt, and the tokens after which it diverged)
                    differing = [(i, d) for i, d in enumerate(firsts) if d is not None]
                    first_token = sum(1 for _, d in differing if d == 0)
                    key = f"{label} {sampling}, bursts of {8 - beside}" + (
                        f" beside {beside} decoding" if beside else ""
                    )
                    result[key] = {
                        "sequences": len(prompts),
                        "differing": len(differing),
                        "first_token_differing": first_token,
                        "first_divergence_at": differing,
                        "tokens_per_s": round(len(prompts) * max_tokens / elapsed, 1),
                    }
        return result
    finally:
        engine.close()


class _Raw:
    """One llama.cpp context as the engine opens it, fed batches by hand."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.model, self.context = open_context(settings)
        self.cells = KvCells(self.context)
        self.batch = llama_cpp.llama_batch_init(settings.n_batch, 0, 1)
        self.n_vocab = self.model.n_vocab()

    def tokens(self, text: str, n: int) -> list[int]:
        tokens = list(self.model.tokenize(text.encode(), True, False))
        while len(tokens) < n:
            tokens += tokens
        return tokens[:n]

    def decode(self, entries: list[tuple[int, int, int]]) -> dict[tuple[int, int], bytes]:
        """(sequence, token, position) in one llama_decode: every entry's logits, as bytes."""
        batch = self.batch
        for i, (seq, token, position) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = seq, True
        batch.n_tokens = len(entries)
        if llama_cpp.llama_decode(self.context.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        out = {}
        for i, (seq, _token, position) in enumerate(entries):
            row = llama_cpp.llama_get_logits_ith(self.context.ctx, i)
            values: npt.NDArray[np.float32] = np.ctypeslib.as_array(
                ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
            )
            out[(seq, position)] = values.tobytes()
        return out

    def clear(self) -> None:
        for seq in range(self.settings.n_seq_max):
            self.cells.clear(seq)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        self.context.close()  # type: ignore[no-untyped-call]
        self.model.close()  # type: ignore[no-untyped-call]


Call = list[tuple[int, int, int]]
Piece = tuple[int, int, int]
"""(sequence, first position, end position) of one sequence's prompt."""


def _cells(settings: EngineSettings) -> list[dict[str, object]]:
    """Each case: the watched sequence's prompt computed alone (``alone``: its pieces, a call
    each) against the same computed in ``mixed`` calls; its logits and cells byte for byte."""
    raw = _Raw(settings)
    text = " ".join(PROMPTS * 3)
    prompts = {seq: raw.tokens(PROMPTS[seq] + " " + text, 400) for seq in range(8)}

    def call(pieces: list[Piece]) -> Call:
        return [(seq, prompts[seq][p], p) for seq, start, end in pieces for p in range(start, end)]

    def compute(
        calls: list[Call], watched: int, cut: int | None = None
    ) -> tuple[dict[tuple[int, int], bytes], bytes]:
        raw.clear()
        logits: dict[tuple[int, int], bytes] = {}
        for entries in calls:
            logits.update(raw.decode(entries))
        if cut is not None:
            raw.cells.cut(watched, cut)
        blob = raw.cells.save(watched) or b""
        return {k: v for k, v in logits.items() if k[0] == watched}, blob

    def case(
        name: str,
        allowed: bool,
        watched: int,
        alone: list[Call],
        mixed: list[Call],
        cut: int | None = None,
    ) -> dict[str, object]:
        ref_logits, ref_cells = compute(alone, watched, cut)
        logits, cells = compute(mixed, watched, cut)
        same = [k for k in ref_logits if k in logits and logits[k] == ref_logits[k]]
        shared = [k for k in ref_logits if k in logits]
        return {
            "case": name,
            "allowed": allowed,
            "cells_equal": cells == ref_cells,
            "logits_equal": f"{len(same)}/{len(shared)}",
        }

    decoding = [(2, 7, 8)]  # a neighbour of the next-lower id decoding one token
    # Sequences 2 and 3 decode a token a step (at 100 and 200 cells), each step's call shared
    # with a 9-token prompt of the next id up (the engine's call while every sequence holds
    # at most 256 cells).
    beside_short = [call([(2, 0, 100)]), call([(3, 0, 200)])] + [
        call([(2, 100 + i, 101 + i), (3, 200 + i, 201 + i), (4 + i, 0, 9)]) for i in range(4)
    ]
    cases: list[Callable[[], dict[str, object]]] = [
        lambda: case(
            "8 short prompts (7-10 tokens) in one call",
            True,
            3,
            [call([(3, 0, 10)])],
            [call([(s, 0, 7 + s % 4) for s in range(8)])],
        ),
        lambda: case(
            "decoded tokens within 256 cells in the short pieces' call (the decoded one)",
            True,
            3,
            [call([(3, 0, 200)])] + [call([(3, p, p + 1)]) for p in range(200, 204)],
            beside_short,
        ),
        lambda: case(
            "decoded tokens within 256 cells in the short pieces' call (a piece there)",
            True,
            5,
            [call([(5, 0, 9)])],
            beside_short,
        ),
        lambda: case(
            "pieces of 64 of 4 prompts in one call (equal lengths)",
            True,
            3,
            [call([(3, 0, 64)]), call([(3, 64, 128)])],
            [call([(s, 0, 64) for s in range(2, 6)]), call([(s, 64, 128) for s in range(2, 6)])],
        ),
        lambda: case(
            "a piece of 64 in the decoding neighbour's call (rule v1)",
            False,
            3,
            [call([(2, 0, 7)]), call([(3, 0, 64)])],
            [call([(2, 0, 7)]), call(decoding + [(3, 0, 64)])],
        ),
        lambda: case(
            "a piece of 64 beside a short piece (different lengths)",
            False,
            3,
            [call([(3, 0, 64)])],
            [call([(3, 0, 64), (4, 0, 9)])],
        ),
        lambda: case(
            "tails of 20 past 256 positions, equal lengths, in one call",
            True,
            3,
            [call([(3, 0, 280)]), call([(3, 280, 300)])],
            [call([(s, 0, 280)]) for s in (2, 3, 4)] + [call([(s, 280, 300) for s in (2, 3, 4)])],
        ),
        lambda: case(
            "a 1-token piece past 256 beside another (not alone)",
            False,
            3,
            [call([(3, 0, 299)]), call([(3, 299, 300)])],
            [call([(s, 0, 299)]) for s in (3, 4)] + [call([(s, 299, 300) for s in (3, 4)])],
        ),
        lambda: case(
            "a row-by-row piece cut inside (prompt found whole: last position again)",
            True,
            3,
            [call([(3, 0, 64)]), call([(3, 64, 99)]), call([(3, 99, 100)])],
            [call([(3, 0, 64)]), call([(3, 64, 100)])],
        ),
        lambda: case(
            "past 256: the last two positions again, row by row",
            True,
            3,
            [call([(3, 0, 256)]), call([(3, 256, 298)]), call([(3, 298, 300)])],
            [call([(3, 0, 256)]), call([(3, 256, 300)])],
        ),
        lambda: case(
            "past 256: the last position alone (split over the cells)",
            False,
            3,
            [call([(3, 0, 256)]), call([(3, 256, 299)]), call([(3, 299, 300)])],
            [call([(3, 0, 256)]), call([(3, 256, 300)])],
        ),
        lambda: case(
            "a prompt's pieces of 64 merged, four to a call (merges)",
            True,
            3,
            [call([(3, p, p + 64)]) for p in range(0, 384, 64)],
            [call([(3, 0, 256)]), call([(3, 256, 384)])],
        ),
        lambda: case(
            "a prompt's pieces of 64 merged, 64 + 64 + 256 (merges)",
            True,
            3,
            [call([(3, p, p + 64)]) for p in range(0, 384, 64)],
            [call([(3, 0, 64)]), call([(3, 64, 128)]), call([(3, 128, 384)])],
        ),
        lambda: case(
            "a prompt's pieces of 64 and its short tail in one call",
            False,
            3,
            [call([(3, 0, 64)]), call([(3, 64, 128)]), call([(3, 128, 150)])],
            [call([(3, 0, 150)])],
        ),
        lambda: case(
            "a prompt's run of tiled pieces fed cut anywhere at 64 or more: 100 + 170 + 114",
            True,
            3,
            [call([(3, p, p + 64)]) for p in range(0, 384, 64)],
            [call([(3, 0, 100)]), call([(3, 100, 270)]), call([(3, 270, 384)])],
        ),
        lambda: case(
            "tiled pieces of different lengths, 300 beside a neighbour's 64 (the longer)",
            True,
            3,
            [call([(3, 0, 300)])],
            [call([(3, 0, 300), (4, 0, 64)])],
        ),
        lambda: case(
            "tiled pieces of different lengths, 300 beside a neighbour's 64 (the shorter)",
            True,
            4,
            [call([(4, 0, 64)])],
            [call([(3, 0, 300), (4, 0, 64)])],
        ),
        lambda: case(
            "tiled pieces of different lengths, 130 beside a neighbour's 100 (30 left alone)",
            False,
            3,
            [call([(3, 0, 130)])],
            [call([(3, 0, 130), (4, 0, 100)])],
        ),
        lambda: case(
            "a tiled piece beside a decoded token of an id not next to it",
            True,
            4,
            [call([(4, 0, 200)])],
            [call([(2, 0, 7)]), call(decoding + [(4, 0, 200)])],
        ),
        lambda: case(
            "a tiled piece cut below 64 tokens",
            False,
            3,
            [call([(3, 0, 64)]), call([(3, 64, 100)])],
            [call([(3, 0, 64)]), call([(3, 64, 128)])],
            cut=100,
        ),
        lambda: case(
            "a tiled piece cut at 64 tokens or more",
            True,
            3,
            [call([(3, 0, 100)])],
            [call([(3, 0, 120)])],
            cut=100,
        ),
    ]

    def common_start() -> dict[str, object]:
        # A slot's cells of another prompt that starts with the same 24 tokens (a chat
        # template's system prompt), cut to those 24, then the rest of the run fed tiled.
        ref_logits, ref_cells = compute([call([(3, 0, 300)])], 3)
        raw.clear()
        other = [*prompts[3][:24], *prompts[5][24:300]]
        raw.decode([(3, other[p], p) for p in range(300)])
        raw.cells.cut(3, 24)
        logits = {k: v for k, v in raw.decode(call([(3, 24, 300)])).items() if k[0] == 3}
        same = [k for k in logits if logits[k] == ref_logits[k]]
        return {
            "case": "a tiled run fed from position 24 on, after 24 cells of another prompt's "
            "tiled piece (a slot's common start)",
            "allowed": True,
            "cells_equal": (raw.cells.save(3) or b"") == ref_cells,
            "logits_equal": f"{len(same)}/{len(logits)}",
        }

    cases.append(common_start)
    try:
        return [run() for run in cases]
    finally:
        raw.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.determinism")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-cells", action="store_true", help="skip the byte comparisons")
    parser.add_argument("--cells-only", action="store_true", help="only the byte comparisons")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/determinism.json"))
    args = parser.parse_args()
    model = default_model_path()
    base = engine_settings_for(model, cpu_extra_buffers=probe_cpu_extra_buffers(model))
    report: dict[str, object] = {}
    if not args.no_cells:
        cells = _cells(base)
        report["cells"] = cells
        print("| way of sharing a call | allowed by engine.pieces | cells equal | logits equal |")
        print("|---|---|---|---|")
        for c in cells:
            print(f"| {c['case']} | {c['allowed']} | {c['cells_equal']} | {c['logits_equal']} |")
        print()
    if args.cells_only:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        return
    invariant = dataclasses.replace(base, batch_invariant=True)
    runs = [measure(base, args.max_tokens), measure(invariant, args.max_tokens)]
    report["engine"] = runs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for r in runs:
        print(f"batch_invariant={r['batch_invariant']}:")
        for key, value in r.items():
            if isinstance(value, dict):
                print(
                    f"  {key}: {value['differing']}/{value['sequences']} differ from their solo "
                    f"run, {value['first_token_differing']} in their first token "
                    f"(prompt, first divergence: {value['first_divergence_at']}); "
                    f"{value['tokens_per_s']} tokens/s"
                )


if __name__ == "__main__":
    main()
