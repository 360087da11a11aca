"""The HTTP API over TCP: HTTP/1.1 and HTTP/2 (hypercorn) on the HTTP/3 port's number.

Most HTTP clients (curl as Debian builds it, httpx and so the ``openai`` SDK, browsers before
they learn of HTTP/3) speak no HTTP/3. This listener serves them the very same router as the
QUIC side, with TLS from the same certificate, and every response says ``alt-svc:
h3=":PORT"`` so those that can switch do (RFC 7838, RFC 9114 §3.1.1).

The HTTP parsing and framing is hypercorn's (h11, h2); this module is only the ASGI glue:
gather the body (bounded), ask the router, and write an event stream with the flow-control
signal a session pauses on. TCP has no acknowledgement a server can read, so a chunk counts
as acknowledged once hypercorn's ``send`` returns: hypercorn awaits the socket's drain (HTTP/1.1)
or the peer's flow-control window (HTTP/2), so a peer that stops reading stops those sends, and
the session pauses ``max_tokens_ahead`` tokens later.

A peer's TLS teardown costs nothing lasting: when a connection closes (keep-alive timeout,
shutdown), asyncio sends TLS close_notify and waits for the peer's; a client that went idle
without reading never answers, and asyncio gives up after ``ssl_shutdown_timeout`` (30 s by
default) with ``TimeoutError("SSL shutdown timed out")``, which hypercorn's connection task
does not catch (asyncio then logs "Unhandled exception in client_connected_cb" and its
traceback). hypercorn's ``serve()`` passes no ``ssl_shutdown_timeout``, so :func:`_serve` is its
``worker_serve`` for the one TLS socket this server has, with a short one
(``tls_shutdown_timeout_s``), and counts that timeout as the peer error it is
(:data:`~quicsrv.peer_errors.PEER_ERRORS`, source ``tcp``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HypercornConfig

from ..http.messages import FullResponse, HttpRequest, SessionStream
from ..http.router import Router
from ..peer_errors import PEER_ERRORS

__all__ = ["TcpListener", "open_tcp_socket", "start_tcp_listener"]

log = logging.getLogger("quicsrv.tcp")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def open_tcp_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``::``: dual-stack, as the UDP socket is);
    raises OSError (EADDRINUSE when the port number is taken over TCP). ``reuse_port``:
    SO_REUSEPORT, so several worker processes listen on one port (the kernel spreads the
    connections between them)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _type, _proto, _name, sockaddr = next(
        i for i in infos if i[0] in (socket.AF_INET, socket.AF_INET6)
    )
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Inherited by every accepted connection. asyncio sets it only on sockets made with
        # proto IPPROTO_TCP (this one's is 0): without it, a streamed event written after the
        # previous one waits for its ACK (Nagle), ~25-40 ms before the client sees a token.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(sockaddr)
        # Listening before hypercorn starts accepting: a client that connects right after
        # start-up waits in the backlog instead of being refused.
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass
class TcpListener:
    """A running listener; :meth:`shutdown` stops it (graceful, then cancelled)."""

    task: asyncio.Task[None]
    stop: asyncio.Event
    port: int
    connections: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)
    """The open connections' tasks (each ends once its connection is closed, TLS and all)."""

    async def shutdown(self, grace_s: float) -> None:
        """Stop: hypercorn's graceful shutdown for up to ``grace_s`` (and a second), then the
        listener is cancelled. Never raises: what comes after it in a shutdown (the hand-over
        to the next process) must run whatever the connections did."""
        self.stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace_s + 1.0)
        except TimeoutError:
            # Idle connections keep hypercorn waiting (the server waits for every connection to
            # close, up to its keep-alive timeout): cancel it, and go on after a second at most.
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=1.0)
        if self.task.done() and not self.task.cancelled() and self.task.exception() is not None:
            # hypercorn 0.17 raises InvalidStateError from its serve() as it is cancelled.
            log.debug("the TCP listener stopped with %r", self.task.exception())


async def start_tcp_listener(
    router: Router,
    sock: socket.socket,
    *,
    cert_path: str,
    key_path: str,
    keep_alive_timeout_s: float,
    tls_shutdown_timeout_s: float,
    grace_s: float,
) -> TcpListener:
    """Serve ``router`` with hypercorn on ``sock`` (which it takes over) until shut down."""
    port = int(sock.getsockname()[1])
    config = HypercornConfig()
    config.certfile = cert_path
    config.keyfile = key_path
    config.alpn_protocols = ["h2", "http/1.1"]
    config.alt_svc_headers = [f'h3=":{port}"; ma=86400']
    config.keep_alive_timeout = keep_alive_timeout_s
    config.graceful_timeout = grace_s
    config.include_server_header = False
    config.accesslog = None
    config.errorlog = log
    stop = asyncio.Event()
    connections: set[asyncio.Task[None]] = set()
    task = asyncio.get_running_loop().create_task(
        _serve(
            AsgiAdapter(router),
            config,
            sock,
            tls_shutdown_timeout_s=tls_shutdown_timeout_s,
            stop=stop,
            connections=connections,
        )
    )
    return TcpListener(task=task, stop=stop, port=port, connections=connections)


async def _serve(
    app: AsgiAdapter,
    config: HypercornConfig,
    sock: socket.socket,
    *,
    tls_shutdown_timeout_s: float,
    stop: asyncio.Event,
    connections: set[asyncio.Task[None]],
) -> None:
    """hypercorn's ``worker_serve`` for one listening TLS socket (see the module docstring):
    without what this server does not use (ASGI lifespan, statsd, plain and QUIC sockets,
    signal handlers, ``max_requests``), with asyncio's ``ssl_shutdown_timeout``. Serves until
    ``stop`` is set, then closes idle connections and waits ``graceful_timeout`` for the rest
    (hypercorn's own shutdown); ``connections`` holds the running connections' tasks."""
    loop = asyncio.get_running_loop()
    context = WorkerContext(None)
    wrapped = ASGIWrapper(app)  # type: ignore[arg-type]  # hypercorn's scope types, not ours

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connections.add(task)
        task.add_done_callback(connections.discard)
        peer = writer.get_extra_info("peername")  # the transport forgets it once closed
        try:
            await TCPServer(wrapped, loop, config, context, {}, reader, writer)
        except TimeoutError as exc:
            # Raised by the close's wait (hypercorn catches the rest of a peer's errors): the
            # peer never answered our close_notify within tls_shutdown_timeout_s.
            PEER_ERRORS.report("tcp", f"TLS shutdown of {peer}: {exc}")

    server = await asyncio.start_server(
        connected,
        sock=sock,
        backlog=config.backlog,
        ssl=config.create_ssl_context(),
        ssl_handshake_timeout=config.ssl_handshake_timeout,
        ssl_shutdown_timeout=tls_shutdown_timeout_s,
    )
    host, port = sock.getsockname()[:2]
    # The line hypercorn's serve() wrote (scripts and tests wait for it).
    log.info(
        "Running on https://%s (HTTP/1.1, HTTP/2)",
        f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
    )
    try:
        await stop.wait()
    finally:
        await context.terminated.set()  # idle keep-alive connections close at once
        server.close()
        await server.wait_closed()
        if connections:
            await asyncio.wait(set(connections), timeout=config.graceful_timeout)


class _WriteBuffer:
    """A session stream's body waiting for hypercorn (a ``messages.ByteSink``): the writer task
    hands it on; bounded by the session's flow control, which stops at the high watermark."""

    def __init__(self) -> None:
        self.chunks: deque[bytes] = deque()
        self.ended = False
        self.aborted = False
        self.ready = asyncio.Event()
        self._sent = 0
        self.acked = 0

    def write(self, data: bytes, end_stream: bool) -> None:
        if self.ended:
            return
        self.chunks.append(data)
        self._sent += len(data)
        self.ended = end_stream
        self.ready.set()

    def sent_offset(self) -> int:
        return self._sent

    def acked_offset(self) -> int:
        return self.acked

    def abort(self) -> None:
        self.aborted = True
        self.ready.set()


class _ConnectionCut(Exception):
    """A test fault: hypercorn drops the connection when the application raises mid-answer."""


class AsgiAdapter:
    """The router as an ASGI 3 application (hypercorn's side of this module)."""

    def __init__(self, router: Router) -> None:
        self._router = router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self._websocket(scope, receive, send)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """An upgrade to WebSocket: refused with the router's JSON error, through ASGI's
        denial response (hypercorn has it); an application that says nothing would get a bare
        500 from hypercorn."""
        if (await receive())["type"] != "websocket.connect":
            return
        response = self._router.refuse_websocket(scope.get("path", ""))
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close"})  # a server without it answers 403
            return
        await send(
            {
                "type": "websocket.http.response.start",
                "status": response.status,
                "headers": _headers(response),
            }
        )
        await send({"type": "websocket.http.response.body", "body": response.body})

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived_at = asyncio.get_running_loop().time()
        body = bytearray()
        limit = self._router.max_body_bytes
        client = scope.get("client") or ("?", 0)
        raw_path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        path = raw_path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        request = HttpRequest(
            method=scope["method"],
            path=path,
            headers={k.lower(): v for k, v in scope["headers"]},
            body=b"",
            connection=f"tcp:{client[0]}:{client[1]}",
            address=str(client[0]),
            arrived_at=arrived_at,
            protocol="h2" if scope.get("http_version") == "2" else "http/1.1",
        )
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                # In the shape of the API the path belongs to (the router's one rule).
                await _send_full(send, self._router.too_large(request))
                return
            if not message.get("more_body", False):
                break
        request = dataclasses.replace(request, body=bytes(body))
        # The peer may leave while a completion is being started or generated.
        disconnected = asyncio.ensure_future(_until_disconnect(receive))
        try:
            handling = asyncio.ensure_future(self._router.handle(request))
            await asyncio.wait({handling, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if not handling.done():
                handling.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await handling
                return
            response = handling.result()
            if isinstance(response, FullResponse):
                await _send_full(send, response)
            elif disconnected.done():
                response.abandon()
            else:
                await _stream(response, send, disconnected)
        finally:
            disconnected.cancel()


async def _stream(stream: SessionStream, send: Send, disconnected: asyncio.Future[None]) -> None:
    """Write ``stream`` until its end, or until the peer leaves (the generation then pauses)."""
    await send(
        {
            "type": "http.response.start",
            "status": stream.status,
            "headers": [(b"content-type", stream.content_type.encode()), *stream.headers],
        }
    )
    sink = _WriteBuffer()
    port = stream.open(sink)
    writer = asyncio.ensure_future(_write(sink, send, stream))
    try:
        await asyncio.wait({writer, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not writer.done():
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
        stream.close(port)  # a no-op once the stream has ended
    if writer.done() and not writer.cancelled():
        cut = writer.exception()
        if isinstance(cut, _ConnectionCut):
            raise cut  # hypercorn drops the connection


async def _write(sink: _WriteBuffer, send: Send, stream: SessionStream) -> None:
    while True:
        await sink.ready.wait()
        sink.ready.clear()
        while sink.chunks:
            data = b"".join(sink.chunks)
            sink.chunks.clear()
            last = sink.ended
            await send({"type": "http.response.body", "body": data, "more_body": not last})
            sink.acked += len(data)
            if last:
                return
            # The reader has taken more: the session may let the engine run further.
            stream.session.on_transport_progress()
        if sink.aborted:
            raise _ConnectionCut("test fault: connection dropped")


def _headers(response: FullResponse) -> list[tuple[bytes, bytes]]:
    return [
        (b"content-type", response.content_type.encode()),
        (b"content-length", str(len(response.body)).encode()),
        *response.headers,
    ]


async def _send_full(send: Send, response: FullResponse) -> None:
    headers = _headers(response)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": False})


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
