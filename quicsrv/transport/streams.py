"""The request streams of one HTTP/3 connection: one table, one stream class, one way in.

Every request stream, native or JSON API or operator endpoint, is a :class:`RequestStream`
here: its body is gathered up to the router's limit, the router answers it (the router alone
decides what a path is), and a streamed answer is written straight onto the QUIC stream, whose
acknowledged offset is the flow-control signal its session pauses on. A peer that resets or
stops a stream, or leaves, detaches its session (the generation pauses, it does not end), and a
request still being started is cancelled, giving back its place in the queue or its slot.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol

from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived

from ..http.messages import FullResponse, HttpRequest, SessionPort, SessionStream
from ..http.router import Router

__all__ = ["H3Host", "RequestStream", "RequestStreams"]

log = logging.getLogger("quicsrv")


class H3Host(Protocol):
    """What the connection protocol lends this module."""

    @property
    def h3(self) -> H3Connection | None: ...

    @property
    def peer(self) -> str:
        """The peer's address, for the log."""

    @property
    def peer_ip(self) -> str:
        """The peer's IP address now ("" when unknown): an open server's rate limits."""

    def stream_offsets(self, stream_id: int) -> tuple[int, int] | None:
        """``(sent, acknowledged)`` offsets of ``stream_id``; None once it is gone."""

    def stop_stream(self, stream_id: int) -> None:
        """Ask the peer to stop sending on ``stream_id`` (its body is not needed)."""

    def drop_connection(self) -> None:
        """Close the connection at once (a test fault: a network that goes away)."""

    def transmit_soon(self) -> None: ...

    @property
    def handshake_complete(self) -> bool:
        """False while the peer's data may still be 0-RTT early data (a possible replay)."""


@dataclass(eq=False)
class RequestStream:
    """One request stream, from its headers until its answer has ended or the peer left; also
    the byte sink its session stream writes to."""

    owner: RequestStreams
    stream_id: int
    method: str
    path: str
    headers: dict[bytes, bytes]
    arrived_at: float
    body: bytearray = field(default_factory=bytearray)
    answering: asyncio.Task[None] | None = None
    """The router at work on it (a generation queued or starting, a resume reading Redis)."""
    response: SessionStream | None = None
    port: SessionPort | None = None

    def write(self, data: bytes, end_stream: bool) -> None:
        self.owner.send_body(self, data, end_stream)

    def sent_offset(self) -> int:
        offsets = self.owner.host.stream_offsets(self.stream_id)
        return 0 if offsets is None else offsets[0]

    def acked_offset(self) -> int:
        offsets = self.owner.host.stream_offsets(self.stream_id)
        return 0 if offsets is None else offsets[1]

    def abort(self) -> None:
        self.owner.host.drop_connection()


class RequestStreams:
    """The request streams of one HTTP/3 connection."""

    def __init__(self, host: H3Host, router: Router, connection: str) -> None:
        self.host = host
        self._router = router
        self._connection = connection
        self._streams: dict[int, RequestStream] = {}

    def headers_received(self, event: HeadersReceived) -> None:
        headers = {k.lower(): v for k, v in event.headers}
        stream = RequestStream(
            owner=self,
            stream_id=event.stream_id,
            method=headers.get(b":method", b"").decode("latin-1"),
            path=headers.get(b":path", b"").decode("latin-1"),
            headers=headers,
            arrived_at=asyncio.get_running_loop().time(),
        )
        self._streams[event.stream_id] = stream
        if event.stream_ended:
            self._answer(stream)
        elif stream.method not in ("POST", "PUT", "PATCH"):
            # The answer needs no body: stop the peer sending one (RFC 9114 §4.1).
            self.host.stop_stream(stream.stream_id)
            self._answer(stream)

    def data_received(self, event: DataReceived) -> None:
        stream = self._streams.get(event.stream_id)
        if stream is None or stream.answering is not None:
            return  # answered already: the rest of the body is not needed
        stream.body += event.data
        if len(stream.body) > self._router.body_limit_bytes:
            self.host.stop_stream(stream.stream_id)
            self._send_full(stream, self._router.too_large(self._request(stream)))
        elif event.stream_ended:
            self._answer(stream)

    def stream_gone(self, stream_id: int, *, capture_kv: bool) -> None:
        """The peer reset the stream or stopped reading it: the generation pauses."""
        stream = self._streams.pop(stream_id, None)
        if stream is None:
            return
        if stream.answering is not None and not stream.answering.done():
            stream.answering.cancel()  # a start in progress gives its slot (or place) back
        if stream.response is not None and stream.port is not None:
            stream.response.close(stream.port, capture_kv=capture_kv)

    def close_all(self) -> None:
        for stream_id in list(self._streams):
            self.stream_gone(stream_id, capture_kv=True)

    def transport_progress(self) -> None:
        """ACKs arrived: the sessions read on this connection update their readers."""
        for stream in list(self._streams.values()):
            if stream.response is not None:
                stream.response.session.on_transport_progress()

    def send_body(self, stream: RequestStream, data: bytes, end_stream: bool) -> None:
        h3 = self.host.h3
        assert h3 is not None
        try:
            h3.send_data(stream.stream_id, data, end_stream)
        except Exception as exc:  # the peer reset the stream or closed the connection meanwhile
            log.debug("stream %d: gone while sending: %r", stream.stream_id, exc)
            self.stream_gone(stream.stream_id, capture_kv=True)
            return
        if end_stream and self._streams.pop(stream.stream_id, None) is not None:
            if stream.response is not None:
                self._log_stream_ended(stream, stream.response)
        self.host.transmit_soon()

    # --- internals ----------------------------------------------------------------------

    def _request(self, stream: RequestStream) -> HttpRequest:
        return HttpRequest(
            method=stream.method,
            path=stream.path,
            headers=stream.headers,
            body=bytes(stream.body),
            connection=self._connection,
            address=self.host.peer_ip,
            arrived_at=stream.arrived_at,
            # Judged once the request is complete: all of it then came in 0-RTT, or not.
            early_data=not self.host.handshake_complete,
            protocol="h3",
        )

    def _answer(self, stream: RequestStream) -> None:
        # On a task: a long prompt is tokenized on a thread and a generation may wait for a
        # slot, while the loop serves every other stream.
        request = self._request(stream)
        stream.answering = asyncio.get_running_loop().create_task(self._respond(stream, request))

    async def _respond(self, stream: RequestStream, request: HttpRequest) -> None:
        response = await self._router.handle(request)
        if self._streams.get(stream.stream_id) is not stream:
            if isinstance(response, SessionStream):
                response.abandon()  # the peer left while it was being started
            return
        if isinstance(response, FullResponse):
            self._send_full(stream, response)
            return
        if not self._send_headers(stream, response.status, response.content_type, response.headers):
            response.abandon()
            return
        stream.response = response
        stream.port = response.open(stream)

    def _send_full(self, stream: RequestStream, response: FullResponse) -> None:
        headers = (*response.headers, (b"content-length", str(len(response.body)).encode()))
        if self._send_headers(stream, response.status, response.content_type, headers):
            self.send_body(stream, response.body, True)
        self._streams.pop(stream.stream_id, None)

    def _send_headers(
        self,
        stream: RequestStream,
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
            h3.send_headers(stream.stream_id, headers)
        except Exception as exc:  # the stream is already gone: nothing to answer
            log.debug("stream %d: gone before its answer: %r", stream.stream_id, exc)
            return False
        self.host.transmit_soon()
        return True

    def _log_stream_ended(self, stream: RequestStream, response: SessionStream) -> None:
        duration_s = asyncio.get_running_loop().time() - stream.arrived_at
        session_id = response.session.session_id.hex()
        log.info(
            "peer %s stream %d session %s: stream ended after %.3fs",
            self.host.peer,
            stream.stream_id,
            session_id,
            duration_s,
            extra={
                "event": "stream_ended",
                "peer": self.host.peer,
                "stream_id": stream.stream_id,
                "session_id": session_id,
                "duration_s": round(duration_s, 6),
            },
        )
