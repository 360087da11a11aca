"""What every quicsrv Locust user shares: options, the asyncio bridges, plumbing, hooks.

Imported (as ``loadtest.locust.user``) by each locustfile, so its Locust listeners are
registered once however many locustfiles use it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import gevent
import gevent.lock
from locust import User, events
from locust.env import Environment

from loadtest.locust.bridge import AsyncioBridge, BridgeTimeout
from loadtest.locust.driver import Connections, Segment, Target, read
from loadtest.locust.ledger import RunTally
from loadtest.locust.metrics import GenerationCheck, Reporter, error_name
from quicsrv_client import (
    CheckpointReceived,
    Client,
    ClientError,
    Event,
    Generation,
    ServerError,
    TokenReceived,
)

__all__ = [
    "CLOSE_TIMEOUT_S",
    "MAIN_WINDOW_BYTES",
    "PROMPTS",
    "RUN",
    "Options",
    "QuicUser",
    "StopAt",
]

log = logging.getLogger("quicsrv.locust")
logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection at INFO
T = TypeVar("T")

CLOSE_TIMEOUT_S = 15.0
#: A cached connection idle longer than this is replaced (the server's idle timeout is 60 s).
MAX_IDLE_REUSE_S = 20.0
#: The longest retry hint honoured, so that a bad hint cannot park a user for the whole run.
MAX_BACK_OFF_S = 30.0
#: The client's default stream receive window (it grows only as the application reads).
MAIN_WINDOW_BYTES = 16 * 1024
PROMPTS = (
    "Once upon a time",
    "The capital of France is",
    "Write three Japanese words with their meanings:",
    "List five prime numbers and explain why they are prime.",
    "Explain what a QUIC stream is to a child.",
    "def fibonacci(n):",
)


# --- options --------------------------------------------------------------------------------


def _add_options(parser: Any, **_: Any) -> None:
    group = parser.add_argument_group("quicsrv")
    group.add_argument(
        "--quic-ca",
        env_var="LOCUST_QUIC_CA",
        default="certs/ca.pem",
        help="CA that signed the server certificate",
    )
    group.add_argument(
        "--quic-summary",
        env_var="LOCUST_QUIC_SUMMARY",
        default="",
        help="write the token/error tally as JSON here when Locust exits",
    )
    group.add_argument(
        "--quic-max-tokens-limit",
        env_var="LOCUST_QUIC_MAX_TOKENS_LIMIT",
        type=int,
        default=2048,
        help="the server's max_tokens_limit (over-limit requests ask for one more)",
    )
    group.add_argument(
        "--quic-loops",
        env_var="LOCUST_QUIC_LOOPS",
        type=int,
        default=1,
        help="asyncio threads the users are spread over",
    )
    group.add_argument(
        "--quic-slow-window",
        env_var="LOCUST_QUIC_SLOW_WINDOW",
        type=int,
        default=2048,
        help="slow readers' stream receive window in bytes",
    )
    group.add_argument(
        "--quic-slow-pause",
        env_var="LOCUST_QUIC_SLOW_PAUSE",
        type=float,
        default=3.0,
        help="mean seconds a slow reader stops reading (uniform, 0.5x to 1.5x)",
    )
    group.add_argument(
        "--quic-no-cover",
        env_var="LOCUST_QUIC_NO_COVER",
        action="store_true",
        default=False,
        help="skip the first round in which each user runs every scenario once",
    )
    group.add_argument(
        "--quic-phase-timeout",
        env_var="LOCUST_QUIC_PHASE_TIMEOUT",
        type=float,
        default=120.0,
        help="seconds one read phase may take before it counts as a failure",
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """The ``--quic-*`` options, typed."""

    ca: Path
    summary: Path | None
    max_tokens_limit: int
    loops: int
    slow_window_bytes: int
    slow_pause_s: float
    cover: bool
    phase_timeout_s: float

    @classmethod
    def of(cls, environment: Environment) -> Options:
        parsed = environment.parsed_options
        get: Callable[[str, Any], Any] = (
            (lambda name, default: getattr(parsed, name, default))
            if parsed is not None
            else (lambda name, default: os.environ.get(f"LOCUST_{name.upper()}", default))
        )
        summary = str(get("quic_summary", ""))
        return cls(
            ca=Path(get("quic_ca", "certs/ca.pem")),
            summary=Path(summary) if summary else None,
            max_tokens_limit=int(get("quic_max_tokens_limit", 2048)),
            loops=max(1, int(get("quic_loops", 1))),
            slow_window_bytes=int(get("quic_slow_window", 2048)),
            slow_pause_s=float(get("quic_slow_pause", 3.0)),
            cover=not get("quic_no_cover", False),
            phase_timeout_s=float(get("quic_phase_timeout", 120.0)),
        )


# --- process-wide state: the bridges and the tally -------------------------------------------


class _Run:
    """The asyncio threads (created on demand, shared by all users) and the run's tally."""

    def __init__(self) -> None:
        self.loops: list[tuple[AsyncioBridge, Connections]] = []
        self.tally = RunTally()
        self._next = 0
        # Starting a bridge yields to gevent: without the lock, two users starting together
        # could both start the same one.
        self._starting = gevent.lock.Semaphore()

    def assign(self, n_loops: int) -> tuple[AsyncioBridge, Connections]:
        """Users go round-robin over ``n_loops`` bridges."""
        with self._starting:
            while len(self.loops) < n_loops:
                bridge = AsyncioBridge(f"quicsrv-asyncio-{len(self.loops)}")
                self.loops.append((bridge, Connections()))
        chosen = self.loops[self._next % len(self.loops)]
        self._next += 1
        return chosen

    def close_connections(self) -> None:
        for bridge, connections in self.loops:
            try:
                bridge.run(connections.close_all(), CLOSE_TIMEOUT_S)
            except (BridgeTimeout, ClientError, OSError) as exc:
                log.warning("closing connections: %s", exc)

    def stop(self) -> None:
        for bridge, _ in self.loops:
            bridge.stop()
        self.loops.clear()


RUN = _Run()


def _on_test_stop(environment: Environment, **_: Any) -> None:
    RUN.close_connections()


def _on_quitting(environment: Environment, **_: Any) -> None:
    RUN.close_connections()
    RUN.stop()
    tally = RUN.tally
    log.info("quicsrv tally: %s", tally.as_dict())
    options = Options.of(environment)
    if options.summary is not None:
        tally.write(options.summary)
    if tally.order_failures or tally.unexpected_errors or tally.expected_errors_wrong:
        environment.process_exit_code = 1


class StopAt:
    """Read-phase stop condition, evaluated on the loop thread: token ``index`` arrived (or,
    for -1, the first CHECKPOINT: the session exists but no token does yet)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, event: Event) -> bool:
        if self.index < 0:
            return isinstance(event, CheckpointReceived)
        return isinstance(event, TokenReceived) and event.index >= self.index


class QuicUser(User):
    """Base of the quicsrv users: a bridge, a target, the reporter and connection plumbing."""

    abstract = True
    host = "quic://127.0.0.1:4433"

    def on_start(self) -> None:
        self.options = Options.of(self.environment)
        self.target = Target.parse(self.host or QuicUser.host, self.options.ca)
        self.bridge, self.connections = RUN.assign(self.options.loops)
        self.report = Reporter(self.environment.events, RUN.tally)
        self._clients: dict[str, Client] = {}
        self._last_used: dict[str, float] = {}

    def on_stop(self) -> None:
        # Possibly inside GreenletExit: start the closes, do not wait for them.
        for client in self._clients.values():
            self.bridge.submit(self.connections.close(client))
        self._clients.clear()

    def await_(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return self.bridge.run(coro, timeout_s or self.options.phase_timeout_s)

    def read_phase(
        self,
        check: GenerationCheck,
        generation: Generation,
        stop: Callable[[Event], bool] | None = None,
    ) -> Segment | None:
        """One read phase; None (and a failure) if it timed out."""
        try:
            return self.await_(read(generation, stop))
        except BridgeTimeout as exc:
            check.abandon(exc)
            return None

    def connection(self, slot: str, window_bytes: int) -> Client | None:
        """The user's long-lived connection for ``slot``, (re)connected as needed.

        One left idle for ``MAX_IDLE_REUSE_S`` (while the user was busy elsewhere) is replaced
        first: the server closes connections idle for 60 s, and a real client would not send
        a request down one that is about to expire either.
        """
        now = time.monotonic()
        client = self._clients.get(slot)
        if client is not None and now - self._last_used.get(slot, now) > MAX_IDLE_REUSE_S:
            del self._clients[slot]
            self.await_(self.connections.close(client), CLOSE_TIMEOUT_S)
            client = None
        if client is None:
            client = self.open_connection(window_bytes)
            if client is not None:
                self._clients[slot] = client
        self._last_used[slot] = now
        return client

    def fresh_connection(self) -> Client | None:
        return self.open_connection(MAIN_WINDOW_BYTES)

    def open_connection(self, window_bytes: int) -> Client | None:
        try:
            client, seconds = self.await_(
                self.connections.open(self.target, read_window_bytes=window_bytes)
            )
        except (ClientError, BridgeTimeout, OSError) as exc:
            self.report.unexpected(exc)
            return None
        self.report.measure("connect", "handshake", seconds)
        return client

    def back_off(self, segment: Segment | None) -> None:
        """Honour a refusal's retry hint (``overloaded``): a well-behaved client waits."""
        error = None if segment is None else segment.error
        if isinstance(error, ServerError) and error.retry_after_s:
            gevent.sleep(min(error.retry_after_s, MAX_BACK_OFF_S))

    def done_with(self, slot: str, segment: Segment | None) -> None:
        """The scenario is done with ``slot``'s connection for now: keep it for the next task,
        unless ``segment`` timed out (None) or ended in a transport or protocol error."""
        self._last_used[slot] = time.monotonic()
        self.back_off(segment)
        if segment is not None and (
            segment.error is None or isinstance(segment.error, ServerError)
        ):
            return
        client = self._clients.pop(slot, None)
        if client is not None:
            try:
                self.await_(self.connections.close(client), CLOSE_TIMEOUT_S)
            except BridgeTimeout as exc:
                log.warning("closing a broken connection: %s (%s)", exc, error_name(exc))


# Locust's EventHook.add_listener carries no annotations.
events.init_command_line_parser.add_listener(_add_options)  # type: ignore[no-untyped-call]
events.test_stop.add_listener(_on_test_stop)  # type: ignore[no-untyped-call]
events.quitting.add_listener(_on_quitting)  # type: ignore[no-untyped-call]
