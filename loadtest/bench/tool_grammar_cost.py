"""What the native tool format's ``auto`` grammar costs a text answer: decode speed of the same
greedy generation unconstrained and under the grammar of ``<tool_call>`` blocks or text (text:
anything that does not start with ``<``; :mod:`quicsrv.engine.tool_call_grammar`).

quicsrv's engine in this process (no server: the grammar's cost is the engine's), one stream,
``--max-tokens`` tokens of the bench prompts (EOS ignored; under a grammar an end token still
ends it, so the rate is per token), the two modes interleaved round by round. Extra CPU
buffers (AMX) off, as the suite runs in-process engines::

    .venv/bin/python -m loadtest.bench.tool_grammar_cost [--rounds 5] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from loadtest.bench.engine import run_streams
from loadtest.bench.servers import ServerSettings
from quicsrv.engine import default_model_path
from quicsrv.engine.llama import LlamaEngine
from quicsrv.engine.vocab import Vocabulary
from quicsrv.http.tool_calls import parse_tool_choice

__all__ = ["main"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.tool_grammar_cost")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", type=Path, help="GGUF (default: the project's default)")
    args = parser.parse_args(argv)
    model = args.model or default_model_path()
    auto = parse_tool_choice([WEATHER], "auto", native="hermes")
    assert auto is not None
    vocabulary = Vocabulary.load(model)
    gbnf = vocabulary.grammar_for(auto.schema).gbnf
    vocabulary.close()
    engine = LlamaEngine(
        ServerSettings(model_path=model, cpu_extra_buffers=False).engine_settings()
    )
    rates: dict[str, list[float]] = {"none": [], "auto grammar": []}
    lengths: dict[str, list[int]] = {"none": [], "auto grammar": []}
    try:
        run_streams(engine, 1, 4)
        for _ in range(args.rounds):
            for mode, grammar in (("none", None), ("auto grammar", gbnf)):
                _, [result] = run_streams(engine, 1, args.max_tokens, grammar=grammar)
                times = result.token_times_s
                rates[mode].append((len(times) - 1) / (times[-1] - times[0]))
                lengths[mode].append(len(times))
    finally:
        engine.close()
    print(
        json.dumps(
            {
                mode: {
                    "median tokens/s": round(statistics.median(rates[mode]), 1),
                    "runs": [round(r, 1) for r in rates[mode]],
                    "tokens": lengths[mode],
                }
                for mode in rates
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
