"""The HTTP/3 server: the aioquic adapter between QUIC connections and the one front door.

Every request stream of a connection goes through one table (:mod:`.streams`) to the one
router shared with the TCP listener (:mod:`quicsrv.http.router`): the native frame API
(``POST /v1/generate``, ``POST /v1/resume``), OpenAI's API and the operators' endpoints alike.
This module only feeds aioquic's events in, transmits, and watches the connection. The
connection and other streams go on whatever one request does.

aioquic has no "writable" event, so flow control is watched from the other end: after every
datagram (which may carry ACKs) each attached session compares the stream's sent and
acknowledged offsets (read in :mod:`.aioquic_internals`, the one place aioquic's private state
is touched) and pauses or resumes its engine sequence accordingly.

0-RTT (RFC 8446 §8, RFC 8470): tickets are single-use (the store's ``pop`` is the fetcher), so a
replayed first flight finds no ticket and its early data is discarded; on top of that only
requests whose replay is harmless are answered from early data (the router's one rule).
aioquic delivers early data as ordinary stream events, so the handshake is tracked here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)

from quicsrv_proto import ErrorCode
from quicsrv_proto.http3 import (
    H3_NO_ERROR,
    H3_REQUEST_CANCELLED,
)

from ..config import ServerConfig
from ..http.router import Router
from ..metrics import ServerMetrics, TransportFacts
from ..peer_errors import install_filters
from ..sessions.handover import HandOver
from ..sessions.manager import SessionManager
from . import aioquic_internals
from .drain import Drained, PeerDrain, QuietPeer, silent_s, still_waiting
from .sockets import AppliedSocketOptions, SocketOptions, open_udp_socket, serve_on_socket
from .streams import RequestStreams
from .tcp import TcpListener, open_tcp_socket, start_tcp_listener
from .tickets import TicketStore

__all__ = ["QuicServerApp", "RunningServer", "start_server"]

log = logging.getLogger("quicsrv")

#: How often the last wait of a shutdown looks at the connections again: a small part of a
#: loopback probe timeout (about 30 ms), so a quiet peer costs little more than its three.
_DRAIN_POLL_S = 0.01


class QuicServerApp:
    """What every connection shares: the router, the sessions (for the hand-over) and the live
    connections."""

    def __init__(
        self,
        *,
        router: Router,
        sessions: SessionManager,
        metrics: ServerMetrics,
        config: ServerConfig,
    ) -> None:
        self.router = router
        self.sessions = sessions
        self.metrics = metrics
        self.config = config
        self.connection_ids = itertools.count(1)
        self.connections: set[_H3ServerProtocol] = set()
        metrics.bind_transport(_AppFacts(self))

    @property
    def refusals(self) -> Counter[ErrorCode]:
        """Requests refused with a wire code, per code (401, 429, 503, 504, ...)."""
        return self.router.refusals

    @property
    def early_resumes(self) -> int:
        """Resumes answered from 0-RTT data."""
        return self.router.early_resumes

    @property
    def early_generates_refused(self) -> int:
        """Requests that would start compute, refused ``too_early`` in 0-RTT data."""
        return self.router.early_starts_refused

    async def hand_over(self, grace_s: float) -> HandOver:
        """Stop accepting, pause every generation with its KV cells saved for the next
        process, then end every open stream with END(shutdown) (resume elsewhere)."""
        self.sessions.shutdown()
        handed = await self.sessions.hand_over(grace_s)
        for connection in list(self.connections):
            connection.transmit()
        return handed


class _AppFacts(TransportFacts):
    """The transport's state, read by the metrics collector when scraped."""

    def __init__(self, app: QuicServerApp) -> None:
        self._app = app

    def open_connections(self) -> int:
        return len(self._app.connections)

    def early_resumes(self) -> int:
        return self._app.early_resumes

    def early_generates_refused(self) -> int:
        return self._app.early_generates_refused

    def accepting(self) -> bool:
        return self._app.sessions.accepting


class _H3ServerProtocol(QuicConnectionProtocol):
    """One QUIC connection: feeds aioquic's events to HTTP/3 and its request streams to the
    one stream table (:mod:`.streams`), and lets the attached sessions see acknowledgements."""

    def __init__(self, *args: Any, app: QuicServerApp, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app = app
        self._h3: H3Connection | None = None
        self._transmit_scheduled = False
        self._handshake_done = False
        # Without API keys, a client is its connection (a number never reused by this process).
        self._streams = RequestStreams(self, app.router, f"conn:{next(app.connection_ids)}")
        self._heard_at = asyncio.get_running_loop().time()  # the last datagram from the peer
        app.connections.add(self)
        app.metrics.connections_opened.inc()

    @property
    def peer(self) -> str:
        address = aioquic_internals.peer_address(self._quic)
        return f"{address[0]}:{address[1]}" if address else "?"

    @property
    def peer_ip(self) -> str:
        address = aioquic_internals.peer_address(self._quic)
        return address[0] if address else ""

    def stream_offsets(self, stream_id: int) -> tuple[int, int] | None:
        return aioquic_internals.stream_offsets(self._quic, stream_id)

    @property
    def h3(self) -> H3Connection | None:
        return self._h3

    def stop_stream(self, stream_id: int) -> None:
        try:
            self._quic.stop_stream(stream_id, H3_NO_ERROR)
        except Exception as exc:  # the stream may already be gone
            log.debug("stream %d: not stopped: %r", stream_id, exc)

    def drop_connection(self) -> None:
        log.info("test fault: dropping the connection of %s", self.peer)
        self._quic.close(error_code=H3_NO_ERROR, reason_phrase="test fault: connection dropped")
        self.transmit()

    def transmit_soon(self) -> None:
        # Many frames are often written in one go (a resume replays history): one transmit.
        if not self._transmit_scheduled:
            self._transmit_scheduled = True
            asyncio.get_running_loop().call_soon(self._transmit_now)

    def _transmit_now(self) -> None:
        self._transmit_scheduled = False
        self.transmit()

    @property
    def handshake_complete(self) -> bool:
        return self._handshake_done

    def drain_state(self) -> PeerDrain:
        """What a shutdown's last wait needs to know of this connection (:mod:`.drain`)."""
        return PeerDrain(
            unacked_streams=aioquic_internals.unfinished_requests(self._quic),
            heard_at=self._heard_at,
            unacked_since=aioquic_internals.unacknowledged_since(self._quic),
            probe_timeout_s=aioquic_internals.probe_timeout_s(self._quic),
        )

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self._heard_at = asyncio.get_running_loop().time()
        super().datagram_received(data, addr)
        if aioquic_internals.peer_closed(self._quic):
            # Nobody reads any more: pause now, not after the drain period.
            self._streams.close_all()
            return
        # The datagram may have acknowledged stream data: let readers' sessions catch up.
        self._streams.transport_progress()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated) and event.alpn_protocol in H3_ALPN:
            self._h3 = H3Connection(self._quic)
        elif isinstance(event, HandshakeCompleted):
            self._handshake_done = True
        elif isinstance(event, StreamReset | StopSendingReceived):
            # Either direction of a cancelled request: nobody will read the tokens.
            capture_kv = event.error_code != H3_REQUEST_CANCELLED
            self._streams.stream_gone(event.stream_id, capture_kv=capture_kv)
        elif isinstance(event, ConnectionTerminated):
            self._streams.close_all()
            self._app.connections.discard(self)
        if self._h3 is not None:
            for h3_event in self._h3.handle_event(event):
                if isinstance(h3_event, HeadersReceived):
                    self._streams.headers_received(h3_event)
                elif isinstance(h3_event, DataReceived):
                    self._streams.data_received(h3_event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._streams.close_all()
        self._app.connections.discard(self)
        super().connection_lost(exc)


@dataclass
class RunningServer:
    server: QuicServer
    app: QuicServerApp
    sweeper: asyncio.Task[None]
    socket_options: AppliedSocketOptions
    tickets: TicketStore
    tcp: TcpListener | None = None
    """HTTP/1.1 + HTTP/2 on the same port number (None when ``tcp_listener`` is off)."""
    on_closed: Callable[[], None] = lambda: None
    """Called once everything is stopped (the composition root lets go of the engine)."""
    handed: HandOver | None = None
    """What the shutdown's hand-over left for the next process (None: no shutdown yet)."""
    drained: Drained | None = None
    """How the shutdown's wait for the END frames' acknowledgements ended."""
    _shut_down: bool = False

    @property
    def port(self) -> int:
        return aioquic_internals.server_port(self.server)

    @property
    def sessions(self) -> SessionManager:
        return self.app.sessions

    async def shutdown(self, grace_s: float) -> None:
        """Hand every generation over (paused, KV cells saved, streams told with
        END(shutdown)), then close connections. ``grace_s`` bounds the whole hand-over: the
        pauses the engine is still making, then the wait for live peers to acknowledge their
        END frames (a peer gone quiet is not waited for, :mod:`.drain`). Only the first call
        does anything."""
        if self._shut_down:
            return
        self._shut_down = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        self.sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.sweeper
        self.handed = await self.app.hand_over(grace_s)
        log.info("shutdown: %s", self.handed.describe(), extra={"event": "hand_over"})
        self.drained = await self._drain(deadline)
        for peer in self.drained.quiet:
            log.info("shutdown: not waiting for %s", peer.describe())
        log.info("shutdown: %s", self.drained.describe(), extra={"event": "drained"})
        for connection in list(self.app.connections):
            connection.close()
        if self.tcp is not None:
            await self.tcp.shutdown(grace_s)
        self.server.close()
        self.tickets.close()
        await self.app.sessions.aclose()
        self.on_closed()

    async def _drain(self, deadline: float) -> Drained:
        """Give the END frames a chance to be acknowledged before the connections close: wait
        while a peer that still answers has some unacknowledged, until ``deadline``."""
        loop = asyncio.get_running_loop()
        told_at = now = loop.time()
        while now < deadline and any(
            still_waiting(c.drain_state(), told_at=told_at, now=now) for c in self.app.connections
        ):
            await asyncio.sleep(_DRAIN_POLL_S)  # polling acknowledgements, not waiting for them
            now = loop.time()
        quiet, acknowledged, cut_short = [], 0, 0
        for connection in self.app.connections:
            state = connection.drain_state()
            if not state.unacked_streams:
                acknowledged += 1
            elif still_waiting(state, told_at=told_at, now=now):
                cut_short += 1
            else:
                quiet.append(
                    QuietPeer(
                        peer=connection.peer,
                        streams=state.unacked_streams,
                        silent_s=silent_s(state, told_at=told_at, now=now),
                        probe_timeout_s=state.probe_timeout_s,
                    )
                )
        return Drained(
            waited_s=now - told_at,
            acknowledged=acknowledged,
            quiet=tuple(quiet),
            cut_short=cut_short,
            deadline_passed=now >= deadline,
        )


async def start_server(
    *,
    router: Router,
    sessions: SessionManager,
    metrics: ServerMetrics,
    config: ServerConfig,
    udp_options: SocketOptions,
    tickets: TicketStore,
    on_closed: Callable[[], None] = lambda: None,
) -> RunningServer:
    """Listen on ``config.host:config.port`` (port 0: an ephemeral one), UDP for HTTP/3 and, on
    the same port number, TCP, every request going to ``router``; ``on_closed`` once stopped.
    :func:`quicsrv.app.start` builds the parts."""
    install_filters()  # a peer's errors on these listeners: counted, rarely logged
    configuration = QuicConfiguration(
        is_client=False,
        alpn_protocols=H3_ALPN,
        idle_timeout=config.idle_timeout_s,
        max_datagram_frame_size=None,
        congestion_control_algorithm=config.congestion_control,
        max_data=config.max_data_bytes,
        max_stream_data=config.max_stream_data_bytes,
    )
    configuration.load_cert_chain(config.cert_path, config.key_path)
    sock, applied, tcp_sock = _open_sockets(config, udp_options)
    log.info("socket: %s", applied.describe())
    for warning in applied.warnings:
        log.warning("socket: %s", warning)
    log.info(
        "transport: congestion=%s idle_timeout=%.0fs max_data=%d max_stream_data=%d "
        "0-RTT: single-use tickets (ttl %.0fs, at most %d), GENERATE in early data -> too_early",
        config.congestion_control,
        config.idle_timeout_s,
        config.max_data_bytes,
        config.max_stream_data_bytes,
        config.ticket_ttl_s,
        config.max_tickets,
    )
    app = QuicServerApp(router=router, sessions=sessions, metrics=metrics, config=config)
    server = await serve_on_socket(
        sock,
        configuration=configuration,
        create_protocol=lambda *a, **kw: _H3ServerProtocol(*a, app=app, **kw),
        # pop, not get: a ticket resumes one connection only, so a replayed first flight
        # finds none and its 0-RTT data is discarded (RFC 8446 §8.1).
        session_ticket_fetcher=tickets.pop,
        session_ticket_handler=tickets.add,
    )
    sweeper = asyncio.get_running_loop().create_task(
        sessions.run_sweeper(config.session_sweep_interval_s)
    )
    tcp = None
    if tcp_sock is not None:
        tcp = await start_tcp_listener(
            router,
            tcp_sock,
            cert_path=str(config.cert_path),
            key_path=str(config.key_path),
            keep_alive_timeout_s=config.tcp_keep_alive_timeout_s,
            tls_shutdown_timeout_s=config.tcp_tls_shutdown_timeout_s,
            grace_s=config.shutdown_grace_s,
        )
        log.info("HTTP/1.1 + HTTP/2 on TCP port %d (alt-svc: h3)", tcp.port)
    return RunningServer(
        server=server,
        app=app,
        sweeper=sweeper,
        socket_options=applied,
        tickets=tickets,
        tcp=tcp,
        on_closed=on_closed,
    )


def _open_sockets(
    config: ServerConfig, options: SocketOptions
) -> tuple[socket.socket, AppliedSocketOptions, socket.socket | None]:
    """The UDP socket, and the TCP one on the same port number when the TCP listener is on.

    With port 0 the kernel picks the UDP port, which TCP may already use elsewhere: then both
    are tried again with another number (a few times; a fixed port is not retried).
    """
    attempts = 20 if config.port == 0 else 1
    for attempt in range(attempts):
        sock, applied = open_udp_socket(config.host, config.port, options)
        if not config.tcp_listener:
            return sock, applied, None
        try:
            tcp = open_tcp_socket(
                config.host, int(sock.getsockname()[1]), reuse_port=config.udp_reuse_port
            )
            return sock, applied, tcp
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
