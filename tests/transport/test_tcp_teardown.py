"""The TCP listener's TLS teardown: a keep-alive client that goes idle without reading never
answers the server's close_notify; the close gives up after ``tls_shutdown_timeout_s`` and
counts a peer error, with no traceback in the log (asyncio's default handler would log
"Unhandled exception in client_connected_cb ... SSL shutdown timed out")."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from pathlib import Path

import pytest

from quicsrv.http.messages import FullResponse, HttpRequest
from quicsrv.peer_errors import PeerErrorLog
from quicsrv.transport import tcp
from quicsrv.transport.tcp import open_tcp_socket, start_tcp_listener

pytestmark = pytest.mark.asyncio


class _Answers:
    """What the ASGI glue asks of the router: one small answer to every request."""

    max_body_bytes = 1024

    async def handle(self, request: HttpRequest) -> FullResponse:
        return FullResponse(status=200, body=b"{}")


def _idle_client(port: int, ca: Path) -> ssl.SSLSocket:
    """One request over HTTP/1.1 with keep-alive, the answer's first bytes read (so the
    server's connection exists and is idle), then nothing read again: the server's
    close_notify is never answered."""
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["http/1.1"])
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock = context.wrap_socket(raw, server_hostname="localhost")
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert sock.recv(12) == b"HTTP/1.1 200"
    return sock


async def test_an_idle_client_that_never_reads_is_a_counted_peer_error_without_traceback(
    certs, caplog, monkeypatch
):
    errors = PeerErrorLog(interval_s=3600.0)
    monkeypatch.setattr(tcp, "PEER_ERRORS", errors)
    listener = await start_tcp_listener(
        _Answers(),  # type: ignore[arg-type]
        open_tcp_socket("127.0.0.1", 0),
        cert_path=str(certs.server_cert),
        key_path=str(certs.server_key),
        keep_alive_timeout_s=0.05,
        tls_shutdown_timeout_s=0.05,
        grace_s=1.0,
    )
    client = None
    try:
        with caplog.at_level(logging.DEBUG):
            client = await asyncio.to_thread(_idle_client, listener.port, certs.ca_cert)
            [connection] = listener.connections
            # Keep-alive timeout, close_notify sent, no answer: the connection's task ends.
            async with asyncio.timeout(30):
                await asyncio.wait({connection})
            assert connection.exception() is None
    finally:
        if client is not None:
            client.close()
        await listener.shutdown(grace_s=1.0)
    assert errors.counts == {"tcp": 1}
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if "client_connected_cb" in r.getMessage()]
