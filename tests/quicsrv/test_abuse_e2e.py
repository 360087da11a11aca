"""End to end: what any peer can do to the listeners costs the server's log almost nothing.

A real ``quicsrv serve`` process, its log in a file. Peers drop hundreds of TLS connections
abruptly (some mid-handshake, some mid-request), send data after TLS close_notify, reset
HTTP/2 streams as fast as they open them, and throw garbage datagrams at the QUIC port. The
server goes on serving, and its log holds at most one line per case and no traceback.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import ssl
import struct
from pathlib import Path

import h2.config
import h2.connection
import httpx
import pytest

from quicsrv.engine.model import default_model_path
from tests.helpers import spawn_server_async

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

_DROPPED = 300


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST, as a peer that vanishes does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _tls(port: int, context: ssl.SSLContext, alpn: list[str]) -> ssl.SSLSocket:
    context.set_alpn_protocols(alpn)
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    return context.wrap_socket(raw, server_hostname="localhost")


def _drop_connections(port: int, ca: Path) -> None:
    """Hundreds of connections dropped with a reset: idle after the handshake, mid-handshake,
    and mid-request (headers dribbled, never finished)."""
    context = ssl.create_default_context(cafile=str(ca))
    idle = [_tls(port, context, ["http/1.1"]) for _ in range(_DROPPED // 3)]
    half = []
    for _ in range(_DROPPED // 3):
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        raw.sendall(b"\x16\x03\x01\x00\xc8\x01\x00\x00\xc4\x03\x03")  # a ClientHello, cut
        half.append(raw)
    dribbling = []
    for _ in range(_DROPPED // 3):
        sock = _tls(port, context, ["http/1.1"])
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Le")
        dribbling.append(sock)
    for sock in [*idle, *half, *dribbling]:
        _reset(sock)


def _data_after_close_notify(port: int, ca: Path) -> None:
    context = ssl.create_default_context(cafile=str(ca))
    for _ in range(20):
        sock = _tls(port, context, ["http/1.1"])
        raw = sock.unwrap()  # close_notify sent (and the server's read back)
        raw.sendall(b"\x17\x03\x03\x00\x10" + b"\x00" * 16)  # application data after it
        _reset(raw)


def _h2_rapid_reset(port: int, ca: Path) -> None:
    """HTTP/2 streams opened and reset at once, many times, then the connection dropped."""
    context = ssl.create_default_context(cafile=str(ca))
    sock = _tls(port, context, ["h2"])
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    headers = [(":method", "GET"), (":path", "/v1/models"), (":scheme", "https")]
    headers.append((":authority", "localhost"))
    for _ in range(500):
        stream_id = connection.get_next_available_stream_id()
        connection.send_headers(stream_id, headers, end_stream=True)
        connection.reset_stream(stream_id)
    sock.sendall(connection.data_to_send())
    _reset(sock)


def _streams_dropped_while_written(port: int, ca: Path, model: str) -> None:
    """SSE streams whose connections are reset while the server writes their tokens."""
    context = ssl.create_default_context(cafile=str(ca))
    body = json.dumps(
        {"model": model, "prompt": "Once upon a time", "max_tokens": 16, "stream": True}
    ).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json"
        b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    for _ in range(16):
        sock = _tls(port, context, ["http/1.1"])
        sock.sendall(request)
        sock.recv(1)  # the answer has begun
        _reset(sock)


def _quic_garbage(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        for n in range(200):
            # Long headers with a QUIC version and nonsense, short headers, tiny datagrams.
            udp.sendto(bytes([0xC0, 0, 0, 0, 1]) + bytes(range(n % 256)) * 4, ("127.0.0.1", port))
            udp.sendto(bytes([0x40]) + b"\xff" * 40, ("127.0.0.1", port))
            udp.sendto(b"\x00", ("127.0.0.1", port))


async def test_abrupt_peers_cost_at_most_a_line_each_and_no_traceback(certs, tmp_path):
    log = tmp_path / "server.log"
    args = ["--host", "127.0.0.1", "--port", "0", "--data-dir", str(tmp_path / "data")]
    args += ["--cert", str(certs.server_cert), "--key", str(certs.server_key)]
    model = default_model_path().stem
    cases = [
        lambda port: _drop_connections(port, certs.ca_cert),
        lambda port: _data_after_close_notify(port, certs.ca_cert),
        lambda port: _h2_rapid_reset(port, certs.ca_cert),
        lambda port: _streams_dropped_while_written(port, certs.ca_cert, model),
        _quic_garbage,
    ]
    async with spawn_server_async(args, log=log) as server:
        async with httpx.AsyncClient(
            verify=ssl.create_default_context(cafile=str(certs.ca_cert)), http2=True
        ) as client:
            url = f"https://localhost:{server.port}"
            for case in cases:
                await asyncio.to_thread(case, server.port)
                # The server still answers, over TCP and so over the listener that was abused.
                assert (await client.get(f"{url}/v1/models")).status_code == 200
            metrics = (await client.get(f"{url}/metrics")).text
        server.process.send_signal(signal.SIGTERM)
        status = await asyncio.to_thread(server.process.wait, 60)
    assert status == 0
    lines = log.read_text().splitlines()
    assert not [line for line in lines if "Traceback" in line]
    # From the TCP listener's start (its line comes last at start-up) to the SIGTERM's line.
    start = next(i for i, line in enumerate(lines) if "Running on https://" in line)
    end = next(i for i, line in enumerate(lines) if "shutting down" in line)
    during = lines[start + 1 : end]
    # At most a line per case (each source logs once per 10 s), and only those lines.
    assert len(during) <= len(cases), during
    assert all("peer error" in line for line in during), during
    assert "# TYPE quicsrv_peer_errors_total counter" in metrics
