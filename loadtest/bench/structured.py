"""Structured output's cost: decode speed with and without a JSON schema, side by side.

One quicsrv server (``--parallel 8``), one client (httpx over HTTP/1.1, streamed chat
completions, greedy), the same prompt asked ``--rounds`` times in each mode, modes interleaved
round by round so a drifting machine hits them alike:

- ``text``: no constraint;
- ``json_schema``: an object with bounded strings, an enum, a number and an array;
- ``json_object``: any JSON object (OpenAI's ``json_object``);
- ``tool``: a named function's arguments.

Tokens/s is the completion's tokens after the first over the time from the first content to the
last (the decode, without the prompt's prefill), from the server's ``usage``; TTFT is request
sent → first content. With the grammar, a generation ends once its JSON is complete, so the
modes' lengths differ; the rate is per token. Prints a table and writes
``loadtest/results/structured-<ts>.{md,json}``::

    .venv/bin/python -m loadtest.bench.structured [--rounds 5] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.servers import ServerSettings, quicsrv_server
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv.settings import probe_cpu_extra_buffers

__all__ = ["main"]

MODEL_NAME = "bench"
PROMPT = [{"role": "user", "content": "Describe the keeper of a lighthouse on a small island."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer"},
        "role": {"enum": ["keeper", "sailor", "cook"]},
        "duties": {"type": "array", "items": {"type": "string", "maxLength": 48}, "maxItems": 4},
        "island": {"type": "string", "maxLength": 32},
    },
    "required": ["name", "age", "role", "duties", "island"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {"name": "describe", "parameters": SCHEMA},
}
MODES: dict[str, dict[str, Any]] = {
    "text": {},
    "json_schema": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "keeper", "schema": SCHEMA},
        }
    },
    "json_object": {"response_format": {"type": "json_object"}},
    "tool": {
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "describe"}},
    },
}


@dataclass(frozen=True, slots=True)
class Run:
    mode: str
    round: int
    ttft_s: float
    decode_s: float
    completion_tokens: int
    finish_reason: str

    @property
    def tokens_per_s(self) -> float:
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0


async def _ask(http: httpx.AsyncClient, mode: str, round_: int, max_tokens: int) -> Run:
    body = {
        "model": MODEL_NAME,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **MODES[mode],
    }
    sent = time.perf_counter()
    first = last = float("nan")
    usage: dict[str, Any] = {}
    finish = ""
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{mode}: HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                calls = delta.get("tool_calls") or []
                if delta.get("content") or any(c["function"].get("arguments") for c in calls):
                    now = time.perf_counter()
                    first = now if first != first else first
                    last = now
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return Run(
        mode=mode,
        round=round_,
        ttft_s=first - sent,
        decode_s=last - first,
        completion_tokens=int(usage.get("completion_tokens", 0)),
        finish_reason=finish,
    )


def _render(runs: list[Run], rounds: int) -> str:
    lines = [
        f"Greedy, one stream at a time, {rounds} rounds per mode (medians).",
        "",
        "| mode | tokens/s | vs text | TTFT ms | completion tokens | finish |",
        "|---|---:|---:|---:|---:|---|",
    ]
    base = statistics.median(r.tokens_per_s for r in runs if r.mode == "text")
    for mode in MODES:
        mine = [r for r in runs if r.mode == mode]
        rate = statistics.median(r.tokens_per_s for r in mine)
        ttft = statistics.median(r.ttft_s for r in mine) * 1000
        tokens = statistics.median(r.completion_tokens for r in mine)
        finishes = ", ".join(sorted({r.finish_reason for r in mine}))
        lines.append(
            f"| {mode} | {rate:.1f} | {rate / base:.2f}× | {ttft:.0f} | {tokens:.0f} | {finishes} |"
        )
    return "\n".join(lines) + "\n"


async def _measure(args: argparse.Namespace, logs: Path) -> list[Run]:
    model = args.model or default_model_path()
    settings = ServerSettings(model_path=model, cpu_extra_buffers=probe_cpu_extra_buffers(model))
    certs = ensure_dev_certs(logs / "certs")
    runs: list[Run] = []
    async with quicsrv_server(
        settings,
        certs.server_cert,
        certs.server_key,
        logs / "quicsrv.log",
        env={"QUICSRV_MODEL_NAME": MODEL_NAME},
    ) as child:
        async with httpx.AsyncClient(
            base_url=f"https://localhost:{child.port}", verify=str(certs.ca_cert), timeout=300
        ) as http:
            for mode in MODES:  # warm-up: each grammar compiled once, the prompt cached
                await _ask(http, mode, -1, 8)
            for round_ in range(args.rounds):
                for mode in MODES:
                    run = await _ask(http, mode, round_, args.max_tokens)
                    print(
                        f"round {round_ + 1} {mode:12s} {run.tokens_per_s:6.1f} tokens/s, "
                        f"{run.completion_tokens} tokens, {run.finish_reason}",
                        flush=True,
                    )
                    runs.append(run)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.structured")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--model", type=Path, help="GGUF (default: the project's default)")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    logs = (args.out / f"structured-{stamp}-logs").resolve()
    logs.mkdir(parents=True, exist_ok=True)
    runs = asyncio.run(_measure(args, logs))
    text = _render(runs, args.rounds)
    print(text)
    (args.out / f"structured-{stamp}.md").write_text(text)
    saved = {"argv": sys.argv[1:] if argv is None else argv, "runs": [asdict(r) for r in runs]}
    (args.out / f"structured-{stamp}.json").write_text(json.dumps(saved, indent=1))
    print(f"wrote {args.out / f'structured-{stamp}.md'} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
