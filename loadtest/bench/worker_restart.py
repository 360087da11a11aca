"""Engine worker crash: what a client sees when the worker process is killed mid-generation.

``quicsrv serve`` runs as it does in production (its engine in a worker process). N streams
generate on one connection; when stream 0 has received token K, the worker gets SIGKILL. For
every stream the clock runs from the kill to the first token after it (restart-to-next-token:
detection, a new worker loading the model and passing its canary, then the exact replay of the
prompt and of every token generated so far). Each run also checks the joined output against an
uninterrupted run of the same streams: tokens lost, repeated or different.

Run: ``.venv/bin/python -m loadtest.bench.worker_restart [--streams 1 4] [--kill-at 16 64 112]
[--runs 3] [--max-tokens 128]``. Prints a table; writes
``loadtest/results/worker-restart-<time>.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from loadtest.bench.servers import ServerSettings, quicsrv_server
from loadtest.bench.stats import PROMPTS
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv_client import Client, TokenReceived

PARAMS = dict(temperature=0.0, ignore_eos=True)


@dataclass(frozen=True, slots=True)
class Run:
    streams: int
    kill_at: int
    restart_to_next_token_ms: list[float]  # one per stream that was still generating
    usual_gap_ms: float  # median inter-token gap of the same run, away from the kill
    identical: int  # streams whose whole output equals the uninterrupted run
    worker_restarted: bool


def _worker_pid(server_pid: int) -> int:
    """The server's child process: its engine worker."""
    for task in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{task}/children") as f:
            children = f.read().split()
        if children:
            return int(children[0])
    raise RuntimeError(f"quicsrv (pid {server_pid}) has no worker process")


async def _generate(
    port: int, ca: Path, streams: int, max_tokens: int, kill: tuple[int, int] | None
) -> tuple[list[list[int]], list[list[float]], float | None]:
    """Token ids and arrival times per stream; with ``kill=(server_pid, K)``, SIGKILL the
    worker when stream 0 receives token K, and return the kill's time."""
    ids: list[list[int]] = [[] for _ in range(streams)]
    times: list[list[float]] = [[] for _ in range(streams)]
    killed_at: list[float] = []
    async with Client("127.0.0.1", port, ca=ca) as client:

        async def one(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            async for event in client.generate(prompt, max_tokens=max_tokens, **PARAMS):
                if not isinstance(event, TokenReceived):
                    continue
                ids[i].append(event.token_id)
                times[i].append(time.perf_counter())
                if kill is not None and i == 0 and event.index == kill[1] and not killed_at:
                    os.kill(_worker_pid(kill[0]), signal.SIGKILL)
                    killed_at.append(time.perf_counter())

        await asyncio.gather(*(one(i) for i in range(streams)))
    return ids, times, (killed_at[0] if killed_at else None)


async def measure(args: argparse.Namespace) -> list[Run]:
    runs: list[Run] = []
    model = args.model or default_model_path()
    with tempfile.TemporaryDirectory(prefix="quicsrv-restart-") as scratch:
        certs = ensure_dev_certs(Path(scratch) / "certs")
        settings = ServerSettings(model_path=model)
        log = Path(scratch) / "server.log"
        async with quicsrv_server(settings, certs.server_cert, certs.server_key, log) as server:
            for streams in args.streams:
                reference, _, _ = await _generate(
                    server.port, certs.ca_cert, streams, args.max_tokens, None
                )
                for kill_at in args.kill_at:
                    for _ in range(args.runs):
                        before = _worker_pid(server.pid)
                        ids, times, killed = await _generate(
                            server.port,
                            certs.ca_cert,
                            streams,
                            args.max_tokens,
                            (server.pid, kill_at),
                        )
                        assert killed is not None
                        # Tokens already in flight arrive just after the kill; the restart is
                        # the stream's longest silence after it, and ends with its next token.
                        resumed = [_end_of_longest_gap(ts, killed) for ts in times]
                        gaps = [
                            1e3 * (b - a)
                            for ts in times
                            for a, b in zip(ts, ts[1:], strict=False)
                            if not a <= killed <= b
                        ]
                        run = Run(
                            streams=streams,
                            kill_at=kill_at,
                            restart_to_next_token_ms=[
                                1e3 * (t - killed) for t in resumed if t is not None
                            ],
                            usual_gap_ms=statistics.median(gaps) if gaps else 0.0,
                            identical=sum(a == b for a, b in zip(ids, reference, strict=True)),
                            worker_restarted=_worker_pid(server.pid) != before,
                        )
                        runs.append(run)
                        print(_row(run), file=sys.stderr, flush=True)
    return runs


def _end_of_longest_gap(times: list[float], since: float) -> float | None:
    """The arrival that ends the longest silence after ``since`` (None: nothing came)."""
    previous = max([t for t in times if t <= since], default=since)
    best: tuple[float, float] | None = None
    for t in (t for t in times if t > since):
        if best is None or t - previous > best[0]:
            best = (t - previous, t)
        previous = t
    return best[1] if best is not None else None


def _row(run: Run) -> str:
    waits = run.restart_to_next_token_ms
    median = statistics.median(waits) if waits else float("nan")
    worst = max(waits) if waits else float("nan")
    return (
        f"| {run.streams} | {run.kill_at} | {median:.0f} | {worst:.0f} | {run.usual_gap_ms:.0f} "
        f"| {run.identical}/{run.streams} | {'yes' if run.worker_restarted else 'NO'} |"
    )


def report(runs: list[Run], args: argparse.Namespace) -> str:
    lines = [
        f"# Engine worker kill -9: restart to next token ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        f"`python -m loadtest.bench.worker_restart --streams {' '.join(map(str, args.streams))} "
        f"--kill-at {' '.join(map(str, args.kill_at))} --runs {args.runs} "
        f"--max-tokens {args.max_tokens}`; greedy, EOS ignored, one connection, "
        f"{os.cpu_count()} CPUs.",
        "",
        "| streams | killed at token | kill → next token p50 ms | max ms | usual gap ms "
        "| identical to uninterrupted | new worker |",
        "|---:|---:|---:|---:|---:|---:|---|",
        *(_row(r) for r in runs),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.worker_restart")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--kill-at", type=int, nargs="+", default=[16, 64, 112])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    # Every run kills a worker on purpose: lift the crash-loop bound for the server we start.
    os.environ["QUICSRV_WORKER_MAX_RESTARTS"] = str(10 * len(args.kill_at) * args.runs + 10)
    runs = asyncio.run(measure(args))
    text = report(runs, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"worker-restart-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    print(f"wrote {stem}.md, {stem}.json")


if __name__ == "__main__":
    main()
