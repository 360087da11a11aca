"""The HTTP/3 client: one QUIC connection, one request stream per generation."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import warnings
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, cast

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import MAX_STREAM_DATA_FRAME_CAPACITY, QuicConnection
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StreamDataReceived, StreamReset
from aioquic.quic.packet import QuicFrameType
from aioquic.quic.packet_builder import QuicPacketBuilder
from aioquic.quic.recovery import QuicPacketSpace
from aioquic.quic.stream import QuicStream
from cryptography.x509 import load_pem_x509_certificates

import proto

from ._errors import ConnectTimeout, NetworkError, ProtocolError, ServerError, TransportError
from ._events import (
    CheckpointReceived,
    Event,
    GenerationEnded,
    GenerationResult,
    ResumePosition,
    SessionStarted,
    TokenReceived,
)

__all__ = ["DEFAULT_CA", "GENERATE_PATH", "RESUME_PATH", "Client", "Generation", "MessageLike"]

DEFAULT_CA = "certs/ca.pem"
GENERATE_PATH = "/v1/generate"
RESUME_PATH = "/v1/resume"
CONTENT_TYPE = "application/vnd.quicsrv.frames"
SESSION_HEADER = "quicsrv-session"
RESUME_PATH_HEADER = "quicsrv-resume-path"
#: Stream receive window: how far the server may run ahead of what the application has read.
DEFAULT_READ_WINDOW_BYTES = 16 * 1024
#: HTTP/3 error code used when the consumer abandons a generation (RFC 9114 §8.1).
H3_REQUEST_CANCELLED = 0x10C

MessageLike = proto.ChatMessage | Mapping[str, str]

_StreamItem = tuple[H3Event, int] | Exception  # an event and the stream offset it reaches


class _H3Protocol(QuicConnectionProtocol):
    """Feeds QUIC events through an H3Connection and routes them to per-stream queues.

    aioquic widens a stream's receive window as data *arrives*; here it widens as the
    application *reads*, so a consumer that stops iterating really stops the server's stream
    (RFC 9000 §4.1) instead of buffering without bound. The server sees the stall and pauses
    that generation, while other streams on the connection go on at full speed.
    """

    def __init__(self, *args: Any, read_window_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.streams: dict[int, asyncio.Queue[_StreamItem]] = {}
        self.terminated: NetworkError | None = None
        self._read_window = read_window_bytes
        self._consumed: dict[int, int] = {}
        self._default_stream_limits = self._quic._write_stream_limits
        self._quic._write_stream_limits = self._write_stream_limits  # type: ignore[method-assign]

    def _write_stream_limits(
        self, builder: QuicPacketBuilder, space: QuicPacketSpace, stream: QuicStream
    ) -> None:
        consumed = None if stream.stream_id is None else self._consumed.get(stream.stream_id)
        if consumed is None or stream.stream_id is None:
            self._default_stream_limits(builder=builder, space=space, stream=stream)
            return
        target = consumed + self._read_window
        # Grow in half-window steps, so one MAX_STREAM_DATA frame covers many reads.
        if target - stream.max_stream_data_local >= self._read_window // 2:
            stream.max_stream_data_local = target
        if stream.max_stream_data_local_sent != stream.max_stream_data_local:
            quic: QuicConnection = self._quic
            buf = builder.start_frame(
                QuicFrameType.MAX_STREAM_DATA,
                capacity=MAX_STREAM_DATA_FRAME_CAPACITY,
                handler=quic._on_max_stream_data_delivery,
                handler_args=(stream,),
            )
            buf.push_uint_var(stream.stream_id)
            buf.push_uint_var(stream.max_stream_data_local)
            stream.max_stream_data_local_sent = stream.max_stream_data_local

    def mark_consumed(self, stream_id: int, offset: int) -> None:
        """The application has read the stream up to ``offset``: maybe widen its window."""
        if stream_id not in self._consumed or offset <= self._consumed[stream_id]:
            return
        self._consumed[stream_id] = offset
        stream = self._quic._streams.get(stream_id)
        if stream is not None and (
            offset + self._read_window - stream.max_stream_data_local >= self._read_window // 2
        ):
            self.transmit()

    async def wait_connected(self) -> None:
        try:
            await super().wait_connected()
        except asyncio.CancelledError:
            # Connect timed out: the shielded waiter later fails with ConnectionError when the
            # connection is closed; retrieve it so asyncio does not log "never retrieved".
            waiter = self._connected_waiter
            if waiter is not None:
                waiter.add_done_callback(_consume_result)
            raise

    def open_stream(self) -> tuple[int, asyncio.Queue[_StreamItem]]:
        if self.terminated is not None:
            raise self.terminated
        stream_id = self._quic.get_next_available_stream_id()
        queue: asyncio.Queue[_StreamItem] = asyncio.Queue()
        self.streams[stream_id] = queue
        self._consumed[stream_id] = 0
        return stream_id, queue

    def close_stream(self, stream_id: int) -> None:
        self.streams.pop(stream_id, None)
        self._consumed.pop(stream_id, None)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ConnectionTerminated):
            reason = event.reason_phrase or "no reason given"
            self.terminated = NetworkError(
                f"connection terminated (error 0x{event.error_code:x}: {reason})"
            )
            for queue in self.streams.values():
                queue.put_nowait(self.terminated)
        elif isinstance(event, StreamReset):
            reset_queue = self.streams.get(event.stream_id)
            if reset_queue is not None:
                reset_queue.put_nowait(
                    NetworkError(f"server reset the stream (error 0x{event.error_code:x})")
                )
        offset = 0
        if isinstance(event, StreamDataReceived):
            stream = self._quic._streams.get(event.stream_id)
            offset = stream.receiver.starting_offset() if stream is not None else 0
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
        with contextlib.suppress(Exception):
            self._quic.reset_stream(stream_id, H3_REQUEST_CANCELLED)
        with contextlib.suppress(Exception):
            self._quic.stop_stream(stream_id, H3_REQUEST_CANCELLED)
        with contextlib.suppress(Exception):
            self.transmit()


def _consume_result(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def _to_message(message: MessageLike) -> proto.ChatMessage:
    if isinstance(message, proto.ChatMessage):
        return message
    try:
        return proto.ChatMessage(role=str(message["role"]), content=str(message["content"]))
    except KeyError as exc:
        raise ValueError(f"chat message is missing {exc.args[0]!r}") from None


class Client:
    """An HTTP/3 connection to a quicsrv server.

    Use it as an async context manager; each :meth:`generate` call opens its own request
    stream, so several generations can share one connection concurrently.
    """

    def __init__(
        self,
        host: str = "localhost",
        port: int = 4433,
        *,
        ca: str | Path | None = None,
        insecure_skip_verify: bool = False,
        connect_timeout_s: float = 10.0,
        read_window_bytes: int = DEFAULT_READ_WINDOW_BYTES,
    ) -> None:
        self.host = host
        self.port = port
        self.ca = Path(ca if ca is not None else DEFAULT_CA)
        self.insecure_skip_verify = insecure_skip_verify
        self.connect_timeout_s = connect_timeout_s
        self.read_window_bytes = read_window_bytes
        self._stack: contextlib.AsyncExitStack | None = None
        self._protocol: _H3Protocol | None = None

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def _configuration(self) -> QuicConfiguration:
        config = QuicConfiguration(
            is_client=True,
            alpn_protocols=list(H3_ALPN),
            max_stream_data=self.read_window_bytes,
        )
        if self.insecure_skip_verify:
            config.verify_mode = ssl.CERT_NONE
        else:
            # Read and parse the CA here: aioquic only opens the file mid-handshake, where a
            # missing file surfaces as a stalled connection instead of a clear error.
            try:
                cadata = self.ca.read_bytes()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if not load_pem_x509_certificates(cadata):
                        raise ValueError("no certificate found")
            except (OSError, ValueError) as exc:
                raise TransportError(f"cannot load CA certificate {self.ca}: {exc}") from exc
            config.load_verify_locations(cadata=cadata)
        return config

    async def connect(self) -> None:
        """Open the QUIC connection (done by ``async with``)."""
        if self._protocol is not None:
            return
        config = self._configuration()
        stack = contextlib.AsyncExitStack()
        created: list[_H3Protocol] = []

        def create_protocol(*args: Any, **kwargs: Any) -> _H3Protocol:
            protocol = _H3Protocol(*args, read_window_bytes=self.read_window_bytes, **kwargs)
            created.append(protocol)
            return protocol

        try:
            protocol = await asyncio.wait_for(
                stack.enter_async_context(
                    connect(
                        self.host,
                        self.port,
                        configuration=config,
                        create_protocol=create_protocol,
                    )
                ),
                timeout=self.connect_timeout_s,
            )
        except TimeoutError:
            await stack.aclose()
            raise ConnectTimeout(
                f"no QUIC handshake with {self.authority} within {self.connect_timeout_s}s"
            ) from None
        except (OSError, ConnectionError) as exc:
            await stack.aclose()
            detail = str(exc)
            if created and created[0].terminated is not None:
                detail = str(created[0].terminated)
            raise NetworkError(f"cannot connect to {self.authority}: {detail}") from exc
        assert isinstance(protocol, _H3Protocol)
        self._stack = stack
        self._protocol = protocol

    async def close(self) -> None:
        """Close the connection gracefully (done on leaving ``async with``)."""
        stack, self._stack, self._protocol = self._stack, None, None
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
        await self.close()

    def _require_protocol(self) -> _H3Protocol:
        if self._protocol is None:
            raise RuntimeError("Client is not connected; use `async with Client(...)`")
        return self._protocol

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[MessageLike] | None = None,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        stop: Iterable[str] = (),
        ignore_eos: bool = False,
    ) -> Generation:
        """Stream one generation's events; the last one is :class:`GenerationEnded`.

        Raises :class:`ServerError` on an ERROR frame, :class:`ProtocolError` on malformed
        bytes, and :class:`NetworkError` if the stream ends without END. Leaving the loop
        early cancels the request on the server (RESET_STREAM + STOP_SENDING). Whatever
        happens, :attr:`Generation.position` says where :meth:`resume_from` can continue.
        """
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt and messages")
        frame = proto.Generate(
            prompt=prompt,
            messages=None if messages is None else tuple(_to_message(m) for m in messages),
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            seed=seed,
            stop=tuple(stop),
            ignore_eos=ignore_eos,
        )
        return Generation(self, GENERATE_PATH, frame, session_id=None, last_index=-1)

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
        frame = proto.ResumeStream(
            session_id=session_id,
            last_index=last_index,
            snapshot_hash=snapshot_hash,
            hash_index=None if checkpoint_index == last_index else checkpoint_index,
        )
        generation = Generation(self, RESUME_PATH, frame, session_id=session, last_index=last_index)
        generation._checkpoint = CheckpointReceived(
            index=frame.checkpoint_index, snapshot_hash=snapshot_hash
        )
        return generation

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
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        stop: Iterable[str] = (),
        ignore_eos: bool = False,
    ) -> GenerationResult:
        """Run a whole generation and return its text, token ids and END."""
        return await collect(
            self.generate(
                prompt,
                messages=messages,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                repeat_penalty=repeat_penalty,
                seed=seed,
                stop=stop,
                ignore_eos=ignore_eos,
            )
        )

    async def _request(
        self, path: str, frame: proto.Frame, session_id: str | None
    ) -> AsyncIterator[Event]:
        protocol = self._require_protocol()
        stream_id, queue = protocol.open_stream()
        finished = False
        headers = [
            (b":method", b"POST"),
            (b":scheme", b"https"),
            (b":authority", self.authority.encode()),
            (b":path", path.encode()),
            (b"content-type", CONTENT_TYPE.encode()),
        ]
        if session_id is not None:
            headers.append((SESSION_HEADER.encode(), session_id.encode()))
        try:
            protocol.h3.send_headers(stream_id, headers)
            protocol.h3.send_data(stream_id, proto.encode_frame(frame), end_stream=True)
            protocol.transmit()
            async for event in _read_response(protocol, stream_id, queue):
                if isinstance(event, GenerationEnded):
                    finished = True
                yield event
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


class Generation:
    """One generation's events, in order, plus where to resume it after any failure.

    Iterate it with ``async for``. Every TOKEN must carry the next index (each token exactly
    once, in order), or :class:`ProtocolError` is raised. :attr:`position` is the latest
    checkpoint the client holds together with the last token index it received.
    """

    def __init__(
        self,
        client: Client,
        path: str,
        frame: proto.Frame,
        *,
        session_id: str | None,
        last_index: int,
    ) -> None:
        self.session_id = session_id
        self.last_index = last_index
        self.resume_path: str | None = None
        """For a resume: how the server rebuilt the decoder state (kv-restore, replay...)."""
        self._checkpoint: CheckpointReceived | None = None
        self._events = cast(AsyncGenerator[Event, None], client._request(path, frame, session_id))

    @property
    def position(self) -> ResumePosition | None:
        """Where to resume from; None before the server sent a session and a checkpoint."""
        if self.session_id is None or self._checkpoint is None:
            return None
        return ResumePosition(
            session_id=self.session_id,
            last_index=self.last_index,
            checkpoint_index=self._checkpoint.index,
            snapshot_hash=self._checkpoint.snapshot_hash,
        )

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Event:
        event = await self._events.__anext__()
        if isinstance(event, SessionStarted):
            if self.session_id is not None and event.session_id != self.session_id:
                raise ProtocolError(
                    "the server answered for another session", proto.ErrorCode.INVALID_FIELD
                )
            self.session_id = event.session_id
            self.resume_path = event.resume_path
        elif isinstance(event, TokenReceived):
            if event.index != self.last_index + 1:
                raise ProtocolError(
                    f"token index {event.index} after {self.last_index}: lost or repeated",
                    proto.ErrorCode.INVALID_FIELD,
                )
            self.last_index = event.index
        elif isinstance(event, CheckpointReceived) and event.index <= self.last_index:
            self._checkpoint = event
        return event

    async def aclose(self) -> None:
        """Abandon the generation (the server stops it within a token)."""
        await self._events.aclose()


async def collect(events: Generation) -> GenerationResult:
    """Drain a generation into its text, token ids and END."""
    parts: list[str] = []
    token_ids: list[int] = []
    end: GenerationEnded | None = None
    try:
        async for event in events:
            if isinstance(event, TokenReceived):
                parts.append(event.text)
                token_ids.append(event.token_id)
            elif isinstance(event, GenerationEnded):
                parts.append(event.text)
                end = event
    finally:
        await events.aclose()
    if end is None:  # pragma: no cover - the iterator raises instead
        raise NetworkError("stream ended without END")
    return GenerationResult(text="".join(parts), token_ids=tuple(token_ids), end=end)


async def _read_response(
    protocol: _H3Protocol, stream_id: int, queue: asyncio.Queue[_StreamItem]
) -> AsyncIterator[Event]:
    """Turn one request stream's H3 events into client events; stops after END."""
    status: int | None = None
    decoder = proto.FrameDecoder()
    while True:
        item = await queue.get()
        if isinstance(item, Exception):
            raise item
        h3_event, offset = item
        protocol.mark_consumed(stream_id, offset)
        if isinstance(h3_event, HeadersReceived):
            if status is None:
                status, session, resume_path = _parse_headers(h3_event.headers)
                if session is not None and status == 200:
                    yield SessionStarted(session_id=session, resume_path=resume_path)
            frames: list[proto.Frame] = []  # trailers carry nothing we use
        elif isinstance(h3_event, DataReceived):
            if status is None:
                raise ProtocolError(
                    "DATA before response headers", proto.ErrorCode.UNEXPECTED_FRAME
                )
            try:
                frames = decoder.feed(h3_event.data)
            except proto.ProtocolError as exc:
                raise ProtocolError.from_proto(exc) from None
        else:  # pragma: no cover - only those two are routed here
            continue
        for frame in frames:
            assert status is not None
            if isinstance(frame, proto.Error):
                raise ServerError(
                    frame.code,
                    frame.message,
                    http_status=status,
                    retry_after_s=frame.retry_after_s,
                )
            if status != 200:
                raise ProtocolError(
                    f"HTTP {status} response body holds {type(frame).__name__}, not ERROR",
                    proto.ErrorCode.UNEXPECTED_FRAME,
                )
            if isinstance(frame, proto.Token):
                yield TokenReceived(index=frame.index, token_id=frame.token_id, text=frame.text)
            elif isinstance(frame, proto.Checkpoint):
                yield CheckpointReceived(index=frame.index, snapshot_hash=frame.snapshot_hash)
            elif isinstance(frame, proto.End):
                yield GenerationEnded(
                    reason=frame.reason,
                    prompt_tokens=frame.prompt_tokens,
                    completion_tokens=frame.completion_tokens,
                    text=frame.text,
                )
                return
            else:
                raise ProtocolError(
                    f"unexpected {type(frame).__name__} frame from the server",
                    proto.ErrorCode.UNEXPECTED_FRAME,
                )
        if h3_event.stream_ended:
            try:
                decoder.end_of_stream()
            except proto.ProtocolError as exc:
                raise ProtocolError.from_proto(exc) from None
            if status is not None and status != 200:
                raise ServerError(0, f"HTTP {status} without an ERROR frame", http_status=status)
            raise NetworkError("stream ended before the END frame")


def _parse_headers(headers: list[tuple[bytes, bytes]]) -> tuple[int, str | None, str | None]:
    status: int | None = None
    session: str | None = None
    resume_path: str | None = None
    for name, value in headers:
        if name == b":status":
            try:
                status = int(value)
            except ValueError:
                raise ProtocolError(
                    f"bad :status {value!r}", proto.ErrorCode.MALFORMED_PAYLOAD
                ) from None
        elif name == SESSION_HEADER.encode():
            session = value.decode("ascii", errors="replace")
        elif name == RESUME_PATH_HEADER.encode():
            resume_path = value.decode("ascii", errors="replace")
    if status is None:
        raise ProtocolError("response has no :status", proto.ErrorCode.MALFORMED_PAYLOAD)
    return status, session, resume_path
