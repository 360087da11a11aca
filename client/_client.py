"""The HTTP/3 client: one QUIC connection, one request stream per generation.

Connections resume TLS sessions with tickets (kept in memory, or in a 0600 cache file shared
across processes) and then send RESUME_STREAM as 0-RTT early data: a resume costs no round trip
before the request. GENERATE always waits for the handshake (the server refuses it in early data,
because a replayed first flight must never start compute).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import ssl
import warnings
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Unpack

from aioquic.asyncio.client import connect
from aioquic.h3.connection import H3_ALPN
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.tls import SessionTicket
from cryptography.x509 import load_pem_x509_certificates

import quicsrv_proto
from quicsrv_proto import http3

from ._errors import (
    ConnectTimeout,
    NetworkError,
    ProtocolError,
    ServerError,
    TransportError,
    map_exceptions,
)
from ._events import (
    CheckpointReceived,
    Event,
    GenerationEnded,
    GenerationResult,
    ResumePosition,
)
from ._generation import RESUME_PATH, Generation, collect, read_response
from ._options import (
    API_KEY_ENV,
    DEFAULT_CA,
    DEFAULT_READ_WINDOW_BYTES,
    DEFAULT_STALL_TIMEOUT_S,
    ClientConfig,
    ClientSettings,
    SamplingOptions,
    SamplingSettings,
)
from ._protocol import H3_REQUEST_CANCELLED, H3Protocol
from ._reconnect import ReconnectPolicy
from ._stats import ClientStats
from ._tickets import TicketCache, ticket_cache_key

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_CA",
    "DEFAULT_READ_WINDOW_BYTES",
    "DEFAULT_STALL_TIMEOUT_S",
    "GENERATE_PATH",
    "H3_REQUEST_CANCELLED",
    "Client",
    "ClientStats",
    "MessageLike",
    "PlainResponse",
]

GENERATE_PATH = http3.GENERATE_PATH.decode()

MessageLike = quicsrv_proto.ChatMessage | Mapping[str, str]
#: The largest plain response body :meth:`Client.get` accepts (a /metrics page is a few KiB).
MAX_PLAIN_BODY_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class PlainResponse:
    """The answer to a plain ``GET`` (:meth:`Client.get`)."""

    status: int
    """The HTTP status."""
    headers: dict[str, str]
    """Response headers, names in lower case (pseudo-headers left out)."""
    body: bytes
    """The whole body."""

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class _MemoryTickets:
    """Tickets for this Client object only (no cache file given)."""

    def __init__(self) -> None:
        self._tickets: dict[str, SessionTicket] = {}

    def pop(self, key: str) -> SessionTicket | None:
        return self._tickets.pop(key, None)

    def put(self, key: str, ticket: SessionTicket) -> None:
        self._tickets[key] = ticket


def _to_message(message: MessageLike) -> quicsrv_proto.ChatMessage:
    if isinstance(message, quicsrv_proto.ChatMessage):
        return message
    try:
        return quicsrv_proto.ChatMessage(role=str(message["role"]), content=str(message["content"]))
    except KeyError as exc:
        raise ValueError(f"chat message is missing {exc.args[0]!r}") from None


class Client:
    """An HTTP/3 connection to a quicsrv server.

    Use it as an async context manager; each :meth:`stream` call opens its own request
    stream, so several generations can share one connection concurrently. With a
    ``reconnect`` policy, a generation whose connection is lost reconnects and resumes inside
    its ``async for``. Settings come as a :class:`ClientConfig` (``config=``), as keywords
    (``api_key=...``, overriding the config's), or both.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 4433,
        *,
        config: ClientConfig | None = None,
        ticket_cache: TicketCache | str | Path | None = None,
        **settings: Unpack[ClientSettings],
    ) -> None:
        self.host = host
        self.port = port
        # None for these means "the default" (the default CA, $QUICSRV_API_KEY), as it always has.
        if "ca" in settings and settings["ca"] is None:
            del settings["ca"]
        if "api_key" in settings and settings["api_key"] is None:
            del settings["api_key"]
        base = config if config is not None else ClientConfig()
        self.config = base.replace(**settings) if settings else base
        self.stats = ClientStats()
        self._tickets: TicketCache | _MemoryTickets = (
            _MemoryTickets()
            if ticket_cache is None
            else ticket_cache
            if isinstance(ticket_cache, TicketCache)
            else TicketCache(ticket_cache)
        )
        self._stack: contextlib.AsyncExitStack | None = None
        self._protocol: H3Protocol | None = None
        self._handshake: asyncio.Task[None] | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._reconnecting = asyncio.Lock()

    # The config's fields, read where a generation or a test needs them.
    @property
    def api_key(self) -> str | None:
        return self.config.api_key

    @api_key.setter
    def api_key(self, key: str | None) -> None:
        """A new key applies to the next request, on the same connection (key rotation)."""
        self.config = self.config.replace(api_key=key)

    @property
    def reconnect_policy(self) -> ReconnectPolicy | None:
        return self.config.reconnect

    @property
    def stall_timeout_s(self) -> float | None:
        return self.config.stall_timeout_s

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def early_data_accepted(self) -> bool | None:
        """Whether the server accepted this connection's 0-RTT data (None: not known yet)."""
        handshake = self._protocol.handshake if self._protocol is not None else None
        return None if handshake is None else handshake.early_data_accepted

    def _configuration(self) -> QuicConfiguration:
        settings = self.config
        config = QuicConfiguration(
            is_client=True,
            alpn_protocols=list(H3_ALPN),
            max_stream_data=settings.read_window_bytes,
            idle_timeout=settings.idle_timeout_s,
        )
        if settings.insecure_skip_verify:
            config.verify_mode = ssl.CERT_NONE
        else:
            # Read and parse the CA here: aioquic only opens the file mid-handshake, where a
            # missing file surfaces as a stalled connection instead of a clear error.
            try:
                cadata = settings.ca.read_bytes()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if not load_pem_x509_certificates(cadata):
                        raise ValueError("no certificate found")
            except (OSError, ValueError) as exc:
                raise TransportError(f"cannot load CA certificate {settings.ca}: {exc}") from exc
            config.load_verify_locations(cadata=cadata)
        return config

    async def connect(self) -> None:
        """Open the QUIC connection (done by ``async with``).

        With a session ticket for this server, returns before the handshake completes, so
        the next request (a resume) travels as 0-RTT data; otherwise waits for it.
        """
        if self._protocol is not None:
            return
        config = self._configuration()
        config.server_name = self.host
        key = ticket_cache_key(self.host, self.port, self.host)
        ticket = self._tickets.pop(key)
        # aioquic ignores a ticket for another server name; such a ticket is not 0-RTT.
        early = ticket is not None and ticket.server_name == config.server_name
        config.session_ticket = ticket if early else None
        stack = contextlib.AsyncExitStack()
        created: list[H3Protocol] = []

        def create_protocol(*args: Any, **kwargs: Any) -> H3Protocol:
            protocol = H3Protocol(
                *args,
                read_window_bytes=self.config.read_window_bytes,
                ack_delay_s=self.config.ack_delay_s,
                **kwargs,
            )
            created.append(protocol)
            return protocol

        def store_ticket(new_ticket: SessionTicket) -> None:
            self._tickets.put(key, new_ticket)

        def connection_failed(exc: Exception) -> NetworkError:
            # aioquic raises a bare ConnectionError; the close frame it got says why.
            detail = created[0].terminated if created and created[0].terminated else exc
            return NetworkError(f"cannot connect to {self.authority}: {detail}")

        try:
            with self._map_connect_errors(connection_failed):
                protocol = await asyncio.wait_for(
                    stack.enter_async_context(
                        connect(
                            self.host,
                            self.port,
                            configuration=config,
                            create_protocol=create_protocol,
                            session_ticket_handler=store_ticket,
                            wait_connected=not early,
                        )
                    ),
                    timeout=self.config.connect_timeout_s,
                )
        except BaseException:
            await stack.aclose()
            raise
        assert isinstance(protocol, H3Protocol)
        self._stack = stack
        self._protocol = protocol
        self.stats.connections += 1
        if early:
            self.stats.tickets_offered += 1
            loop = asyncio.get_running_loop()
            # aioquic holds the first flight back when not waiting for the handshake; a request
            # written in this same turn still rides in it as 0-RTT, a later one right after.
            loop.call_soon(protocol.transmit)
            self._handshake = loop.create_task(self._watch_handshake(protocol))

    async def _watch_handshake(self, protocol: H3Protocol) -> None:
        """With 0-RTT nobody awaited the handshake: fail the connection if it never comes."""
        try:
            with self._map_connect_errors(
                lambda exc: NetworkError(f"cannot connect to {self.authority}: {exc}")
            ):
                await asyncio.wait_for(protocol.wait_connected(), self.config.connect_timeout_s)
        except TransportError as exc:
            protocol.fail(exc)
            return
        if protocol.handshake is not None and protocol.handshake.early_data_accepted:
            self.stats.early_data_accepted += 1

    def _map_connect_errors(
        self, connection_failed: Callable[[Exception], NetworkError]
    ) -> contextlib.AbstractContextManager[None]:
        timeout_s = self.config.connect_timeout_s
        return map_exceptions(
            {
                TimeoutError: lambda _: ConnectTimeout(
                    f"no QUIC handshake with {self.authority} within {timeout_s}s"
                ),
                OSError: connection_failed,  # ConnectionError included
            }
        )

    async def _wait_handshake(self) -> None:
        if self._handshake is not None:
            await asyncio.shield(self._handshake)
            protocol = self._require_protocol()
            if protocol.terminated is not None:
                raise protocol.terminated

    def _start_keepalive(self) -> None:
        if self._keepalive is None or self._keepalive.done():
            self._keepalive = asyncio.get_running_loop().create_task(self._send_keepalives())

    async def _send_keepalives(self) -> None:
        # Three PINGs per idle timeout while streams are open: a live server's ACKs keep the
        # connection up through long pauses, and a dead one is noticed after idle_timeout_s.
        while self._protocol is not None and self._protocol.streams:
            await asyncio.sleep(self.config.idle_timeout_s / 3)  # a period, not a synchronisation
            if self._protocol is not None:
                self._protocol.send_keepalive()

    def server_going_away(self) -> None:
        """The server announced it is going away (END(shutdown), or a resume refused with
        ``shutting_down``): the next :meth:`reconnect` replaces the connection even though it
        may still look alive, and every generation on it resumes elsewhere."""
        if self._protocol is not None:
            self._protocol.fail(NetworkError("the server is going away"))

    async def reconnect(self) -> bool:
        """Replace a lost connection (once, however many generations ask); True if 0-RTT."""
        async with self._reconnecting:
            protocol = self._protocol
            if protocol is not None and protocol.terminated is None:
                return self._handshake is not None  # another generation reconnected already
            await self.aclose()
            await self.connect()
            return self._handshake is not None

    async def aclose(self) -> None:
        """Close the connection gracefully (done on leaving ``async with``)."""
        stack, self._stack, self._protocol = self._stack, None, None
        for task in (self._handshake, self._keepalive):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._handshake = self._keepalive = None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    close = aclose  # the name earlier releases used

    def _require_protocol(self) -> H3Protocol:
        if self._protocol is None:
            raise RuntimeError("Client is not connected; use `async with Client(...)`")
        return self._protocol

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        sampling: SamplingOptions | None = None,
        deadline_ms: int | None = None,
        truncation: quicsrv_proto.Truncation = quicsrv_proto.Truncation.DISABLED,
        json_schema: Mapping[str, Any] | None = None,
        logprobs: int | None = None,
        **options: Unpack[SamplingSettings],
    ) -> Generation:
        """One generation's events; the last one is :class:`GenerationEnded`.

        Use it as ``async with client.stream(prompt) as generation: async for event in
        generation`` (leaving the block early cancels the request on the server with
        RESET_STREAM + STOP_SENDING), or iterate it directly. Sampling comes as a
        :class:`SamplingOptions` (``sampling=``), as keywords (``max_tokens=32``, overriding
        it), or both. Raises :class:`ServerError` on an ERROR frame, :class:`ProtocolError` on
        malformed bytes, and :class:`NetworkError` if the stream ends without END; whatever
        happens, :attr:`Generation.position` says where :meth:`resume_from` can continue.
        ``deadline_ms``: the server gives up (``deadline_exceeded``) unless generation starts
        within that long. ``truncation=Truncation.AUTO``: a chat over the context budget loses
        its oldest turns instead of being refused (``prompt_too_long``). ``json_schema``: the
        output follows it (every token is sampled under its grammar; a resume continues the
        same constrained generation); ``{"type": "object"}`` asks for any JSON object.
        ``logprobs``: each token comes with its log-probability and this many most likely
        alternatives (0 to 20; a resume brings the same numbers).
        """
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt and messages")
        chosen = sampling if sampling is not None else SamplingOptions()
        if options:
            chosen = chosen.replace(**options)
        frame = chosen.to_frame(
            prompt=prompt,
            messages=None if messages is None else tuple(_to_message(m) for m in messages),
            deadline_ms=deadline_ms,
            truncation=truncation,
        )
        if json_schema is not None:
            frame = dataclasses.replace(
                frame, json_schema=json.dumps(json_schema, separators=(",", ":"))
            )
        if logprobs is not None:
            frame = dataclasses.replace(frame, logprobs=logprobs)
        return Generation(self, GENERATE_PATH, frame, session_id=None, last_index=-1)

    generate = stream  # ``async for event in client.generate(...)`` reads well without a block

    def resume(
        self,
        session: str,
        last_index: int,
        snapshot_hash: bytes,
        *,
        checkpoint_index: int | None = None,
    ) -> Generation:
        """Continue a session after token ``last_index``, on this connection.

        ``snapshot_hash`` is a CHECKPOINT hash of the session, for the token index
        ``checkpoint_index`` (default: ``last_index``). The events are those the interrupted
        stream would have delivered after ``last_index``: no token is lost or repeated.
        """
        try:
            session_id = bytes.fromhex(session)
        except ValueError:
            raise ValueError(f"session {session!r} is not a hex id") from None
        frame = quicsrv_proto.ResumeStream(
            session_id=session_id,
            last_index=last_index,
            snapshot_hash=snapshot_hash,
            hash_index=None if checkpoint_index == last_index else checkpoint_index,
        )
        return Generation(
            self,
            RESUME_PATH,
            frame,
            session_id=session,
            last_index=last_index,
            checkpoint=CheckpointReceived(
                index=frame.checkpoint_index, snapshot_hash=snapshot_hash
            ),
        )

    def resume_from(self, position: ResumePosition) -> Generation:
        """Continue where an interrupted :class:`Generation` stopped (its ``position``)."""
        return self.resume(
            position.session_id,
            position.last_index,
            position.snapshot_hash,
            checkpoint_index=position.checkpoint_index,
        )

    async def generate_text(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        sampling: SamplingOptions | None = None,
        deadline_ms: int | None = None,
        truncation: quicsrv_proto.Truncation = quicsrv_proto.Truncation.DISABLED,
        json_schema: Mapping[str, Any] | None = None,
        logprobs: int | None = None,
        **options: Unpack[SamplingSettings],
    ) -> GenerationResult:
        """Run a whole generation (as :meth:`stream`) and return its text, token ids and END."""
        return await collect(
            self.stream(
                prompt,
                messages=messages,
                sampling=sampling,
                deadline_ms=deadline_ms,
                truncation=truncation,
                json_schema=json_schema,
                logprobs=logprobs,
                **options,
            )
        )

    async def get(
        self,
        path: str,
        *,
        timeout_s: float = 30.0,
        max_body_bytes: int = MAX_PLAIN_BODY_BYTES,
    ) -> PlainResponse:
        """A plain ``GET path`` on this connection (``/metrics``, ``/healthz``, ``/readyz``),
        with the client's API key. Any status is returned, not raised; NetworkError when no
        complete answer comes within ``timeout_s``, ProtocolError for a body over
        ``max_body_bytes``."""
        await self._wait_handshake()
        protocol = self._require_protocol()
        stream_id, queue = protocol.open_stream()
        headers = [
            (b":method", b"GET"),
            (b":scheme", b"https"),
            (b":authority", self.authority.encode()),
            (b":path", path.encode()),
        ]
        if self.config.api_key:
            headers.append((http3.AUTHORIZATION_HEADER, f"Bearer {self.config.api_key}".encode()))
        status, response_headers, body = 0, {}, bytearray()
        complete = False
        timed_out = {
            TimeoutError: lambda _: NetworkError(
                f"GET {path}: no complete answer within {timeout_s}s"
            ),
            ValueError: lambda exc: ProtocolError(  # a :status that is not a number
                f"GET {path}: {exc}", quicsrv_proto.ErrorCode.MALFORMED_PAYLOAD
            ),
        }
        try:
            with map_exceptions(timed_out):
                protocol.h3.send_headers(stream_id, headers, end_stream=True)
                protocol.transmit()
                async with asyncio.timeout(timeout_s):
                    while not complete:
                        item = await queue.get()
                        if isinstance(item, Exception):
                            raise item
                        event, offset = item
                        if isinstance(event, HeadersReceived):
                            for name, value in event.headers:
                                if name == b":status":
                                    status = int(value)
                                elif not name.startswith(b":"):
                                    response_headers[name.decode().lower()] = value.decode()
                        elif isinstance(event, DataReceived):
                            body += event.data
                            if len(body) > max_body_bytes:
                                raise ProtocolError(
                                    f"GET {path}: the body exceeds {max_body_bytes} bytes",
                                    quicsrv_proto.ErrorCode.FRAME_TOO_LARGE,
                                )
                            protocol.mark_consumed(stream_id, offset)
                        complete = bool(getattr(event, "stream_ended", False))
        finally:
            protocol.close_stream(stream_id)
            if not complete:
                protocol.cancel_stream(stream_id)
        return PlainResponse(status=status, headers=response_headers, body=bytes(body))

    async def open_request(
        self, path: str, frame: quicsrv_proto.Frame, session_id: str | None
    ) -> AsyncIterator[list[Event]]:
        """One request stream's events, up to END, a list per HTTP/3 event (the machinery
        under :class:`Generation`)."""
        protocol = self._protocol
        if protocol is not None and protocol.terminated is not None:
            # The connection went idle (no request for idle_timeout_s: nothing keeps an idle
            # connection alive) or was closed since the last request. A new request has
            # nothing in flight to lose: it gets a new connection.
            await self.reconnect()
        if path == GENERATE_PATH:
            # GENERATE is never sent as 0-RTT data: the server would refuse it (too_early).
            try:
                await self._wait_handshake()
            except TransportError:
                # The connection failed before this request sent anything (e.g. a 0-RTT
                # reconnect to a server still starting): with auto-resume on, a new one is fine.
                if self.config.reconnect is None:
                    raise
                await self.reconnect()
                await self._wait_handshake()
        protocol = self._require_protocol()
        stream_id, queue = protocol.open_stream()
        finished = False
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"https"),
            (b":authority", self.authority.encode()),
            (b":path", path.encode()),
            (b"content-type", http3.CONTENT_TYPE),
        ]
        if session_id is not None:
            headers.append((http3.SESSION_HEADER, session_id.encode()))
        if self.config.api_key:
            headers.append((http3.AUTHORIZATION_HEADER, f"Bearer {self.config.api_key}".encode()))
        try:
            protocol.h3.send_headers(stream_id, headers)
            protocol.h3.send_data(stream_id, quicsrv_proto.encode_frame(frame), end_stream=True)
            protocol.transmit()
            self._start_keepalive()
            async for batch in read_response(protocol, stream_id, queue):
                finished = isinstance(batch[-1], GenerationEnded)  # END comes last, if at all
                yield batch
                if finished:
                    return
            finished = True  # unreachable in practice: _read_response raises or ends on END
        except (ServerError, ProtocolError, NetworkError):
            finished = True
            raise
        finally:
            protocol.close_stream(stream_id)
            if not finished:
                protocol.cancel_stream(stream_id)
