"""The client's QUIC protocol: H3 events to per-stream queues, read-driven receive windows."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    QuicEvent,
    StreamDataReceived,
    StreamReset,
)
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream

from quicsrv_proto.http3 import H3_REQUEST_CANCELLED

from . import _aioquic_internals as internals
from ._errors import NetworkError, TransportError

__all__ = ["H3_REQUEST_CANCELLED", "StreamItem", "H3Protocol"]

log = logging.getLogger("quicsrv_client.protocol")

#: The ``max_ack_delay`` transport parameter aioquic advertises (25 ms), in seconds.
MAX_ACK_DELAY_S = 0.025
#: How long the client may sit on an acknowledgement (the default; ``Client(ack_delay_s=)``).
DEFAULT_ACK_DELAY_S = 0.02

StreamItem = tuple[H3Event, int] | Exception  # an event and the stream offset it reaches


class H3Protocol(QuicConnectionProtocol):
    """Feeds QUIC events through an H3Connection and routes them to per-stream queues.

    aioquic widens a stream's receive window as data *arrives*; here it widens as the
    application *reads*, so a consumer that stops iterating really stops the server's stream
    (RFC 9000 §4.1) instead of buffering without bound. The server sees the stall and pauses
    that generation, while other streams on the connection go on at full speed.
    """

    def __init__(
        self, *args: Any, read_window_bytes: int, ack_delay_s: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.streams: dict[int, asyncio.Queue[StreamItem]] = {}
        self.terminated: TransportError | None = None
        self.handshake: HandshakeCompleted | None = None
        self._read_window = read_window_bytes
        self._consumed: dict[int, int] = {}
        internals.replace_stream_limits_writer(self._quic, self._write_stream_limits)
        self._ack_delay_s = ack_delay_s

    def _write_stream_limits(
        self,
        default: internals.StreamLimitsWriter,
        builder: QuicPacketBuilder,
        space: QuicPacketSpace,
        stream: QuicStream,
    ) -> None:
        consumed = None if stream.stream_id is None else self._consumed.get(stream.stream_id)
        if consumed is None or stream.stream_id is None:
            default(builder, space, stream)
            return
        target = consumed + self._read_window
        # Grow in half-window steps, so one MAX_STREAM_DATA frame covers many reads.
        if target - stream.max_stream_data_local >= self._read_window // 2:
            stream.max_stream_data_local = target
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            internals.write_max_stream_data(
                self._quic, builder, stream, stream.max_stream_data_local
            )
            stream.max_stream_data_local_sent = stream.max_stream_data_local

    def _delay_acks(self) -> None:
        """Acknowledge streamed tokens every ``ack_delay_s`` rather than each packet.

        aioquic acknowledges an ack-eliciting packet after 1 ms, so a generation streaming a
        token per packet costs the server one received ACK datagram per token (decrypt, loss
        recovery, a trip through its event loop), next to llama.cpp on the same cores. RFC 9000
        §13.2.1 lets a receiver delay acknowledgements up to the ``max_ack_delay`` it advertised
        (aioquic: 25 ms), which the sender's loss timers already allow for. Set once the
        handshake is done: handshake packets are still acknowledged at once.
        """
        internals.set_ack_delay(self._quic, min(self._ack_delay_s, MAX_ACK_DELAY_S))

    def mark_consumed(self, stream_id: int, offset: int) -> None:
        """The application has read the stream up to ``offset``: maybe widen its window."""
        if stream_id not in self._consumed or offset <= self._consumed[stream_id]:
            return
        self._consumed[stream_id] = offset
        window = internals.stream_window(self._quic, stream_id)
        if window is not None and offset + self._read_window - window >= self._read_window // 2:
            self.transmit()

    async def wait_connected(self) -> None:
        try:
            await super().wait_connected()
        except asyncio.CancelledError:
            # Connect timed out: the shielded waiter later fails with ConnectionError when the
            # connection is closed; retrieve it so asyncio does not log "never retrieved".
            waiter = internals.connected_waiter(self)
            if waiter is not None:
                waiter.add_done_callback(consume_result)
            raise

    def open_stream(self) -> tuple[int, asyncio.Queue[StreamItem]]:
        if self.terminated is not None:
            raise self.terminated
        stream_id = self._quic.get_next_available_stream_id()
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self.streams[stream_id] = queue
        self._consumed[stream_id] = 0
        return stream_id, queue

    def close_stream(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        self._consumed.pop(stream_id, None)

    def fail(self, error: TransportError) -> None:
        """The connection is unusable: every open stream gets ``error``."""
        if self.terminated is None:
            self.terminated = error
            for queue in self.streams.values():
                queue.put_nowait(error)

    def send_keepalive(self) -> None:
        """A PING: the peer's ACK keeps the idle timer fresh while the server is alive, and
        its absence lets the idle timeout notice a dead server (RFC 9000 §10.1.2)."""
        if self.terminated is None:
            self._quic.send_ping(0)
            self.transmit()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            reason = event.reason_phrase or "no reason given"
            self.fail(
                NetworkError(f"connection terminated (error 0x{event.error_code:x}: {reason})")
            )
        elif isinstance(event, HandshakeCompleted):
            self.handshake = event
            self._delay_acks()
        elif isinstance(event, StreamReset):
            reset_queue = self.streams.get(event.stream_id)
            if reset_queue is not None:
                reset_queue.put_nowait(
                    NetworkError(f"server reset the stream (error 0x{event.error_code:x})")
                )
        offset = 0
        if isinstance(event, StreamDataReceived):
            offset = internals.received_offset(self._quic, event.stream_id)
        for h3_event in self.h3.handle_event(event):
            if isinstance(h3_event, HeadersReceived | DataReceived):
                stream_queue = self.streams.get(h3_event.stream_id)
                if stream_queue is not None:
                    stream_queue.put_nowait((h3_event, offset))
        # Deliberately no super() call: the base class would wrap every stream in an unused
        # StreamReader/StreamWriter pair, which complains when garbage-collected.

    def cancel_stream(self, stream_id: int) -> None:
        """Abort a request the consumer no longer wants: RESET_STREAM and STOP_SENDING."""
        if self.terminated is not None:
            return
        # Either direction may be over already (the server finished, or reset it first).
        for cancel in (self._quic.reset_stream, self._quic.stop_stream):
            try:
                cancel(stream_id, H3_REQUEST_CANCELLED)
            except Exception as exc:
                log.debug("stream %d: %s: %r", stream_id, cancel.__name__, exc)
        self.transmit()


def consume_result(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
