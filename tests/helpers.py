"""Shared test helpers: a running server on an ephemeral port, and a raw HTTP/3 requester."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import QuicEvent

import quicsrv_proto
from quicsrv.app import start
from quicsrv.config import ServerConfig
from quicsrv.devcerts import DevCertPaths
from quicsrv.engine import Engine
from quicsrv.sessions.manager import SessionManager
from quicsrv.sessions.settings import SessionSettings
from quicsrv.settings import session_settings_for
from quicsrv.spawn import spawn_server_async
from quicsrv.transport import RunningServer


def session_settings(data_dir: Path, **changes: Any) -> SessionSettings:
    """SessionSettings for tests (the server's defaults); FlowSettings fields may be given
    alongside the others."""
    return session_settings_for(data_dir, **changes)


@contextlib.contextmanager
def llama_extra_buffers(enabled: bool) -> Iterator[None]:
    """Make ``llama_cpp.Llama`` load models with ``use_extra_bufts = enabled``: it has no
    argument for it, so the default parameters it asks for are adjusted meanwhile."""
    import llama_cpp.llama_cpp as bindings

    original = bindings.llama_model_default_params

    def params() -> Any:
        value = original()
        value.use_extra_bufts = enabled
        return value

    bindings.llama_model_default_params = params
    try:
        yield
    finally:
        bindings.llama_model_default_params = original


@contextlib.asynccontextmanager
async def running_server(
    engine: Engine,
    certs: DevCertPaths,
    *,
    sessions: SessionSettings | SessionManager | None = None,
    **config: Any,
) -> AsyncIterator[RunningServer]:
    """A real quicsrv on 127.0.0.1 with an ephemeral port, shut down afterwards.

    Sessions live in a fresh temporary data directory unless ``sessions`` says otherwise.
    """
    with tempfile.TemporaryDirectory(prefix="quicsrv-test-") as scratch:
        settings = ServerConfig(
            host="127.0.0.1",
            port=0,
            cert_path=certs.server_cert,
            key_path=certs.server_key,
            **{"data_dir": Path(scratch), **config},
        )
        if sessions is None:
            sessions = session_settings(Path(scratch))
        if isinstance(sessions, SessionSettings):
            sessions = SessionManager(engine, sessions)
        server = await start(engine, settings, sessions)
        try:
            yield server
        finally:
            await server.shutdown(grace_s=5.0)


@dataclass
class RawResponse:
    status: int = 0
    body: bytearray = field(default_factory=bytearray)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def frames(self) -> list[quicsrv_proto.Frame]:
        return quicsrv_proto.decode_frames(bytes(self.body))


class _RawProtocol(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.responses: dict[int, RawResponse] = {}

    def quic_event_received(self, event: QuicEvent) -> None:
        for h3_event in self.h3.handle_event(event):
            self._h3_event(h3_event)

    def _h3_event(self, event: H3Event) -> None:
        response = self.responses.get(getattr(event, "stream_id", -1))
        if response is None:
            return
        if isinstance(event, HeadersReceived):
            response.status = int(dict(event.headers)[b":status"])
        elif isinstance(event, DataReceived):
            response.body += event.data
        if getattr(event, "stream_ended", False):
            response.done.set()

    async def request(self, method: str, path: str, body: bytes) -> RawResponse:
        stream_id = self._quic.get_next_available_stream_id()
        response = self.responses[stream_id] = RawResponse()
        self.h3.send_headers(
            stream_id,
            [
                (b":method", method.encode()),
                (b":scheme", b"https"),
                (b":authority", b"localhost"),
                (b":path", path.encode()),
            ],
            end_stream=not body,
        )
        if body:
            self.h3.send_data(stream_id, body, end_stream=True)
        self.transmit()
        await asyncio.wait_for(response.done.wait(), timeout=60)
        return response


@contextlib.asynccontextmanager
async def raw_connection(port: int, ca: Path) -> AsyncIterator[_RawProtocol]:
    """An HTTP/3 connection that can send any bytes, path and method."""
    configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
    configuration.load_verify_locations(str(ca))
    async with connect(
        "127.0.0.1",
        port,
        configuration=configuration,
        create_protocol=_RawProtocol,
        wait_connected=True,
    ) as protocol:
        assert isinstance(protocol, _RawProtocol)
        yield protocol


@contextlib.asynccontextmanager
async def server_process(
    certs: DevCertPaths,
    data_dir: Path,
    port: int = 0,
    *,
    extra: list[str] | None = None,
    host: str = "127.0.0.1",
    prefix: list[str] | None = None,
) -> AsyncIterator[tuple[subprocess.Popen[str], int]]:
    """``quicsrv serve`` as a real process (to kill -9 it); yields it and its port.

    ``extra``: more ``serve`` flags (``--store``, ``--workers``); ``prefix``: a command to run
    it under (``ip netns exec NS``)."""
    args = [
        *("--host", host, "--port", str(port)),
        *("--cert", str(certs.server_cert), "--key", str(certs.server_key)),
        *("--data-dir", str(data_dir)),
        *(extra or []),
    ]
    # Its whole output kept beside its data (pytest keeps the last runs' tmp dirs): what a
    # failed or stuck test's server did.
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "server.log"
    async with spawn_server_async(args, prefix=prefix or (), log=log) as server:
        yield server.process, server.port


_End = TypeVar("_End")


def uncached(end: _End) -> _End:
    """A generation's end as two runs of it must agree on: ``cached_tokens`` says what the prefix
    cache held when each started (a short prompt reuses the cells its slot kept), not what was
    generated."""
    return dataclasses.replace(end, cached_tokens=0)  # type: ignore[type-var]
