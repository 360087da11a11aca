"""Scaling out: resume latency by store backend, and throughput of N=1 vs N=2 processes.

1. **Resume latency by backend.** ``quicsrv serve`` with ``--store file`` and with
   ``--store redis://`` (a ``redis-server`` started here, Unix socket). Each run: a generation is
   cut after token 10 (its connection closed), then resumed on a new connection; the clock runs
   from ``connect()`` to the first resumed token. With Redis the resume is also timed on a
   *second* process (the record, token log and KV blob fetched from Redis, the lease taken over).
   Every resumed output is checked against an uninterrupted run.
2. **Throughput, N=1 vs N=2.** ``--workers 1`` (2 engine threads) with the file store and with
   Redis, and ``--workers 2`` (1 thread each, two model copies) on one port with Redis;
   ``--streams`` generations at once, each on its own connection (the kernel spreads
   connections over the workers by 4-tuple hash); aggregate tokens/s over the wall time of the
   batch, runs interleaved across the set-ups.

Run: ``.venv/bin/python -m loadtest.bench.scale [--runs 8] [--streams 8] [--max-tokens 64]``
Writes ``loadtest/results/scale-<time>.{md,json}`` and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from quicsrv.devcerts import DevCertPaths, ensure_dev_certs
from quicsrv.spawn import spawn_server_async
from quicsrv_client import Client, GenerationEnded, TokenReceived

PROMPT = "Write a long, detailed history of the city of Rome, century by century."


@contextlib.contextmanager
def _redis(directory: Path) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (make system-deps)")
    sock = directory / "redis.sock"
    process = subprocess.Popen(
        [binary, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(unix_socket_path=str(sock))
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()
        yield f"unix://{sock}"
    finally:
        process.kill()
        process.wait()


@contextlib.asynccontextmanager
async def _server(certs: DevCertPaths, data_dir: Path, *extra: str) -> AsyncIterator[int]:
    args = [
        "--host", "127.0.0.1", "--port", "0",
        "--cert", str(certs.server_cert), "--key", str(certs.server_key),
        "--data-dir", str(data_dir), *extra,
    ]  # fmt: skip
    async with spawn_server_async(args, stop_timeout_s=60.0) as server:
        yield server.port


async def _reference(port: int, ca: Path, max_tokens: int) -> list[int]:
    async with Client("127.0.0.1", port, ca=ca) as c:
        result = await c.generate_text(PROMPT, max_tokens=max_tokens, ignore_eos=True)
    return list(result.token_ids)


async def _cut_and_resume(
    start_port: int, resume_port: int, ca: Path, max_tokens: int, reference: list[int]
) -> tuple[float, str]:
    ids: list[int] = []
    client = Client("127.0.0.1", start_port, ca=ca)
    await client.connect()
    generation = client.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True)
    async for event in generation:
        if isinstance(event, TokenReceived):
            ids.append(event.token_id)
            if len(ids) == 10:
                break
    position = generation.position
    await client.close()
    assert position is not None
    await asyncio.sleep(0.2)  # let the pause (and its KV blob) settle: a benchmark, not a test
    started = time.perf_counter()
    first = None
    async with Client("127.0.0.1", resume_port, ca=ca) as c:
        resumed = c.resume_from(position)
        async for event in resumed:
            if isinstance(event, TokenReceived):
                if first is None:
                    first = time.perf_counter() - started
                ids.append(event.token_id)
            elif isinstance(event, GenerationEnded):
                break
    if ids != reference:
        raise AssertionError("a resumed output differs from the uninterrupted run")
    assert first is not None
    return first, resumed.resume_path or "none"


async def _resume_latency(
    certs: DevCertPaths, scratch: Path, redis_url: str, runs: int, max_tokens: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    ca = certs.ca_cert
    async with _server(certs, scratch / "file", "--threads", "2") as port:
        reference = await _reference(port, ca, max_tokens)
        samples = [
            await _cut_and_resume(port, port, ca, max_tokens, reference) for _ in range(runs)
        ]
        rows.append(_row("file", "same process", samples))
    redis_args = ("--store", redis_url, "--threads", "1")
    async with (
        _server(certs, scratch / "redis-a", *redis_args) as a,
        _server(certs, scratch / "redis-b", *redis_args) as b,
    ):
        reference = await _reference(a, ca, max_tokens)
        same = [await _cut_and_resume(a, a, ca, max_tokens, reference) for _ in range(runs)]
        rows.append(_row("redis", "same process", same))
        other = [await _cut_and_resume(a, b, ca, max_tokens, reference) for _ in range(runs)]
        rows.append(_row("redis", "other process", other))
    return rows


def _row(backend: str, where: str, samples: list[tuple[float, str]]) -> dict[str, Any]:
    times = sorted(s for s, _ in samples)
    paths = sorted({p for _, p in samples})
    return {
        "backend": backend,
        "resumed on": where,
        "runs": len(times),
        "median_ms": round(statistics.median(times) * 1000, 1),
        "min_ms": round(times[0] * 1000, 1),
        "max_ms": round(times[-1] * 1000, 1),
        "paths": ",".join(paths),
    }


async def _one_stream(port: int, ca: Path, max_tokens: int, seed: int) -> int:
    async with Client("127.0.0.1", port, ca=ca) as c:
        result = await c.generate_text(
            PROMPT, max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=seed
        )
    return len(result.token_ids)


async def _throughput(
    certs: DevCertPaths, scratch: Path, redis_url: str, streams: int, max_tokens: int, runs: int
) -> list[dict[str, Any]]:
    """Every set-up up at once (idle servers cost no CPU), runs interleaved so a busy phase
    of this shared machine hits them alike."""
    cores = os.cpu_count() or 1
    setups = [("file", 1), ("redis", 1), ("redis", 2)]
    rates: dict[tuple[str, int], list[float]] = {setup: [] for setup in setups}
    async with contextlib.AsyncExitStack() as stack:
        ports = {}
        for store, workers in setups:
            threads = str(max(1, cores // workers))
            extra = ["--workers", str(workers), "--threads", threads]
            if store == "redis":
                extra += ["--store", redis_url]
            ports[(store, workers)] = await stack.enter_async_context(
                _server(certs, scratch / f"tp-{store}-{workers}", *extra)
            )
            await _one_stream(ports[(store, workers)], certs.ca_cert, 8, 0)  # warm-up
        for run in range(runs):
            for setup in setups:
                started = time.perf_counter()
                counts = await asyncio.gather(
                    *(
                        _one_stream(ports[setup], certs.ca_cert, max_tokens, run * 100 + i)
                        for i in range(streams)
                    )
                )
                rates[setup].append(sum(counts) / (time.perf_counter() - started))
    return [
        {
            "store": store,
            "workers": workers,
            "engine threads each": max(1, cores // workers),
            "streams": streams,
            "runs": runs,
            "tokens_per_s_median": round(statistics.median(rates[(store, workers)]), 1),
            "tokens_per_s_all": [round(r, 1) for r in rates[(store, workers)]],
        }
        for store, workers in setups
    ]


def _table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> None:
    certs = ensure_dev_certs(Path("certs"))
    with tempfile.TemporaryDirectory(prefix="quicsrv-scale-") as tmp:
        scratch = Path(tmp)
        with _redis(scratch) as redis_url:
            latency = await _resume_latency(certs, scratch, redis_url, args.runs, args.max_tokens)
            print(_table(latency), flush=True)
            throughput = await _throughput(
                certs, scratch, redis_url, args.streams, args.max_tokens, args.throughput_runs
            )
            print(_table(throughput), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = {"resume_latency": latency, "throughput": throughput, "args": vars(args)}
    (args.out / f"scale-{stamp}.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / f"scale-{stamp}.md").write_text(
        f"# scale bench {stamp}\n\n## resume latency\n\n{_table(latency)}\n\n"
        f"## throughput\n\n{_table(throughput)}\n"
    )
    print(f"wrote {args.out}/scale-{stamp}.{{md,json}}")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.scale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--runs", type=int, default=8, help="resumes per backend")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8, help="concurrent generations")
    parser.add_argument("--throughput-runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
