"""The link helper, run inside the server namespace: a UDP echo, and a delaying UDP relay.

- Echo (``--echo-port``): every datagram goes back to its sender, so the client can measure
  the round-trip time of the path it uses (``probe RTT`` in the report).
- Relay (``--relay-port`` and ``--target``, only when netem is unavailable): a user-space
  stand-in for ``tc netem delay``. Each datagram from a client is held ``--delay-ms`` and then
  sent to the server from a socket of its own for that client; each datagram from the server is
  held ``--delay-ms`` and sent back to that client. Order is kept (one FIFO per direction and
  peer); there is no loss, no rate limit and no jitter beyond the event loop's timer precision
  (about a millisecond). The echo then holds each datagram for twice the delay, so both
  measure the same path.

Prints ``ready`` once its sockets are bound; runs until killed.

Run: ``python -m loadtest.netns.link --host 10.200.0.1 --echo-port 4499
[--relay-port 4434 --target 10.200.0.1:4433 --delay-ms 25]``
"""

from __future__ import annotations

import argparse
import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, cast

__all__ = ["DelayLine", "DelayRelay"]

Address = tuple[Any, ...]


class DelayLine:
    """Datagrams sent ``delay_s`` after they were pushed, in push order."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self._queue: deque[tuple[float, Callable[[], None]]] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def push(self, send: Callable[[], None]) -> None:
        """Schedule ``send`` (one datagram's sendto) ``delay_s`` from now."""
        if self.delay_s <= 0:
            send()
            return
        loop = asyncio.get_running_loop()
        self._queue.append((loop.time() + self.delay_s, send))
        if self._timer is None:
            self._timer = loop.call_at(self._queue[0][0], self._drain)

    def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = None
        # A timer fires up to one clock resolution early: send what is due within it.
        horizon = loop.time() + 0.0005
        while self._queue and self._queue[0][0] <= horizon:
            _due, send = self._queue.popleft()
            send()
        if self._queue:
            self._timer = loop.call_at(self._queue[0][0], self._drain)


class _Echo(asyncio.DatagramProtocol):
    def __init__(self, delay_s: float) -> None:
        self.line = DelayLine(delay_s)
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # asyncio's selector transport implements DatagramTransport without subclassing it.
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        transport = self.transport
        if transport is not None:
            self.line.push(lambda: transport.sendto(data, addr))


class _Upstream(asyncio.DatagramProtocol):
    """One client's socket towards the server: answers go back through the delay line."""

    def __init__(self, relay: DelayRelay, client: Address) -> None:
        self.relay = relay
        self.client = client
        self.line = DelayLine(relay.delay_s)  # server -> client
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: Address) -> None:
        downstream = self.relay.transport
        if downstream is not None:
            client = self.client
            self.line.push(lambda: downstream.sendto(data, client))


class DelayRelay(asyncio.DatagramProtocol):
    """Forwards each client's datagrams to ``target`` and the answers back, each held
    ``delay_s`` (bind it with ``loop.create_datagram_endpoint``)."""

    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self.target = target
        self.delay_s = delay_s
        self.transport: asyncio.DatagramTransport | None = None
        self._upstreams: dict[Address, _Upstream] = {}
        self._pending: dict[Address, list[bytes]] = {}
        self._lines: dict[Address, DelayLine] = {}  # client -> server, per client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def close(self) -> None:
        """Close its socket and every client's socket towards the target."""
        for upstream in self._upstreams.values():
            if upstream.transport is not None:
                upstream.transport.close()
        if self.transport is not None:
            self.transport.close()

    def datagram_received(self, data: bytes, addr: Address) -> None:
        line = self._lines.get(addr)
        if line is None:
            line = self._lines[addr] = DelayLine(self.delay_s)
        line.push(lambda: self._forward(addr, data))

    def _forward(self, client: Address, data: bytes) -> None:
        upstream = self._upstreams.get(client)
        if upstream is not None and upstream.transport is not None:
            upstream.transport.sendto(data)
            return
        # The first datagram of a new client: open its upstream socket, queue until it is up.
        waiting = self._pending.get(client)
        if waiting is not None:
            waiting.append(data)
            return
        self._pending[client] = [data]
        asyncio.get_running_loop().create_task(self._open_upstream(client))

    async def _open_upstream(self, client: Address) -> None:
        loop = asyncio.get_running_loop()
        _transport, upstream = await loop.create_datagram_endpoint(
            lambda: _Upstream(self, client), remote_addr=self.target
        )
        self._upstreams[client] = upstream
        assert upstream.transport is not None
        for data in self._pending.pop(client, []):
            upstream.transport.sendto(data)


async def _serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    delay_s = args.delay_ms / 1000
    relaying = args.relay_port is not None
    # With the relay, the echo adds the relay's delay both ways; with netem, nothing.
    await loop.create_datagram_endpoint(
        lambda: _Echo(2 * delay_s if relaying else 0.0), local_addr=(args.host, args.echo_port)
    )
    if relaying:
        host, _, port = args.target.rpartition(":")
        await loop.create_datagram_endpoint(
            lambda: DelayRelay((host, int(port)), delay_s), local_addr=(args.host, args.relay_port)
        )
    print("ready", flush=True)
    await asyncio.Event().wait()  # until killed


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.netns.link", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--host", required=True)
    parser.add_argument("--echo-port", type=int, required=True)
    parser.add_argument("--relay-port", type=int)
    parser.add_argument("--target", help="HOST:PORT the relay forwards to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="relay delay, each way")
    args = parser.parse_args()
    if (args.relay_port is None) != (args.target is None):
        parser.error("--relay-port and --target go together")
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
