"""The aioquic state the client changes or reads that aioquic does not publish, in one place.

Two behaviours need it: receive windows that widen as the application *reads* (aioquic widens
them as data arrives, so a reader that stops would not stop the server), and delayed
acknowledgements (aioquic acknowledges after 1 ms; a token per packet would cost the server
an ACK datagram per token). tests/transport/test_aioquic_internals.py drives a real client and
server connection in memory and fails loudly when an aioquic release moves any of it; the
versions it passed on are :data:`TESTED_AIOQUIC_VERSIONS`, and pyproject.toml pins that range.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic.connection import MAX_STREAM_DATA_FRAME_CAPACITY, QuicConnection
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream

__all__ = [
    "TESTED_AIOQUIC_VERSIONS",
    "StreamLimitsWriter",
    "connected_waiter",
    "received_offset",
    "replace_stream_limits_writer",
    "set_ack_delay",
    "stream_window",
    "write_max_stream_data",
]

TESTED_AIOQUIC_VERSIONS = ("1.2.0", "1.3.0", "1.4.0", "1.5.0", "1.6.1", "1.7.2")

#: aioquic's per-stream hook that writes MAX_STREAM_DATA frames into a packet being built.
StreamLimitsWriter = Callable[[QuicPacketBuilder, QuicPacketSpace, QuicStream], None]


def replace_stream_limits_writer(
    quic: QuicConnection,
    writer: Callable[[StreamLimitsWriter, QuicPacketBuilder, QuicPacketSpace, QuicStream], None],
) -> None:
    """Route aioquic's MAX_STREAM_DATA decisions through ``writer(default, builder, space,
    stream)``, which may call ``default`` (aioquic's own) for streams it does not manage."""
    default: StreamLimitsWriter = quic._write_stream_limits

    def write(builder: QuicPacketBuilder, space: QuicPacketSpace, stream: QuicStream) -> None:
        writer(default, builder, space, stream)

    quic._write_stream_limits = write  # type: ignore[method-assign]


def write_max_stream_data(
    quic: QuicConnection, builder: QuicPacketBuilder, stream: QuicStream, limit: int
) -> None:
    """Put a MAX_STREAM_DATA frame raising ``stream``'s receive limit to ``limit`` in the
    packet being built (retransmitted by aioquic if lost, like its own)."""
    assert stream.stream_id is not None
    buf = builder.start_frame(
        QuicFrameType.MAX_STREAM_DATA,
        capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
        handler=quic._on_max_stream_data_delivery,
        handler_args=(stream,),
    )
    buf.push_uint_var(stream.stream_id)
    buf.push_uint_var(limit)


def stream_window(quic: QuicConnection, stream_id: int) -> int | None:
    """The receive limit the client has granted on ``stream_id`` (None: no such stream)."""
    stream = quic._streams.get(stream_id)
    return None if stream is None else int(stream.max_stream_data_local)


def received_offset(quic: QuicConnection, stream_id: int) -> int:
    """How far ``stream_id``'s data has been delivered in order (0 when the stream is gone)."""
    stream = quic._streams.get(stream_id)
    return int(stream.receiver.starting_offset()) if stream is not None else 0


def set_ack_delay(quic: QuicConnection, delay_s: float) -> bool:
    """Let aioquic sit on an acknowledgement up to ``delay_s``; False when this aioquic has
    no such knob (then its default stays)."""
    if not hasattr(quic, "_ack_delay"):
        return False
    quic._ack_delay = delay_s
    return True


def connected_waiter(protocol: QuicConnectionProtocol) -> asyncio.Future[None] | None:
    """The future ``wait_connected()`` waits on, while the handshake is still under way (None
    once it completed or before anyone waited)."""
    waiter: asyncio.Future[None] | None = protocol._connected_waiter
    return waiter
