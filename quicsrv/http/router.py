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
- ``GET /metrics``, ``/healthz``, ``/readyz``: handed to the operator endpoints
  (``quicsrv.transport.routes.PlainRoutes``, given as ``plain``), with their own access rules.

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
import json
import logging
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import quicsrv_proto
from quicsrv_proto import ChatMessage, EndReason, ErrorCode, http3
from quicsrv_proto.frames import MAX_MESSAGES
from quicsrv_proto.http3 import EARLY_DATA_HEADER, RESUME_PATH_HEADER, SESSION_HEADER

from ..apikeys import ApiKeys, ClientId
from ..metrics import ServerMetrics
from ..sessions.generation import PreparedRequest, PriorTurn, RequestRejected
from ..sessions.lifecycle import SessionState
from ..sessions.manager import SessionManager
from ..sessions.session import Session
from ..sessions.store import SessionRecord
from . import native, openai_api, responses_api
from .cursor import InvalidCursor, decode_cursor
from .errors import ApiError, Refusal, from_code, refusal_for
from .messages import (
    FrameEncoder,
    FullResponse,
    HttpRequest,
    KeepAlive,
    Response,
    SessionStream,
)
from .responses_api import ResponseView
from .responses_stream import ResponseEncoder
from .sse import KEEPALIVE_COMMENT, CollectedAnswer, CollectingPort, SseEncoder, StreamShape

__all__ = ["STARTS_COMPUTE", "PlainHandler", "Router", "request_too_large"]

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


class PlainHandler(Protocol):
    """The operator endpoints (``transport.routes.PlainRoutes``): passed in, not imported, so
    that this package never imports the transport that imports it."""

    def handle(
        self, method: bytes | None, path: bytes | None, headers: Mapping[bytes, bytes]
    ) -> FullResponse: ...


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
        sse_keepalive_s: float = 0.0,
    ) -> None:
        self._sessions = sessions
        self._api_keys = api_keys
        self._plain = plain
        self._plain_paths = plain_paths
        self._metrics = metrics
        self.model_id = model_id
        self._accepting = accepting
        self.max_body_bytes = max_body_bytes
        self._sse_keepalive = (
            KeepAlive(KEEPALIVE_COMMENT, sse_keepalive_s) if sse_keepalive_s > 0 else None
        )
        self._created = int(time.time())
        self.refusals: Counter[ErrorCode] = Counter()
        """Requests refused with a wire code, per code (401, 429, 503, 504, ...)."""
        self.early_resumes = 0
        """Native resumes answered from 0-RTT data."""
        self.early_starts_refused = 0
        """Requests that would start compute, refused ``too_early`` in 0-RTT data."""

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
        """Answer ``request``; never raises for a peer's mistake (that is an error answer)."""
        bare, _, query = request.path.partition("?")
        if bare.encode("latin-1") in self._plain_paths:
            return self._plain.handle(
                request.method.encode(), bare.encode("latin-1"), request.headers
            )
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
            if self._sessions.shared:  # the record is read from Redis, off the loop
                session = await self._sessions.resume_shared(
                    resume, header_session, key_id=who.key_id
                )
            else:
                session = self._sessions.resume(resume, header_session, key_id=who.key_id)
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
            return _json(200, openai_api.models_body(self.model_id, self._created))
        if path in (_CHAT_PATH, _TEXT_PATH):
            _allow(request, "POST")
            return await self._complete(request, who, chat=path == _CHAT_PATH)
        if path == _RESPONSES_PATH:
            _allow(request, "POST")
            return await self._create_response(request, who)
        if path.startswith(_RESPONSES_PREFIX):
            name, _, action = path[len(_RESPONSES_PREFIX) :].partition("/")
            session_id = responses_api.from_response_id(name)
            if action == "cancel":
                _allow(request, "POST")
                return await self._cancel_response(who, session_id)
            if action:
                raise ApiError(404, f"no such endpoint: {path}", code="not_found")
            if request.method == "DELETE":
                return await self._delete_response(who, session_id)
            _allow(request, "GET", "DELETE")
            return await self._get_response(request, who, session_id, query)
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
            return self._event_stream(session, 0, encoder.encode_all, client=who.name, fresh=True)
        answer = await _collect(session, who.name)
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
        return self._event_stream(
            session, from_index, encoder.encode_all, client=who.name, fresh=False
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

    # --- the Responses API --------------------------------------------------------------

    async def _create_response(self, request: HttpRequest, who: ClientId) -> Response:
        create = responses_api.parse_create(request.body, model_id=self.model_id)
        if not self._accepting():
            raise from_code(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        generate, prior = create.generate, None
        if create.previous_response_id is not None:
            generate, prior = await self._continue(create, who)
        conversation_from = 0 if create.instructions is None else 1

        def api(prepared: PreparedRequest) -> dict[str, Any]:
            kept = prepared.messages if create.store and prepared.messages else ()
            return {
                "kind": responses_api.KIND,
                "fields": create.fields,
                "messages": [[m.role, m.content] for m in kept],
                "from": conversation_from,
            }

        session = await self._sessions.open_generation(
            generate,
            client=who.name,
            owner=who.key_id or "",
            arrived_at=request.arrived_at,
            prior=prior,
            api=api,
            unattended=create.background,
        )
        headers = ((SESSION_HEADER, session.session_id.hex().encode()),)
        if create.stream:
            encoder = ResponseEncoder(ResponseView.of(session.record, ""), text_before="")
            return self._event_stream(session, 0, encoder.encode_all, client=who.name, fresh=True)
        if create.background:
            view = ResponseView.of(session.record, "", queued=session.state is SessionState.QUEUED)
            return _json(200, responses_api.response_object(view), headers)
        answer = await _collect(session, who.name)
        view = ResponseView.of(session.record, answer.text)
        return _json(200, responses_api.response_object(view), headers)

    async def _continue(
        self, create: responses_api.CreateRequest, who: ClientId
    ) -> tuple[quicsrv_proto.Generate, PriorTurn]:
        """The GENERATE of a request that continues ``previous_response_id``: its
        instructions, the previous response's conversation and answer, then its input."""
        assert create.previous_response_id is not None
        param = "previous_response_id"
        previous = await self._stored_response(
            responses_api.from_response_id(create.previous_response_id, param), who, param
        )
        if previous.end is None:
            raise ApiError(
                400,
                f"Previous response with id '{create.previous_response_id}' is still in "
                "progress: wait for it to end, or cancel it",
                code="previous_response_in_progress",
                param=param,
            )
        api = previous.api or {}
        stored = tuple(ChatMessage(role=r, content=c) for r, c in api.get("messages", ()))
        answer = self._sessions.text_of(previous)
        given = create.generate.messages or ()
        messages = (
            *given[: len(given) - len(create.input)],  # the instructions, if any
            *stored[int(api.get("from", 0)) :],
            ChatMessage(role="assistant", content=answer),
            *create.input,
        )
        if len(messages) > MAX_MESSAGES:
            raise ApiError(
                400,
                f"the conversation has {len(messages)} messages, more than {MAX_MESSAGES}: "
                "start a new one from a summary",
                code="invalid_value",
                param=param,
            )
        prior = PriorTurn(
            messages=stored,
            prompt_tokens=previous.prompt_tokens,
            generated=tuple(previous.generated),
            answer=answer,
            exact=previous.end.reason is not EndReason.STOP,
        )
        return dataclasses.replace(create.generate, messages=messages), prior

    async def _stored_response(
        self, session_id: bytes, who: ClientId, param: str | None = None, *, stored: bool = True
    ) -> SessionRecord:
        """A response's record, if this key made it and (``stored``) it was stored: 404
        otherwise, as for an id that never existed."""
        record = await self._sessions.lookup(session_id, key_id=who.key_id)
        api = record.api or {}
        if not responses_api.is_response(record) or (
            stored and not api.get("fields", {}).get("store", True)
        ):
            raise ApiError(
                404,
                f"Response with id '{responses_api.response_id(session_id)}' not found.",
                code="not_found",
                param=param,
            )
        return record

    async def _get_response(
        self, request: HttpRequest, who: ClientId, session_id: bytes, query: str
    ) -> Response:
        params = urllib.parse.parse_qs(query)
        stream = _flag(params, "stream")
        if not stream:
            record = await self._stored_response(session_id, who)
            live = self._sessions.live(session_id)
            queued = live is not None and live.state is SessionState.QUEUED
            view = ResponseView.of(record, self._sessions.text_of(record), queued=queued)
            return _json(200, responses_api.response_object(view))
        after = _starting_after(params, request.headers.get(b"last-event-id"))
        if not self._accepting():
            raise from_code(ErrorCode.SHUTTING_DOWN, "the server is shutting down")
        from_index = responses_api.first_token_after(after)
        session = await self._sessions.reattach_anywhere(session_id, from_index, key_id=who.key_id)
        record = session.record
        if not responses_api.is_response(record):
            raise ApiError(404, "no such response", code="not_found")
        # Past the last token (the closing events): only the END is left to send.
        from_index = min(from_index, len(record.generated))
        encoder = ResponseEncoder(
            ResponseView.of(record, ""),
            text_before=self._sessions.text_of(record, upto=from_index),
            after=after,
        )
        return self._event_stream(
            session, from_index, encoder.encode_all, client=who.name, fresh=False
        )

    async def _cancel_response(self, who: ClientId, session_id: bytes) -> FullResponse:
        await self._stored_response(session_id, who, stored=False)
        await self._sessions.cancel_anywhere(session_id, key_id=who.key_id)
        record = await self._sessions.lookup(session_id, key_id=who.key_id)
        view = ResponseView.of(record, self._sessions.text_of(record))
        return _json(200, responses_api.response_object(view))

    async def _delete_response(self, who: ClientId, session_id: bytes) -> FullResponse:
        await self._stored_response(session_id, who, stored=False)
        await self._sessions.delete_anywhere(session_id, key_id=who.key_id)
        return _json(200, responses_api.deleted_body(session_id))

    def _event_stream(
        self,
        session: Session,
        from_index: int,
        encode: FrameEncoder,
        *,
        client: str,
        fresh: bool,
    ) -> SessionStream:
        """A session stream of SSE events (``text/event-stream``), kept alive while quiet."""
        return SessionStream(
            session=session,
            from_index=from_index,
            encode=encode,
            content_type="text/event-stream",
            headers=(
                (SESSION_HEADER, session.session_id.hex().encode()),
                (b"cache-control", b"no-cache"),
            ),
            client=client,
            fresh=fresh,
            keepalive=self._sse_keepalive,
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


async def _collect(session: Session, client: str) -> CollectedAnswer:
    """The whole answer of a request that is not streamed."""
    port = CollectingPort()
    session.attach(port, 0, client)
    try:
        return await port.answer
    except asyncio.CancelledError:
        # Nobody can resume a non-streamed answer: its peer never learned the session.
        session.cancel()
        raise
    finally:
        session.detach(port)


def _flag(params: dict[str, list[str]], name: str) -> bool:
    values = params.get(name, [])
    if not values or values[0] in ("false", "0", ""):
        return False
    if values[0] in ("true", "1"):
        return True
    raise ApiError(400, f"{name} must be true or false", code="invalid_value", param=name)


def _starting_after(params: dict[str, list[str]], last_event_id: bytes | None) -> int:
    """The ``starting_after`` of a streamed GET (or the ``Last-Event-ID`` an EventSource sends,
    which names the same number); -1: from the first event."""
    values = params.get("starting_after", [])
    text = values[0] if values else (last_event_id or b"").decode("latin-1").strip()
    if not text:
        return -1
    if not text.isdigit() or len(text) > 10:
        raise ApiError(
            400,
            "starting_after must be a sequence number (an integer, 0 or more)",
            code="invalid_value",
            param="starting_after",
        )
    return int(text)


def _query_value(query: str) -> str:
    values = urllib.parse.parse_qs(query).get("last_event_id", [])
    return values[0].strip() if values else ""


def _json(
    status: int, body: dict[str, Any], headers: tuple[tuple[bytes, bytes], ...] = ()
) -> FullResponse:
    return FullResponse(status=status, body=json.dumps(body).encode(), headers=headers)
