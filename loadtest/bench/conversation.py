"""A chat conversation whose client resends the whole history every turn: time to first token
per turn for quicsrv, llama.cpp's own ``llama-server`` (prompt cache on) and raw llama.cpp in
this machine's Python with a perfect prefix cache by hand (issue 30, part 5). And the same
conversation through quicsrv's Responses API, where the client sends only its new message and
``previous_response_id`` (the server builds the prompt from the stored turns; issue 31).

Each turn adds ~``--user-tokens`` tokens of user text; the history sent is every earlier user
message and the answer that system itself gave (greedy, ``max_tokens`` fixed, end-of-generation
ignored, so every answer has the same length). One client harness (httpx over HTTP/1.1: one
connection for quicsrv's conversation, one per request for llama-server's, which drops a
connection after a stream; ``POST /v1/chat/completions`` with ``stream: true``) times request
sent → first chunk with content, against each server in turn, never two model servers at
once; every conversation gets a fresh server, so nothing cached by an earlier one helps it::

    .venv/bin/python -m loadtest.bench.conversation [--turns 8] [--user-tokens 150]
        [--max-tokens 64] [--repeats 1] [--llama-server PATH|auto|none]

llama-server is the cached build of :mod:`loadtest.bench.llama_server_build` (``auto``); without
one its rows say so. Prints the report and writes ``loadtest/results/conversation-<ts>.{md,json}``
(``--report-only JSON`` re-renders one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.conversation_raw import converse_raw
from loadtest.bench.conversation_report import (
    LLAMA_SERVER,
    NO_BUILD,
    QUICSRV,
    QUICSRV_RESPONSES,
    RAW_INCREMENTAL,
    TurnResult,
    render,
)
from loadtest.bench.conversation_script import history, user_turns
from loadtest.bench.isolated import isolated
from loadtest.bench.llama_server import llama_server, llama_server_argv
from loadtest.bench.llama_server_build import cmake_options, find_llama_server
from loadtest.bench.machine import CpuMeter, Quiet
from loadtest.bench.servers import ServerSettings, quicsrv_server
from quicsrv.config import ServerConfig
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv.engine.vocab import Vocabulary
from quicsrv.settings import probe_cpu_extra_buffers

__all__ = ["main"]

MODEL_NAME = "bench"
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class _Endpoint:
    """Where one server answers, and what its requests carry beyond the shared fields."""

    base_url: str
    verify: str | bool
    extra: dict[str, Any]
    """quicsrv refuses fields it does not act on (``cache_prompt``); llama-server needs it."""
    keep_alive: bool = True
    """False: a new connection per request. llama-server answers ``Keep-Alive`` but drops the
    connection after a streamed response, and the next request on it fails (measured: "Server
    disconnected without sending a response"); a loopback TCP connect costs ~0.1 ms."""


@dataclass(frozen=True, slots=True)
class _Reply:
    ttft_s: float
    text: str
    usage: dict[str, Any]
    timings: dict[str, Any]


def _reused(reply: _Reply) -> int | None:
    """Prompt tokens the server says it did not prefill again, if it says."""
    details = reply.usage.get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    cache_n = reply.timings.get("cache_n")  # llama-server's own account
    return int(cache_n) if isinstance(cache_n, int) else None


async def _events(
    http: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of one streamed POST (SSE ``data:`` lines, ``[DONE]`` left out)."""
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode("utf-8", "replace")
            raise RuntimeError(f"HTTP {response.status_code}: {detail[:500]}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: ") :])


async def _ask_responses(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[_Reply, str]:
    """One streamed ``POST /v1/responses``: the reply (usage in chat completions' names) and
    the response id."""
    first = float("nan")
    text: list[str] = []
    usage: dict[str, Any] = {}
    response_id = ""
    sent = time.perf_counter()
    async for event in _events(http, "/v1/responses", body):
        kind = event.get("type", "")
        if kind == "response.created":
            response_id = event["response"]["id"]
        elif kind == "response.output_text.delta" and event["delta"]:
            if not text:
                first = time.perf_counter() - sent
            text.append(event["delta"])
        elif kind in ("response.completed", "response.incomplete"):
            got = event["response"]["usage"]
            usage = {
                "prompt_tokens": got["input_tokens"],
                "completion_tokens": got["output_tokens"],
                "prompt_tokens_details": got["input_tokens_details"],
            }
        elif kind == "error":
            raise RuntimeError(f"error event: {event}")
    return _Reply(ttft_s=first, text="".join(text), usage=usage, timings={}), response_id


async def _ask(http: httpx.AsyncClient, body: dict[str, Any]) -> _Reply:
    """One streamed chat completion: seconds to the first content, the text, usage, timings."""
    first = float("nan")
    text: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    sent = time.perf_counter()
    async for event in _events(http, "/v1/chat/completions", body):
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content") or ""
            if content and not text:
                first = time.perf_counter() - sent
            if content:
                text.append(content)
        usage = event.get("usage") or usage
        timings = event.get("timings") or timings
    return _Reply(ttft_s=first, text="".join(text), usage=usage, timings=timings)


def _body(messages: list[dict[str, str]], max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "repeat_penalty": 1.0,  # llama-server's default was 1.1 in older versions
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def _converse_http(
    endpoint: _Endpoint,
    system: str,
    users: Sequence[str],
    max_tokens: int,
    repeat: int,
    *,
    responses: bool = False,
) -> list[TurnResult]:
    """The conversation over one keep-alive HTTP/1.1 connection, after a short warm-up
    (``responses``: through ``/v1/responses``, each turn naming the previous one)."""
    results: list[TurnResult] = []
    limits = httpx.Limits(max_keepalive_connections=None if endpoint.keep_alive else 0)
    async with httpx.AsyncClient(
        base_url=endpoint.base_url,
        verify=endpoint.verify,
        timeout=REQUEST_TIMEOUT_S,
        limits=limits,
    ) as http:
        warm_up = [{"role": "user", "content": "Say hello."}]
        await _ask(http, _body(warm_up, 8, endpoint.extra))
        answers: list[str] = []
        previous = None
        for turn in range(len(users)):
            if responses:
                reply, previous = await _ask_responses(
                    http, _responses_body(users[turn], previous, max_tokens)
                )
            else:
                body = _body(history(users, answers, turn), max_tokens, endpoint.extra)
                reply = await _ask(http, body)
            answers.append(reply.text)
            results.append(
                TurnResult(
                    system=system,
                    repeat=repeat,
                    turn=turn + 1,
                    ttft_s=reply.ttft_s,
                    prompt_tokens=reply.usage.get("prompt_tokens"),
                    reused_tokens=_reused(reply),
                    completion_tokens=reply.usage.get("completion_tokens"),
                )
            )
            print(
                f"  {system} turn {turn + 1}: TTFT {reply.ttft_s * 1000:6.0f} ms, prompt "
                f"{reply.usage.get('prompt_tokens')}, reused {_reused(reply)}",
                flush=True,
            )
    return results


def _responses_body(user: str, previous: str | None, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "input": user,
        "max_output_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    if previous is not None:
        body["previous_response_id"] = previous
    return body


async def _quicsrv(
    settings: ServerSettings,
    users: Sequence[str],
    args: argparse.Namespace,
    logs: Path,
    r: int,
    *,
    responses: bool = False,
) -> list[TurnResult]:
    certs = ensure_dev_certs(logs / "certs")
    env = {"QUICSRV_MODEL_NAME": MODEL_NAME}
    system = QUICSRV_RESPONSES if responses else QUICSRV
    log_name = f"quicsrv-{'responses-' if responses else ''}{r}.log"
    async with quicsrv_server(
        settings, certs.server_cert, certs.server_key, logs / log_name, env=env
    ) as child:
        endpoint = _Endpoint(
            base_url=f"https://localhost:{child.port}", verify=str(certs.ca_cert), extra={}
        )
        meter = CpuMeter([child.pid])
        results = await _converse_http(
            endpoint, system, users, args.max_tokens, r, responses=responses
        )
        others = meter.stop()
    return [replace(result, others_cpu_share=others) for result in results]


async def _llama_server(
    binary: Path,
    settings: ServerSettings,
    users: Sequence[str],
    args: argparse.Namespace,
    logs: Path,
    r: int,
) -> list[TurnResult]:
    async with llama_server(binary, settings, logs / f"llama-server-{r}.log") as child:
        endpoint = _Endpoint(
            base_url=f"http://127.0.0.1:{child.port}",
            verify=False,
            extra={"cache_prompt": True},
            keep_alive=False,
        )
        meter = CpuMeter([child.pid])
        results = await _converse_http(endpoint, LLAMA_SERVER, users, args.max_tokens, r)
        others = meter.stop()
    return [replace(result, others_cpu_share=others) for result in results]


def _llama_server_binary(choice: str) -> tuple[Path | None, str]:
    """The binary to run and, if none, why (the report's note)."""
    if choice == "none":
        return None, "skipped: --llama-server none"
    if choice == "auto":
        found = find_llama_server()
        return (found, "") if found is not None else (None, NO_BUILD)
    path = Path(choice)
    return (path, "") if path.is_file() else (None, f"skipped: {path} not found")


def _measure(
    args: argparse.Namespace, settings: ServerSettings, binary: Path | None, logs: Path
) -> list[TurnResult]:
    vocabulary = Vocabulary.load(settings.model_path)
    try:
        users = user_turns(
            args.turns,
            args.user_tokens,
            lambda text: len(vocabulary.tokenize(text, add_special=False)),
        )
    finally:
        vocabulary.close()
    quiet = Quiet(args.quiet_below, args.quiet_patience_s)
    systems = [RAW_INCREMENTAL, QUICSRV] + ([LLAMA_SERVER] if binary is not None else [])
    if args.responses:
        systems.append(QUICSRV_RESPONSES)
    results: list[TurnResult] = []
    for r in range(args.repeats):
        # Rotate the order each repeat: a drifting machine then hits every system alike.
        for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
            busy = quiet()
            print(f"repeat {r + 1}/{args.repeats}: {system} (others' CPU {busy:.0%})", flush=True)
            if system == RAW_INCREMENTAL:
                runs = isolated(converse_raw, settings, users, args.max_tokens, r)
                for run in runs:
                    print(
                        f"  {run.system} turn {run.turn}: TTFT {run.ttft_s * 1000:6.0f} ms, "
                        f"prompt {run.prompt_tokens}, reused {run.reused_tokens}",
                        flush=True,
                    )
            elif system in (QUICSRV, QUICSRV_RESPONSES):
                responses = system == QUICSRV_RESPONSES
                runs = asyncio.run(_quicsrv(settings, users, args, logs, r, responses=responses))
            else:
                assert binary is not None
                runs = asyncio.run(_llama_server(binary, settings, users, args, logs, r))
            results += runs
    return results


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.conversation",
        description="TTFT per turn of a conversation that resends its whole history: quicsrv, "
        "llama-server, raw llama.cpp with incremental prefill",
    )
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user-tokens", type=int, default=150, help="tokens per user turn")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--repeats", type=int, default=1, help="conversations per system")
    parser.add_argument(
        "--llama-server",
        default="auto",
        metavar="PATH|auto|none",
        help="llama-server binary; auto: the cached build if there is one (default)",
    )
    parser.add_argument(
        "--flash-attn",
        action=argparse.BooleanOptionalAction,
        default=ServerConfig().flash_attn,
        help="flash attention everywhere (default: quicsrv's default)",
    )
    parser.add_argument(
        "--responses",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the conversation through /v1/responses with previous_response_id",
    )
    parser.add_argument("--model", type=Path, help="GGUF (default: the project's default)")
    parser.add_argument("--quiet-below", type=float, default=0.15)
    parser.add_argument("--quiet-patience-s", type=float, default=60.0)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    parser.add_argument("--report-only", type=Path, metavar="JSON", help="re-render a run")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.report_only is not None:
        saved = json.loads(args.report_only.read_text())
        results = [TurnResult(**r) for r in saved["results"]]
        print(render(results, **saved["report"]))
        return 0
    model = args.model or default_model_path()
    settings = ServerSettings(
        model_path=model,
        flash_attn=args.flash_attn,
        # The raw run loads llama.cpp in a process of ours: follow quicsrv's canary on AMX.
        cpu_extra_buffers=probe_cpu_extra_buffers(model),
    )
    binary, note = _llama_server_binary(args.llama_server)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    logs = (args.out / f"conversation-{stamp}-logs").resolve()
    logs.mkdir(parents=True, exist_ok=True)
    results = _measure(args, settings, binary, logs)
    report = {"turns": args.turns, "repeats": args.repeats, "llama_server_note": note}
    text = render(results, **report)
    print(text)
    (args.out / f"conversation-{stamp}.md").write_text(text)
    saved = {
        "argv": sys.argv[1:] if argv is None else argv,
        "settings": {k: str(v) for k, v in asdict(settings).items()},
        "llama_server": None
        if binary is None
        else {"argv": llama_server_argv(binary, settings), "cmake": cmake_options()},
        "report": report,
        "results": [asdict(r) for r in results],
    }
    (args.out / f"conversation-{stamp}.json").write_text(json.dumps(saved, indent=1))
    print(f"wrote {args.out / f'conversation-{stamp}.md'} and .json; logs in {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
