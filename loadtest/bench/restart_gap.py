"""How long clients ride out a restart: live readers (and, optionally, clients that vanished
without a CONNECTION_CLOSE) through a SIGTERM and a new ``quicsrv serve`` on the same port and
data dir, started at once (as a restart script would); one chain of servers, one restart a round.

Per round: ``--readers`` greedy generations are read, each by a client of its own with the
default reconnect policy; ``--vanished`` more are started by ``quicsrv-client generate`` processes
that are SIGKILLed after a few tokens (their sessions' streams then have data that is never
acknowledged: a peer that cannot answer). Once every live reader holds ``CUT_AT`` tokens the
server gets SIGTERM and the next one is started. Reported per round: the time from the SIGTERM to
the new server's "listening" line, the old server's own account of its hand-over (its
``shutdown:`` log line: pauses, KV cells saved, sessions left to replay because their pause did
not land in the grace period) and the time from the SIGTERM to that line and to the old process's
exit, the clients' longest wait between two tokens, how each came back (the resume path, 0-RTT),
and whether every text is exactly the uninterrupted run's.

With ``--cut`` and ``--kill-worker``, each round is the soak's mix as well: ``--cut`` more readers
drop their connection after ``CUT_AT // 2`` tokens (their generations pause) and resume on a new
connection to the next server, and the engine worker is SIGKILLed once every live reader holds
``CUT_AT // 2`` tokens (the SIGTERM comes once they all hold ``CUT_AT``: the worker is back).
``--kill-server-every K`` makes every Kth round's SIGTERM a SIGKILL (nothing is handed over:
every session comes back from its record, by replay or an earlier pause's KV cells), and
``--seeded`` samples every other prompt (temperature 0.8, top-k 40, a seed of its own) where the
others are greedy. A long run of all of it is the soak of issue 45 (``--minutes 30``: rounds
until 30 minutes have passed, at most ``--rounds``).

    python -m loadtest.bench.restart_gap --rounds 3                          # one reader
    python -m loadtest.bench.restart_gap --rounds 20 --readers 8 --vanished 1  # issue 46
    python -m loadtest.bench.restart_gap --rounds 20 --readers 8 --vanished 1 --cut 2 --kill-worker
    python -m loadtest.bench.restart_gap --rounds 1000 --minutes 30 --readers 4 --vanished 1 \
        --cut 2 --kill-worker --kill-server-every 5 --seeded                     # the soak

Targets of issue 46 (8 readers, 1 vanished, 20 restarts): SIGTERM to listening <= 2 s median,
<= 2.5 s at the 95th percentile, no session left to replay by the grace period, every text exact.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from quicsrv.devcerts import DevCertPaths, ensure_dev_certs
from quicsrv.spawn import SpawnedServer, spawn_server_async
from quicsrv_client import (
    Client,
    Reconnected,
    ReconnectPolicy,
    ResumePosition,
    SessionStarted,
    TokenReceived,
)

__all__ = ["Round", "main", "percentile"]

PROMPTS = (
    "The three most important inventions of the last century are",
    "Write a long story about a lighthouse keeper and the sea.",
    "Explain how a bicycle stays upright, step by step.",
    "List the planets of the solar system and describe each one.",
)
MAX_TOKENS = 160
CUT_AT = 16
"""Tokens every live reader holds when the server gets SIGTERM."""
VANISH_AT = 4
"""Tokens a vanishing client reads before it is SIGKILLed."""
_HANDED = re.compile(
    r"shutdown: (\d+) generations paused, KV cells of (\d+) open sessions saved, (\d+) left to "
    r"replay, (\d+) streams told to resume"
)
_PATIENCE_S = 300.0  # a failure's deadline on 2 busy shared cores, not a measurement


def sampling(prompt: str, seeded: bool) -> dict[str, Any]:
    """How ``prompt`` is generated: greedy, or (``seeded``, every other prompt) sampled with a
    seed of its own."""
    index = PROMPTS.index(prompt)
    if seeded and index % 2:
        return {"temperature": 0.8, "top_k": 40, "seed": 11 + index}
    return {}


@dataclass(frozen=True, slots=True)
class Round:
    sigterm_to_listening_s: float
    """SIGTERM to the new server's "listening" line."""
    sigterm_to_handed_s: float
    """SIGTERM to the old server's ``shutdown:`` line (pauses landed, records and KV written,
    streams told)."""
    sigterm_to_exit_s: float
    """SIGTERM to the old process's exit (its data dir lock released with it)."""
    paused: int
    kv_saved: int
    replay_by_grace: int
    """Sessions the old server left to replay: their pause did not land in the grace period."""
    streams_told: int
    longest_token_gap_s: float
    early_data: int
    """Live readers that came back in 0-RTT."""
    resume_paths: dict[str, int]
    exact: int
    """Live readers whose text is exactly the uninterrupted run's."""
    readers: int
    """Readers whose text was checked: the live ones and the cut ones."""
    vanished: int
    cut: int = 0
    """Readers that dropped their connection before the SIGTERM and resumed after it."""
    worker_killed: bool = False
    server_killed: bool = False
    """SIGKILL, not SIGTERM: the hand-over counts are 0 and its time is nan."""


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


async def _vanish(port: int, certs: DevCertPaths, prompt: str) -> None:
    """A ``quicsrv-client generate`` process that reads a few tokens and is then SIGKILLed:
    its connection is never closed, so the server's stream data to it is never acknowledged."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "quicsrv_client.cli",
        "generate",
        prompt,
        *("--host", "127.0.0.1", "--port", str(port), "--ca", str(certs.ca_cert)),
        *("--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", "--ticket-cache", ""),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert process.stdout is not None
    tokens = 0
    try:
        while tokens < VANISH_AT:
            line = await asyncio.wait_for(process.stdout.readline(), _PATIENCE_S)
            if not line:
                raise RuntimeError("the vanishing client ended before it vanished")
            tokens += json.loads(line)["type"] == "token"
    finally:
        process.kill()
        await process.wait()


@dataclass
class _Reader:
    prompt: str
    ids: list[int]
    times: list[float]
    paths: list[str]
    params: dict[str, Any]
    early: bool = False


async def _read(
    port: int,
    certs: DevCertPaths,
    tickets: Path,
    reader: _Reader,
    cut: asyncio.Event,
    half: asyncio.Event,
) -> None:
    async with Client(
        "127.0.0.1", port, ca=certs.ca_cert, reconnect=ReconnectPolicy(), ticket_cache=tickets
    ) as c:
        generation = c.generate(
            reader.prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **reader.params
        )
        async for event in generation:
            if isinstance(event, TokenReceived):
                reader.ids.append(event.token_id)
                reader.times.append(time.perf_counter())
                if len(reader.ids) == CUT_AT // 2:
                    half.set()
                if len(reader.ids) == CUT_AT:
                    cut.set()
            elif isinstance(event, Reconnected):
                reader.early = reader.early or event.early_data
            elif isinstance(event, SessionStarted) and event.resume_path:
                reader.paths.append(event.resume_path)


async def _drop(port: int, certs: DevCertPaths, reader: _Reader) -> ResumePosition:
    """The soak's cut: a reader's connection goes after ``CUT_AT // 2`` tokens, nobody reads,
    the generation pauses; what it holds and where to resume."""
    client = Client("127.0.0.1", port, ca=certs.ca_cert)
    await client.connect()
    generation = client.generate(
        reader.prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **reader.params
    )
    async for event in generation:
        if isinstance(event, TokenReceived):
            reader.ids.append(event.token_id)
            if len(reader.ids) >= CUT_AT // 2 and generation.position is not None:
                break
    position = generation.position
    await client.aclose()
    if position is None:
        raise RuntimeError("a cut reader has no position to resume from")
    del reader.ids[position.last_index + 1 :]
    return position


async def _resume(port: int, certs: DevCertPaths, reader: _Reader, at: ResumePosition) -> None:
    async with Client("127.0.0.1", port, ca=certs.ca_cert) as c:
        async for event in c.resume_from(at):
            if isinstance(event, TokenReceived):
                reader.ids.append(event.token_id)
            elif isinstance(event, SessionStarted) and event.resume_path:
                reader.paths.append(event.resume_path)


def _kill_worker(server: SpawnedServer) -> None:
    """SIGKILL the engine worker: the process below the server that runs its module (any of
    the server's threads may have started it, so every thread's children are looked at)."""
    pending, killed = [server.process.pid], 0
    while pending:
        pid = pending.pop()
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:  # a thread (or a process) may end while it is looked at
                children = (task / "children").read_text().split()
                for child in children:
                    pending.append(int(child))
                    if b"quicsrv.engine.worker" in Path(f"/proc/{child}/cmdline").read_bytes():
                        os.kill(int(child), signal.SIGKILL)
                        killed += 1
            except FileNotFoundError:
                continue
    if not killed:
        raise RuntimeError("the server has no engine worker to kill")


async def _exit(server: SpawnedServer) -> float:
    """When ``server``'s process exited."""
    await asyncio.to_thread(server.process.wait, _PATIENCE_S)
    return time.perf_counter()


def _handed(log: Path) -> tuple[int, ...]:
    """The old server's ``shutdown:`` counts."""
    for line in log.read_text().splitlines():
        if match := _HANDED.search(line):
            return tuple(int(g) for g in match.groups())
    raise RuntimeError(f"no shutdown line in {log}")


async def _round(
    stack: contextlib.AsyncExitStack,
    old: SpawnedServer,
    serve: list[str],
    work: Path,
    number: int,
    certs: DevCertPaths,
    references: dict[str, list[int]],
    readers: int,
    vanished: int,
    env: dict[str, str],
    mix: Mix,
) -> tuple[Round, SpawnedServer]:
    """``mix``: what else happens in the round (see the module docstring)."""
    port = old.port
    n_cut, kill_worker = mix.cut, mix.kill_worker
    kill_server = mix.kill_server_every > 0 and number % mix.kill_server_every == 0
    for i in range(vanished):
        await _vanish(port, certs, PROMPTS[i % len(PROMPTS)])
    dropped = [_reader(PROMPTS[(readers + i) % len(PROMPTS)], mix) for i in range(n_cut)]
    positions = [await _drop(port, certs, r) for r in dropped]
    cuts = [asyncio.Event() for _ in range(readers)]
    halves = [asyncio.Event() for _ in range(readers)]
    state = [_reader(PROMPTS[i % len(PROMPTS)], mix) for i in range(readers)]
    tickets = work / "tickets.json"
    reading = [
        asyncio.ensure_future(_read(port, certs, tickets, r, cut, half))
        for r, cut, half in zip(state, cuts, halves, strict=True)
    ]
    if kill_worker:
        await asyncio.wait_for(asyncio.gather(*(h.wait() for h in halves)), _PATIENCE_S)
        _kill_worker(old)
    await asyncio.wait_for(asyncio.gather(*(cut.wait() for cut in cuts)), _PATIENCE_S)
    log = work / f"server-{number}.log"
    signalled = time.perf_counter()
    old.process.send_signal(signal.SIGKILL if kill_server else signal.SIGTERM)
    starting = asyncio.ensure_future(
        stack.enter_async_context(
            spawn_server_async(
                [*serve, "--port", str(port)], log=work / f"server-{number + 1}.log", env=env
            )
        )
    )
    exited = asyncio.ensure_future(_exit(old))
    new = await starting
    listening = time.perf_counter()
    exit_at = await exited
    await asyncio.wait_for(asyncio.gather(*reading), _PATIENCE_S)
    for reader, position in zip(dropped, positions, strict=True):
        await asyncio.wait_for(_resume(new.port, certs, reader, position), _PATIENCE_S)
    counts = (0, 0, 0, 0) if kill_server else _handed(log)
    checked = state + dropped
    gaps = [b - a for r in state for a, b in zip(r.times, r.times[1:], strict=False)]
    return (
        Round(
            sigterm_to_listening_s=listening - signalled,
            sigterm_to_handed_s=float("nan") if kill_server else _hand_over_s(log),
            sigterm_to_exit_s=exit_at - signalled,
            paused=counts[0],
            kv_saved=counts[1],
            replay_by_grace=counts[2],
            streams_told=counts[3],
            longest_token_gap_s=max(gaps),
            early_data=sum(r.early for r in state),
            resume_paths=dict(Counter(p for r in checked for p in r.paths)),
            exact=sum(r.ids == references[r.prompt] for r in checked),
            readers=len(checked),
            vanished=vanished,
            cut=n_cut,
            worker_killed=kill_worker,
            server_killed=kill_server,
        ),
        new,
    )


def _hand_over_s(log: Path) -> float:
    """SIGTERM to the ``shutdown:`` line, on the log's own clock (its lines carry wall-clock
    times to the millisecond): from the ``shutting down`` line, which the signal handler's
    wake-up writes at once, to the ``shutdown:`` line."""
    stamps: dict[str, datetime] = {}
    for line in log.read_text().splitlines():
        for key in ("shutting down: handing the sessions over", "shutdown: "):
            if key in line and key not in stamps:
                stamps[key] = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    if len(stamps) < 2:
        return float("nan")
    begun, handed = stamps.values()
    return (handed - begun).total_seconds()


@dataclass(frozen=True, slots=True)
class Mix:
    cut: int = 0
    kill_worker: bool = False
    kill_server_every: int = 0
    seeded: bool = False


def _reader(prompt: str, mix: Mix) -> _Reader:
    return _Reader(prompt, [], [], [], sampling(prompt, mix.seeded))


async def _run(
    work: Path, rounds: int, readers: int, vanished: int, mix: Mix, minutes: float = 0.0
) -> list[Round]:
    """``rounds`` rounds, or fewer when ``minutes`` (if given) have passed first."""
    deadline = time.monotonic() + minutes * 60 if minutes else None
    certs = ensure_dev_certs(work / "certs")
    data = work / "data"
    serve = ["--host", "127.0.0.1", "--data-dir", str(data)]
    serve += ["--cert", str(certs.server_cert), "--key", str(certs.server_key)]
    results: list[Round] = []
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(
            spawn_server_async([*serve, "--port", "0"], log=work / "server-0.log")
        )
        # A machine whose canary crashes with llama.cpp's extra CPU buffers (the safe mode,
        # logged) pays a worker start more at every start: as an operator would once they saw
        # the SAFE MODE line, the next servers are told so, and the restarts time the hand-over.
        safe = "(safe mode)" in (work / "server-0.log").read_text()
        env = {"QUICSRV_CPU_EXTRA_BUFFERS": "off"} if safe else {}
        if safe:
            print("server 0 fell back to the safe mode: cpu_extra_buffers=off from now on")
        references = {}
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            for prompt in PROMPTS[: max(readers + mix.cut, vanished, 1)]:
                reference = await c.generate_text(
                    prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **sampling(prompt, mix.seeded)
                )
                references[prompt] = list(reference.token_ids)
        for number in range(rounds):
            if deadline is not None and time.monotonic() >= deadline:
                break
            result, server = await _round(
                stack, server, serve, work, number, certs, references, readers, vanished, env, mix
            )
            print(_line(number, result), flush=True)
            results.append(result)
    return results


def _line(number: int, r: Round) -> str:
    paths = ", ".join(f"{p} {n}" for p, n in sorted(r.resume_paths.items())) or "none"
    signal_name = "SIGKILL" if r.server_killed else "SIGTERM"
    return (
        f"round {number}: {signal_name} to listening {r.sigterm_to_listening_s:.2f} s (hand-over "
        f"{r.sigterm_to_handed_s:.2f} s, exit {r.sigterm_to_exit_s:.2f} s); paused {r.paused}, "
        f"KV saved {r.kv_saved}, left to replay {r.replay_by_grace}, told {r.streams_told}; "
        f"longest token gap {r.longest_token_gap_s:.2f} s; resumes: {paths}; 0-RTT "
        f"{r.early_data}/{r.readers - r.cut}; exact {r.exact}/{r.readers}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.restart_gap",
        description="the gap clients ride out across server restarts",
    )
    parser.add_argument("--rounds", type=int, default=3, help="restarts")
    parser.add_argument(
        "--minutes", type=float, default=0.0, help="stop starting rounds after this long (0: no)"
    )
    parser.add_argument("--readers", type=int, default=1, help="live readers each round")
    parser.add_argument(
        "--vanished",
        type=int,
        default=0,
        help="clients SIGKILLed mid-generation each round, before the SIGTERM",
    )
    parser.add_argument(
        "--cut", type=int, default=0, help="readers cut before the SIGTERM, resumed after it"
    )
    parser.add_argument(
        "--kill-worker", action="store_true", help="SIGKILL the engine worker mid-round"
    )
    parser.add_argument(
        "--kill-server-every",
        type=int,
        default=0,
        metavar="K",
        help="SIGKILL the server instead of SIGTERM every Kth round (0: never)",
    )
    parser.add_argument(
        "--seeded", action="store_true", help="sample every other prompt with a seed"
    )
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    parser.add_argument(
        "--work", type=Path, help="keep the servers' data dir and logs here (default: temporary)"
    )
    args = parser.parse_args(argv)
    if args.readers < 1:
        parser.error("--readers must be at least 1")
    mix = Mix(args.cut, args.kill_worker, args.kill_server_every, args.seeded)
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        rounds = asyncio.run(
            _run(args.work, args.rounds, args.readers, args.vanished, mix, args.minutes)
        )
    else:
        with tempfile.TemporaryDirectory(prefix="quicsrv-restart-") as tmp:
            rounds = asyncio.run(
                _run(Path(tmp), args.rounds, args.readers, args.vanished, mix, args.minutes)
            )
    listening = [r.sigterm_to_listening_s for r in rounds if not r.server_killed]
    killed = sum(r.server_killed for r in rounds)
    gaps = [r.longest_token_gap_s for r in rounds]
    exact = sum(r.exact for r in rounds)
    total = sum(r.readers for r in rounds)
    replays = sum(r.replay_by_grace for r in rounds)
    print(
        f"SIGTERM to listening: median {statistics.median(listening):.2f} s, p95 "
        f"{percentile(listening, 0.95):.2f} s, max {max(listening):.2f} s over {len(listening)} "
        f"SIGTERM restarts and {killed} SIGKILLs ({args.readers} readers, {args.vanished} "
        f"vanished, {args.cut} cut, worker {'killed' if args.kill_worker else 'kept'}, "
        f"{'greedy and seeded' if args.seeded else 'greedy'}); longest token gap median "
        f"{statistics.median(gaps):.2f} s (max {max(gaps):.2f}); left to replay by the grace "
        f"period {replays}; exact {exact}/{total}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out / f"restart-gap-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "argv": sys.argv[1:] if argv is None else argv,
                "median_sigterm_to_listening_s": statistics.median(listening),
                "p95_sigterm_to_listening_s": percentile(listening, 0.95),
                "left_to_replay_by_grace": replays,
                "exact": exact,
                "readers_total": total,
                "rounds": [asdict(r) for r in rounds],
            }
        )
    )
    print(f"wrote {out}")
    return 0 if exact == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
