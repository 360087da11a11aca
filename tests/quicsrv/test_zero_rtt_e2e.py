"""0-RTT reconnects, the early-data policy, tuned sockets, and auto-resume across a restart."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from typing import Any

import pytest
from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import QuicEvent, StreamDataReceived
from aioquic.tls import SessionTicket

import quicsrv_proto
from quicsrv_client import (
    Client,
    GenerationEnded,
    Reconnected,
    ReconnectPolicy,
    SessionStarted,
    TicketCache,
    TokenReceived,
)
from quicsrv_proto import ErrorCode
from tests.helpers import running_server, server_process

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

PROMPT = "A list of the planets of the solar system:"


async def test_a_resume_rides_in_0rtt_on_a_second_connection(engine, certs, tmp_path):
    cache = TicketCache(tmp_path / "tickets.json")
    async with running_server(engine, certs) as server:
        port, ca = server.port, certs.ca_cert
        async with Client("127.0.0.1", port, ca=ca, ticket_cache=cache) as first:
            generation = first.generate(PROMPT, max_tokens=32, ignore_eos=True)
            async for event in generation:
                if isinstance(event, TokenReceived) and event.index == 9:
                    break
            position = generation.position
            reference = await first.generate_text(PROMPT, max_tokens=32, ignore_eos=True)
        assert position is not None and len(cache) == 1
        second = Client("127.0.0.1", port, ca=ca, ticket_cache=cache)
        async with second:
            resumed = second.resume_from(position)
            events = [e async for e in resumed]
            assert second.early_data_accepted is True
        assert second.stats.tickets_offered == 1
    started = next(e for e in events if isinstance(e, SessionStarted))
    assert started.early_data  # the server answered the RESUME_STREAM from early data
    assert server.app.early_resumes == 1
    ids = [e.token_id for e in events if isinstance(e, TokenReceived)]
    assert ids == list(reference.token_ids[10:])


class _QuietProtocol(QuicConnectionProtocol):
    """aioquic's protocol without wrapping every stream in an unused StreamReader/Writer."""

    def quic_event_received(self, event: QuicEvent) -> None:
        if not isinstance(event, StreamDataReceived):
            super().quic_event_received(event)


class _RecordingProtocol(_QuietProtocol):
    """A raw HTTP/3 client that records every datagram it sends before the handshake."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.first_flight: list[bytes] = []
        self.status: int | None = None
        self.body = bytearray()
        self.done = asyncio.Event()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(_Recorder(transport, self))

    def quic_event_received(self, event: QuicEvent) -> None:
        super().quic_event_received(event)
        for h3_event in self.h3.handle_event(event):
            self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        if isinstance(event, HeadersReceived):
            self.status = int(dict(event.headers)[b":status"])
        elif isinstance(event, DataReceived):
            self.body += event.data
        if getattr(event, "stream_ended", False):
            self.done.set()


class _Recorder:
    """The datagram transport, keeping a copy of what goes out before the handshake."""

    def __init__(self, transport: Any, owner: _RecordingProtocol) -> None:
        self._transport = transport
        self._owner = owner

    def sendto(self, data: bytes, addr: Any = None) -> None:
        if not self._owner._connected:
            self._owner.first_flight.append(data)
        self._transport.sendto(data, addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def _ticket_for(port: int, ca) -> SessionTicket:
    tickets: list[SessionTicket] = []
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    configuration.load_verify_locations(str(ca))
    configuration.server_name = "localhost"
    async with connect(
        "127.0.0.1",
        port,
        configuration=configuration,
        create_protocol=_QuietProtocol,
        session_ticket_handler=tickets.append,
    ) as protocol:
        await protocol.ping()  # a round trip after the handshake: the ticket has arrived
    assert tickets
    return tickets[0]


async def test_generate_in_early_data_is_too_early_and_a_replay_starts_nothing(engine, certs):
    async with running_server(engine, certs) as server:
        port, ca = server.port, certs.ca_cert
        configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
        configuration.load_verify_locations(str(ca))
        configuration.server_name = "localhost"
        configuration.session_ticket = await _ticket_for(port, ca)
        body = quicsrv_proto.encode_frame(quicsrv_proto.Generate(prompt=PROMPT, max_tokens=8))
        async with connect(
            "127.0.0.1",
            port,
            configuration=configuration,
            create_protocol=_RecordingProtocol,
            wait_connected=False,
        ) as raw:
            assert isinstance(raw, _RecordingProtocol)
            stream_id = raw._quic.get_next_available_stream_id()
            raw.h3.send_headers(
                stream_id,
                [
                    (b":method", b"POST"),
                    (b":scheme", b"https"),
                    (b":authority", b"localhost"),
                    (b":path", b"/v1/generate"),
                ],
            )
            raw.h3.send_data(stream_id, body, end_stream=True)
            raw.transmit()  # the first flight: Initial + 0-RTT carrying the GENERATE
            await asyncio.wait_for(raw.done.wait(), 30)
            assert raw._quic.tls.early_data_accepted
        assert raw.status == 425
        [error] = quicsrv_proto.decode_frames(bytes(raw.body))
        assert isinstance(error, quicsrv_proto.Error) and error.code == ErrorCode.TOO_EARLY
        assert len(server.sessions.store) == 0  # no compute was started
        generated_before = engine.tokens_generated_total

        # An attacker replays the captured first flight from another address.
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[bytes] = loop.create_future()

        class _Replayer(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: Any) -> None:
                if not answered.done():
                    answered.set_result(data)

        transport, _ = await loop.create_datagram_endpoint(
            _Replayer, remote_addr=("127.0.0.1", port)
        )
        try:
            for datagram in raw.first_flight:
                transport.sendto(datagram)
            await asyncio.wait_for(answered, 30)  # the server has processed the replay
        finally:
            transport.close()
        # One request through the same socket after the replay: everything before it is done.
        async with Client("127.0.0.1", port, ca=ca) as c:
            ok = await c.generate_text(PROMPT, max_tokens=2, ignore_eos=True)
        assert len(ok.token_ids) == 2
        assert len(server.sessions.store) == 1  # only the legitimate request's session
        assert engine.tokens_generated_total == generated_before + 2
        assert server.app.early_generates_refused == 1  # the replay's 0-RTT data was dropped


async def test_the_server_socket_options_are_applied(engine, certs):
    async with running_server(
        engine, certs, udp_recv_buffer_bytes=1 << 20, udp_send_buffer_bytes=1 << 20
    ) as server:
        sock = server.server._transport.get_extra_info("socket")
        applied = server.socket_options
        # Linux reports twice the usable size it granted.
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == applied.recv_buffer_reported
        assert applied.recv_buffer_bytes == min(1 << 20, applied.recv_buffer_bytes)
        assert applied.recv_buffer_bytes > 0 and applied.send_buffer_bytes > 0
        if sys.platform.startswith("linux"):
            ip_mtu_discover, ip_pmtudisc_probe = 10, 3
            assert sock.getsockopt(socket.IPPROTO_IP, ip_mtu_discover) == ip_pmtudisc_probe
        assert applied.dont_fragment


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.slow
async def test_auto_resume_delivers_everything_through_a_kill_9_and_restart(
    certs, tmp_path, model_path
):
    port = _free_udp_port()
    params = dict(max_tokens=64, temperature=0.8, top_k=40, seed=3, ignore_eos=True)
    events: list[Any] = []
    async with contextlib.AsyncExitStack() as servers:
        first, _ = await servers.enter_async_context(server_process(certs, tmp_path, port))
        restarted: asyncio.Future[Any] | None = None
        client = Client(
            "127.0.0.1",
            port,
            ca=certs.ca_cert,
            idle_timeout_s=2.0,  # a dead server is noticed after 2 s of silence
            connect_timeout_s=3.0,
            reconnect=ReconnectPolicy(max_attempts=30, initial_delay_s=0.05, max_delay_s=0.5),
        )
        async with client:
            async for event in client.generate(PROMPT, **params):
                events.append(event)
                if isinstance(event, TokenReceived) and event.index == 20:
                    first.send_signal(signal.SIGKILL)
                    await asyncio.to_thread(first.wait, 30)
                    restarted = asyncio.ensure_future(
                        servers.enter_async_context(server_process(certs, tmp_path, port))
                    )
            assert restarted is not None
            await restarted
            reference = await client.generate_text(PROMPT, **params)
    reconnects = [e for e in events if isinstance(e, Reconnected)]
    assert reconnects and client.stats.reconnects >= 1
    ids = [e.token_id for e in events if isinstance(e, TokenReceived)]
    text = "".join(e.text for e in events if isinstance(e, TokenReceived | GenerationEnded))
    assert ids == list(reference.token_ids)
    assert text == reference.text
