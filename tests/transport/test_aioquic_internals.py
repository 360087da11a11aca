"""The aioquic state quicsrv and its client read or change privately, checked on a real
client and server connection in memory: a failure here means an aioquic release moved it,
and quicsrv/transport/aioquic_internals.py or client/_aioquic_internals.py must follow (then
add the version to their TESTED_AIOQUIC_VERSIONS and widen the pin in pyproject.toml)."""

from __future__ import annotations

import asyncio
import socket
import ssl
from importlib.metadata import version

import pytest
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream

from quicsrv.devcerts import DevCertPaths
from quicsrv.transport import aioquic_internals as server_internals
from quicsrv_client import _aioquic_internals as client_internals

CLIENT_ADDR = ("1.2.3.4", 1234)
SERVER_ADDR = ("2.3.4.5", 4433)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def tick(self, seconds: float = 0.05) -> float:
        self.now += seconds
        return self.now


def _exchange(client: QuicConnection, server: QuicConnection, clock: Clock) -> None:
    """Datagrams both ways until neither side has anything to send."""
    for _ in range(20):
        moved = False
        now = clock.tick()
        for data, _addr in client.datagrams_to_send(now=now):
            server.receive_datagram(data, CLIENT_ADDR, now=now)
            moved = True
        for data, _addr in server.datagrams_to_send(now=now):
            client.receive_datagram(data, SERVER_ADDR, now=now)
            moved = True
        if not moved:
            return


@pytest.fixture
def pair(certs: DevCertPaths) -> tuple[QuicConnection, QuicConnection, Clock]:
    clock = Clock()
    client_config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    client_config.verify_mode = ssl.CERT_NONE
    server_config = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    server_config.load_cert_chain(certs.server_cert, certs.server_key)
    client = QuicConnection(configuration=client_config)
    server = QuicConnection(
        configuration=server_config,
        original_destination_connection_id=client.original_destination_connection_id,
    )
    client.connect(SERVER_ADDR, now=clock.now)
    _exchange(client, server, clock)
    return client, server, clock


def test_the_version_under_test_is_listed_as_tested() -> None:
    """A new aioquic passing this file gets added to the list (and the pin widened)."""
    installed = version("aioquic")
    assert installed in server_internals.TESTED_AIOQUIC_VERSIONS, installed
    assert server_internals.TESTED_AIOQUIC_VERSIONS == client_internals.TESTED_AIOQUIC_VERSIONS


def test_server_reads_sent_and_acknowledged_offsets(
    pair: tuple[QuicConnection, QuicConnection, Clock],
) -> None:
    client, server, clock = pair
    stream_id = client.get_next_available_stream_id()
    client.send_stream_data(stream_id, b"request", end_stream=True)
    _exchange(client, server, clock)
    assert server_internals.peer_address(server) == CLIENT_ADDR
    assert server_internals.stream_offsets(server, stream_id) == (0, 0)

    server.send_stream_data(stream_id, b"x" * 3000)
    assert server_internals.stream_offsets(server, stream_id) == (3000, 0)
    assert server_internals.unfinished_requests(server) == (stream_id,)
    _exchange(client, server, clock)
    assert server_internals.stream_offsets(server, stream_id) == (3000, 3000)
    assert client_internals.received_offset(client, stream_id) == 3000

    server.send_stream_data(stream_id, b"y", end_stream=True)
    _exchange(client, server, clock)
    assert server_internals.unfinished_requests(server) == ()
    assert server_internals.stream_offsets(server, 1 << 40) is None


def test_server_reads_the_probe_timeout_and_the_oldest_unacknowledged_packet(
    pair: tuple[QuicConnection, QuicConnection, Clock],
) -> None:
    client, server, clock = pair
    unsampled = QuicConnection(configuration=QuicConfiguration(is_client=True, initial_rtt=0.3))
    assert server_internals.probe_timeout_s(unsampled) == pytest.approx(0.6)  # twice the initial
    # The pair's handshake took one tick each way: an RTT of two ticks, plus the ACK delay.
    assert 2 * 0.05 < server_internals.probe_timeout_s(server) < 0.6

    stream_id = client.get_next_available_stream_id()
    client.send_stream_data(stream_id, b"request", end_stream=True)
    _exchange(client, server, clock)
    assert server_internals.unacknowledged_since(server) is None
    server.send_stream_data(stream_id, b"x" * 100)
    sent_at = clock.tick()
    assert server.datagrams_to_send(now=sent_at)  # the client never gets them: it vanished
    server.send_stream_data(stream_id, b"y" * 100)
    assert server.datagrams_to_send(now=clock.tick())
    assert server_internals.unacknowledged_since(server) == sent_at  # the oldest one


def test_client_grants_stream_windows_itself(
    pair: tuple[QuicConnection, QuicConnection, Clock],
) -> None:
    client, server, clock = pair
    seen: list[int] = []
    raised_to = 10_000_000

    def writer(
        default: client_internals.StreamLimitsWriter,
        builder: QuicPacketBuilder,
        space: QuicPacketSpace,
        stream: QuicStream,
    ) -> None:
        assert stream.stream_id is not None
        seen.append(stream.stream_id)
        if stream.max_stream_data_local_sent != raised_to:
            stream.max_stream_data_local = raised_to
            client_internals.write_max_stream_data(client, builder, stream, raised_to)
            stream.max_stream_data_local_sent = raised_to

    client_internals.replace_stream_limits_writer(client, writer)
    stream_id = client.get_next_available_stream_id()
    client.send_stream_data(stream_id, b"request")
    _exchange(client, server, clock)
    assert stream_id in seen
    assert client_internals.stream_window(client, stream_id) == raised_to
    # The server heard it: it may now send that much on the stream.
    assert server._streams[stream_id].max_stream_data_remote == raised_to
    assert client_internals.stream_window(client, 1 << 40) is None


def test_client_sets_the_ack_delay(pair: tuple[QuicConnection, QuicConnection, Clock]) -> None:
    client, _server, _clock = pair
    assert client_internals.set_ack_delay(client, 0.02)
    assert client._ack_delay == 0.02


def test_server_sees_the_peer_close_before_aioquic_reports_it(
    pair: tuple[QuicConnection, QuicConnection, Clock],
) -> None:
    client, server, clock = pair
    assert not server_internals.peer_closed(server)
    client.close(error_code=0, reason_phrase="bye")
    now = clock.tick()
    for data, _addr in client.datagrams_to_send(now=now):
        server.receive_datagram(data, CLIENT_ADDR, now=now)
    assert server_internals.peer_closed(server)
    # aioquic itself says so only after its draining period (three probe timeouts).
    events = []
    while (event := server.next_event()) is not None:
        events.append(type(event).__name__)
    assert "ConnectionTerminated" not in events
    # Our own close is not the peer's.
    assert not server_internals.peer_closed(client)


@pytest.mark.asyncio
async def test_client_finds_the_connected_waiter() -> None:
    protocol = QuicConnectionProtocol(QuicConnection(configuration=QuicConfiguration()))
    assert client_internals.connected_waiter(protocol) is None
    waiting = protocol.wait_connected()
    waiting.send(None)  # runs to its first await, having made its waiter
    waiter = client_internals.connected_waiter(protocol)
    assert isinstance(waiter, asyncio.Future) and not waiter.done()
    waiting.close()


@pytest.mark.asyncio
async def test_server_port_is_the_bound_one(certs: DevCertPaths) -> None:
    configuration = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN)
    configuration.load_cert_chain(certs.server_cert, certs.server_key)
    server = QuicServer(configuration=configuration)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    await loop.create_datagram_endpoint(lambda: server, sock=sock)
    try:
        assert server_internals.server_port(server) == sock.getsockname()[1]
    finally:
        server.close()
