"""What log-probabilities cost: the engine's decode rate with none, with the sampled token's and
5 alternatives, and with 20, in alternating rounds, at each load; and the bytes a token then
takes in a session's token log.

The engine runs in this process (:mod:`.engine`), so the numbers are its own: the softmax over
the vocabulary, the top-N and the extra bytes through the worker pipe are what a server adds on
top of the same decode. ``python -m loadtest.bench.logprobs_cost [--loads 1,8] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from loadtest.bench.engine import run_streams
from quicsrv.engine import default_model_path
from quicsrv.engine.llama import LlamaEngine
from quicsrv.sessions.tokens import entry_bytes
from quicsrv.settings import engine_settings_for, probe_cpu_extra_buffers

VARIANTS: tuple[int | None, ...] = (None, 5, 20)


def _rate(engine: LlamaEngine, streams: int, max_tokens: int, logprobs: int | None) -> float:
    started, results = run_streams(engine, streams, max_tokens, logprobs=logprobs)
    ends = [r.token_times_s[-1] for r in results if r.token_times_s]
    delivered = sum(len(r.token_times_s) for r in results)
    return delivered / (max(ends) - started)


def measure(loads: list[int], max_tokens: int, rounds: int) -> dict[str, object]:
    model = default_model_path()
    settings = engine_settings_for(
        model, n_seq_max=max(loads), cpu_extra_buffers=probe_cpu_extra_buffers(model)
    )
    engine = LlamaEngine(settings)
    rates: dict[str, list[float]] = {}
    try:
        run_streams(engine, 1, 4)  # warm up
        for _ in range(rounds):
            for streams in loads:
                for top in VARIANTS:
                    rate = _rate(engine, streams, max_tokens, top)
                    rates.setdefault(f"{streams}:{top}", []).append(rate)
    finally:
        engine.close()
    rows = []
    for streams in loads:
        base = statistics.median(rates[f"{streams}:None"])
        for top in VARIANTS:
            median = statistics.median(rates[f"{streams}:{top}"])
            rows.append(
                {
                    "streams": streams,
                    "top_logprobs": "none" if top is None else top,
                    "tokens_per_s": round(median, 1),
                    "ratio": round(median / base, 3),
                    "log_bytes_per_token": entry_bytes(top),
                }
            )
    return {"max_tokens": max_tokens, "rounds": rounds, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.logprobs_cost")
    parser.add_argument("--loads", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/logprobs_cost.json"))
    args = parser.parse_args()
    result = measure([int(n) for n in args.loads.split(",")], args.max_tokens, args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| streams | top_logprobs | tokens/s | vs none | log bytes/token |")
    print("|---:|---:|---:|---:|---:|")
    for row in result["rows"]:  # type: ignore[attr-defined]
        print(
            f"| {row['streams']} | {row['top_logprobs']} | {row['tokens_per_s']} | "
            f"{row['ratio']}× | {row['log_bytes_per_token']} |"
        )


if __name__ == "__main__":
    main()
