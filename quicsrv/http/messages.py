"""What a transport and the router exchange: a whole request in, a response out.

A transport (HTTP/3, or HTTP/2 and HTTP/1.1 on TCP) turns a request into an
:class:`HttpRequest` (method, path, lower-case headers, whole body) and gets back a
:class:`FullResponse` or a :class:`SessionStream`, which it opens on a byte sink of its own
(:class:`ByteSink`): the router never sees a socket. A session stream is the one shape of a
streamed answer: SSE events for the JSON API, frames for the native API, each only an encoding
of the same session's frames.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import quicsrv_proto
from quicsrv_proto.http3 import SESSION_HEADER

from ..sessions.session import Session

__all__ = [
    "JSON",
    "ByteSink",
    "FrameEncoder",
    "FullResponse",
    "HttpRequest",
    "KeepAlive",
    "Response",
    "SessionPort",
    "SessionStream",
    "event_stream",
    "json_response",
]

JSON = "application/json"

#: A streamed answer's encoding: frames in, body bytes out (often none for a frame).
FrameEncoder = Callable[[Sequence[quicsrv_proto.Frame]], bytes]


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpRequest:
    method: str
    """``GET``, ``POST``, ``DELETE``..."""
    path: str
    """The request target, query included."""
    headers: Mapping[bytes, bytes]
    """Header fields, names in lower case."""
    body: bytes
    """The whole body (the transport bounds its size)."""
    connection: str
    """The peer's connection, which is its client on a server without API keys."""
    arrived_at: float
    """When the request arrived, on the event loop's clock."""
    address: str = ""
    """The peer's IP address (an open server's rate limits are per address); "": unknown."""
    early_data: bool = False
    """It arrived in TLS 1.3 early data (0-RTT) and could be a replay."""
    protocol: str = "http/1.1"
    """What carried it, as ALPN names it: ``h3``, ``h2`` or ``http/1.1``."""

    @property
    def http3(self) -> bool:
        """It came over HTTP/3, where the native frame API is served too."""
        return self.protocol == "h3"


@dataclass(frozen=True, slots=True, kw_only=True)
class FullResponse:
    status: int
    """The HTTP status."""
    body: bytes
    """The whole body."""
    content_type: str = JSON
    """The ``content-type`` header."""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    """Further headers."""


class ByteSink(Protocol):
    """A transport's response body as a session stream writes it."""

    def write(self, data: bytes, end_stream: bool) -> None: ...

    def sent_offset(self) -> int:
        """Body bytes written so far."""

    def acked_offset(self) -> int:
        """Body bytes the transport has handed on to the peer (a flow-control signal)."""

    def abort(self) -> None:
        """Drop the connection under the stream, as a network that goes away would (a test
        fault: :class:`~.faults.StreamFaults`)."""


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """What a stream writes when it has written nothing for ``interval_s`` (an SSE comment
    line), so that a proxy's read timeout does not cut a stream that waits for a slot or a
    long prefill."""

    data: bytes
    interval_s: float


class SessionPort:
    """A session's reader that writes its frames, encoded, to a transport's sink (a
    ``sessions.attachment.StreamPort``), and its keep-alive while nothing else is written."""

    def __init__(
        self,
        encode: FrameEncoder,
        sink: ByteSink,
        keepalive: KeepAlive | None = None,
        *,
        cut_after_writes: int | None = None,
    ) -> None:
        self._encode = encode
        self._sink = sink
        self._keepalive = keepalive
        self._writes_left = cut_after_writes  # None: no test fault armed
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self._last_write = self._loop.time()
        if keepalive is not None and keepalive.interval_s > 0:
            self._timer = self._loop.call_later(keepalive.interval_s, self._keep_alive)

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None:
        data = self._encode((frame,))
        if data or end_stream:
            self._write(data, end_stream)

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        data = self._encode(frames)
        if data:
            self._write(data, False)

    def sent_offset(self) -> int:
        return self._sink.sent_offset()

    def acked_offset(self) -> int:
        return self._sink.acked_offset()

    def stop(self) -> None:
        """No more keep-alives: the stream ended or went away."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def _write(self, data: bytes, end_stream: bool) -> None:
        if self._writes_left is not None:
            if self._writes_left <= 0:
                return  # cut: the transport tells the session once the connection is gone
            self._writes_left -= 1
            if self._writes_left == 0:
                self._sink.write(data, False)
                self.stop()
                self._sink.abort()
                return
        self._sink.write(data, end_stream)
        if end_stream:
            self.stop()
        elif self._timer is not None:
            self._last_write = self._loop.time()

    def _keep_alive(self) -> None:
        keepalive = self._keepalive
        assert keepalive is not None
        loop = self._loop
        idle_s = loop.time() - self._last_write
        if idle_s >= keepalive.interval_s:
            self._sink.write(keepalive.data, False)
            self._last_write, idle_s = loop.time(), 0.0
        self._timer = loop.call_later(keepalive.interval_s - idle_s, self._keep_alive)


class SessionStream:
    """A ``200`` answer that reads ``session`` from ``from_index`` on, in ``content_type``.

    The transport sends the status and headers, then :meth:`open`\\ s it on its sink; a peer
    that goes away is :meth:`close`\\ d (the generation pauses, it does not end).
    """

    status = 200

    def __init__(
        self,
        *,
        session: Session,
        from_index: int,
        encode: FrameEncoder,
        content_type: str,
        headers: tuple[tuple[bytes, bytes], ...],
        client: str,
        fresh: bool,
        keepalive: KeepAlive | None = None,
        cancel_keeps_cells: bool = False,
    ) -> None:
        self.session = session
        self.content_type = content_type
        self.headers = headers
        self._from_index = from_index
        self._encode = encode
        self._client = client
        self._fresh = fresh
        self._keepalive = keepalive
        self.cut_after_writes: int | None = None
        """A test fault: the connection drops after this many writes (None: never)."""
        self.cancel_keeps_cells = cancel_keeps_cells
        """A cancelled request is a cut like any other (the JSON API's SSE streams: a browser
        cancels its fetch when the page reloads or navigates; stopping is an explicit request
        there), so the paused sequence's KV cells are kept for the resume."""

    def open(self, sink: ByteSink) -> SessionPort:
        port = SessionPort(
            self._encode, sink, self._keepalive, cut_after_writes=self.cut_after_writes
        )
        self.session.attach(port, self._from_index, self._client)
        return port

    def close(self, port: SessionPort, *, capture_kv: bool = True) -> None:
        """The peer went away (``capture_kv`` False: it cancelled the request, so the paused
        sequence's cells are not worth saving, unless :attr:`cancel_keeps_cells`)."""
        port.stop()
        self.session.detach(port, capture_kv=capture_kv or self.cancel_keeps_cells)

    def abandon(self) -> None:
        """The peer left before the stream was opened: a new generation stops spending compute
        (it stays resumable); a resumed one was never attached, so nothing changes."""
        if self._fresh:
            self.session.abandon()


Response = FullResponse | SessionStream


def json_response(
    status: int, body: dict[str, Any], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> FullResponse:
    return FullResponse(status=status, body=json.dumps(body).encode(), headers=headers)


def event_stream(
    session: Session,
    from_index: int,
    encode: FrameEncoder,
    *,
    client: str,
    fresh: bool,
    keepalive: KeepAlive | None,
) -> SessionStream:
    """A session stream of SSE events (``text/event-stream``), kept alive while quiet; a
    cancelled request only cuts it (see :attr:`SessionStream.cancel_keeps_cells`)."""
    return SessionStream(
        session=session,
        from_index=from_index,
        encode=encode,
        content_type="text/event-stream",
        headers=(
            (SESSION_HEADER, session.session_id.hex().encode()),
            (b"cache-control", b"no-cache"),
        ),
        client=client,
        fresh=fresh,
        keepalive=keepalive,
        cancel_keeps_cells=True,
    )
