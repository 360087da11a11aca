"""How often a model calls a tool under ``tool_choice: "auto"``: quicsrv against llama-server,
the same model, the same questions (issue 41).

Under ``auto`` the model decides whether to call (OpenAI's spec, and Open Responses'), so a
test that expects a call for a question a tool can serve — the Open Responses suite's
``tool-calling``: "What's the weather like in San Francisco?" with a ``get_weather`` tool — tests
the model as much as the server. This bench asks each question of :data:`QUESTIONS` ``--n``
times (sampled at ``--temperature``, the suite's requests leave it to the server) of both servers
through chat completions, and counts the answers that call a tool: where a tool fits, and where
none does (a call there is a wrong one)::

    .venv/bin/python -m loadtest.bench.tool_choice [--n 12] [--model GGUF]

Both servers are up side by side (:mod:`.servers`); the requests go to one server at a time, a
question's ``--n`` together. Printed as a table and written to
``loadtest/results/tool-choice-<stamp>.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.llama_server import llama_server
from loadtest.bench.llama_server_build import find_llama_server
from loadtest.bench.servers import ServerSettings, quicsrv_server
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv.settings import probe_cpu_extra_buffers

__all__ = ["QUESTIONS", "Question", "main"]


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


WEATHER = _function(
    "get_weather",
    "Get the current weather for a location",
    {
        "location": {
            "type": "string",
            "description": "The city and state, e.g. San Francisco, CA",
        }
    },
)
ADD = _function("add", "Add two numbers", {"a": {"type": "number"}, "b": {"type": "number"}})


@dataclass(frozen=True, slots=True)
class Question:
    name: str
    text: str
    tool: dict[str, Any]
    fits: bool
    """A tool serves it: a call is the right answer (else a text answer is)."""


QUESTIONS = (
    # The Open Responses suite's tool-calling test, word for word.
    Question("suite: weather in SF", "What's the weather like in San Francisco?", WEATHER, True),
    Question("weather in Paris", "Is it raining in Paris right now?", WEATHER, True),
    Question("a sum", "What is 1234 plus 5678?", ADD, True),
    Question("a haiku", "Write a haiku about the sea.", WEATHER, False),
    Question("a greeting", "Hello! Who are you?", WEATHER, False),
    Question("a capital", "What is the capital of France?", ADD, False),
)


async def _calls(
    client: httpx.AsyncClient, url: str, question: Question, n: int, temperature: float
) -> int:
    model = (await client.get(f"{url}/models")).json()["data"][0]["id"]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question.text}],
        "tools": [question.tool],
        "tool_choice": "auto",
        "temperature": temperature,
        "max_tokens": 128,
    }

    async def one() -> bool:
        response = await client.post(f"{url}/chat/completions", json=body)
        response.raise_for_status()
        return bool(response.json()["choices"][0]["message"].get("tool_calls"))

    return sum(await asyncio.gather(*(one() for _ in range(n))))


async def _measure(args: argparse.Namespace, logs: Path) -> dict[str, list[int]]:
    model = args.model or default_model_path()
    settings = ServerSettings(
        model_path=model, parallel=4, cpu_extra_buffers=probe_cpu_extra_buffers(model)
    )
    certs = ensure_dev_certs(logs / "certs")
    counts: dict[str, list[int]] = {}
    async with contextlib.AsyncExitStack() as stack:
        quicsrv = await stack.enter_async_context(
            quicsrv_server(settings, certs.server_cert, certs.server_key, logs / "quicsrv.log")
        )
        servers = [("quicsrv", f"https://localhost:{quicsrv.port}/v1")]
        binary = find_llama_server()
        if binary is not None:
            peer = await stack.enter_async_context(
                llama_server(binary, settings, logs / "llama-server.log")
            )
            servers.append(("llama-server", f"http://127.0.0.1:{peer.port}/v1"))
        else:
            print("llama-server not built (python -m loadtest.bench.llama_server_build): skipped")
        client = await stack.enter_async_context(
            httpx.AsyncClient(verify=str(certs.ca_cert), timeout=300)
        )
        for name, url in servers:
            counts[name] = [
                await _calls(client, url, q, args.n, args.temperature) for q in QUESTIONS
            ]
    return counts


def render(counts: dict[str, list[int]], n: int, heading: str) -> str:
    names = list(counts)
    lines = [
        heading,
        "",
        "| question | a tool fits | " + " | ".join(f"{s}: calls" for s in names) + " |",
        "|---|---|" + "---:|" * len(names),
    ]
    for i, q in enumerate(QUESTIONS):
        cells = " | ".join(f"{counts[s][i]}/{n}" for s in names)
        lines.append(f"| {q.name} | {'yes' if q.fits else 'no'} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=12, help="requests a question and server")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--model", type=Path, help="a GGUF (default: quicsrv's default model)")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    logs = args.out / f"tool-choice-{stamp}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    counts = asyncio.run(_measure(args, logs))
    model = (args.model or default_model_path()).name
    heading = (
        f"tool_choice auto, {model}, temperature {args.temperature}, {args.n} requests a "
        f"question, chat completions, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    )
    table = render(counts, args.n, heading)
    print(table)
    out = args.out / f"tool-choice-{stamp}.md"
    out.write_text(table + "\n")
    (args.out / f"tool-choice-{stamp}.json").write_text(json.dumps(counts, indent=2))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
