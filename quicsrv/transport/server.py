"""The HTTP/3 server: the aioquic adapter between QUIC connections and the sessions.

``POST /v1/generate`` (body: one GENERATE frame) starts a session; ``POST /v1/resume`` (session
id in the ``quicsrv-session`` header, body: one RESUME_STREAM frame) attaches to one. Either
response is ``200`` with TOKEN/CHECKPOINT ... END frames. What a request on those paths becomes,
the 0-RTT policy and the mapping of every error (unexpected ones included) to a status and an
ERROR frame are decided sans-I/O in :mod:`.requests`; this module feeds it H3 events and
performs its actions. Every path of the HTTP API (OpenAI's ``/v1/chat/completions`` and the
rest, ``/metrics``, ``/healthz``, ``/readyz``) goes to the one router shared with the TCP
listener (:mod:`.h3_routed`, :mod:`quicsrv.http.router`). The connection and other streams go
on whatever one request does.

aioquic has no "writable" event, so flow control is watched from the other end: after every
datagram (which may carry ACKs) each attached session compares the stream's sent and
acknowledged offsets (read in :mod:`.aioquic_internals`, the one place aioquic's private state
is touched) and pauses or resumes its engine sequence accordingly.

0-RTT (RFC 8446 §8, RFC 8470): tickets are single-use (the store's ``pop`` is the fetcher), so a
replayed first flight finds no ticket and its early data is discarded; on top of that only
requests whose replay is harmless are answered from early data (see :mod:`.requests`).
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
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)

import quicsrv_proto
from quicsrv_proto import ErrorCode
from quicsrv_proto.http3 import (
    EARLY_DATA_HEADER,
    H3_NO_ERROR,
    H3_REQUEST_CANCELLED,
    NATIVE_PATHS,
    RESUME_PATH_HEADER,
    SESSION_HEADER,
)

from ..apikeys import ApiKeys
from ..config import ServerConfig
from ..engine import Engine
from ..http.router import Router
from ..http.tcp import TcpListener, open_tcp_socket, start_tcp_listener
from ..metrics import TransportFacts
from ..sessions.manager import SessionManager
from ..sessions.redis_store import connect
from ..sessions.session import Session
from . import aioquic_internals
from .h3_routed import RoutedStreams
from .redis_tickets import RedisTicketStore
from .requests import (
    Action,
    IncomingRequest,
    Reject,
    RequestIntake,
    StartGeneration,
    StartResume,
    error_response,
    rejection_for,
)
from .routes import PLAIN_PATHS, PlainRoutes, authorize_metrics, readiness
from .sockets import AppliedSocketOptions, open_udp_socket, serve_on_socket
from .tickets import MemoryTicketStore, TicketStore

__all__ = ["QuicServerApp", "RunningServer", "start_server"]

log = logging.getLogger("quicsrv")


@dataclass(eq=False)
class _Answering:
    """A native request past its intake: starting, or streaming its session's frames."""

    request: IncomingRequest
    session: Session | None = None
    port: _StreamPort | None = None
    starting: asyncio.Task[None] | None = None  # a GENERATE queued, or a resume reading Redis


class _StreamPort:
    """One response stream as a session sees it (see sessions.StreamPort)."""

    def __init__(self, protocol: _H3ServerProtocol, stream_id: int) -> None:
        self._protocol = protocol
        self._stream_id = stream_id

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None:
        self._protocol.send_data(self._stream_id, quicsrv_proto.encode_frame(frame), end_stream)

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        data = b"".join([quicsrv_proto.encode_frame(frame) for frame in frames])
        self._protocol.send_data(self._stream_id, data, False)

    def sent_offset(self) -> int:
        offsets = self._protocol.stream_offsets(self._stream_id)
        return 0 if offsets is None else offsets[0]

    def acked_offset(self) -> int:
        offsets = self._protocol.stream_offsets(self._stream_id)
        return 0 if offsets is None else offsets[1]


class QuicServerApp:
    """What every connection shares: the sessions, the config, and the live connections."""

    def __init__(
        self,
        engine: Engine,
        config: ServerConfig,
        sessions: SessionManager,
        api_keys: ApiKeys | None = None,
        *,
        model_id: str = "quicsrv",
    ) -> None:
        self.engine = engine
        self.config = config
        self.sessions = sessions
        self.api_keys = api_keys if api_keys is not None else ApiKeys()
        self.connection_ids = itertools.count(1)
        self.connections: set[_H3ServerProtocol] = set()
        self.accepting = True
        self.early_resumes = 0  # RESUME_STREAMs answered from 0-RTT data (stats, tests)
        self.refusals: Counter[ErrorCode] = Counter()
        """Requests answered with an ERROR frame, per code (401, 429, 503, 504, ...)."""
        self.early_generates_refused = 0
        self.metrics = sessions.metrics
        self.metrics.bind_engine(engine)
        self.metrics.bind_transport(_AppFacts(self))
        self.routes = PlainRoutes(
            metrics=self.metrics,
            readiness=lambda: readiness(self.engine, accepting=self.accepting),
            authorize_metrics=lambda headers: authorize_metrics(
                headers, api_keys=self.api_keys, metrics_public=self.config.metrics_public
            ),
        )
        self.router = Router(
            sessions=sessions,
            api_keys=self.api_keys,
            plain=self.routes,
            plain_paths=PLAIN_PATHS,
            metrics=self.metrics,
            model_id=model_id,
            accepting=lambda: self.accepting,
            max_body_bytes=config.max_request_bytes,
        )

    def shut_down_streams(self) -> None:
        """End every open stream with END(shutdown); sessions stay resumable."""
        self.accepting = False
        self.sessions.shutdown()
        for connection in list(self.connections):
            connection.transmit()


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
        return self._app.accepting


class _H3ServerProtocol(QuicConnectionProtocol):
    """The aioquic adapter: feeds H3 events to the request intake and the HTTP API's router,
    performs what they decide, and watches acknowledgements for the attached sessions."""

    def __init__(self, *args: Any, app: QuicServerApp, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app = app
        self._h3: H3Connection | None = None
        self._answering: dict[int, _Answering] = {}
        self._transmit_scheduled = False
        self._handshake_done = False
        # Without API keys, a client is its connection (a number never reused by this process).
        self._connection_client = f"conn:{next(app.connection_ids)}"
        self._intake = RequestIntake(
            api_keys=app.api_keys,
            connection=self._connection_client,
            max_request_bytes=app.config.max_request_bytes,
        )
        # The HTTP API's streams (OpenAI endpoints, operators' endpoints) on this connection.
        self._routed = RoutedStreams(self, app.router, self._connection_client)
        app.connections.add(self)
        app.metrics.connections_opened.inc()

    @property
    def _peer(self) -> str:
        address = aioquic_internals.peer_address(self._quic)
        return f"{address[0]}:{address[1]}" if address else "?"

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

    @property
    def handshake_complete(self) -> bool:
        return self._handshake_done

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        super().datagram_received(data, addr)
        if aioquic_internals.peer_closed(self._quic):
            self._detach_all()  # nobody reads any more: pause now, not after the drain period
            return
        # The datagram may have acknowledged stream data: let readers' sessions catch up.
        for answering in list(self._answering.values()):
            if answering.session is not None:
                answering.session.on_transport_progress()
        self._routed.transport_progress()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated) and event.alpn_protocol in H3_ALPN:
            self._h3 = H3Connection(self._quic)
        elif isinstance(event, HandshakeCompleted):
            self._handshake_done = True
        elif isinstance(event, StreamReset | StopSendingReceived):
            # Either direction of a cancelled request: nobody will read the tokens.
            capture_kv = event.error_code != H3_REQUEST_CANCELLED
            self._detach(event.stream_id, capture_kv=capture_kv)
            self._routed.stream_gone(event.stream_id, capture_kv=capture_kv)
        elif isinstance(event, ConnectionTerminated):
            self._detach_all()
            self._app.connections.discard(self)
        if self._h3 is not None:
            for h3_event in self._h3.handle_event(event):
                self._h3_event_received(h3_event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._detach_all()
        self._app.connections.discard(self)
        super().connection_lost(exc)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            path = dict(event.headers).get(b":path")
            if path not in NATIVE_PATHS and self._app.router.owns(path):
                self._routed.headers_received(event)  # the HTTP API, shared with TCP
                return
            now = asyncio.get_running_loop().time()
            action = self._intake.headers_received(event, now=now, accepting=self._app.accepting)
        elif isinstance(event, DataReceived):
            self._routed.data_received(event)
            action = self._intake.data_received(event, early=not self._handshake_done)
        else:
            return
        if action is not None:
            self._perform(action)

    def _perform(self, action: Action) -> None:
        if isinstance(action, Reject):
            self._reject(action)
            return
        request = action.request
        answering = _Answering(request)
        self._answering[request.stream_id] = answering
        if isinstance(action, StartGeneration):
            # On a task: a long prompt is tokenized on a thread (milliseconds per thousand
            # tokens), while the loop serves every other stream.
            answering.starting = asyncio.get_running_loop().create_task(
                self._guarded(answering, partial(self._start_generation, answering, action.frame))
            )
        elif self._app.sessions.shared:  # the record is read from Redis: on a task
            answering.starting = asyncio.get_running_loop().create_task(
                self._guarded(answering, partial(self._resume_shared, answering, action))
            )
        else:
            try:
                session = self._app.sessions.resume(
                    action.frame, action.header_session, key_id=request.key_id
                )
            except Exception as exc:  # refusals and bugs alike: an answer, never a hang
                self._reject(rejection_for(exc, request))
                return
            self._answer_resume(answering, session, action)

    async def _guarded(self, answering: _Answering, start: Callable[[], Awaitable[None]]) -> None:
        """Run a request's asynchronous start; whatever it raises becomes the answer."""
        try:
            await start()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._answering.get(answering.request.stream_id) is answering:
                self._reject(rejection_for(exc, answering.request))

    async def _resume_shared(self, answering: _Answering, action: StartResume) -> None:
        request = answering.request
        session = await self._app.sessions.resume_shared(
            action.frame, action.header_session, key_id=request.key_id
        )
        if self._answering.get(request.stream_id) is not answering:
            session.abandon()  # the stream went away meanwhile; the session stays resumable
            return
        self._answer_resume(answering, session, action)

    def _answer_resume(self, answering: _Answering, session: Session, action: StartResume) -> None:
        extra: list[tuple[bytes, bytes]] = []
        if action.early:
            self._app.early_resumes += 1
            extra.append((EARLY_DATA_HEADER, b"1"))
        path = session.planned_resume_path()
        extra.append((RESUME_PATH_HEADER, b"none" if path is None else path.value.encode()))
        self._respond(answering, session, action.frame.last_index + 1, extra)

    async def _start_generation(self, answering: _Answering, frame: quicsrv_proto.Generate) -> None:
        request = answering.request
        session = await self._app.sessions.open_generation(
            frame, client=request.client, owner=request.key_id or "", arrived_at=request.arrived_at
        )
        if self._answering.get(request.stream_id) is not answering:
            session.abandon()  # the stream went away as it was opened; it stays resumable
            return
        self._respond(answering, session, 0, [])

    def _respond(
        self,
        answering: _Answering,
        session: Session,
        from_index: int,
        extra: list[tuple[bytes, bytes]],
    ) -> None:
        """200 with the session id, then the session's frames from ``from_index`` on."""
        request = answering.request
        answering.session = session
        answering.port = _StreamPort(self, request.stream_id)
        self._app.metrics.request_finished(request.endpoint, "ok")
        assert self._h3 is not None
        self._h3.send_headers(
            request.stream_id,
            [
                (b":status", b"200"),
                (b"content-type", quicsrv_proto.http3.CONTENT_TYPE),
                (SESSION_HEADER, session.session_id.hex().encode()),
                *extra,
            ],
        )
        self.transmit_soon()
        session.attach(answering.port, from_index, request.client)

    def send_data(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        assert self._h3 is not None
        try:
            self._h3.send_data(stream_id, data, end_stream)
        except Exception as exc:  # the peer reset the stream or closed the connection meanwhile
            log.debug("peer %s stream %d: gone while sending: %r", self._peer, stream_id, exc)
            self._detach(stream_id, capture_kv=True)
            return
        if end_stream:
            answering = self._answering.pop(stream_id, None)
            if answering is not None and answering.session is not None:
                self._log_stream_ended(answering.request, answering.session)
        self.transmit_soon()

    def _log_stream_ended(self, request: IncomingRequest, session: Session) -> None:
        duration_s = asyncio.get_running_loop().time() - request.arrived_at
        session_id = session.session_id.hex()
        log.info(
            "peer %s stream %d session %s: stream ended after %.3fs",
            self._peer,
            request.stream_id,
            session_id,
            duration_s,
            extra={
                "event": "stream_ended",
                "peer": self._peer,
                "stream_id": request.stream_id,
                "session_id": session_id,
                "duration_s": round(duration_s, 6),
            },
        )

    def transmit_soon(self) -> None:
        # Many frames are often written in one go (a resume replays history): one transmit.
        if not self._transmit_scheduled:
            self._transmit_scheduled = True
            asyncio.get_running_loop().call_soon(self._transmit_now)

    def _transmit_now(self) -> None:
        self._transmit_scheduled = False
        self.transmit()

    def _reject(self, reject: Reject) -> None:
        """Send a rejection (status + ERROR frame, stream ended), counted and logged."""
        request = reject.request
        log.info(
            "peer %s stream %d: %s: %s",
            self._peer,
            request.stream_id,
            reject.code.slug,
            reject.message,
            extra={
                "event": "request_rejected",
                "peer": self._peer,
                "stream_id": request.stream_id,
                "code": reject.code.slug,
                "duration_s": round(asyncio.get_running_loop().time() - request.arrived_at, 6),
            },
        )
        self._app.refusals[reject.code] += 1
        if reject.code is ErrorCode.TOO_EARLY:
            self._app.early_generates_refused += 1
        self._app.metrics.request_finished(request.endpoint, reject.code.slug)
        stream_id = request.stream_id
        self._answering.pop(stream_id, None)
        headers, body = error_response(reject)
        try:
            assert self._h3 is not None
            self._h3.send_headers(stream_id, headers)
            self._h3.send_data(stream_id, body, end_stream=True)
        except Exception as exc:  # the stream is already gone; nothing to answer
            log.debug(
                "peer %s stream %d: gone before its answer: %r", self._peer, request.stream_id, exc
            )
            return
        self.transmit_soon()

    def _detach(self, stream_id: int, *, capture_kv: bool) -> None:
        self._intake.forget(stream_id)
        answering = self._answering.pop(stream_id, None)
        if answering is None:
            return
        if answering.starting is not None and not answering.starting.done():
            answering.starting.cancel()  # gives its place in the queue (or its slot) back
        if answering.session is not None and answering.port is not None:
            answering.session.detach(answering.port, capture_kv=capture_kv)

    def _detach_all(self) -> None:
        for stream_id in list(self._answering):
            self._detach(stream_id, capture_kv=True)
        self._intake.forget_all()
        self._routed.close_all()

    @property
    def has_unacked_requests(self) -> bool:
        return aioquic_internals.has_unfinished_requests(self._quic)


@dataclass
class RunningServer:
    server: QuicServer
    app: QuicServerApp
    sweeper: asyncio.Task[None]
    socket_options: AppliedSocketOptions
    tickets: TicketStore
    tcp: TcpListener | None = None
    """HTTP/1.1 + HTTP/2 on the same port number (None when ``tcp_listener`` is off)."""

    @property
    def port(self) -> int:
        return aioquic_internals.server_port(self.server)

    @property
    def sessions(self) -> SessionManager:
        return self.app.sessions

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, end open streams with END(shutdown), then close connections."""
        self.sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.sweeper
        self.app.shut_down_streams()
        await self.app.sessions.wait_idle(grace_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        # Give the END frames a chance to be acknowledged before the connections close.
        while loop.time() < deadline and any(c.has_unacked_requests for c in self.app.connections):
            await asyncio.sleep(0.05)
        for connection in list(self.app.connections):
            connection.close()
        if self.tcp is not None:
            await self.tcp.shutdown(grace_s)
        self.server.close()
        await self.app.sessions.aclose()
        self.app.metrics.unbind_engine(self.app.engine)


async def start_server(
    engine: Engine,
    config: ServerConfig,
    sessions: SessionManager | None = None,
    tickets: TicketStore | None = None,
) -> RunningServer:
    """Listen on ``config.host:config.port`` (port 0: an ephemeral one)."""
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
    if sessions is None:
        sessions = SessionManager(engine, config.session_settings())
    if tickets is None and sessions.redis is not None:  # shared, like the sessions
        # A client of its own: aioquic asks for tickets on the event loop, so a Redis that
        # stalls must cost a handshake its 0-RTT within half a second, never retried.
        tickets = RedisTicketStore(
            connect(sessions.settings.store_url, timeout_s=0.5, retries=0),
            ttl_s=config.ticket_ttl_s,
        )
    if tickets is None:
        tickets = MemoryTicketStore(ttl_s=config.ticket_ttl_s, max_tickets=config.max_tickets)
    sock, applied, tcp_sock = _open_sockets(config)
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
    api_keys = ApiKeys([config.api_key] if config.api_key else [], keys_file=config.api_keys_file)
    if api_keys.enabled:
        log.info("API keys: %d accepted; requests without one get 401", len(api_keys))
    else:
        log.warning(
            "NO API KEY CONFIGURED: anyone who reaches %s can generate "
            "(set --api-key, QUICSRV_API_KEY or api_keys_file)",
            config.address(sock.getsockname()[1]),
        )
    app = QuicServerApp(engine, config, sessions, api_keys, model_id=_model_id(config, engine))
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
    log.info("session store: %s", sessions.usage())
    tcp = None
    if tcp_sock is not None:
        tcp = await start_tcp_listener(
            app.router,
            tcp_sock,
            cert_path=str(config.cert_path),
            key_path=str(config.key_path),
            keep_alive_timeout_s=config.tcp_keep_alive_timeout_s,
            grace_s=config.shutdown_grace_s,
        )
        log.info("HTTP/1.1 + HTTP/2 on TCP port %d (alt-svc: h3)", tcp.port)
    return RunningServer(
        server=server, app=app, sweeper=sweeper, socket_options=applied, tickets=tickets, tcp=tcp
    )


def _open_sockets(
    config: ServerConfig,
) -> tuple[socket.socket, AppliedSocketOptions, socket.socket | None]:
    """The UDP socket, and the TCP one on the same port number when the TCP listener is on.

    With port 0 the kernel picks the UDP port, which TCP may already use elsewhere: then both
    are tried again with another number (a few times; a fixed port is not retried).
    """
    options = config.socket_options()
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


def _model_id(config: ServerConfig, engine: Engine) -> str:
    """The id ``/v1/models`` lists: the configured name, else the model file's stem."""
    if config.model_name:
        return config.model_name
    settings = getattr(engine, "settings", None)
    path = config.model_path or getattr(settings, "model_path", None)
    return Path(path).stem if path is not None else "quicsrv"
