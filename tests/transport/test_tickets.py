"""Session tickets: the server's single-use store, and 0-RTT over real aioquic on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import HandshakeCompleted, QuicEvent, StreamDataReceived
from aioquic.tls import CipherSuite, SessionTicket

from quicsrv.devcerts import DevCertPaths
from quicsrv.settings import socket_options_for
from quicsrv.transport.sockets import open_udp_socket, serve_on_socket
from quicsrv.transport.tickets import MemoryTicketStore, TicketStore
from quicsrv_client._tickets import TicketCache, ticket_cache_key

ALPN = "quicsrv-ticket-test"
SERVER_NAME = "localhost"
SAFETY_TIMEOUT_S = 30.0  # bounds a broken test; nothing waits for it to pass


def _ticket(label: bytes) -> SessionTicket:
    now = datetime.datetime.now(datetime.UTC)
    return SessionTicket(
        age_add=1,
        cipher_suite=CipherSuite.AES_128_GCM_SHA256,
        not_valid_after=now + datetime.timedelta(days=1),
        not_valid_before=now,
        resumption_secret=b"s" * 32,
        server_name=SERVER_NAME,
        ticket=label,
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the store ---------------------------------------------------------------------------------


def test_memory_store_is_a_ticket_store() -> None:
    store: TicketStore = MemoryTicketStore()
    store.add(_ticket(b"a"))
    assert store.pop(b"a") is not None


def test_pop_makes_a_ticket_single_use() -> None:
    store = MemoryTicketStore()
    ticket = _ticket(b"a")
    store.add(ticket)
    assert store.pop(b"a") is ticket
    assert store.pop(b"a") is None
    assert store.pop(b"never issued") is None


def test_get_looks_without_removing() -> None:
    store = MemoryTicketStore()
    store.add(_ticket(b"a"))
    assert store.get(b"a") is not None
    assert store.get(b"a") is not None
    assert len(store) == 1


def test_tickets_expire_after_ttl() -> None:
    clock = _Clock()
    store = MemoryTicketStore(ttl_s=10.0, clock=clock)
    store.add(_ticket(b"a"))
    clock.now += 9.999
    assert store.get(b"a") is not None
    clock.now += 0.001
    assert store.get(b"a") is None
    assert store.pop(b"a") is None


def test_expired_tickets_are_purged_on_add() -> None:
    clock = _Clock()
    store = MemoryTicketStore(ttl_s=10.0, clock=clock)
    store.add(_ticket(b"old"))
    clock.now += 5
    store.add(_ticket(b"newer"))
    clock.now += 5
    store.add(_ticket(b"newest"))
    assert len(store) == 2
    assert store.get(b"newer") is not None


def test_size_bound_evicts_the_oldest() -> None:
    store = MemoryTicketStore(max_tickets=3)
    for label in (b"1", b"2", b"3", b"4", b"5"):
        store.add(_ticket(label))
    assert len(store) == 3
    assert [store.get(label) is not None for label in (b"1", b"2", b"3", b"4", b"5")] == [
        False,
        False,
        True,
        True,
        True,
    ]


def test_concurrent_pops_hand_a_ticket_out_once() -> None:
    store = MemoryTicketStore()
    store.add(_ticket(b"contested"))
    threads = 8
    barrier = threading.Barrier(threads)
    results: list[SessionTicket | None] = []
    lock = threading.Lock()

    def take() -> None:
        barrier.wait()
        ticket = store.pop(b"contested")
        with lock:
            results.append(ticket)

    workers = [threading.Thread(target=take) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert sum(ticket is not None for ticket in results) == 1


@pytest.mark.parametrize("kwargs", [{"ttl_s": 0.0}, {"max_tickets": 0}])
def test_invalid_bounds_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        MemoryTicketStore(**kwargs)


# --- 0-RTT over plain aioquic ------------------------------------------------------------------


class _EchoServerProtocol(QuicConnectionProtocol):
    """Echoes every stream; records which streams arrived before the handshake completed."""

    def __init__(self, *args: Any, seen: list[_EchoServerProtocol], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handshake: HandshakeCompleted | None = None
        self.early_streams: set[int] = set()
        seen.append(self)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.handshake = event
        elif isinstance(event, StreamDataReceived):
            # Until the client's Finished arrives, stream data can only have come as 0-RTT.
            if self.handshake is None:
                self.early_streams.add(event.stream_id)
            self._quic.send_stream_data(event.stream_id, event.data, event.end_stream)
        # No super(): it would wrap each stream in an unused StreamReader/StreamWriter.


class _EchoClientProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handshake: HandshakeCompleted | None = None
        self.ticket_received = asyncio.Event()
        self._replies: dict[int, bytearray] = {}
        self._done: dict[int, asyncio.Event] = {}

    def send_now(self, data: bytes) -> int:
        """Queue a request at once: with a ticket it leaves in the first flight, as 0-RTT."""
        stream_id = self._quic.get_next_available_stream_id()
        self._replies[stream_id] = bytearray()
        self._done[stream_id] = asyncio.Event()
        self._quic.send_stream_data(stream_id, data, end_stream=True)
        self.transmit()
        return stream_id

    async def reply(self, stream_id: int) -> bytes:
        await self._done[stream_id].wait()
        return bytes(self._replies[stream_id])

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.handshake = event
        elif isinstance(event, StreamDataReceived):
            self._replies[event.stream_id] += event.data
            if event.end_stream:
                self._done[event.stream_id].set()


@dataclass
class _Server:
    port: int
    store: MemoryTicketStore
    connections: list[_EchoServerProtocol] = field(default_factory=list)


@contextlib.asynccontextmanager
async def _echo_server(
    certs: DevCertPaths, fetcher: Callable[[MemoryTicketStore], Callable[..., Any]]
) -> AsyncIterator[_Server]:
    configuration = QuicConfiguration(is_client=False, alpn_protocols=[ALPN])
    configuration.load_cert_chain(certs.server_cert, certs.server_key)
    store = MemoryTicketStore()
    sock, applied = open_udp_socket("127.0.0.1", 0, socket_options_for())
    state = _Server(port=applied.address[1], store=store)
    server = await serve_on_socket(
        sock,
        configuration=configuration,
        create_protocol=lambda *a, **kw: _EchoServerProtocol(*a, seen=state.connections, **kw),
        session_ticket_fetcher=fetcher(store),
        session_ticket_handler=store.add,
    )
    try:
        yield state
    finally:
        server.close()


@dataclass(frozen=True)
class _Outcome:
    handshake: HandshakeCompleted
    reply: bytes
    server_saw_early_data: bool


async def _exchange(
    server: _Server, certs: DevCertPaths, cache: TicketCache, ticket: SessionTicket | None
) -> _Outcome:
    """One connection: send a request in the first flight, read the echo, keep the new ticket."""
    configuration = QuicConfiguration(
        is_client=True, alpn_protocols=[ALPN], server_name=SERVER_NAME
    )
    configuration.load_verify_locations(cafile=str(certs.ca_cert))
    configuration.session_ticket = ticket
    key = ticket_cache_key("127.0.0.1", server.port, SERVER_NAME)
    created: list[_EchoClientProtocol] = []

    def create_protocol(*args: Any, **kwargs: Any) -> _EchoClientProtocol:
        created.append(_EchoClientProtocol(*args, **kwargs))
        return created[-1]

    def ticket_received(new_ticket: SessionTicket) -> None:
        cache.put(key, new_ticket)
        created[0].ticket_received.set()

    async with connect(
        "127.0.0.1",
        server.port,
        configuration=configuration,
        create_protocol=create_protocol,
        session_ticket_handler=ticket_received,
        wait_connected=False,  # so the request can go out before the handshake, as 0-RTT
    ) as protocol:
        assert isinstance(protocol, _EchoClientProtocol)
        stream_id = protocol.send_now(b"ping")
        async with asyncio.timeout(SAFETY_TIMEOUT_S):
            await protocol.wait_connected()
            reply = await protocol.reply(stream_id)
            # The server issues the next ticket after the client's Finished (RFC 9001 §4.5).
            await protocol.ticket_received.wait()
        assert protocol.handshake is not None
        handshake = protocol.handshake
    server_connection = server.connections[-1]
    return _Outcome(
        handshake=handshake,
        reply=reply,
        server_saw_early_data=bool(server_connection.early_streams),
    )


def _pop(store: MemoryTicketStore) -> Callable[[bytes], SessionTicket | None]:
    return store.pop


def _get(store: MemoryTicketStore) -> Callable[[bytes], SessionTicket | None]:
    return store.get


@pytest.mark.asyncio
async def test_cached_ticket_reconnects_with_0rtt(certs: DevCertPaths, tmp_path: Path) -> None:
    cache = TicketCache(tmp_path / "tickets.json")
    async with _echo_server(certs, _pop) as server:
        key = ticket_cache_key("127.0.0.1", server.port, SERVER_NAME)

        first = await _exchange(server, certs, cache, ticket=None)
        assert first.reply == b"ping"
        assert not first.handshake.session_resumed
        assert not first.handshake.early_data_accepted
        assert not first.server_saw_early_data
        assert len(server.store) == 1

        # The ticket comes back from the cache file, so its JSON round trip carries
        # everything 0-RTT needs (the server's transport parameters included).
        ticket = cache.pop(key)
        assert ticket is not None
        assert ticket.max_early_data_size is not None
        second = await _exchange(server, certs, cache, ticket=ticket)

    assert second.reply == b"ping"
    assert second.handshake.session_resumed
    assert second.handshake.early_data_accepted
    assert second.server_saw_early_data
    server_handshake = server.connections[-1].handshake
    assert server_handshake is not None and server_handshake.early_data_accepted
    # The used ticket is gone; the second connection's fresh ticket replaced it on both sides.
    assert server.store.get(ticket.ticket) is None
    assert len(server.store) == 1
    replacement = cache.get(key)
    assert replacement is not None and replacement.ticket != ticket.ticket


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("fetcher", "replay_accepted"), [(_pop, False), (_get, True)], ids=["pop", "get"]
)
async def test_a_ticket_replayed_is_refused_only_by_a_popping_store(
    certs: DevCertPaths,
    tmp_path: Path,
    fetcher: Callable[[MemoryTicketStore], Callable[..., Any]],
    replay_accepted: bool,
) -> None:
    cache = TicketCache(tmp_path / "tickets.json")
    async with _echo_server(certs, fetcher) as server:
        key = ticket_cache_key("127.0.0.1", server.port, SERVER_NAME)
        await _exchange(server, certs, cache, ticket=None)
        ticket = cache.pop(key)
        assert ticket is not None

        used = await _exchange(server, certs, cache, ticket=ticket)
        assert used.handshake.early_data_accepted

        # The same ticket again, as an attacker replaying the first flight would present it.
        replayed = await _exchange(server, certs, cache, ticket=ticket)

    assert replayed.handshake.early_data_accepted is replay_accepted
    assert replayed.handshake.session_resumed is replay_accepted
    assert replayed.server_saw_early_data is replay_accepted
    # Refused early data is not lost: the client sends it again under 1-RTT keys.
    assert replayed.reply == b"ping"


def test_unused_tickets_pass_to_the_next_process_once(tmp_path):
    path = tmp_path / "data" / "tickets.cbor"
    old = MemoryTicketStore()
    for label in (b"a", b"b", b"c"):
        old.add(_ticket(label))
    assert old.pop(b"b") is not None  # used here: not passed on
    expired = dataclasses.replace(
        _ticket(b"gone"),
        not_valid_after=datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=1),
    )
    old.add(expired)
    assert old.save(path) == 3
    assert path.stat().st_mode & 0o777 == 0o600
    new = MemoryTicketStore()
    assert new.load(path) == 2  # the expired one is dropped
    assert not path.exists()  # taken: a third process finds none
    assert MemoryTicketStore().load(path) == 0
    popped = new.pop(b"a")
    assert popped is not None and popped.resumption_secret == b"s" * 32
    assert new.pop(b"a") is None and new.pop(b"b") is None
    assert new.pop(b"c") is not None


def test_an_unreadable_saved_ticket_file_costs_only_0_rtt(tmp_path, caplog):
    path = tmp_path / "tickets.cbor"
    path.write_bytes(b"not cbor at all")
    with caplog.at_level(logging.WARNING):
        assert MemoryTicketStore().load(path) == 0
    assert "unreadable" in caplog.text
