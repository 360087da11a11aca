"""CPU per delivered token, server and client, for several quicsrv set-ups side by side.

On 2 cores every microsecond the server or the client spends per token is taken from llama.cpp's
threads, so this is the number a change to the per-token path must move. Each ``--server`` is a
quicsrv (this checkout or another, with its own ``QUICSRV_*`` settings); all of them run at once
and take turns, round after round, in alternating order, so drift in the machine's speed hits
them alike. Per run: delivered tokens/s, the server process's CPU (its threads' schedstat, to
the nanosecond; its engine worker excluded) and this client process's CPU, each per delivered
token; the table shows medians.

    python -m loadtest.bench.cpu --streams 1 --max-tokens 256 --rounds 4 \\
        --server now --server coalesce-off:QUICSRV_TOKEN_COALESCE_MS=0 \\
        --server before:tree=/tmp/base,ack_ms=1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from loadtest.bench.load import run_quicsrv_load
from loadtest.bench.machine import threads_cpu_s
from loadtest.bench.servers import Child, ServerSettings, quicsrv_server
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv.settings import probe_cpu_extra_buffers

__all__ = ["ServerSpec", "main", "parse_spec"]

WARMUP_TOKENS = 8


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """``NAME[:KEY=VALUE,...]``: ``tree=DIR`` (another checkout), ``ack_ms=N`` (the client's
    ACK delay against it), anything else a ``QUICSRV_*`` variable for that server."""

    name: str
    tree: Path | None = None
    ack_delay_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)


def parse_spec(text: str) -> ServerSpec:
    name, _, options = text.partition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"{text!r}: a server needs a name")
    tree: Path | None = None
    ack: float | None = None
    env: dict[str, str] = {}
    for option in filter(None, options.split(",")):
        key, sep, value = option.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{option!r}: expected KEY=VALUE")
        if key == "tree":
            tree = Path(value).resolve()
        elif key == "ack_ms":
            ack = float(value) / 1000
        elif key.startswith("QUICSRV_"):
            env[key] = value
        else:
            raise argparse.ArgumentTypeError(f"{key!r}: expected tree, ack_ms or QUICSRV_*")
    return ServerSpec(name, tree, ack, env)


@dataclass(frozen=True, slots=True)
class Run:
    server: str
    round: int
    tokens: int
    tokens_per_s: float
    server_us_per_token: float
    client_us_per_token: float


def _client_cpu_s() -> float:
    return time.process_time()  # to the nanosecond, like threads_cpu_s for the server


async def _one_run(
    spec: ServerSpec, server: Child, ca: Path, args: argparse.Namespace, round_: int
) -> Run:
    server_before, client_before = threads_cpu_s(server.pid), _client_cpu_s()
    started = time.perf_counter()
    _, results = await run_quicsrv_load(
        server.port,
        ca,
        streams=args.streams,
        max_tokens=args.max_tokens,
        timeout_s=600,
        ack_delay_s=spec.ack_delay_s,
    )
    wall_s = time.perf_counter() - started
    tokens = sum(r.delivered for r in results)
    if tokens < args.streams * args.max_tokens:
        raise SystemExit(f"{spec.name}: {tokens} of {args.streams * args.max_tokens} tokens")
    return Run(
        server=spec.name,
        round=round_,
        tokens=tokens,
        tokens_per_s=tokens / wall_s,
        server_us_per_token=1e6 * (threads_cpu_s(server.pid) - server_before) / tokens,
        client_us_per_token=1e6 * (_client_cpu_s() - client_before) / tokens,
    )


async def _measure(specs: list[ServerSpec], args: argparse.Namespace, logs: Path) -> list[Run]:
    """Every server built as the side-by-side benchmark builds quicsrv (same model, threads,
    context, flash attention), each warmed up, then the rounds."""
    model = default_model_path()
    settings = ServerSettings(model_path=model, cpu_extra_buffers=probe_cpu_extra_buffers(model))
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="quicsrv-cpu-") as tmp:
        certs = ensure_dev_certs(Path(tmp))
        async with contextlib.AsyncExitStack() as stack:
            servers: list[tuple[ServerSpec, Child]] = []
            for spec in specs:
                server = await stack.enter_async_context(
                    quicsrv_server(
                        settings,
                        certs.server_cert,
                        certs.server_key,
                        logs / f"{spec.name}.log",
                        tree=spec.tree,
                        env=spec.env,
                    )
                )
                await run_quicsrv_load(
                    server.port, certs.ca_cert, streams=1, max_tokens=WARMUP_TOKENS, timeout_s=600
                )
                servers.append((spec, server))
            for round_ in range(args.rounds):
                for spec, server in servers if round_ % 2 == 0 else servers[::-1]:
                    run = await _one_run(spec, server, certs.ca_cert, args, round_)
                    print(
                        f"  {run.server} round {round_}: {run.tokens_per_s:.1f} tokens/s, "
                        f"server {run.server_us_per_token:.0f} µs/token, "
                        f"client {run.client_us_per_token:.0f}",
                        flush=True,
                    )
                    runs.append(run)
    return runs


def _table(specs: list[ServerSpec], runs: list[Run], args: argparse.Namespace) -> str:
    lines = [
        f"{args.streams} stream(s) × {args.max_tokens} greedy tokens, {args.rounds} rounds; "
        "medians over the rounds",
        "",
        "| server | tokens/s | server CPU µs / token | client CPU µs / token |",
        "|---|---:|---:|---:|",
    ]
    for spec in specs:
        mine = [r for r in runs if r.server == spec.name]
        lines.append(
            f"| {spec.name} | {statistics.median(r.tokens_per_s for r in mine):.1f} "
            f"| {statistics.median(r.server_us_per_token for r in mine):.0f} "
            f"| {statistics.median(r.client_us_per_token for r in mine):.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.cpu",
        description="CPU per delivered token (server and client) of quicsrv set-ups, side by side",
    )
    parser.add_argument(
        "--server",
        dest="servers",
        type=parse_spec,
        action="append",
        metavar="NAME[:KEY=VALUE,...]",
        help="a server to measure (repeatable): tree=DIR, ack_ms=N, QUICSRV_*=VALUE",
    )
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)
    specs: list[ServerSpec] = args.servers or [ServerSpec("now")]
    if len({s.name for s in specs}) != len(specs):
        parser.error("server names must differ")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    logs = args.out / f"cpu-{stamp}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    runs = asyncio.run(_measure(specs, args, logs))
    table = _table(specs, runs, args)
    print(table)
    (args.out / f"cpu-{stamp}.md").write_text(table)
    (args.out / f"cpu-{stamp}.json").write_text(
        json.dumps(
            {"argv": sys.argv[1:] if argv is None else argv, "runs": [asdict(r) for r in runs]},
            indent=2,
        )
    )
    print(f"wrote {args.out / f'cpu-{stamp}.md'} and .json; server logs in {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
