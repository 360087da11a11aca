"""Does a greedy sequence's output depend on what else is in its batch?

For each prompt: decode it alone, then decode it alongside 7 others, with the default engine and
with ``batch_invariant``; count sequences whose tokens differ and where they first diverge, and
time the aggregate rate of both modes. Run: ``.venv/bin/python -m loadtest.bench.determinism``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

from loadtest.bench.stats import PROMPTS
from quicsrv.engine import (
    FinishReason,
    PausedState,
    ResumePath,
    SamplingParams,
    SequenceRequest,
    default_model_path,
)
from quicsrv.engine.llama import LlamaEngine
from quicsrv.settings import engine_settings_for, probe_cpu_extra_buffers


class _Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.done = threading.Event()

    def token_generated(self, index: int, token_id: int, piece: bytes) -> None:
        self.tokens.append(token_id)

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self.done.set()

    def sequence_paused(self, state: PausedState) -> None:
        self.done.set()  # never asked for here; ending the wait beats hanging on it

    def sequence_resumed(self, path: ResumePath) -> None:
        pass

    def sequence_planned(self, plan: object) -> None:
        pass


def _run(engine: LlamaEngine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    sinks = [_Sink() for _ in prompts]
    for prompt, sink in zip(prompts, sinks, strict=True):
        request = SequenceRequest(
            prompt_tokens=tuple(engine.tokenize(prompt, add_special=True)),
            max_tokens=max_tokens,
            sampling=SamplingParams(),
            ignore_eos=True,
        )
        engine.submit(request, sink)
    for sink in sinks:
        sink.done.wait()
    return [sink.tokens for sink in sinks]


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def measure(batch_invariant: bool, max_tokens: int) -> dict[str, object]:
    model = default_model_path()
    engine = LlamaEngine(
        engine_settings_for(
            model,
            batch_invariant=batch_invariant,
            cpu_extra_buffers=probe_cpu_extra_buffers(model),
        )
    )
    try:
        solo = [_run(engine, [p], max_tokens)[0] for p in PROMPTS]
        together: list[list[int]] = []
        elapsed = 0.0
        for group in range(0, len(PROMPTS), 8):
            start = time.perf_counter()
            together += _run(engine, PROMPTS[group : group + 8], max_tokens)
            elapsed += time.perf_counter() - start
        divergences = [_first_divergence(a, b) for a, b in zip(solo, together, strict=True)]
        differing = [d for d in divergences if d is not None]
        return {
            "batch_invariant": batch_invariant,
            "sequences": len(PROMPTS),
            "tokens_each": max_tokens,
            "differing": len(differing),
            "first_divergence_at": differing,
            "aggregate_tokens_per_s_8_streams": round(len(PROMPTS) * max_tokens / elapsed, 1),
        }
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.determinism",
    )
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/determinism.json"))
    args = parser.parse_args()
    results = [measure(False, args.max_tokens), measure(True, args.max_tokens)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    for r in results:
        print(
            f"batch_invariant={r['batch_invariant']}: {r['differing']}/{r['sequences']} greedy "
            f"sequences differ from their solo run "
            f"(first divergence at {r['first_divergence_at']}); "
            f"8 streams together: {r['aggregate_tokens_per_s_8_streams']} tokens/s"
        )


if __name__ == "__main__":
    main()
