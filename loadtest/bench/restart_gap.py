"""How long a client rides out a restart: one greedy generation read through a SIGTERM and a new
``quicsrv serve`` on the same port and data dir, started at once (as a restart script would).

Per round: the time from the SIGTERM to the new server's "listening" line, and, at the client,
the longest wait between two tokens (the gap the reconnect policy must cover), how it came back
(0-RTT, the resume path) and whether the text is exactly the uninterrupted run's.

    python -m loadtest.bench.restart_gap --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from quicsrv.devcerts import ensure_dev_certs
from quicsrv.spawn import spawn_server_async
from quicsrv_client import Client, Reconnected, ReconnectPolicy, SessionStarted, TokenReceived

__all__ = ["main"]

PROMPT = "The three most important inventions of the last century are"
CUT_AT = 20


@dataclass(frozen=True, slots=True)
class Round:
    sigterm_to_listening_s: float
    longest_token_gap_s: float
    early_data: bool
    resume_path: str | None
    exact: bool


async def _round(work: Path, certs_dir: Path, tickets: Path) -> Round:
    certs = ensure_dev_certs(certs_dir)
    data = work / "data"
    serve = ["--host", "127.0.0.1", "--data-dir", str(data)]
    serve += ["--cert", str(certs.server_cert), "--key", str(certs.server_key)]
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(
            spawn_server_async([*serve, "--port", "0"], log=work / "first.log")
        )
        port = first.port
        async with Client("127.0.0.1", port, ca=certs.ca_cert) as c:
            reference = await c.generate_text(PROMPT, max_tokens=96, ignore_eos=True)
        ids: list[int] = []
        times: list[float] = []
        restarted: asyncio.Task[object] | None = None
        signalled = listening = 0.0
        early, path = False, None

        async def restart() -> object:
            nonlocal listening
            second = await stack.enter_async_context(
                spawn_server_async([*serve, "--port", str(port)], log=work / "second.log")
            )
            listening = time.perf_counter()
            return second

        policy = ReconnectPolicy()
        async with Client(
            "127.0.0.1", port, ca=certs.ca_cert, reconnect=policy, ticket_cache=tickets
        ) as c:
            async for event in c.generate(PROMPT, max_tokens=96, ignore_eos=True):
                if isinstance(event, TokenReceived):
                    ids.append(event.token_id)
                    times.append(time.perf_counter())
                    if len(ids) == CUT_AT:
                        first.process.send_signal(signal.SIGTERM)
                        signalled = time.perf_counter()
                        restarted = asyncio.ensure_future(restart())
                elif isinstance(event, Reconnected):
                    early = early or event.early_data
                elif isinstance(event, SessionStarted) and event.resume_path:
                    path = event.resume_path
        assert restarted is not None
        await restarted
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return Round(
        sigterm_to_listening_s=listening - signalled,
        longest_token_gap_s=max(gaps),
        early_data=early,
        resume_path=path,
        exact=ids == list(reference.token_ids),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.restart_gap",
        description="the gap a client rides out across a server restart",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="quicsrv-restart-") as tmp:
        for i in range(args.rounds):
            work = Path(tmp) / f"round-{i}"
            work.mkdir()
            result = asyncio.run(_round(work, Path(tmp) / "certs", Path(tmp) / "tickets.json"))
            print(
                f"round {i}: SIGTERM to listening {result.sigterm_to_listening_s:.2f} s, "
                f"longest token gap {result.longest_token_gap_s:.2f} s, "
                f"0-RTT {result.early_data}, resume {result.resume_path}, exact {result.exact}",
                flush=True,
            )
            rounds.append(result)
    listening = [r.sigterm_to_listening_s for r in rounds]
    gaps = [r.longest_token_gap_s for r in rounds]
    print(
        f"median SIGTERM to listening {statistics.median(listening):.2f} s "
        f"(max {max(listening):.2f}); median longest token gap {statistics.median(gaps):.2f} s "
        f"(max {max(gaps):.2f}); exact in {sum(r.exact for r in rounds)}/{len(rounds)}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out / f"restart-gap-{stamp}.json"
    out.write_text(
        json.dumps(
            {"argv": sys.argv[1:] if argv is None else argv, "rounds": [asdict(r) for r in rounds]}
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
