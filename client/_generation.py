"""One generation as the caller sees it: events in order, a resume position, auto-resume.

A :class:`Generation` checks that every TOKEN carries the next index (each token exactly once)
and keeps the newest checkpoint it holds, so :attr:`Generation.position` can continue it after
any failure. With a :class:`ReconnectPolicy` on the client, a lost connection is handled inside
the ``async for``: reconnect with exponential backoff and jitter (0-RTT when a ticket is held),
send RESUME_STREAM from the position, emit :class:`Reconnected`, and go on.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from aioquic.h3.events import DataReceived, HeadersReceived

import proto

from ._errors import NetworkError, ProtocolError, ServerError, StallTimeout, TransportError
from ._events import (
    CheckpointReceived,
    Event,
    GenerationEnded,
    GenerationResult,
    Reconnected,
    ResumePosition,
    SessionStarted,
    TokenReceived,
)
from ._protocol import H3Protocol, StreamItem

if TYPE_CHECKING:
    from ._client import Client

__all__ = [
    "EARLY_DATA_HEADER",
    "RESUME_PATH",
    "RESUME_PATH_HEADER",
    "SESSION_HEADER",
    "Generation",
    "ReconnectPolicy",
    "collect",
    "read_response",
]

RESUME_PATH = "/v1/resume"
SESSION_HEADER = "quicsrv-session"
RESUME_PATH_HEADER = "quicsrv-resume-path"
EARLY_DATA_HEADER = "quicsrv-early-data"


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconnectPolicy:
    """How a :class:`Generation` reconnects and resumes by itself after a connection loss."""

    max_attempts: int = 8
    """Consecutive reconnect attempts without a new token before giving up."""
    initial_delay_s: float = 0.05
    max_delay_s: float = 5.0
    """Backoff doubles from ``initial_delay_s`` up to this, each delay jittered down to half."""

    def delay_s(self, attempt: int) -> float:
        """The pause before reconnect attempt ``attempt`` (1-based): backoff with jitter."""
        ceiling = min(self.max_delay_s, self.initial_delay_s * 2 ** (attempt - 1))
        return float(ceiling * random.uniform(0.5, 1.0))


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
        self.reconnects = 0
        self._client = client
        self._checkpoint: CheckpointReceived | None = None
        self._ended = False
        self._failures = 0  # reconnect attempts since the last token
        self._streaming = False  # a token arrived: from now on, silence is a stall
        self._pending: deque[Event] = deque()
        self._events = self._open(path, frame)

    def _open(self, path: str, frame: proto.Frame) -> AsyncGenerator[Event, None]:
        return cast(
            AsyncGenerator[Event, None], self._client._request(path, frame, self.session_id)
        )

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
        while not self._pending:
            try:
                event = await self._next_event()
            except TransportError as exc:
                await self._resume_after(exc)
                continue
            self._pending.append(self._track(event))
        return self._pending.popleft()

    async def _next_event(self) -> Event:
        """The stream's next event; StallTimeout after ``stall_timeout_s`` of silence.

        The clock runs only while the caller waits for an event: a caller that stops reading
        pauses the generation by design, and that is no stall. Before the first token (of
        the request, or of the stream that resumed it) the server may be queueing, prefilling
        or rebuilding the session, which the request's deadline bounds instead.
        """
        stall_s = self._client.stall_timeout_s
        if stall_s is None or not self._streaming or self._ended:
            return await self._events.__anext__()
        try:
            async with asyncio.timeout(stall_s):
                return await self._events.__anext__()
        except TimeoutError:
            # The stream was cancelled as the wait was (the server pauses the session).
            await self._events.aclose()
            raise StallTimeout(
                f"no event for {stall_s:g} s after token {self.last_index} while the "
                "connection is alive"
            ) from None

    def _track(self, event: Event) -> Event:
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
            self._failures = 0
            self._streaming = True
        elif isinstance(event, CheckpointReceived) and event.index <= self.last_index:
            self._checkpoint = event
        elif isinstance(event, GenerationEnded):
            self._ended = True
        return event

    async def _resume_after(self, error: TransportError) -> None:
        """Reconnect and resume, or re-raise ``error`` when that is not possible."""
        policy = self._client.reconnect_policy
        position = self.position
        if policy is None or position is None or self._ended:
            raise error
        last: TransportError = error
        while self._failures < policy.max_attempts:
            self._failures += 1
            # Backoff with jitter: many clients of one restarted server must not come back
            # in lockstep. A pause by design, not a synchronisation.
            delay = policy.delay_s(self._failures)
            await asyncio.sleep(delay)
            try:
                early = await self._client._reconnect()
            except TransportError as exc:
                last = exc
                continue
            self.reconnects += 1
            self._client.stats.reconnects += 1
            frame = proto.ResumeStream(
                session_id=bytes.fromhex(position.session_id),
                last_index=position.last_index,
                snapshot_hash=position.snapshot_hash,
                hash_index=position.checkpoint_index,
            )
            self._events = self._open(RESUME_PATH, frame)
            # The resumed stream may wait for a slot and rebuild its KV cells first: like a
            # new request before its first token, that is no stall.
            self._streaming = False
            self._pending.append(
                Reconnected(
                    attempt=self._failures,
                    last_index=position.last_index,
                    early_data=early,
                    delay_s=delay,
                    error=str(error),
                )
            )
            return
        raise NetworkError(
            f"gave up after {policy.max_attempts} reconnect attempts: {last}"
        ) from last

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


async def read_response(
    protocol: H3Protocol, stream_id: int, queue: asyncio.Queue[StreamItem]
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
                status, session, resume_path, early = _parse_headers(h3_event.headers)
                if session is not None and status == 200:
                    yield SessionStarted(
                        session_id=session, resume_path=resume_path, early_data=early
                    )
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


def _parse_headers(
    headers: list[tuple[bytes, bytes]],
) -> tuple[int, str | None, str | None, bool]:
    status: int | None = None
    session: str | None = None
    resume_path: str | None = None
    early = False
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
        elif name == EARLY_DATA_HEADER.encode():
            early = value == b"1"
    if status is None:
        raise ProtocolError("response has no :status", proto.ErrorCode.MALFORMED_PAYLOAD)
    return status, session, resume_path, early
