"""HTTP/3 request streams answered by the shared HTTP router (:mod:`quicsrv.http.router`).

The native CBOR paths (``/v1/generate``, ``/v1/resume``) stay with the server protocol; every
path the router owns (OpenAI's ``/v1/...``, ``/metrics``, ``/healthz``, ``/readyz``) comes here:
the body is gathered up to the router's limit, the router answers, and an event stream is
written straight onto the QUIC stream, whose acknowledged offset is the flow-control signal
the session pauses on, as for native streams.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived

from ..http.router import (
    EventStream,
    FullResponse,
    HttpRequest,
    Router,
    SsePort,
    request_too_large,
)

__all__ = ["H3Host", "RoutedStreams"]

log = logging.getLogger("quicsrv")


class H3Host(Protocol):
    """What the connection protocol lends this module."""

    @property
    def h3(self) -> H3Connection | None: ...

    def stream_offsets(self, stream_id: int) -> tuple[int, int] | None:
        """``(sent, acknowledged)`` offsets of ``stream_id``; None once it is gone."""

    def stop_stream(self, stream_id: int) -> None:
        """Ask the peer to stop sending on ``stream_id`` (its body is not needed)."""

    def transmit_soon(self) -> None: ...

    @property
    def handshake_complete(self) -> bool:
        """False while the peer's data may still be 0-RTT early data (a possible replay)."""


@dataclass(eq=False)
class _Exchange:
    stream_id: int
    method: str
    path: str
    headers: dict[bytes, bytes]
    arrived_at: float
    body: bytearray = field(default_factory=bytearray)
    answering: asyncio.Task[None] | None = None
    stream: EventStream | None = None
    port: SsePort | None = None


class _QuicSink:
    """An event stream's body on one QUIC stream (a ``router.ByteSink``)."""

    def __init__(self, owner: RoutedStreams, stream_id: int) -> None:
        self._owner = owner
        self._stream_id = stream_id

    def write(self, data: bytes, end_stream: bool) -> None:
        self._owner.send_body(self._stream_id, data, end_stream)

    def sent_offset(self) -> int:
        offsets = self._owner.host.stream_offsets(self._stream_id)
        return 0 if offsets is None else offsets[0]

    def acked_offset(self) -> int:
        offsets = self._owner.host.stream_offsets(self._stream_id)
        return 0 if offsets is None else offsets[1]


class RoutedStreams:
    """The routed request streams of one HTTP/3 connection."""

    def __init__(self, host: H3Host, router: Router, connection: str) -> None:
        self.host = host
        self._router = router
        self._connection = connection
        self._exchanges: dict[int, _Exchange] = {}

    def headers_received(self, event: HeadersReceived) -> None:
        headers = {k.lower(): v for k, v in event.headers}
        exchange = _Exchange(
            stream_id=event.stream_id,
            method=headers.get(b":method", b"").decode("latin-1"),
            path=headers.get(b":path", b"").decode("latin-1"),
            headers=headers,
            arrived_at=asyncio.get_running_loop().time(),
        )
        self._exchanges[event.stream_id] = exchange
        if exchange.method == "POST" and self._router.owns(exchange.path.encode("latin-1")):
            if not exchange.path.startswith("/v1/"):
                self._answer_now(exchange, event.stream_ended)  # operators' POST: a 405
            elif event.stream_ended:
                self._answer_soon(exchange)
            return
        self._answer_now(exchange, event.stream_ended)

    def data_received(self, event: DataReceived) -> None:
        exchange = self._exchanges.get(event.stream_id)
        if exchange is None or exchange.answering is not None:
            return  # answered already: the rest of the body is not needed
        exchange.body += event.data
        if len(exchange.body) > self._router.max_body_bytes:
            self.host.stop_stream(exchange.stream_id)
            error = request_too_large(self._router.max_body_bytes)
            self._send_full(
                exchange,
                FullResponse(status=error.status, body=error.body(), headers=error.headers),
            )
        elif event.stream_ended:
            self._answer_soon(exchange)

    def stream_gone(self, stream_id: int, *, capture_kv: bool) -> None:
        """The peer reset the stream or stopped reading it: the generation pauses."""
        exchange = self._exchanges.pop(stream_id, None)
        if exchange is None:
            return
        if exchange.answering is not None and not exchange.answering.done():
            exchange.answering.cancel()  # a start in progress gives its slot (or place) back
        if exchange.stream is not None and exchange.port is not None:
            exchange.stream.close(exchange.port, capture_kv=capture_kv)

    def close_all(self) -> None:
        for stream_id in list(self._exchanges):
            self.stream_gone(stream_id, capture_kv=True)

    def transport_progress(self) -> None:
        """ACKs arrived: the sessions read by event streams update their readers' positions."""
        for exchange in list(self._exchanges.values()):
            if exchange.stream is not None:
                exchange.stream.session.on_transport_progress()

    def send_body(self, stream_id: int, data: bytes, end_stream: bool) -> None:
        h3 = self.host.h3
        assert h3 is not None
        try:
            h3.send_data(stream_id, data, end_stream)
        except Exception as exc:  # the peer reset the stream or closed the connection meanwhile
            log.debug("stream %d: gone while sending: %r", stream_id, exc)
            self.stream_gone(stream_id, capture_kv=True)
            return
        if end_stream:
            self._exchanges.pop(stream_id, None)
        self.host.transmit_soon()

    # --- internals ----------------------------------------------------------------------

    def _answer_now(self, exchange: _Exchange, request_ended: bool) -> None:
        if not request_ended:
            # The answer needs no body: stop the peer sending one (RFC 9114 §4.1).
            self.host.stop_stream(exchange.stream_id)
        self._answer_soon(exchange)

    def _answer_soon(self, exchange: _Exchange) -> None:
        exchange.answering = asyncio.get_running_loop().create_task(self._answer(exchange))

    async def _answer(self, exchange: _Exchange) -> None:
        request = HttpRequest(
            method=exchange.method,
            path=exchange.path,
            headers=exchange.headers,
            body=bytes(exchange.body),
            connection=self._connection,
            arrived_at=exchange.arrived_at,
            # Judged once the request is complete: all of it then came in 0-RTT, or not.
            early_data=not self.host.handshake_complete,
        )
        response = await self._router.handle(request)
        if self._exchanges.get(exchange.stream_id) is not exchange:
            if isinstance(response, EventStream):
                response.abandon()  # the peer left while it was being started
            return
        if isinstance(response, FullResponse):
            self._send_full(exchange, response)
            return
        if not self._send_headers(
            exchange.stream_id, response.status, response.content_type, response.headers
        ):
            response.abandon()
            return
        exchange.stream = response
        exchange.port = response.open(_QuicSink(self, exchange.stream_id))

    def _send_full(self, exchange: _Exchange, response: FullResponse) -> None:
        headers = (*response.headers, (b"content-length", str(len(response.body)).encode()))
        if self._send_headers(exchange.stream_id, response.status, response.content_type, headers):
            self.send_body(exchange.stream_id, response.body, True)
        self._exchanges.pop(exchange.stream_id, None)

    def _send_headers(
        self,
        stream_id: int,
        status: int,
        content_type: str,
        extra: tuple[tuple[bytes, bytes], ...],
    ) -> bool:
        h3 = self.host.h3
        assert h3 is not None
        headers = [
            (b":status", str(status).encode()),
            (b"content-type", content_type.encode()),
            *extra,
        ]
        try:
            h3.send_headers(stream_id, headers)
        except Exception as exc:  # the stream is already gone: nothing to answer
            log.debug("stream %d: gone before its answer: %r", stream_id, exc)
            return False
        self.host.transmit_soon()
        return True
