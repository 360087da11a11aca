"""The HTTP/3 server: routes request streams to generations and maps every error to a frame.

One generation is one request stream: ``POST /v1/generate`` whose body is one GENERATE frame;
the response body is TOKEN ... END. Peer errors become an HTTP status plus an ERROR frame in
exactly one place (:meth:`_H3ServerProtocol._reject`); the connection and other streams go on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer, serve
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import (
    ConnectionTerminated,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)

import proto
from proto import ErrorCode

from ..config import ServerConfig
from ..engine import Engine
from ..sessions import GenerationStream, RequestRejected, build_request

__all__ = ["QuicServerApp", "RunningServer", "start_server"]

log = logging.getLogger("quicsrv")

CONTENT_TYPE = b"application/vnd.quicsrv.frames"
GENERATE_PATH = b"/v1/generate"


@dataclass(eq=False)
class _Request:
    stream_id: int
    decoder: proto.FrameDecoder
    frames: list[proto.Frame] = field(default_factory=list)
    rejected: bool = False
    generation: GenerationStream | None = None


class QuicServerApp:
    """What every connection shares: the engine, the config, and the live connections."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.connections: set[_H3ServerProtocol] = set()
        self.accepting = True

    def shut_down_streams(self) -> None:
        """End every open generation with END(shutdown) and tell connections to go away."""
        self.accepting = False
        for connection in list(self.connections):
            connection.end_all_for_shutdown()


class _H3ServerProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, app: QuicServerApp, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._app = app
        self._h3: H3Connection | None = None
        self._requests: dict[int, _Request] = {}
        app.connections.add(self)

    @property
    def _peer(self) -> str:
        address = self._quic._network_paths[0].addr if self._quic._network_paths else None
        return f"{address[0]}:{address[1]}" if address else "?"

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated) and event.alpn_protocol in H3_ALPN:
            self._h3 = H3Connection(self._quic)
        elif isinstance(event, StreamReset | StopSendingReceived):
            # Either direction of a cancelled request: nobody will read the tokens.
            self._cancel(event.stream_id)
        elif isinstance(event, ConnectionTerminated):
            for stream_id in list(self._requests):
                self._cancel(stream_id)
            self._app.connections.discard(self)
        if self._h3 is not None:
            for h3_event in self._h3.handle_event(event):
                self._h3_event_received(h3_event)

    def connection_lost(self, exc: Exception | None) -> None:
        for stream_id in list(self._requests):
            self._cancel(stream_id)
        self._app.connections.discard(self)
        super().connection_lost(exc)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            self._headers_received(event)
        elif isinstance(event, DataReceived):
            request = self._requests.get(event.stream_id)
            if request is None or request.rejected or request.generation is not None:
                return
            try:
                request.frames.extend(request.decoder.feed(event.data))
                if len(request.frames) > 1:
                    raise proto.UnexpectedFrame("the request body holds more than one frame")
                if event.stream_ended:
                    request.decoder.end_of_stream()
                    self._start_generation(request)
            except proto.ProtocolError as exc:
                self._reject(request, exc.error_code, exc.message)
            except RequestRejected as exc:
                self._reject(request, exc.code, exc.message, exc.retry_after_s)

    def _headers_received(self, event: HeadersReceived) -> None:
        headers = dict(event.headers)
        request = _Request(
            stream_id=event.stream_id,
            decoder=proto.FrameDecoder(max_payload_bytes=self._app.config.max_request_bytes),
        )
        self._requests[event.stream_id] = request
        method, path = headers.get(b":method"), headers.get(b":path")
        if path != GENERATE_PATH:
            self._reject(request, ErrorCode.NOT_FOUND, f"no such path: {path!r}")
        elif method != b"POST":
            self._reject(request, ErrorCode.METHOD_NOT_ALLOWED, f"{path!r} takes POST")
        elif not self._app.accepting:
            self._reject(request, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        elif event.stream_ended:
            self._reject(request, ErrorCode.MISSING_FIELD, "the request has no GENERATE frame")

    def _start_generation(self, request: _Request) -> None:
        if not request.frames:
            raise proto.MissingField("the request body holds no frame")
        frame = request.frames[0]
        if not isinstance(frame, proto.Generate):
            raise proto.UnexpectedFrame(f"expected GENERATE, got {frame.frame_type.name}")
        sequence = build_request(
            self._app.engine, frame, max_tokens_limit=self._app.config.max_tokens_limit
        )
        stream_id = request.stream_id

        def forget(_generation: GenerationStream) -> None:
            self._requests.pop(stream_id, None)

        generation = GenerationStream(
            engine=self._app.engine,
            request=sequence,
            stop=frame.stop,
            send=lambda data, end: self._send(stream_id, data, end),
            loop=asyncio.get_running_loop(),
            on_done=forget,
        )
        generation.start()
        request.generation = generation
        self._send_headers(stream_id, 200, [(b"quicsrv-session", generation.session_id.encode())])

    def _send_headers(
        self, stream_id: int, status: int, extra: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        assert self._h3 is not None
        headers = [(b":status", str(status).encode()), (b"content-type", CONTENT_TYPE)]
        self._h3.send_headers(stream_id, headers + (extra or []))
        self.transmit()

    def _send(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        assert self._h3 is not None
        try:
            self._h3.send_data(stream_id, data, end_stream)
        except Exception:  # the peer reset the stream or closed the connection meanwhile
            self._cancel(stream_id)
            return
        self.transmit()

    def _reject(
        self,
        request: _Request,
        code: ErrorCode,
        message: str,
        retry_after_s: float | None = None,
    ) -> None:
        """The one place a peer error becomes a response: status + ERROR frame, stream ended."""
        log.info("peer %s stream %d: %s: %s", self._peer, request.stream_id, code.slug, message)
        request.rejected = True
        self._requests.pop(request.stream_id, None)
        frame = proto.Error(code=code, message=message, retry_after_s=retry_after_s)
        try:
            self._send_headers(request.stream_id, proto.http_status_for(code))
            assert self._h3 is not None
            self._h3.send_data(request.stream_id, proto.encode_frame(frame), end_stream=True)
        except Exception:  # the stream is already gone; nothing to answer
            return
        self.transmit()

    def _cancel(self, stream_id: int) -> None:
        request = self._requests.pop(stream_id, None)
        if request is not None and request.generation is not None:
            request.generation.cancel()

    @property
    def has_unacked_requests(self) -> bool:
        # Client-initiated bidirectional streams are the requests (RFC 9000 §2.1).
        streams = self._quic._streams
        return any(not s.sender.is_finished for i, s in streams.items() if i % 4 == 0)

    def end_all_for_shutdown(self) -> None:
        for request in list(self._requests.values()):
            if request.generation is not None:
                request.generation.end_for_shutdown()


@dataclass
class RunningServer:
    server: QuicServer
    app: QuicServerApp

    @property
    def port(self) -> int:
        transport = self.server._transport
        assert transport is not None
        return int(transport.get_extra_info("sockname")[1])

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, end open streams with END(shutdown), then close connections."""
        self.app.shut_down_streams()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        # Give the END frames a chance to be acknowledged before the connections close.
        while loop.time() < deadline and any(c.has_unacked_requests for c in self.app.connections):
            await asyncio.sleep(0.05)
        for connection in list(self.app.connections):
            connection.close()
        self.server.close()


async def start_server(engine: Engine, config: ServerConfig) -> RunningServer:
    """Listen on ``config.host:config.port`` (port 0: an ephemeral one)."""
    configuration = QuicConfiguration(
        is_client=False,
        alpn_protocols=H3_ALPN,
        idle_timeout=config.idle_timeout_s,
        max_datagram_frame_size=None,
    )
    configuration.load_cert_chain(config.cert_path, config.key_path)
    app = QuicServerApp(engine, config)
    server = await serve(
        config.host,
        config.port,
        configuration=configuration,
        create_protocol=lambda *a, **kw: _H3ServerProtocol(*a, app=app, **kw),
    )
    return RunningServer(server=server, app=app)
