"""Time to first token by way in: the native frame API and ``/v1/completions``, each driven by
more than one client, against one server, in alternating rounds.

Issue 27 saw the server's own TTFT mean at 0.38-0.41 s through ``/v1/generate`` (the project's
Python QUIC client) and 0.24-0.28 s through ``/v1/completions``, 8 concurrent generations each.
This separates the two candidate causes: the server's path (each way in, same raw aioquic
client, which does next to nothing per request) and the client (the same native path through
``quicsrv_client.Client``; completions over TCP through httpx, as the earlier run did). All
clients run in this one process, one mode at a time, so each competes for the 2 cores only
with the server. The server's TTFT is read from its own histogram (``/metrics`` before and
after); the client's from request sent to first token received.

    python -m loadtest.bench.ttft_paths --streams 8 --rounds 4 [--tree CHECKOUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import QuicEvent

import quicsrv_proto
from loadtest.bench.servers import ServerSettings, quicsrv_server
from loadtest.bench.stats import PROMPTS
from loadtest.locust.metrics_scrape import parse_scrape
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv_client import Client, TokenReceived

__all__ = ["main"]

MODEL_NAME = "bench"
MODES = ("native:quicsrv_client", "native:raw", "completions:raw", "completions:httpx-tcp")


@dataclass(frozen=True, slots=True)
class Run:
    mode: str
    round: int
    server_ttft_s: float
    """The server's mean time to first token over the run (its histogram's sum / count)."""
    client_ttft_s: float
    """The mean, at the client, from a request's send to its first token."""
    client_cpu_s: float
    """This process's CPU time over the run."""


class _TimedProtocol(QuicConnectionProtocol):
    """Plain aioquic HTTP/3: sends a request, notes when its first body byte arrives."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self._first: dict[int, asyncio.Future[float]] = {}
        self._done: dict[int, asyncio.Event] = {}
        self.bodies: dict[int, bytearray] = {}

    def quic_event_received(self, event: QuicEvent) -> None:
        for h3_event in self.h3.handle_event(event):
            self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        stream_id = getattr(event, "stream_id", -1)
        if isinstance(event, DataReceived) and stream_id in self.bodies:
            self.bodies[stream_id] += event.data
            first = self._first[stream_id]
            if not first.done() and _holds_a_token(bytes(self.bodies[stream_id])):
                first.set_result(time.perf_counter())
        elif isinstance(event, HeadersReceived):
            pass
        if getattr(event, "stream_ended", False) and stream_id in self._done:
            self._done[stream_id].set()

    async def request(self, method: str, path: str, body: bytes) -> tuple[float, bytes]:
        """(seconds from send to the first token, the whole body)."""
        stream_id = self._quic.get_next_available_stream_id()
        self._first[stream_id] = asyncio.get_running_loop().create_future()
        self._done[stream_id] = asyncio.Event()
        self.bodies[stream_id] = bytearray()
        headers = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", b"localhost"),
            (b":path", path.encode()),
        ]
        sent = time.perf_counter()
        self.h3.send_headers(stream_id, headers, end_stream=not body)
        if body:
            self.h3.send_data(stream_id, body, end_stream=True)
        self.transmit()
        await self._done[stream_id].wait()
        first = self._first.pop(stream_id)
        del self._done[stream_id]
        return (first.result() if first.done() else float("nan")) - sent, bytes(
            self.bodies.pop(stream_id)
        )


def _holds_a_token(body: bytes) -> bool:
    """Whether a response body so far holds a generated token: a TOKEN frame, or an SSE event
    with text (the opening event has none)."""
    if body.startswith(quicsrv_proto.MAGIC):
        try:
            frames = quicsrv_proto.FrameDecoder().feed(body)
        except quicsrv_proto.ProtocolError:
            return False
        return any(isinstance(f, quicsrv_proto.Token) for f in frames)
    return any(_event_text(line) for line in body.decode("utf-8", "replace").splitlines())


def _event_text(line: str) -> str:
    """The text an SSE ``data:`` line of a completion chunk carries ("" for anything else)."""
    if not line.startswith("data: {"):
        return ""
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    return str(choices[0].get("text") or "")


async def _scrape(protocol: _TimedProtocol) -> tuple[float, float]:
    _, body = await protocol.request("GET", "/metrics", b"")
    scrape = parse_scrape(body.decode(), 0.0)
    return scrape.ttft_sum_s, scrape.ttft_count


def _generate_body(i: int, max_tokens: int) -> bytes:
    frame = quicsrv_proto.Generate(
        prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens, ignore_eos=True
    )
    return quicsrv_proto.encode_frame(frame)


def _completion_body(i: int, max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": PROMPTS[i % len(PROMPTS)],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,  # every generation has a first token to time
            "stream": True,
        }
    ).encode()


async def _native_client(port: int, ca: Path, streams: int, max_tokens: int) -> list[float]:
    async with Client("127.0.0.1", port, ca=ca) as client:

        async def one(i: int) -> float:
            sent = time.perf_counter()
            first = float("nan")
            prompt = PROMPTS[i % len(PROMPTS)]
            async for event in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
                if isinstance(event, TokenReceived) and first != first:
                    first = time.perf_counter() - sent
            return first

        return list(await asyncio.gather(*(one(i) for i in range(streams))))


async def _raw(
    protocol: _TimedProtocol, path: str, body: Callable[[int, int], bytes], streams: int, n: int
) -> list[float]:
    replies = await asyncio.gather(
        *(protocol.request("POST", path, body(i, n)) for i in range(streams))
    )
    return [seconds for seconds, _ in replies]


async def _httpx(port: int, ca: Path, streams: int, max_tokens: int) -> list[float]:
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(
        base_url=f"https://localhost:{port}", verify=str(ca), limits=limits, timeout=120
    ) as http:

        async def one(i: int) -> float:
            sent = time.perf_counter()
            first = float("nan")
            body = _completion_body(i, max_tokens)
            headers = {"content-type": "application/json"}
            async with http.stream("POST", "/v1/completions", content=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if first != first and _event_text(line):
                        first = time.perf_counter() - sent
            return first

        return list(await asyncio.gather(*(one(i) for i in range(streams))))


async def _measure(args: argparse.Namespace, logs: Path) -> list[Run]:
    certs = ensure_dev_certs(logs / "certs")
    settings = ServerSettings(model_path=default_model_path())
    runs: list[Run] = []
    env = {"QUICSRV_MODEL_NAME": MODEL_NAME}
    async with quicsrv_server(
        settings,
        certs.server_cert,
        certs.server_key,
        logs / "server.log",
        tree=args.tree,
        per_client_caps=args.per_client_caps,
        env=env,
    ) as child:
        configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
        configuration.load_verify_locations(str(certs.ca_cert))
        async with connect(
            "127.0.0.1", child.port, configuration=configuration, create_protocol=_TimedProtocol
        ) as protocol:
            assert isinstance(protocol, _TimedProtocol)
            n, streams, ca = args.max_tokens, args.streams, certs.ca_cert
            drivers: dict[str, Callable[[], Awaitable[list[float]]]] = {
                "native:quicsrv_client": lambda: _native_client(child.port, ca, streams, n),
                "native:raw": lambda: _raw(protocol, "/v1/generate", _generate_body, streams, n),
                "completions:raw": lambda: _raw(
                    protocol, "/v1/completions", _completion_body, streams, n
                ),
                "completions:httpx-tcp": lambda: _httpx(child.port, ca, streams, n),
            }
            await drivers["native:raw"]()  # warm-up: caches, first-use costs
            for round_ in range(args.rounds):
                order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    before_sum, before_count = await _scrape(protocol)
                    cpu = time.process_time()
                    client = await drivers[mode]()
                    cpu = time.process_time() - cpu
                    after_sum, after_count = await _scrape(protocol)
                    run = Run(
                        mode=mode,
                        round=round_,
                        server_ttft_s=(after_sum - before_sum)
                        / max(1.0, after_count - before_count),
                        client_ttft_s=statistics.fmean(client),
                        client_cpu_s=cpu,
                    )
                    print(
                        f"round {round_} {mode:24} server TTFT {run.server_ttft_s * 1000:6.0f} ms"
                        f"  client TTFT {run.client_ttft_s * 1000:6.0f} ms"
                        f"  client CPU {run.client_cpu_s:5.2f} s",
                        flush=True,
                    )
                    runs.append(run)
    return runs


def _table(runs: list[Run], args: argparse.Namespace) -> str:
    lines = [
        f"{args.streams} concurrent generations × {args.max_tokens} tokens, {args.rounds} rounds "
        "alternating; medians over the rounds",
        "",
        "| way in : client | server TTFT mean (ms) | client TTFT mean (ms) | client CPU (s) |",
        "|---|---:|---:|---:|",
    ]
    for mode in MODES:
        mine = [r for r in runs if r.mode == mode]
        lines.append(
            f"| {mode} | {statistics.median(r.server_ttft_s for r in mine) * 1000:.0f} "
            f"| {statistics.median(r.client_ttft_s for r in mine) * 1000:.0f} "
            f"| {statistics.median(r.client_cpu_s for r in mine):.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.ttft_paths",
        description="time to first token by way in (native, completions) and by client",
    )
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--tree", type=Path, help="serve from this checkout instead (an earlier commit)"
    )
    parser.add_argument(
        "--per-client-caps",
        action="store_true",
        help="keep the server's per-client limits (a client is its connection here): one QUIC "
        "connection then runs at most 3/4 of the slots, while httpx opens a connection a stream",
    )
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    logs = (args.out / f"ttft-paths-{stamp}-logs").resolve()  # the server may run elsewhere
    logs.mkdir(parents=True, exist_ok=True)
    runs = asyncio.run(_measure(args, logs))
    table = _table(runs, args)
    print(table)
    (args.out / f"ttft-paths-{stamp}.md").write_text(table)
    (args.out / f"ttft-paths-{stamp}.json").write_text(
        json.dumps(
            {"argv": sys.argv[1:] if argv is None else argv, "runs": [asdict(r) for r in runs]}
        )
    )
    print(f"wrote {args.out / f'ttft-paths-{stamp}.md'} and .json; server log in {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
