"""The aioquic state the server reads that aioquic does not publish, in one place.

aioquic has no "writable" event and no per-stream acknowledgement offset, yet pausing a
generation whose reader stopped needs both: how far a stream's data was sent and how far the
peer acknowledged it (the sender's buffer bounds). The peer's address and the open request
streams come from the connection's private tables too. Everything private is read here and
nowhere else; tests/transport/test_aioquic_internals.py drives a real client and server
connection in memory and fails loudly when an aioquic release moves any of it. The versions it
passed on are :data:`TESTED_AIOQUIC_VERSIONS`, and pyproject.toml pins that range.
"""

from __future__ import annotations

from aioquic import tls
from aioquic.asyncio.server import QuicServer
from aioquic.quic.connection import QuicConnection, QuicConnectionState

__all__ = [
    "TESTED_AIOQUIC_VERSIONS",
    "peer_address",
    "peer_closed",
    "probe_timeout_s",
    "server_port",
    "stream_offsets",
    "unacknowledged_since",
    "unfinished_requests",
]

TESTED_AIOQUIC_VERSIONS = ("1.2.0", "1.3.0", "1.4.0", "1.5.0", "1.6.1", "1.7.2")


def stream_offsets(quic: QuicConnection, stream_id: int) -> tuple[int, int] | None:
    """``(sent, acknowledged)``: the stream offsets up to which data was handed to the
    connection, and up to which the peer acknowledged all of it; None once the stream is gone
    (finished both ways, or reset)."""
    stream = quic._streams.get(stream_id)
    if stream is None:
        return None
    sender = stream.sender
    return int(sender._buffer_stop), int(sender._buffer_start)


def peer_address(quic: QuicConnection) -> tuple[str, int] | None:
    """The address the connection's packets come from now (it changes on migration)."""
    paths = quic._network_paths
    if not paths:
        return None
    host, port = paths[0].addr[:2]
    return str(host), int(port)


def peer_closed(quic: QuicConnection) -> bool:
    """Whether the peer closed the connection (its CONNECTION_CLOSE arrived). aioquic reports
    that as ConnectionTerminated only when its draining period ends, three probe timeouts
    later (hundreds of ms with delayed ACKs), while the generations it fed ran on."""
    return quic._state is QuicConnectionState.DRAINING


def unfinished_requests(quic: QuicConnection) -> tuple[int, ...]:
    """The request streams that still have response data the peer has not acknowledged."""
    # Client-initiated bidirectional streams are the requests (RFC 9000 §2.1).
    return tuple(
        stream_id
        for stream_id, stream in quic._streams.items()
        if stream_id % 4 == 0 and not stream.sender.is_finished
    )


def probe_timeout_s(quic: QuicConnection) -> float:
    """The connection's probe timeout without backoff (RFC 9002 §6.2.1): smoothed RTT, four
    RTT deviations (at least the timer granularity) and the peer's largest ACK delay; twice the
    initial RTT before any sample. How long a live peer may take to acknowledge."""
    return float(quic._loss.get_probe_timeout())


def unacknowledged_since(quic: QuicConnection) -> float | None:
    """When the oldest application packet that the peer must acknowledge and has not was sent
    (the connection's clock: the loop's); None when none is in flight. A probe timeout does not
    take a packet off the list, only an acknowledgement or a later one's does (RFC 9002 §6.1),
    so a peer that stopped answering leaves its oldest packet here."""
    space = quic._spaces.get(tls.Epoch.ONE_RTT)
    if space is None:
        return None
    for packet in space.sent_packets.values():  # in packet number order: oldest first
        if packet.is_ack_eliciting and packet.sent_time is not None:
            return float(packet.sent_time)
    return None


def server_port(server: QuicServer) -> int:
    """The UDP port a running :class:`QuicServer` listens on (port 0 asked the kernel)."""
    transport = server._transport
    assert transport is not None, "the server is not listening"
    return int(transport.get_extra_info("sockname")[1])
