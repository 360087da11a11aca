"""What ``tool_choice: "auto"`` costs on a model without a tools template (the generic format):
prompt tokens, TTFT and decode speed against the same question asked without tools.

One quicsrv server, one client (httpx, streamed chat completions, greedy), modes interleaved
round by round: ``plain`` (no tools), ``auto-call`` (one tool, a question that asks for it: the
model calls), ``auto-text`` (one tool, a question it answers in text). Prompt tokens come from
the server's ``usage``; TTFT is request sent → first content or argument delta (the generic
format sends nothing until the answer's first key is written, a few tokens in)::

    .venv/bin/python -m loadtest.bench.tools [--rounds 3] [--max-tokens 60]

With ``--chat-template-file tests/http/hermes_template.jinja`` the server renders a template
that shows tools in the Hermes style, and the same modes measure the native format instead
(:mod:`quicsrv.http.hermes_format`: the tools in the template, ``<tool_call>`` blocks, a text
answer under a grammar that only forbids a leading ``<``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.servers import ServerSettings, quicsrv_server
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv.settings import probe_cpu_extra_buffers

__all__ = ["main"]

MODEL_NAME = "bench"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}
MODES: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "Hello! What is 2+2?"}]},
    "auto-text": {"messages": [{"role": "user", "content": "Hello! What is 2+2?"}]}
    | {"tools": [WEATHER]},
    "auto-call": {
        "messages": [
            {"role": "user", "content": "Use the get_weather tool to get the weather in Paris."}
        ],
        "tools": [WEATHER],
    },
}


@dataclass(frozen=True, slots=True)
class Run:
    mode: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    decode_s: float
    finish_reason: str

    @property
    def tokens_per_s(self) -> float:
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0


async def _ask(http: httpx.AsyncClient, mode: str, max_tokens: int) -> Run:
    body = {
        "model": MODEL_NAME,
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
                if delta.get("content") or delta.get("tool_calls"):
                    now = time.perf_counter()
                    first = now if first != first else first
                    last = now
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return Run(
        mode=mode,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        ttft_s=first - sent,
        decode_s=last - first,
        finish_reason=finish,
    )


def _render(runs: list[Run]) -> str:
    lines = [
        "| mode | prompt tokens | TTFT ms | tokens/s | completion tokens | finish |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for mode in MODES:
        mine = [r for r in runs if r.mode == mode]
        lines.append(
            f"| {mode} | {statistics.median(r.prompt_tokens for r in mine):.0f} "
            f"| {statistics.median(r.ttft_s for r in mine) * 1000:.0f} "
            f"| {statistics.median(r.tokens_per_s for r in mine):.1f} "
            f"| {statistics.median(r.completion_tokens for r in mine):.0f} "
            f"| {', '.join(sorted({r.finish_reason for r in mine}))} |"
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
        env={"QUICSRV_MODEL_NAME": MODEL_NAME}
        | (
            {"QUICSRV_CHAT_TEMPLATE_FILE": str(args.chat_template_file.resolve())}
            if args.chat_template_file
            else {}
        ),
    ) as child:
        async with httpx.AsyncClient(
            base_url=f"https://localhost:{child.port}", verify=str(certs.ca_cert), timeout=300
        ) as http:
            for mode in MODES:  # warm-up: the grammar compiled once
                await _ask(http, mode, 4)
            for _ in range(args.rounds):
                for mode in MODES:
                    runs.append(await _ask(http, mode, args.max_tokens))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.tools")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--model", type=Path, help="GGUF (default: the project's default)")
    parser.add_argument("--logs", type=Path, default=Path("loadtest/results/tools-logs"))
    parser.add_argument(
        "--chat-template-file", type=Path, help="a chat template for the server (native tools)"
    )
    args = parser.parse_args(argv)
    args.logs.mkdir(parents=True, exist_ok=True)
    print(_render(asyncio.run(_measure(args, args.logs.resolve()))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
