"""The client side of the netns benchmark, run inside the client namespace; prints JSON.

Per run, each on new connections:

- ``handshake``: ``Client.connect()`` with no ticket (a full QUIC + TLS 1.3 handshake).
- ``resume_0rtt``: a generation is cut after token ``--cut-index`` (its connection closed);
  a new Client holding the ticket the cut connection received (a shared TicketCache file)
  is timed from ``connect()`` to the first TokenReceived of ``resume_from(position)``.
- ``resume_full``: the same, from a Client without a ticket (full handshake, then RESUME).
- ``fresh``: a new generation from scratch, timed from ``connect()`` to token ``--cut-index
  + 1`` (the index the resumes deliver first); ``fresh_first_token`` is its token 0.

Also the path's round-trip time, from UDP probes to the link helper's echo.

Run (from netns_bench): ``python -m loadtest.netns.client --host H --port P --ca CA
--echo-port E --runs N``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from quicsrv_client import (
    Client,
    ResumePosition,
    SessionStarted,
    TicketCache,
    TokenReceived,
)

PROMPT = "A list of the planets of the solar system:"
KINDS = ("handshake", "resume_0rtt", "resume_full", "fresh", "fresh_first_token")


def probe_rtt_ms(host: str, port: int, count: int) -> list[float]:
    """Round trips of one small UDP datagram to the echo, one at a time."""
    samples: list[float] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2.0)
        sock.connect((host, port))
        for i in range(count):
            payload = i.to_bytes(4, "big")
            started = time.perf_counter()
            sock.send(payload)
            while sock.recv(64) != payload:  # a late answer to an earlier probe: skip it
                pass
            samples.append((time.perf_counter() - started) * 1000)
    return samples


class Bench:
    """The four measurements against one server."""

    def __init__(self, args: argparse.Namespace, cache: TicketCache) -> None:
        self.host: str = args.host
        self.port: int = args.port
        self.ca = Path(args.ca)
        self.cut_index: int = args.cut_index
        self.max_tokens: int = args.max_tokens
        self.settle_s: float = args.settle_ms / 1000
        self.cache = cache

    def client(self, *, tickets: bool = False) -> Client:
        return Client(
            self.host, self.port, ca=self.ca, ticket_cache=self.cache if tickets else None
        )

    async def handshake(self) -> float:
        c = self.client()
        started = time.perf_counter()
        await c.connect()
        elapsed = time.perf_counter() - started
        await c.close()
        return elapsed

    async def cut(self, *, tickets: bool) -> ResumePosition:
        """A generation whose connection closes right after token ``cut_index``."""
        async with self.client(tickets=tickets) as c:
            generation = c.generate(PROMPT, max_tokens=self.max_tokens, ignore_eos=True)
            async for event in generation:
                if isinstance(event, TokenReceived) and event.index == self.cut_index:
                    break
            position = generation.position
        if position is None or position.last_index != self.cut_index:
            raise RuntimeError(f"the cut generation stopped early: {position}")
        # The server notices the closed connection and pauses the session; let it settle so
        # both resume kinds find the same state.
        await asyncio.sleep(self.settle_s)
        return position

    async def resume(self, position: ResumePosition, *, tickets: bool) -> dict[str, Any]:
        """Time from connect() to the first resumed token; with what the server said."""
        c = self.client(tickets=tickets)
        started = time.perf_counter()
        await c.connect()
        generation = c.resume_from(position)
        early: bool | None = None
        first_index = -1
        elapsed = float("nan")
        try:
            async for event in generation:
                if isinstance(event, SessionStarted):
                    early = event.early_data
                elif isinstance(event, TokenReceived):
                    elapsed = time.perf_counter() - started
                    first_index = event.index
                    break
            accepted = c.early_data_accepted
        finally:
            await generation.aclose()
            await c.close()
        return {
            "seconds": elapsed,
            "early_data": early,
            "tls_early_data_accepted": accepted,
            "tickets_offered": c.stats.tickets_offered,
            "first_index": first_index,
            "resume_path": generation.resume_path,
        }

    async def fresh(self) -> tuple[float, float]:
        """connect() + GENERATE: seconds to token 0 and to token ``cut_index + 1``."""
        c = self.client()
        started = time.perf_counter()
        await c.connect()
        generation = c.generate(PROMPT, max_tokens=self.max_tokens, ignore_eos=True)
        first = target = float("nan")
        try:
            async for event in generation:
                if isinstance(event, TokenReceived):
                    if event.index == 0:
                        first = time.perf_counter() - started
                    if event.index == self.cut_index + 1:
                        target = time.perf_counter() - started
                        break
        finally:
            await generation.aclose()
            await c.close()
        return first, target

    def has_ticket(self) -> bool:
        return len(self.cache) > 0  # one server: any ticket is for it


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        bench = Bench(args, TicketCache(Path(scratch) / "tickets.json"))
        # Warm-up, not measured: the server's first request pays one-off costs.
        async with bench.client() as c:
            await c.generate_text(PROMPT, max_tokens=args.cut_index + 2, ignore_eos=True)
        probes = probe_rtt_ms(args.host, args.echo_port, args.probes)
        samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
        resumes: dict[str, list[dict[str, Any]]] = {"resume_0rtt": [], "resume_full": []}
        missing_tickets = 0
        for run_index in range(args.runs):
            samples["handshake"].append(await bench.handshake())

            position = await bench.cut(tickets=True)
            if not bench.has_ticket():
                missing_tickets += 1
            detail = await bench.resume(position, tickets=True)
            resumes["resume_0rtt"].append(detail)
            samples["resume_0rtt"].append(detail["seconds"])

            position = await bench.cut(tickets=False)
            detail = await bench.resume(position, tickets=False)
            resumes["resume_full"].append(detail)
            samples["resume_full"].append(detail["seconds"])

            first, target = await bench.fresh()
            samples["fresh_first_token"].append(first)
            samples["fresh"].append(target)
            print(
                f"run {run_index + 1}/{args.runs}: "
                + " ".join(f"{k}={v[-1] * 1000:.1f}ms" for k, v in samples.items()),
                file=sys.stderr,
                flush=True,
            )
    return {
        "probe_rtt_ms": probes,
        "probe_rtt_median_ms": statistics.median(probes),
        "samples_s": samples,
        "resumes": resumes,
        "cut_index": args.cut_index,
        "max_tokens": args.max_tokens,
        "missing_tickets": missing_tickets,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.netns.client", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ca", required=True)
    parser.add_argument("--echo-port", type=int, required=True)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--cut-index", type=int, default=9)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--settle-ms", type=float, default=300.0)
    args = parser.parse_args()
    with contextlib.suppress(BrokenPipeError):
        print(json.dumps(asyncio.run(run(args))), flush=True)


if __name__ == "__main__":
    main()
