"""The asyncio half of the load test: connections and read phases, run on a bridge's loop.

Every coroutine here runs on an :class:`~loadtest.locust.bridge.AsyncioBridge` thread; the
greenlet that asked only ever gets plain data back (a :class:`Segment`) or opaque handles
(a :class:`client.Client`, a :class:`client.Generation`) that it passes back in. Each event is
stamped with ``time.perf_counter()`` the moment the client yields it, on the loop thread, so
gevent scheduling never leaks into the latencies.
"""

from __future__ import annotations

import contextlib
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.locust.raw import RawBadRequest, RawReply, raw_connection
from quicsrv_client import (
    Client,
    ClientError,
    Event,
    Generation,
    GenerationEnded,
    ResumePosition,
    TokenReceived,
)

__all__ = ["Connections", "Segment", "Target", "read", "send_raw"]

DEFAULT_PORT = 4433


@dataclass(frozen=True, slots=True)
class Target:
    """Where the server listens and the CA that signed its certificate."""

    host: str
    port: int
    ca: Path

    @classmethod
    def parse(cls, url: str, ca: Path) -> Target:
        """``quic://HOST:PORT`` (also ``https://``, or bare ``HOST:PORT``); IPv6 in brackets."""
        parsed = urllib.parse.urlsplit(url if "://" in url else f"quic://{url}")
        if parsed.scheme not in ("quic", "https", "h3") or not parsed.hostname:
            raise ValueError(f"--host {url!r}: expected quic://HOST:PORT")
        return cls(host=parsed.hostname, port=parsed.port or DEFAULT_PORT, ca=ca)


@dataclass(slots=True)
class Segment:
    """What one read phase of a generation got: each event with the time it arrived."""

    started_s: float
    """When the phase began (for a generation's first phase: when the request went out)."""
    events: list[tuple[float, Event]] = field(default_factory=list)
    error: ClientError | None = None
    """The client error that ended the phase early, if one did."""
    position: ResumePosition | None = None
    """Where to resume after this phase (the generation's position when it returned)."""
    resume_path: str | None = None
    ended_s: float = 0.0
    """When the phase returned (END, error, or ``stop``)."""

    @property
    def end(self) -> GenerationEnded | None:
        if self.events and isinstance(self.events[-1][1], GenerationEnded):
            return self.events[-1][1]
        return None

    def tokens(self) -> list[tuple[float, TokenReceived]]:
        return [(t, e) for t, e in self.events if isinstance(e, TokenReceived)]


async def read(generation: Generation, stop: Callable[[Event], bool] | None = None) -> Segment:
    """Iterate ``generation`` until END, an error, or an event for which ``stop`` is true.

    Stopping on ``stop`` leaves the stream open and unread: the client's receive window stops
    growing, exactly as for an application that stopped reading.
    """
    segment = Segment(started_s=time.perf_counter())
    try:
        async for event in generation:
            segment.events.append((time.perf_counter(), event))
            if isinstance(event, GenerationEnded) or (stop is not None and stop(event)):
                break
    except ClientError as exc:
        segment.error = exc
    segment.ended_s = time.perf_counter()
    segment.position = generation.position
    segment.resume_path = generation.resume_path
    return segment


class Connections:
    """The client connections opened on one loop, so that whatever is left can be closed."""

    def __init__(self) -> None:
        self._open: set[Client] = set()

    async def open(self, target: Target, *, read_window_bytes: int) -> tuple[Client, float]:
        """A connected client and its handshake time in seconds."""
        client = Client(target.host, target.port, ca=target.ca, read_window_bytes=read_window_bytes)
        started = time.perf_counter()
        await client.connect()
        self._open.add(client)
        return client, time.perf_counter() - started

    async def close(self, client: Client, *generations: Generation) -> None:
        """Close the connection (CONNECTION_CLOSE: to the server, a lost client), then
        finalise the generations read on it; they cannot send a cancel on a closed one."""
        self._open.discard(client)
        with contextlib.suppress(ClientError, OSError):
            await client.close()
        for generation in generations:
            with contextlib.suppress(ClientError, OSError):
                await generation.aclose()

    async def close_all(self) -> None:
        for client in list(self._open):
            await self.close(client)


async def send_raw(
    target: Target, request: RawBadRequest, timeout_s: float
) -> tuple[RawReply, float]:
    """Send one raw request on a connection of its own: the reply and its latency (s)."""
    async with raw_connection(target.host, target.port, target.ca) as connection:
        authority = f"{target.host}:{target.port}"
        started = time.perf_counter()
        reply = await connection.send(request, authority, timeout_s)
        return reply, time.perf_counter() - started
