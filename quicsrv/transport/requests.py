"""Request handling for the native paths, sans-I/O: HTTP/3 events in, actions out.

:class:`RequestIntake` holds every request stream of one connection until its body is whole,
and decides what it becomes: a rejection (status + ERROR frame), a generation to start, or a
session to resume. It reads no clock and touches no socket: the aioquic adapter
(:mod:`.server`) feeds it events with the time and the handshake state, and performs the
actions. The 0-RTT policy lives here: a request that arrived whole in early data is answered
only if replaying it is harmless (RFC 8470): RESUME_STREAM attaches to an existing session, so
it may; GENERATE would start compute, so it gets ``too_early`` and the client sends it again
after the handshake.

:func:`rejection_for` is the one place an exception becomes a response. Peer errors keep their
wire code; anything else is a bug: ``internal_error`` (500) for the peer, the traceback logged
once, and the connection and every other stream go on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from aioquic.h3.events import DataReceived, HeadersReceived

import quicsrv_proto
from quicsrv_proto import ErrorCode
from quicsrv_proto.http3 import (
    AUTHORIZATION_HEADER,
    CONTENT_TYPE,
    GENERATE_PATH,
    NATIVE_PATHS,
    RESUME_PATH,
    SESSION_HEADER,
    parse_session_header,
)

from ..apikeys import AccessDenied, ApiKeys, ClientId
from ..http.errors import CHALLENGE, refusal_for

__all__ = [
    "Action",
    "IncomingRequest",
    "Reject",
    "RequestIntake",
    "StartGeneration",
    "StartResume",
    "error_response",
    "rejection_for",
]

log = logging.getLogger("quicsrv")


@dataclass(eq=False)
class IncomingRequest:
    """One request stream on a native path, from its headers until it is answered."""

    stream_id: int
    path: bytes
    session_header: bytes | None
    decoder: quicsrv_proto.FrameDecoder
    arrived_at: float
    client: str
    """Whose request it is, for per-client limits: its API key id, else its connection."""
    key_id: str | None = None
    """The API key it presented (None on an open server)."""
    frames: list[quicsrv_proto.Frame] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        """The ``endpoint`` metrics label (bounded: anything unknown is "other")."""
        return {GENERATE_PATH: "generate", RESUME_PATH: "resume"}.get(self.path, "other")


@dataclass(frozen=True, slots=True)
class Reject:
    """Answer ``request`` with the status of ``code`` and an ERROR frame; the stream ends."""

    request: IncomingRequest
    code: ErrorCode
    message: str
    retry_after_s: float | None = None
    extra_headers: tuple[tuple[bytes, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class StartGeneration:
    """Admit and start ``frame``'s generation, then answer 200 and stream it."""

    request: IncomingRequest
    frame: quicsrv_proto.Generate


@dataclass(frozen=True, slots=True)
class StartResume:
    """Check ``frame`` against its session and attach the stream to it."""

    request: IncomingRequest
    frame: quicsrv_proto.ResumeStream
    header_session: bytes | None
    early: bool
    """The whole request arrived in 0-RTT data (the answer says so)."""


Action = Reject | StartGeneration | StartResume


class RequestIntake:
    """The native request streams of one connection (the HTTP API's go to the router)."""

    def __init__(self, *, api_keys: ApiKeys, connection: str, max_request_bytes: int) -> None:
        self._api_keys = api_keys
        self._connection = connection
        self._max_request_bytes = max_request_bytes
        self._pending: dict[int, IncomingRequest] = {}

    def headers_received(
        self, event: HeadersReceived, *, now: float, accepting: bool
    ) -> Action | None:
        """A request's headers (``event.headers``): remembered until its body is whole, or
        rejected at once. Call only for :data:`~quicsrv_proto.http3.NATIVE_PATHS` and unknown
        paths."""
        headers = dict(event.headers)
        method, path = headers.get(b":method"), headers.get(b":path") or b""
        denied: AccessDenied | None = None
        try:
            who = self._api_keys.authorize(
                headers.get(AUTHORIZATION_HEADER), connection=self._connection
            )
        except AccessDenied as exc:
            denied, who = exc, ClientId(name=self._connection, key_id=None)
        request = IncomingRequest(
            stream_id=event.stream_id,
            path=path,
            session_header=headers.get(SESSION_HEADER),
            decoder=quicsrv_proto.FrameDecoder(max_payload_bytes=self._max_request_bytes),
            arrived_at=now,
            client=who.name,
            key_id=who.key_id,
        )
        if denied is not None:
            # Before anything else: an unauthenticated peer learns nothing about paths.
            return Reject(request, ErrorCode.UNAUTHORIZED, denied.message, None, CHALLENGE)
        if path not in NATIVE_PATHS:
            return Reject(request, ErrorCode.NOT_FOUND, f"no such path: {path!r}")
        if method != b"POST":
            return Reject(request, ErrorCode.METHOD_NOT_ALLOWED, f"{path!r} takes POST")
        if not accepting:
            return Reject(request, ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        if event.stream_ended:
            return Reject(request, ErrorCode.MISSING_FIELD, "the request has no body frame")
        self._pending[event.stream_id] = request
        return None

    def data_received(self, event: DataReceived, *, early: bool) -> Action | None:
        """Body bytes of a pending request; an action once the body is whole or bad.
        ``early``: the handshake has not completed (the data is 0-RTT)."""
        request = self._pending.get(event.stream_id)
        if request is None:
            return None  # answered already, or not a native request
        try:
            request.frames.extend(request.decoder.feed(event.data))
            if len(request.frames) > 1:
                raise quicsrv_proto.UnexpectedFrame("the request body holds more than one frame")
            if not event.stream_ended:
                return None
            request.decoder.end_of_stream()
            return self._complete(request, early)
        except Exception as exc:  # every failure becomes an answer; later data is ignored
            self._pending.pop(event.stream_id, None)
            return rejection_for(exc, request)

    def forget(self, stream_id: int) -> None:
        """The stream went away before its body was whole."""
        self._pending.pop(stream_id, None)

    def forget_all(self) -> None:
        self._pending.clear()

    def _complete(self, request: IncomingRequest, early: bool) -> Action:
        self._pending.pop(request.stream_id, None)
        if not request.frames:
            raise quicsrv_proto.MissingField("the request body holds no frame")
        frame = request.frames[0]
        if request.path == GENERATE_PATH:
            if not isinstance(frame, quicsrv_proto.Generate):
                raise quicsrv_proto.UnexpectedFrame(
                    f"expected GENERATE, got {frame.frame_type.name}"
                )
            if early:
                return Reject(
                    request,
                    ErrorCode.TOO_EARLY,
                    "GENERATE is not accepted in 0-RTT data: send it after the handshake",
                    retry_after_s=0.0,
                )
            return StartGeneration(request, frame)
        if not isinstance(frame, quicsrv_proto.ResumeStream):
            raise quicsrv_proto.UnexpectedFrame(
                f"expected RESUME_STREAM, got {frame.frame_type.name}"
            )
        return StartResume(request, frame, parse_session_header(request.session_header), early)


def rejection_for(exc: BaseException, request: IncomingRequest) -> Reject:
    """The answer to ``request`` that failed with ``exc``: the one mapping of errors.

    A peer's mistake or a refusal keeps its code; any other exception is a bug in this server:
    ``internal_error``, with the traceback logged here (once) and no detail sent to the peer.
    """
    refusal = refusal_for(exc)
    if refusal is not None:
        return Reject(
            request, refusal.code, refusal.message, refusal.retry_after_s, refusal.headers
        )
    log.error(
        "stream %d (%s): internal error",
        request.stream_id,
        request.endpoint,
        exc_info=exc,
        extra={"event": "internal_error", "stream_id": request.stream_id},
    )
    return Reject(request, ErrorCode.INTERNAL_ERROR, "internal error")


def error_response(reject: Reject) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body that answer ``reject``: its status and one ERROR frame."""
    headers = [
        (b":status", str(quicsrv_proto.http_status_for(reject.code)).encode()),
        (b"content-type", CONTENT_TYPE),
        *reject.extra_headers,
    ]
    frame = quicsrv_proto.Error(
        code=reject.code, message=reject.message, retry_after_s=reject.retry_after_s
    )
    return headers, quicsrv_proto.encode_frame(frame)
