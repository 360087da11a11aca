"""Does a decode step's cost depend on which sequence ids the batch holds, and in what order?

Found while looking for the gap between quicsrv's engine and the raw loop at 8 sequences: with
llama.cpp's default split KV cache (``kv_unified = false``, one cache stream per sequence id), a
batch whose ids are not 0, 1, 2, ... in order decodes markedly slower; with ``kv_unified = true``
the order does not matter. Run: ``.venv/bin/python -m loadtest.bench.seqids [--unified]``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence

import llama_cpp

from loadtest.bench.machine import CpuMeter
from loadtest.bench.raw import _RawEngine
from loadtest.bench.servers import ServerSettings
from loadtest.bench.stats import PROMPTS, percentile
from quicsrv.engine import default_model_path
from quicsrv.settings import probe_cpu_extra_buffers

LAYOUTS: dict[str, list[int]] = {
    "8 ids 0..7 in order": [0, 1, 2, 3, 4, 5, 6, 7],
    "8 ids shuffled": [3, 0, 6, 1, 7, 2, 5, 4],
    "8 ids reversed": [7, 6, 5, 4, 3, 2, 1, 0],
    "4 ids 0..3": [0, 1, 2, 3],
    "4 ids 0, 2, 5, 7": [0, 2, 5, 7],
}


def step_times(engine: _RawEngine, ids: Sequence[int], steps: int) -> list[float]:
    """Prefill one prompt per id, then time ``steps`` decode steps of one token per id."""
    llama_cpp.llama_memory_clear(engine.memory, True)
    prompts = [engine.model.tokenize(PROMPTS[k].encode(), True, True) for k in range(len(ids))]
    entries = [
        (token, pos, ids[k], pos == len(tokens) - 1)
        for k, tokens in enumerate(prompts)
        for pos, token in enumerate(tokens)
    ]
    engine._decode(entries)
    last = [engine._argmax(i) for i, entry in enumerate(entries) if entry[3]]
    positions = [len(tokens) for tokens in prompts]
    times: list[float] = []
    for _ in range(steps):
        batch = [(last[k], positions[k], ids[k], True) for k in range(len(ids))]
        start = time.perf_counter()
        engine._decode(batch)
        times.append(time.perf_counter() - start)
        last = [engine._argmax(k) for k in range(len(ids))]
        positions = [p + 1 for p in positions]
    return times


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.seqids")
    parser.add_argument("--unified", action="store_true", help="kv_unified = true")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.unified:
        # _RawEngine takes the library defaults for everything it does not set itself.
        defaults = llama_cpp.llama_context_default_params

        def unified() -> llama_cpp.llama_context_params:
            params: llama_cpp.llama_context_params = defaults()
            params.kv_unified = True
            return params

        llama_cpp.llama_context_default_params = unified
    model = default_model_path()
    engine = _RawEngine(
        ServerSettings(model_path=model, cpu_extra_buffers=probe_cpu_extra_buffers(model))
    )
    try:
        step_times(engine, [0], 4)
        print(f"kv_unified={args.unified}: decode step ms (min / p10 / p50), others' CPU")
        for _ in range(args.rounds):
            for name, ids in LAYOUTS.items():
                meter = CpuMeter([os.getpid()])
                times = step_times(engine, ids, args.steps)
                ms = [1e3 * (percentile(times, p) or 0.0) for p in (0, 10, 50)]
                print(f"  {name:18s} {ms[0]:6.1f} {ms[1]:6.1f} {ms[2]:6.1f}   {meter.stop():.0%}")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
