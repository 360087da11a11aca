"""Malformed and over-limit requests for the load test, each with the error it must get.

Raw ones go over plain aioquic HTTP/3 (the client library cannot send broken bytes); the others
through :class:`client.Client`, so they share a connection with the user's real generations.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import QuicEvent

import quicsrv_proto
from quicsrv_proto import ErrorCode

__all__ = ["RAW_BAD_REQUESTS", "RawBadRequest", "RawProtocol", "RawReply", "raw_connection"]

_HEADER = struct.Struct(">4sBIB")
_GOOD = quicsrv_proto.encode_frame(quicsrv_proto.Generate(prompt="x", max_tokens=4))


def _with_header(
    body: bytes, *, magic: bytes = quicsrv_proto.MAGIC, version: int = 1, kind: int = 1
) -> bytes:
    return _HEADER.pack(magic, version, len(body), kind) + body


@dataclass(frozen=True, slots=True, kw_only=True)
class RawBadRequest:
    """One kind of broken request and the answer the server owes it."""

    name: str
    method: str
    path: str
    body: bytes
    code: ErrorCode
    status: int


RAW_BAD_REQUESTS: tuple[RawBadRequest, ...] = (
    RawBadRequest(
        name="bad_magic",
        method="POST",
        path="/v1/generate",
        body=b"XYZ\x00" + _GOOD[4:],
        code=ErrorCode.BAD_MAGIC,
        status=400,
    ),
    RawBadRequest(
        name="bad_version",
        method="POST",
        path="/v1/generate",
        body=_GOOD[:4] + b"\x09" + _GOOD[5:],
        code=ErrorCode.UNSUPPORTED_VERSION,
        status=400,
    ),
    RawBadRequest(
        name="oversized_frame",
        method="POST",
        path="/v1/generate",
        body=_HEADER.pack(quicsrv_proto.MAGIC, 1, 50_000_000, 1),  # declares 50 MB, sends none
        code=ErrorCode.FRAME_TOO_LARGE,
        status=413,
    ),
    RawBadRequest(
        name="malformed_cbor",
        method="POST",
        path="/v1/generate",
        body=_with_header(b"\xff\xff"),
        code=ErrorCode.MALFORMED_PAYLOAD,
        status=400,
    ),
    RawBadRequest(
        name="truncated_frame",
        method="POST",
        path="/v1/generate",
        body=_GOOD[:-2],
        code=ErrorCode.TRUNCATED_FRAME,
        status=400,
    ),
    RawBadRequest(
        name="unknown_field",
        method="POST",
        path="/v1/generate",
        body=_with_header(cbor2.dumps({"prompt": "x", "max_tokens": 4, "colour": "red"})),
        code=ErrorCode.UNKNOWN_FIELD,
        status=400,
    ),
    RawBadRequest(
        name="wrong_frame",
        method="POST",
        path="/v1/generate",
        body=quicsrv_proto.encode_frame(quicsrv_proto.Token(index=0, token_id=1, text="a")),
        code=ErrorCode.UNEXPECTED_FRAME,
        status=400,
    ),
    RawBadRequest(
        name="wrong_path",
        method="POST",
        path="/nope",  # other /v1/ paths belong to the JSON API (its 404 is JSON)
        body=b"",
        code=ErrorCode.NOT_FOUND,
        status=404,
    ),
    RawBadRequest(
        name="wrong_method",
        method="GET",
        path="/v1/generate",
        body=b"",
        code=ErrorCode.METHOD_NOT_ALLOWED,
        status=405,
    ),
)


@dataclass(slots=True)
class RawReply:
    """A raw response: status and the frames of its body."""

    status: int = 0
    body: bytearray = field(default_factory=bytearray)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def error(self) -> quicsrv_proto.Error | None:
        """The single ERROR frame of the body, or None if the body is anything else."""
        try:
            frames = quicsrv_proto.decode_frames(bytes(self.body))
        except quicsrv_proto.ProtocolError:
            return None
        if len(frames) == 1 and isinstance(frames[0], quicsrv_proto.Error):
            return frames[0]
        return None


class RawProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.replies: dict[int, RawReply] = {}

    def quic_event_received(self, event: QuicEvent) -> None:
        for h3_event in self.h3.handle_event(event):
            self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        reply = self.replies.get(getattr(event, "stream_id", -1))
        if reply is None:
            return
        if isinstance(event, HeadersReceived):
            reply.status = int(dict(event.headers).get(b":status", b"0"))
        elif isinstance(event, DataReceived):
            reply.body += event.data
        if getattr(event, "stream_ended", False):
            reply.done.set()

    async def send(self, request: RawBadRequest, authority: str, timeout_s: float) -> RawReply:
        """Send one request; the reply once its stream ends (TimeoutError after timeout_s)."""
        stream_id = self._quic.get_next_available_stream_id()
        reply = self.replies[stream_id] = RawReply()
        self.h3.send_headers(
            stream_id,
            [
                (b":method", request.method.encode()),
                (b":scheme", b"https"),
                (b":authority", authority.encode()),
                (b":path", request.path.encode()),
            ],
            end_stream=not request.body,
        )
        if request.body:
            self.h3.send_data(stream_id, request.body, end_stream=True)
        self.transmit()
        try:
            await asyncio.wait_for(reply.done.wait(), timeout_s)
        finally:
            del self.replies[stream_id]
        return reply


@contextlib.asynccontextmanager
async def raw_connection(host: str, port: int, ca: Path) -> AsyncIterator[RawProtocol]:
    """An HTTP/3 connection that can send any bytes, path and method."""
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    configuration.load_verify_locations(str(ca))
    async with connect(
        host,
        port,
        configuration=configuration,
        create_protocol=RawProtocol,
        wait_connected=True,
    ) as protocol:
        assert isinstance(protocol, RawProtocol)
        yield protocol
