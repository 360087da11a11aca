"""The one routing layer of the HTTP API, whatever carried the request (HTTP/3, HTTP/2, HTTP/1.1).

A transport turns a request into an :class:`HttpRequest` (method, path, lower-case headers,
whole body) and gets back either a :class:`FullResponse` or an :class:`EventStream`, which it
opens on a byte sink of its own (see :class:`ByteSink`): the router never sees a socket.

Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions``: a generation (``stream: true`` →
  :class:`EventStream`, else one JSON body once it has ended);
- ``GET /v1/models``;
- ``GET /v1/streams/{session}`` with ``Last-Event-ID`` (header, or ``?last_event_id=``): the
  stream's events after that cursor; ``DELETE /v1/streams/{session}``: stop the generation;
- ``GET /metrics``, ``/healthz``, ``/readyz``: handed to the operator endpoints
  (``quicsrv.transport.routes.PlainRoutes``, given as ``plain``), with their own access rules.

Every ``/v1/`` request needs an API key when keys are configured (401 before anything else is
looked at); every refusal is an OpenAI-style error (:mod:`.errors`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import quicsrv_proto
from quicsrv_proto import ErrorCode

from ..apikeys import AccessDenied, ApiKeys, ClientId
from ..metrics import ServerMetrics
from ..sessions.manager import SessionManager
from ..sessions.session import Session
from . import openai_api
from .cursor import InvalidCursor, decode_cursor
from .errors import CHALLENGE, ApiError, Refusal, from_code, refusal_for
from .sse import CollectingPort, SseEncoder, StreamShape

__all__ = ["ByteSink", "EventStream", "FullResponse", "HttpRequest", "Router", "SsePort"]

log = logging.getLogger(__name__)

JSON = "application/json"
SESSION_HEADER = b"quicsrv-session"
_CHAT_PATH = "/v1/chat/completions"
_TEXT_PATH = "/v1/completions"
_MODELS_PATH = "/v1/models"
_STREAMS_PREFIX = "/v1/streams/"


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpRequest:
    method: str
    """``GET``, ``POST``, ``DELETE``..."""
    path: str
    """The request target, query included."""
    headers: Mapping[bytes, bytes]
    """Header fields, names in lower case."""
    body: bytes
    """The whole body (the transport bounds its size)."""
    connection: str
    """The peer's connection, which is its client on a server without API keys."""
    arrived_at: float
    """When the request arrived, on the event loop's clock."""
    early_data: bool = False
    """It arrived in TLS 1.3 early data (0-RTT) and could be a replay."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FullResponse:
    status: int
    """The HTTP status."""
    body: bytes
    """The whole body."""
    content_type: str = JSON
    """The ``content-type`` header."""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    """Further headers."""


class ByteSink(Protocol):
    """A transport's response body as an event stream writes it."""

    def write(self, data: bytes, end_stream: bool) -> None: ...

    def sent_offset(self) -> int:
        """Body bytes written so far."""

    def acked_offset(self) -> int:
        """Body bytes the transport has handed on to the peer (a flow-control signal)."""


class PlainAnswer(Protocol):
    @property
    def status(self) -> int: ...
    @property
    def body(self) -> bytes: ...
    @property
    def content_type(self) -> str: ...
    @property
    def headers(self) -> tuple[tuple[bytes, bytes], ...]: ...


class PlainHandler(Protocol):
    """The operator endpoints (``transport.routes.PlainRoutes``): passed in, not imported, so
    that this package never imports the transport that imports it."""

    def handle(
        self, method: bytes | None, path: bytes | None, headers: Mapping[bytes, bytes]
    ) -> PlainAnswer: ...


class SsePort:
    """A session's reader that writes SSE events (a ``sessions.StreamPort``)."""

    def __init__(self, encoder: SseEncoder, sink: ByteSink) -> None:
        self._encoder = encoder
        self._sink = sink

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None:
        data = self._encoder.encode(frame)
        if data or end_stream:
            self._sink.write(data, end_stream)

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        data = b"".join([self._encoder.encode(frame) for frame in frames])
        if data:
            self._sink.write(data, False)

    def sent_offset(self) -> int:
        return self._sink.sent_offset()

    def acked_offset(self) -> int:
        return self._sink.acked_offset()


class EventStream:
    """A ``200 text/event-stream`` answer that reads ``session`` from ``from_index`` on.

    The transport sends the status and headers, then :meth:`open`\\ s it on its sink; a peer
    that goes away is :meth:`close`\\ d (the generation pauses, it does not end).
    """

    status = 200
    content_type = "text/event-stream"

    def __init__(
        self,
        *,
        session: Session,
        from_index: int,
        encoder: SseEncoder,
        client: str,
        fresh: bool,
    ) -> None:
        self.session = session
        self._from_index = from_index
        self._encoder = encoder
        self._client = client
        self._fresh = fresh
        self.headers: tuple[tuple[bytes, bytes], ...] = (
            (SESSION_HEADER, session.session_id.hex().encode()),
            (b"cache-control", b"no-cache"),
        )

    def open(self, sink: ByteSink) -> SsePort:
        port = SsePort(self._encoder, sink)
        self.session.attach(port, self._from_index, self._client)
        return port

    def close(self, port: SsePort, *, capture_kv: bool = True) -> None:
        self.session.detach(port, capture_kv=capture_kv)

    def abandon(self) -> None:
        """The peer left before the stream was opened: a new generation stops spending compute
        (it stays resumable); a resumed one was never attached, so nothing changes."""
        if self._fresh:
            self.session.abandon()


Response = FullResponse | EventStream


class Router:
    """See the module docstring."""

    def __init__(
        self,
        *,
        sessions: SessionManager,
        api_keys: ApiKeys,
        plain: PlainHandler,
        plain_paths: frozenset[bytes],
        metrics: ServerMetrics,
        model_id: str,
        accepting: Callable[[], bool],
        max_body_bytes: int,
    ) -> None:
        self._sessions = sessions
        self._api_keys = api_keys
        self._plain = plain
        self._plain_paths = plain_paths
        self._metrics = metrics
        self.model_id = model_id
        self._accepting = accepting
        self.max_body_bytes = max_body_bytes
        self._created = int(time.time())

    def owns(self, path: bytes | None) -> bool:
        """Whether this layer answers ``path``: every ``/v1/`` path and the operators' ones
        (the HTTP/3 side keeps its native ``/v1/generate`` and ``/v1/resume`` before asking)."""
        if path is None:
            return False
        bare = path.partition(b"?")[0]
        return bare in self._plain_paths or bare.startswith(b"/v1/")

    async def handle(self, request: HttpRequest) -> Response:
        """Answer ``request``; never raises for a peer's mistake (that is an error body)."""
        bare, _, query = request.path.partition("?")
        if bare.encode("latin-1") in self._plain_paths:
            plain = self._plain.handle(
                request.method.encode(), bare.encode("latin-1"), request.headers
            )
            return FullResponse(
                status=plain.status,
                body=plain.body,
                content_type=plain.content_type,
                headers=plain.headers,
            )
        endpoint = _endpoint(bare)
        try:
            response = await self._route(request, bare, query)
        except ApiError as exc:
            self._refused(request, endpoint, exc)
            return FullResponse(status=exc.status, body=exc.body(), headers=exc.response_headers())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            refusal = refusal_for(exc)
            if refusal is None:  # a bug: the peer still gets an answer, the log the traceback
                log.exception("%s %s failed", request.method, bare)
                refusal = Refusal(code=ErrorCode.INTERNAL_ERROR, message="internal error")
            error = refusal.api_error()
            self._refused(request, endpoint, error)
            return FullResponse(
                status=error.status, body=error.body(), headers=error.response_headers()
            )
        self._metrics.request_finished(endpoint, "ok")
        return response

    # --- routing ------------------------------------------------------------------------

    async def _route(self, request: HttpRequest, path: str, query: str) -> Response:
        who = self._authorize(request)
        if len(request.body) > self.max_body_bytes:
            raise request_too_large(self.max_body_bytes)
        if path == _MODELS_PATH:
            _allow(request, "GET")
            return _json(200, openai_api.models_body(self.model_id, self._created))
        if path in (_CHAT_PATH, _TEXT_PATH):
            _allow(request, "POST")
            return await self._complete(request, who, chat=path == _CHAT_PATH)
        if path.startswith(_STREAMS_PREFIX):
            session_id = _session_id(path[len(_STREAMS_PREFIX) :])
            if request.method == "DELETE":
                return await self._stop(request, who, session_id)
            _allow(request, "GET", "DELETE")
            return await self._resume(request, who, session_id, query)
        raise ApiError(404, f"no such endpoint: {path}", code="not_found")

    def _authorize(self, request: HttpRequest) -> ClientId:
        try:
            return self._api_keys.authorize(
                request.headers.get(b"authorization"), connection=request.connection
            )
        except AccessDenied as exc:
            raise ApiError(
                401,
                exc.message,
                code="unauthorized",
                headers=CHALLENGE,
            ) from None

    async def _complete(self, request: HttpRequest, who: ClientId, *, chat: bool) -> Response:
        completion = openai_api.parse_completion(request.body, chat=chat, model_id=self.model_id)
        if request.early_data:
            # A replayed 0-RTT flight would start the compute twice (RFC 8470 §5.2).
            raise from_code(ErrorCode.TOO_EARLY, "a completion is not accepted in 0-RTT data", 0.0)
        if not self._accepting():
            raise from_code(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        session = await self._sessions.open_generation(
            completion.generate,
            client=who.name,
            owner=who.key_id or "",
            arrived_at=request.arrived_at,
        )
        shape = StreamShape(
            session_id=session.session_id,
            chat=chat,
            include_usage=completion.include_usage,
            model=self.model_id,
            created=int(session.record.created_at_s),
        )
        if completion.stream:
            encoder = SseEncoder(shape, mac_key=self._sessions.keys.current)
            return EventStream(
                session=session, from_index=0, encoder=encoder, client=who.name, fresh=True
            )
        port = CollectingPort()
        session.attach(port, 0, who.name)
        try:
            answer = await port.answer
        except asyncio.CancelledError:
            # Nobody can resume a non-streamed answer: its peer never learned the session.
            session.cancel()
            raise
        finally:
            session.detach(port)
        body = openai_api.completion_body(
            session_id=shape.session_id,
            chat=chat,
            model=shape.model,
            created=shape.created,
            text=answer.text,
            end=answer.end,
        )
        return _json(200, body, ((SESSION_HEADER, session.session_id.hex().encode()),))

    async def _resume(
        self, request: HttpRequest, who: ClientId, session_id: bytes, query: str
    ) -> EventStream:
        last = request.headers.get(b"last-event-id")
        text = last.decode("latin-1").strip() if last is not None else _query_value(query)
        if not text:
            raise ApiError(
                400,
                "resuming a stream needs the last event id it received (Last-Event-ID)",
                code="missing_last_event_id",
                param="Last-Event-ID",
            )
        keys = self._sessions.keys.verifying_keys(time.time())
        try:
            cursor = decode_cursor(text, keys)
        except InvalidCursor as exc:
            raise ApiError(403, str(exc), code="invalid_cursor", param="Last-Event-ID") from None
        if cursor.session_id != session_id:
            raise ApiError(
                403,
                "the cursor belongs to another stream",
                code="invalid_cursor",
                param="Last-Event-ID",
            )
        if not self._accepting():
            raise from_code(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        session = await self._sessions.reattach_anywhere(
            session_id, cursor.index + 1, key_id=who.key_id
        )
        shape = StreamShape(
            session_id=session_id,
            chat=cursor.chat,
            include_usage=cursor.include_usage,
            model=self.model_id,
            created=int(session.record.created_at_s),
        )
        encoder = SseEncoder(shape, mac_key=self._sessions.keys.current, after=cursor.index)
        # Past the last token (the finishing or usage event): only the END is left to send.
        from_index = min(cursor.index + 1, len(session.record.generated))
        return EventStream(
            session=session, from_index=from_index, encoder=encoder, client=who.name, fresh=False
        )

    async def _stop(self, request: HttpRequest, who: ClientId, session_id: bytes) -> FullResponse:
        end = await self._sessions.cancel_anywhere(session_id, key_id=who.key_id)
        body = {
            "id": session_id.hex(),
            "object": "stream",
            "status": "cancelled"
            if end.reason is quicsrv_proto.EndReason.CANCELLED
            else "finished",
            "finish_reason": openai_api.finish_reason(end.reason),
            "completion_tokens": end.completion_tokens,
        }
        return _json(200, body)

    def _refused(self, request: HttpRequest, endpoint: str, error: ApiError) -> None:
        log.info(
            "%s %s: %d %s: %s",
            request.method,
            request.path.partition("?")[0],
            error.status,
            error.code,
            error.message,
            extra={"event": "request_rejected", "code": error.code, "peer": request.connection},
        )
        self._metrics.request_finished(endpoint, error.code)


def request_too_large(limit: int) -> ApiError:
    """The error of a body over ``limit`` bytes (raised by transports while reading, too)."""
    return ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def _endpoint(path: str) -> str:
    """The ``endpoint`` metrics label (bounded: anything unknown is "other")."""
    if path.startswith(_STREAMS_PREFIX):
        return "streams"
    return {
        _CHAT_PATH: "chat_completions",
        _TEXT_PATH: "completions",
        _MODELS_PATH: "models",
    }.get(path, "other")


def _allow(request: HttpRequest, *methods: str) -> None:
    if request.method not in methods:
        raise ApiError(
            405,
            f"{request.path.partition('?')[0]} takes {' or '.join(methods)}",
            code="method_not_allowed",
            headers=((b"allow", ", ".join(methods).encode()),),
        )


def _session_id(text: str) -> bytes:
    try:
        session_id = bytes.fromhex(text)
    except ValueError:
        session_id = b""
    if len(session_id) != quicsrv_proto.SESSION_ID_BYTES:
        raise ApiError(404, "no such stream", code="unknown_session")
    return session_id


def _query_value(query: str) -> str:
    values = urllib.parse.parse_qs(query).get("last_event_id", [])
    return values[0].strip() if values else ""


def _json(
    status: int, body: dict[str, Any], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> FullResponse:
    return FullResponse(status=status, body=json.dumps(body).encode(), headers=headers)
