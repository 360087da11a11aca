"""The one front door: every request, whatever carried it (HTTP/3, HTTP/2, HTTP/1.1), is
answered here, and nowhere else dispatches on a path.

A transport hands over an :class:`~.messages.HttpRequest` and gets back a
:class:`~.messages.FullResponse` or a :class:`~.messages.SessionStream` (see :mod:`.messages`).

Routes:

- ``POST /v1/generate``, ``POST /v1/resume`` (HTTP/3 only): the native frame API
  (:mod:`.native`): a session stream of frames, refusals as an ERROR frame;
- ``POST /v1/chat/completions``, ``POST /v1/completions``: a generation (``stream: true`` →
  a session stream of SSE events, else one JSON body once it has ended);
- ``POST /v1/responses``: OpenAI's Responses API (:mod:`.responses_api`): a generation, streamed
  (events with sequence numbers), answered whole, or run in the background;
  ``GET /v1/responses/{id}`` (the response object; with ``?stream=true&starting_after=N`` its
  events after N), ``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}``;
- ``GET /v1/models``;
- ``GET /v1/streams/{session}`` with ``Last-Event-ID`` (header, or ``?last_event_id=``): the
  stream's events after that cursor; ``DELETE /v1/streams/{session}``: stop the generation;
- ``GET /`` and ``/ui/...``: the chat page (:mod:`.webui`), no key needed;
- ``GET /metrics``, ``/healthz``, ``/readyz``: handed to the operator endpoints
  (:class:`~.operator.PlainRoutes`, given as ``plain``), with their own access rules.

Every other request needs an API key when keys are configured (401 before anything else is
looked at). The 0-RTT policy is one rule here (RFC 8470): a request that arrived in early data
may be a replay, so a route that starts compute (:data:`STARTS_COMPUTE`) answers it
``too_early`` and the client sends it again after the handshake; reading, resuming or stopping
what exists is harmless twice. Every refusal goes through the one error table
(:func:`.errors.refusal_for`) and is rendered for its API: an ERROR frame on the native paths
(and on unknown paths outside ``/v1/`` over HTTP/3), an OpenAI-style error elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable

import quicsrv_proto
from quicsrv_proto import ErrorCode, http3
from quicsrv_proto.http3 import (
    EARLY_DATA_HEADER,
    PROTOCOL_HEADER,
    RESUME_PATH_HEADER,
    SESSION_HEADER,
)

from ..apikeys import ApiKeys, ClientId
from ..metrics import ServerMetrics
from ..sessions.generation import RequestRejected
from ..sessions.manager import SessionManager
from ..sessions.session import Session
from . import native, openai_api, responses_api, webui
from .cursor import InvalidCursor, decode_cursor
from .errors import ApiError, Refusal, from_code, refusal_for
from .faults import StreamFaults
from .messages import (
    FrameEncoder,
    FullResponse,
    HttpRequest,
    KeepAlive,
    Response,
    SessionStream,
    event_stream,
    json_response,
)
from .operator import PLAIN_PATHS, PlainRoutes
from .responses_endpoints import ResponsesEndpoints
from .sse import KEEPALIVE_COMMENT, SseEncoder, StreamShape, collect_answer
from .tool_calls import ToolChoice

__all__ = ["STARTS_COMPUTE", "Router", "request_too_large"]

log = logging.getLogger(__name__)

_CHAT_PATH = "/v1/chat/completions"
_TEXT_PATH = "/v1/completions"
_MODELS_PATH = "/v1/models"
_STREAMS_PREFIX = "/v1/streams/"
_RESPONSES_PATH = "/v1/responses"
_RESPONSES_PREFIX = "/v1/responses/"
_GENERATE_PATH = http3.GENERATE_PATH.decode()
_RESUME_PATH = http3.RESUME_PATH.decode()

#: The endpoints whose request starts compute: a replay of its 0-RTT data would start it twice.
STARTS_COMPUTE = frozenset({"generate", "chat_completions", "completions", "responses"})


class Router:
    """See the module docstring."""

    def __init__(
        self,
        *,
        sessions: SessionManager,
        api_keys: ApiKeys,
        plain: PlainRoutes,
        metrics: ServerMetrics,
        model_id: str,
        accepting: Callable[[], bool],
        max_body_bytes: int,
        sse_keepalive_s: float = 0.0,
    ) -> None:
        self._sessions = sessions
        self._api_keys = api_keys
        self._plain = plain
        self._metrics = metrics
        self.model_id = model_id
        self._accepting = accepting
        self.max_body_bytes = max_body_bytes
        self._sse_keepalive = (
            KeepAlive(KEEPALIVE_COMMENT, sse_keepalive_s) if sse_keepalive_s > 0 else None
        )
        self._created = int(time.time())
        self._responses = ResponsesEndpoints(
            sessions=sessions, model_id=model_id, accepting=accepting, keepalive=self._sse_keepalive
        )
        self.refusals: Counter[ErrorCode] = Counter()
        """Requests refused with a wire code, per code (401, 429, 503, 504, ...)."""
        self.early_resumes = 0
        """Native resumes answered from 0-RTT data."""
        self.early_starts_refused = 0
        """Requests that would start compute, refused ``too_early`` in 0-RTT data."""
        self.faults = StreamFaults()
        """Test faults: streams whose connection drops on demand."""

    @property
    def body_limit_bytes(self) -> int:
        """The most body bytes a transport gathers for one request: a request frame's limit
        plus its header (a JSON body's own limit is checked on top)."""
        return self.max_body_bytes + quicsrv_proto.HEADER_SIZE

    def too_large(self, request: HttpRequest) -> FullResponse:
        """The answer to a request whose body passed :attr:`body_limit_bytes` (``request``
        holds what arrived before); the transport stops reading it."""
        if self._is_native(request):
            message = f"the request frame exceeds {self.max_body_bytes} bytes"
            return native.error_response(Refusal(code=ErrorCode.FRAME_TOO_LARGE, message=message))
        error = request_too_large(self.max_body_bytes)
        return FullResponse(status=error.status, body=error.body(), headers=error.headers)

    async def handle(self, request: HttpRequest) -> Response:
        """Answer ``request``; never raises for a peer's mistake (that is an error answer).
        Every answer says what carried it (``quicsrv-protocol``: a streaming ``fetch`` cannot
        tell a page otherwise)."""
        response = await self._answer(request)
        self._metrics.requests_by_protocol.labels(protocol=request.protocol).inc()
        protocol = (PROTOCOL_HEADER, request.protocol.encode())
        if isinstance(response, SessionStream):
            response.headers += (protocol,)
            response.cut_after_writes = self.faults.take()
            return response
        return dataclasses.replace(response, headers=(*response.headers, protocol))

    async def _answer(self, request: HttpRequest) -> Response:
        bare, _, query = request.path.partition("?")
        if bare.encode("latin-1") in PLAIN_PATHS:
            return self._plain.handle(
                request.method.encode(), bare.encode("latin-1"), request.headers
            )
        if bare in webui.PAGES and request.method == "GET":
            return webui.page(bare)
        endpoint = _endpoint(bare)
        is_native = self._is_native(request)
        try:
            who = self._api_keys.authorize(
                request.headers.get(b"authorization"), connection=request.connection
            )
            if request.early_data and endpoint in STARTS_COMPUTE:
                # A replayed 0-RTT flight would start the compute twice (RFC 8470 §5.2).
                raise RequestRejected(
                    ErrorCode.TOO_EARLY,
                    f"{request.method} {bare} is not accepted in 0-RTT data: "
                    "send it again after the handshake",
                    0.0,
                )
            response: Response
            if is_native:
                response = await self._native(request, who, bare)
            else:
                response = await self._route(request, who, bare, query)
        except asyncio.CancelledError:
            raise
        except ApiError as exc:
            self._refused(request, endpoint, exc.status, exc.code, exc.message)
            return FullResponse(status=exc.status, body=exc.body(), headers=exc.response_headers())
        except Exception as exc:
            refusal = refusal_for(exc)
            if refusal is None:  # a bug: the peer still gets an answer, the log the traceback
                log.error(
                    "%s %s: internal error",
                    request.method,
                    bare,
                    exc_info=exc,
                    extra={"event": "internal_error", "endpoint": endpoint},
                )
                refusal = Refusal(code=ErrorCode.INTERNAL_ERROR, message="internal error")
            self.refusals[refusal.code] += 1
            if refusal.code is ErrorCode.TOO_EARLY:
                self.early_starts_refused += 1
            self._refused(request, endpoint, refusal.status, refusal.code.slug, refusal.message)
            if is_native:
                return native.error_response(refusal)
            error = refusal.api_error()
            return FullResponse(
                status=error.status, body=error.body(), headers=error.response_headers()
            )
        self._metrics.request_finished(endpoint, "ok")
        return response

    # --- routing ------------------------------------------------------------------------

    def _is_native(self, request: HttpRequest) -> bool:
        """Whether the native frame API answers ``request``: its paths, and over HTTP/3 every
        path outside the JSON API's ``/v1/`` (so that a wrong path gets an ERROR frame)."""
        bare = request.path.partition("?")[0]
        return request.http3 and (
            bare in (_GENERATE_PATH, _RESUME_PATH) or not bare.startswith("/v1/")
        )

    async def _native(self, request: HttpRequest, who: ClientId, path: str) -> SessionStream:
        if path not in (_GENERATE_PATH, _RESUME_PATH):
            raise RequestRejected(ErrorCode.NOT_FOUND, f"no such path: {path!r}")
        if request.method != "POST":
            raise RequestRejected(ErrorCode.METHOD_NOT_ALLOWED, f"{path!r} takes POST")
        if not self._accepting():
            raise RequestRejected(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        headers: tuple[tuple[bytes, bytes], ...] = ()
        if path == _GENERATE_PATH:
            frame = native.read_generate(request.body, max_payload_bytes=self.max_body_bytes)
            session = await self._sessions.open_generation(
                frame, client=who.name, owner=who.key_id or "", arrived_at=request.arrived_at
            )
            from_index, fresh = 0, True
        else:
            resume, header_session = native.read_resume(
                request.body,
                request.headers.get(SESSION_HEADER),
                max_payload_bytes=self.max_body_bytes,
            )
            session = await self._sessions.resume(resume, header_session, key_id=who.key_id)
            if request.early_data:
                self.early_resumes += 1
                headers += ((EARLY_DATA_HEADER, b"1"),)
            planned = session.planned_resume_path()
            shown = b"none" if planned is None else planned.value.encode()
            headers += ((RESUME_PATH_HEADER, shown),)
            from_index, fresh = resume.last_index + 1, False
        return SessionStream(
            session=session,
            from_index=from_index,
            encode=native.encode_frames,
            content_type=native.FRAMES,
            headers=((SESSION_HEADER, session.session_id.hex().encode()), *headers),
            client=who.name,
            fresh=fresh,
        )

    async def _route(self, request: HttpRequest, who: ClientId, path: str, query: str) -> Response:
        if len(request.body) > self.max_body_bytes:
            raise request_too_large(self.max_body_bytes)
        if path == _MODELS_PATH:
            _allow(request, "GET")
            return json_response(200, openai_api.models_body(self.model_id, self._created))
        if path in (_CHAT_PATH, _TEXT_PATH):
            _allow(request, "POST")
            return await self._complete(request, who, chat=path == _CHAT_PATH)
        if path == _RESPONSES_PATH:
            _allow(request, "POST")
            return await self._responses.create(request, who)
        if path.startswith(_RESPONSES_PREFIX):
            name, _, action = path[len(_RESPONSES_PREFIX) :].partition("/")
            session_id = responses_api.from_response_id(name)
            if action == "cancel":
                _allow(request, "POST")
                return await self._responses.cancel(who, session_id)
            if action:
                raise ApiError(404, f"no such endpoint: {path}", code="not_found")
            if request.method == "DELETE":
                return await self._responses.delete(who, session_id)
            _allow(request, "GET", "DELETE")
            return await self._responses.retrieve(request, who, session_id, query)
        if path.startswith(_STREAMS_PREFIX):
            session_id = _session_id(path[len(_STREAMS_PREFIX) :])
            if request.method == "DELETE":
                return await self._stop(request, who, session_id)
            _allow(request, "GET", "DELETE")
            return await self._resume(request, who, session_id, query)
        raise ApiError(404, f"no such endpoint: {path}", code="not_found")

    async def _complete(self, request: HttpRequest, who: ClientId, *, chat: bool) -> Response:
        completion = openai_api.parse_completion(request.body, chat=chat, model_id=self.model_id)
        if not self._accepting():
            raise from_code(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        tools = completion.tools
        session = await self._sessions.open_generation(
            completion.generate,
            client=who.name,
            owner=who.key_id or "",
            arrived_at=request.arrived_at,
            # A resumed stream renders the call the same way: the record says it is one.
            api=None if tools is None else lambda _: {"kind": "chat", "tools": tools.stored()},
        )
        shape = StreamShape(
            session_id=session.session_id,
            chat=chat,
            include_usage=completion.include_usage,
            model=self.model_id,
            created=int(session.record.created_at_s),
            tools=tools,
        )
        if completion.stream:
            encoder = SseEncoder(shape, mac_key=self._sessions.keys.current)
            return self._event_stream(session, 0, encoder.encode_all, client=who.name, fresh=True)
        answer = await collect_answer(session, who.name)
        body = openai_api.completion_body(
            session_id=shape.session_id,
            chat=chat,
            model=shape.model,
            created=shape.created,
            text=answer.text,
            end=answer.end,
            tools=tools,
        )
        return json_response(200, body, ((SESSION_HEADER, session.session_id.hex().encode()),))

    async def _resume(
        self, request: HttpRequest, who: ClientId, session_id: bytes, query: str
    ) -> SessionStream:
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
        session = await self._sessions.reattach(session_id, cursor.index + 1, key_id=who.key_id)
        record = session.record
        names = (record.api or {}).get("tools")
        shape = StreamShape(
            session_id=session_id,
            chat=cursor.chat,
            include_usage=cursor.include_usage,
            model=self.model_id,
            created=int(record.created_at_s),
            tools=None if names is None else ToolChoice.from_stored(names),
        )
        # Past the last token (the finishing or usage event): only the END is left to send.
        from_index = min(cursor.index + 1, len(record.generated))
        encoder = SseEncoder(
            shape,
            mac_key=self._sessions.keys.current,
            after=cursor.index,
            text_before=self._sessions.text_of(record, upto=from_index) if names else "",
        )
        return self._event_stream(
            session, from_index, encoder.encode_all, client=who.name, fresh=False
        )

    async def _stop(self, request: HttpRequest, who: ClientId, session_id: bytes) -> FullResponse:
        end = await self._sessions.cancel(session_id, key_id=who.key_id)
        body = {
            "id": session_id.hex(),
            "object": "stream",
            "status": "cancelled"
            if end.reason is quicsrv_proto.EndReason.CANCELLED
            else "finished",
            "finish_reason": openai_api.finish_reason(end.reason),
            "completion_tokens": end.completion_tokens,
        }
        return json_response(200, body)

    def _event_stream(
        self,
        session: Session,
        from_index: int,
        encode: FrameEncoder,
        *,
        client: str,
        fresh: bool,
    ) -> SessionStream:
        return event_stream(
            session, from_index, encode, client=client, fresh=fresh, keepalive=self._sse_keepalive
        )

    def _refused(
        self, request: HttpRequest, endpoint: str, status: int, code: str, message: str
    ) -> None:
        log.info(
            "%s %s: %d %s: %s",
            request.method,
            request.path.partition("?")[0],
            status,
            code,
            message,
            extra={"event": "request_rejected", "code": code, "peer": request.connection},
        )
        self._metrics.request_finished(endpoint, code)


def request_too_large(limit: int) -> ApiError:
    """The error of a body over ``limit`` bytes (raised by transports while reading, too)."""
    return ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def _endpoint(path: str) -> str:
    """The ``endpoint`` metrics label (bounded: anything unknown is "other")."""
    if path.startswith(_STREAMS_PREFIX):
        return "streams"
    if path.startswith(_RESPONSES_PREFIX):
        return "response"
    return {
        _CHAT_PATH: "chat_completions",
        _TEXT_PATH: "completions",
        _MODELS_PATH: "models",
        _RESPONSES_PATH: "responses",
        _GENERATE_PATH: "generate",
        _RESUME_PATH: "resume",
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
