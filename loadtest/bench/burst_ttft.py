"""Time to first token where users arrive together or repeat themselves (issue 40): a burst of
simultaneous short prompts, a burst of simultaneous long ones (``--long-words``: 410 words,
about 512 tokens each), a prompt whose first token shows no text (``blank``: with the default
model, greedy, an end of turn and then a newline; its reader's first token is the second), and
the same prompt again (a retry, a "regenerate": the whole prompt is in the server's cache), each
a streamed ``/v1/completions`` over TCP (httpx, a
connection per stream), greedy, end-of-generation ignored.

The servers (this tree's quicsrv; another checkout's with ``--tree``; llama.cpp's llama-server
when :mod:`loadtest.bench.llama_server_build` built one) are started once, side by side with
the same model, slots, context, batch and threads, and take turns round by round (the order
reversed every other round); an idle one sleeps. Every round's prompts are new (a round number
up front), so no server finds a burst prompt, or the first of a repeated pair, in a cache.

    python -m loadtest.bench.burst_ttft --rounds 6 [--long-words 410] [--tree CHECKOUT]
        [--llama-server auto|none|PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench.llama_server import llama_server
from loadtest.bench.llama_server_build import chosen_llama_server
from loadtest.bench.machine import wait_until_quiet
from loadtest.bench.servers import ServerSettings, quicsrv_server
from loadtest.bench.stats import PROMPTS, percentile
from loadtest.bench.ttft_paths import _event_text
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv.settings import probe_cpu_extra_buffers

__all__ = ["main"]

WORKLOADS = ("burst", "long", "blank", "cold", "again")

MODEL_NAME = "bench"
LONG_TEXT = " ".join(PROMPTS) + " " + " ".join(PROMPTS[:8])
"""The repeated prompt's body: about 170 tokens, a short system prompt's worth."""
BLANK_FIRST = PROMPTS[1]
"""A prompt whose first token shows no text (the default model, greedy, after a round tag)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    name: str
    base_url: str
    verify: str | bool
    keep_alive: bool = True
    """llama-server closes a connection after a streamed response (Keep-Alive or not)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    server: str
    round: int
    workload: str
    """``burst`` (one of the simultaneous short prompts), ``long`` (one of the simultaneous long
    ones), ``cold`` (a new prompt) or ``again`` (the same prompt right after)."""
    ttft_s: float


async def _first_token_s(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> float:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    first = float("nan")
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.is_error:
            await response.aread()
            raise RuntimeError(f"{http.base_url}: {response.status_code} {response.text}")
        async for line in response.aiter_lines():
            if first != first and _event_text(line):
                first = time.perf_counter() - sent
    return first


def _client(endpoint: Endpoint, streams: int) -> httpx.AsyncClient:
    keep = streams if endpoint.keep_alive else 0
    return httpx.AsyncClient(
        base_url=endpoint.base_url,
        verify=endpoint.verify,
        limits=httpx.Limits(max_connections=streams, max_keepalive_connections=keep),
        timeout=120,
    )


async def _round(
    endpoint: Endpoint, http: httpx.AsyncClient, r: int, args: argparse.Namespace
) -> list[Sample]:
    samples = []
    burst = [f"Round {r}. {PROMPTS[i % len(PROMPTS)]}" for i in range(args.streams)]
    ttfts = await asyncio.gather(*(_first_token_s(http, p, args.max_tokens) for p in burst))
    samples += [Sample(server=endpoint.name, round=r, workload="burst", ttft_s=t) for t in ttfts]
    if args.long_words > 0:
        # Each stream's own text from its first word on, so no prompt finds another's cells.
        words = " ".join(PROMPTS * 8).split()
        long = [
            f"Round {r}, reader {i}: " + " ".join(words[i * 7 :][: args.long_words])
            for i in range(args.streams)
        ]
        ttfts = await asyncio.gather(*(_first_token_s(http, p, args.max_tokens) for p in long))
        samples += [Sample(server=endpoint.name, round=r, workload="long", ttft_s=t) for t in ttfts]
    ttft = await _first_token_s(http, f"Alone {r}. {BLANK_FIRST}", args.max_tokens)
    samples.append(Sample(server=endpoint.name, round=r, workload="blank", ttft_s=ttft))
    prompt = f"Round {r}. {LONG_TEXT}"
    for workload in ("cold", "again"):
        ttft = await _first_token_s(http, prompt, args.max_tokens)
        samples.append(Sample(server=endpoint.name, round=r, workload=workload, ttft_s=ttft))
    return samples


async def _measure(args: argparse.Namespace, logs: Path) -> list[Sample]:
    model = default_model_path()
    settings = ServerSettings(
        model_path=model, n_threads=args.threads, cpu_extra_buffers=probe_cpu_extra_buffers(model)
    )
    certs = ensure_dev_certs(logs / "certs")
    env = {"QUICSRV_MODEL_NAME": MODEL_NAME}
    endpoints: list[Endpoint] = []
    async with contextlib.AsyncExitStack() as stack:
        trees: list[tuple[str, Path | None]] = [("quicsrv", None)]
        if args.tree is not None:
            trees.append((f"quicsrv@{args.tree.name}", args.tree))
        for name, tree in trees:
            child = await stack.enter_async_context(
                quicsrv_server(
                    settings,
                    certs.server_cert,
                    certs.server_key,
                    logs / f"{name.replace('/', '_')}.log",
                    tree=tree,
                    env=env,
                )
            )
            url = f"https://localhost:{child.port}"
            endpoints.append(Endpoint(name=name, base_url=url, verify=str(certs.ca_cert)))
        binary = chosen_llama_server(args.llama_server)
        if binary is not None:
            child = await stack.enter_async_context(
                llama_server(binary, settings, logs / "llama-server.log")
            )
            url = f"http://127.0.0.1:{child.port}"
            endpoints.append(
                Endpoint(name="llama-server", base_url=url, verify=False, keep_alive=False)
            )
        # One client per server for the whole run, as an SDK keeps one: its connections (TLS
        # handshakes included) are made in the warm-up and reused, where the server keeps them.
        clients = {
            e.name: await stack.enter_async_context(_client(e, args.streams)) for e in endpoints
        }
        for endpoint in endpoints:  # warm-up: first-use costs
            await _round(endpoint, clients[endpoint.name], -1, args)
        samples: list[Sample] = []
        for r in range(args.rounds):
            for endpoint in endpoints if r % 2 == 0 else list(reversed(endpoints)):
                # What the last turn left running (a server writing its cache to disk once
                # idle, the kernel flushing it) is not this server's to pay for.
                busy = await asyncio.to_thread(
                    wait_until_quiet, args.quiet_below, args.quiet_patience_s, 0.5
                )
                if busy > args.quiet_below:
                    print(f"round {r} {endpoint.name}: the machine stayed {busy:.0%} busy")
                mine = await _round(endpoint, clients[endpoint.name], r, args)
                samples += mine
                medians = {
                    w: statistics.median(s.ttft_s for s in mine if s.workload == w) * 1000
                    for w in WORKLOADS
                    if any(s.workload == w for s in mine)
                }
                line = "  ".join(f"{w} {ms:5.0f}" for w, ms in medians.items())
                print(f"round {r} {endpoint.name:28} TTFT ms (median): {line}", flush=True)
    return samples


def _table(samples: list[Sample], args: argparse.Namespace) -> str:
    servers = list(dict.fromkeys(s.server for s in samples))
    lines = [
        f"{args.streams} simultaneous short prompts (burst), {args.streams} simultaneous "
        f"prompts of {args.long_words} words (long), a prompt whose first token shows no text "
        f"(blank), and a ~170-token prompt sent (cold) then sent again (again); "
        f"{args.max_tokens} tokens each, {args.rounds} rounds, "
        f"servers taking turns, n_threads={args.threads}; TTFT at the client, ms",
        "",
        "| server | burst p50 | burst p90 | burst max | long p50 | long p90 | blank p50 "
        "| cold p50 | again p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for server in servers:

        def of(workload: str, server: str = server) -> list[float]:
            return sorted(
                s.ttft_s * 1000 for s in samples if s.server == server and s.workload == workload
            )

        burst, long, cold, again = of("burst"), of("long"), of("cold"), of("again")
        blank50 = percentile(of("blank"), 50) or 0.0
        p50, p90 = percentile(burst, 50) or 0.0, percentile(burst, 90) or 0.0
        long50, long90 = percentile(long, 50) or 0.0, percentile(long, 90) or 0.0
        cold50, again50 = percentile(cold, 50) or 0.0, percentile(again, 50) or 0.0
        lines.append(
            f"| {server} | {p50:.0f} | {p90:.0f} | {burst[-1]:.0f} | {long50:.0f} | "
            f"{long90:.0f} | {blank50:.0f} | {cold50:.0f} | {again50:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.burst_ttft",
        description="TTFT of a burst of short prompts and of the same prompt again",
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--long-words", type=int, default=410, help="words of each long prompt (0: none)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tree", type=Path, help="also serve this checkout (an earlier commit)")
    parser.add_argument("--llama-server", default="auto", help="auto, none or a binary's path")
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.1,
        help="before each turn, wait until the machine is busy less than this share",
    )
    parser.add_argument("--quiet-patience-s", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    logs = (args.out / f"burst-ttft-{stamp}-logs").resolve()
    logs.mkdir(parents=True, exist_ok=True)
    samples = asyncio.run(_measure(args, logs))
    table = _table(samples, args)
    print(table)
    (args.out / f"burst-ttft-{stamp}.md").write_text(table)
    report: dict[str, Any] = {
        "argv": sys.argv[1:] if argv is None else argv,
        "samples": [asdict(s) for s in samples],
    }
    (args.out / f"burst-ttft-{stamp}.json").write_text(json.dumps(report))
    print(f"wrote {args.out / f'burst-ttft-{stamp}.md'} and .json; logs in {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
