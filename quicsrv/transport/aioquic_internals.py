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

from aioquic.asyncio.server import QuicServer
from aioquic.quic.connection import QuicConnection, QuicConnectionState

__all__ = [
    "TESTED_AIOQUIC_VERSIONS",
    "has_unfinished_requests",
    "peer_address",
    "peer_closed",
    "server_port",
    "stream_offsets",
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


def has_unfinished_requests(quic: QuicConnection) -> bool:
    """Whether a request stream still has response data the peer has not acknowledged."""
    # Client-initiated bidirectional streams are the requests (RFC 9000 §2.1).
    return any(
        not stream.sender.is_finished
        for stream_id, stream in quic._streams.items()
        if stream_id % 4 == 0
    )


def server_port(server: QuicServer) -> int:
    """The UDP port a running :class:`QuicServer` listens on (port 0 asked the kernel)."""
    transport = server._transport
    assert transport is not None, "the server is not listening"
    return int(transport.get_extra_info("sockname")[1])
