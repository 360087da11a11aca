"""One generation as the caller sees it: events in order, a resume position, auto-resume.

A :class:`Generation` checks that every TOKEN carries the next index (each token exactly once)
and keeps the newest checkpoint it holds, so :attr:`Generation.position` can continue it after
any failure. With a :class:`ReconnectPolicy` on the client, a lost connection is handled inside
the ``async for``: reconnect with exponential backoff and jitter (0-RTT when a ticket is held),
send RESUME_STREAM from the position, emit :class:`Reconnected`, and go on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType
from typing import Protocol, cast

from aioquic.h3.events import DataReceived, HeadersReceived

import quicsrv_proto
from quicsrv_proto import http3

from ._errors import (
    NetworkError,
    ProtocolError,
    ServerError,
    StallTimeout,
    TransportError,
    map_exceptions,
)
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
from ._reconnect import ReconnectPolicy
from ._stats import ClientStats

__all__ = [
    "RESUME_PATH",
    "Generation",
    "RequestSender",
    "collect",
    "read_response",
]

RESUME_PATH = http3.RESUME_PATH.decode()


class RequestSender(Protocol):
    """What a :class:`Generation` needs from its client (a :class:`~client.Client`)."""

    @property
    def reconnect_policy(self) -> ReconnectPolicy | None: ...

    @property
    def stall_timeout_s(self) -> float | None: ...

    @property
    def stats(self) -> ClientStats: ...

    def open_request(
        self, path: str, frame: quicsrv_proto.Frame, session_id: str | None
    ) -> AsyncIterator[list[Event]]:
        """One request stream's events, up to and including END, in the batches they arrived
        in (one per HTTP/3 event)."""
        ...

    async def reconnect(self) -> bool:
        """Replace a lost connection; True when the new one sends 0-RTT data."""
        ...

    def server_going_away(self) -> None:
        """The server said it is going away: its connection is to be replaced, even if it
        still looks alive."""
        ...


class Generation:
    """One generation's events, in order, plus where to resume it after any failure.

    Iterate it with ``async for``, inside ``async with`` to be sure it is closed (leaving early
    cancels the request on the server). Every TOKEN must carry the next index (each token exactly
    once, in order), or :class:`ProtocolError` is raised. :attr:`position` is the latest
    checkpoint the client holds together with the last token index it received.
    """

    def __init__(
        self,
        client: RequestSender,
        path: str,
        frame: quicsrv_proto.Frame,
        *,
        session_id: str | None,
        last_index: int,
        checkpoint: CheckpointReceived | None = None,
    ) -> None:
        self.session_id = session_id
        self.last_index = last_index
        self.resume_path: str | None = None
        """For a resume: how the server rebuilt the decoder state (kv-restore, replay...)."""
        self.reconnects = 0
        self._client = client
        self._checkpoint = checkpoint
        self._ended = False
        self._failures = 0  # reconnect attempts since the last token
        self._streaming = False  # a token arrived: from now on, silence is a stall
        self._pending: deque[Event] = deque()
        self._batches = self._open(path, frame)

    def _open(self, path: str, frame: quicsrv_proto.Frame) -> AsyncGenerator[list[Event], None]:
        return cast(
            AsyncGenerator[list[Event], None],
            self._client.open_request(path, frame, self.session_id),
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
        while True:
            while not self._pending:
                try:
                    self._pending.extend(await self._next_batch())
                except TransportError as exc:
                    await self._resume_after(exc)
                except ServerError as exc:
                    if exc.code != quicsrv_proto.ErrorCode.SHUTTING_DOWN or not self._resumable:
                        raise
                    # A resume that reached the old server while it hands over: come back
                    # to whichever process serves next.
                    self._client.server_going_away()
                    await self._resume_after(NetworkError(f"server: {exc}"))
            event = self._pending.popleft()
            if (
                isinstance(event, GenerationEnded)
                and event.reason is quicsrv_proto.EndReason.SHUTDOWN
                and self._resumable
            ):
                # No end: the server is going away (a restart) with the session saved. Like
                # a lost connection: reconnect with backoff and resume where we are.
                self._client.server_going_away()
                await self._resume_after(NetworkError("the server is shutting down"))
                continue
            # Checked as the caller gets each event, so a bad one comes after every good one
            # before it, and position never names a token the caller has not seen.
            return self._track(event)

    @property
    def _resumable(self) -> bool:
        """Whether a failure now is followed by a reconnect and a resume."""
        return (
            self._client.reconnect_policy is not None
            and self.position is not None
            and not self._ended
        )

    async def _next_batch(self) -> list[Event]:
        """The stream's next events (what one DATA chunk carried: a burst of tokens arrives in
        one, and is waited for, with its stall clock, once); StallTimeout after
        ``stall_timeout_s`` of silence.

        The clock runs only while the caller waits for an event: a caller that stops reading
        pauses the generation by design, and that is no stall. Before the first token (of
        the request, or of the stream that resumed it) the server may be queueing, prefilling
        or rebuilding the session, which the request's deadline bounds instead.
        """
        stall_s = self._client.stall_timeout_s
        if stall_s is None or not self._streaming or self._ended:
            return await self._batches.__anext__()
        try:
            async with asyncio.timeout(stall_s):
                return await self._batches.__anext__()
        except TimeoutError:
            # The stream was cancelled as the wait was (the server pauses the session).
            await self._batches.aclose()
            raise StallTimeout(
                f"no event for {stall_s:g} s after token {self.last_index} while the "
                "connection is alive"
            ) from None

    def _track(self, event: Event) -> Event:
        if isinstance(event, SessionStarted):
            if self.session_id is not None and event.session_id != self.session_id:
                raise ProtocolError(
                    "the server answered for another session", quicsrv_proto.ErrorCode.INVALID_FIELD
                )
            self.session_id = event.session_id
            self.resume_path = event.resume_path
        elif isinstance(event, TokenReceived):
            if event.index != self.last_index + 1:
                raise ProtocolError(
                    f"token index {event.index} after {self.last_index}: lost or repeated",
                    quicsrv_proto.ErrorCode.INVALID_FIELD,
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
                early = await self._client.reconnect()
            except TransportError as exc:
                last = exc
                continue
            self.reconnects += 1
            self._client.stats.reconnects += 1
            frame = quicsrv_proto.ResumeStream(
                session_id=bytes.fromhex(position.session_id),
                last_index=position.last_index,
                snapshot_hash=position.snapshot_hash,
                hash_index=position.checkpoint_index,
            )
            self._batches = self._open(RESUME_PATH, frame)
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
        """Abandon the generation (the server stops it within a token); after END, nothing."""
        await self._batches.aclose()

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


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
) -> AsyncIterator[list[Event]]:
    """Turn one request stream's H3 events into client events, a list per H3 event (a burst
    of tokens is one DATA chunk); stops after END."""
    status: int | None = None
    decoder = quicsrv_proto.FrameDecoder()
    while True:
        item = await queue.get()
        if isinstance(item, Exception):
            raise item
        h3_event, offset = item
        protocol.mark_consumed(stream_id, offset)
        batch: list[Event] = []
        if isinstance(h3_event, HeadersReceived):
            if status is None:
                status, session, resume_path, early = _parse_headers(h3_event.headers)
                if session is not None and status == 200:
                    batch.append(
                        SessionStarted(
                            session_id=session, resume_path=resume_path, early_data=early
                        )
                    )
            frames: list[quicsrv_proto.Frame] = []  # trailers carry nothing we use
        elif isinstance(h3_event, DataReceived):
            if status is None:
                raise ProtocolError(
                    "DATA before response headers", quicsrv_proto.ErrorCode.UNEXPECTED_FRAME
                )
            with map_exceptions():
                frames = decoder.feed(h3_event.data)
        else:  # pragma: no cover - only those two are routed here
            continue
        for frame in frames:
            assert status is not None
            event = _event(frame) if status == 200 else None
            if event is None:
                if batch:
                    yield batch  # what came before the bad frame is the caller's
                raise _unexpected(frame, status)
            batch.append(event)
            if isinstance(event, GenerationEnded):
                yield batch
                return
        if batch:
            yield batch
        if h3_event.stream_ended:
            with map_exceptions():
                decoder.end_of_stream()
            if status is not None and status != 200:
                raise ServerError(0, f"HTTP {status} without an ERROR frame", http_status=status)
            raise NetworkError("stream ended before the END frame")


def _event(frame: quicsrv_proto.Frame) -> Event | None:
    """The client event a frame of a 200 response stands for; None: it may not be there."""
    if isinstance(frame, quicsrv_proto.Token):
        return TokenReceived(
            index=frame.index,
            token_id=frame.token_id,
            text=frame.text,
            logprob=frame.logprob,
            top_logprobs=frame.top_logprobs,
        )
    if isinstance(frame, quicsrv_proto.Checkpoint):
        return CheckpointReceived(index=frame.index, snapshot_hash=frame.snapshot_hash)
    if isinstance(frame, quicsrv_proto.End):
        return GenerationEnded(
            reason=frame.reason,
            prompt_tokens=frame.prompt_tokens,
            completion_tokens=frame.completion_tokens,
            text=frame.text,
            cached_tokens=frame.cached_tokens,
        )
    return None


def _unexpected(frame: quicsrv_proto.Frame, status: int) -> ServerError | ProtocolError:
    """What a frame the response may not hold there means: the server's ERROR, or a
    protocol error."""
    if isinstance(frame, quicsrv_proto.Error):
        return ServerError(
            frame.code, frame.message, http_status=status, retry_after_s=frame.retry_after_s
        )
    if status != 200:
        return ProtocolError(
            f"HTTP {status} response body holds {type(frame).__name__}, not ERROR",
            quicsrv_proto.ErrorCode.UNEXPECTED_FRAME,
        )
    return ProtocolError(
        f"unexpected {type(frame).__name__} frame from the server",
        quicsrv_proto.ErrorCode.UNEXPECTED_FRAME,
    )


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
                    f"bad :status {value!r}", quicsrv_proto.ErrorCode.MALFORMED_PAYLOAD
                ) from None
        elif name == http3.SESSION_HEADER:
            session = value.decode("ascii", errors="replace")
        elif name == http3.RESUME_PATH_HEADER:
            resume_path = value.decode("ascii", errors="replace")
        elif name == http3.EARLY_DATA_HEADER:
            early = value == b"1"
    if status is None:
        raise ProtocolError("response has no :status", quicsrv_proto.ErrorCode.MALFORMED_PAYLOAD)
    return status, session, resume_path, early
