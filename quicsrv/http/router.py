"""The one front door: every request, whatever carried it (HTTP/3, HTTP/2, HTTP/1.1), is
answered here, and nowhere else dispatches on a path.

A transport hands over an :class:`~.messages.HttpRequest` and gets back a
:class:`~.messages.FullResponse` or a :class:`~.messages.SessionStream` (see :mod:`.messages`).
The router only dispatches; each API's endpoints are a class of their own, acting on the
sessions:

- ``POST /v1/generate``, ``POST /v1/resume`` (HTTP/3 only): the native frame API
  (:class:`~.native_endpoints.NativeEndpoints`): a session stream of frames, refusals as an
  ERROR frame;
- ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (and
  ``/v1/models/{id}``), and
  ``GET /v1/streams/{session}`` with ``Last-Event-ID`` (the stream's events after that cursor),
  ``DELETE /v1/streams/{session}`` (stop the generation): OpenAI's completions
  (:class:`~.completions_endpoints.CompletionsEndpoints`);
- ``POST /v1/responses``, ``GET /v1/responses/{id}`` (with ``?stream=true``: its events),
  ``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}``: OpenAI's Responses API
  (:class:`~.responses_endpoints.ResponsesEndpoints`);
- ``POST /v1/messages``, ``POST /v1/messages/count_tokens``: Anthropic's Messages API
  (:class:`~.anthropic_endpoints.AnthropicEndpoints`); its streams resume on
  ``GET /v1/streams/{session}`` like the others, the cursor saying whose they are;
- ``POST /tokenize``, ``POST /detokenize``, ``GET /props``: llama-server's token endpoints
  and server facts (:class:`~.token_endpoints.TokenEndpoints`), over HTTP/3 too although
  they sit outside ``/v1/``; ``POST /v1/responses/input_tokens``: the Responses API's count;
- ``GET /`` and ``/ui/...``: the chat page (:mod:`.webui`), no key needed;
- ``GET /metrics``, ``/healthz``, ``/readyz``: the operator endpoints
  (:class:`~.operator.PlainRoutes`), with their own access rules.

Every other request needs an API key when keys are configured (401 before anything else is
looked at): ``authorization: Bearer <key>``, or Anthropic's ``x-api-key: <key>`` (the same
keys). The 0-RTT policy is one rule here (RFC 8470): a request that arrived in early data may be
a replay, so a route that starts compute (:data:`STARTS_COMPUTE`) answers it
``too_early`` and the client sends it again after the handshake; reading, resuming or stopping
what exists is harmless twice. Shutting down is one rule here too: once the server stops
accepting, every route that starts or resumes a generation is refused ``shutting_down`` (the
client resumes on the next process); reading and stopping what exists still work. Every
refusal goes through the one error table (:func:`.errors.refusal_for`) and is rendered for its
API: an ERROR frame on the native paths (and on unknown paths outside ``/v1/`` over HTTP/3),
Anthropic's shape on its paths (and on ``/v1/streams/`` for a request that says
``anthropic-version``, as Anthropic's clients all do), an OpenAI-style error elsewhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import urllib.parse
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import quicsrv_proto
from quicsrv_proto import ErrorCode, http3
from quicsrv_proto.http3 import PROTOCOL_HEADER

from ..apikeys import ApiKeys, ClientId
from ..metrics import ServerMetrics
from ..sessions.errors import RequestRejected
from ..sessions.manager import SessionManager
from . import anthropic_stream, native, responses_api, responses_endpoints, webui
from .anthropic_endpoints import AnthropicEndpoints
from .completions_endpoints import CompletionsEndpoints
from .cursor import read_cursor
from .errors import ApiError, Refusal, anthropic_payload, anthropic_status, refusal_for
from .faults import StreamFaults
from .messages import FullResponse, HttpRequest, KeepAlive, Response, SessionStream
from .native_endpoints import NativeEndpoints
from .operator import PLAIN_PATHS, PlainRoutes
from .responses_endpoints import ResponsesEndpoints
from .sse import KEEPALIVE_COMMENT
from .token_endpoints import TokenEndpoints

__all__ = ["STARTS_COMPUTE", "Router", "request_too_large", "unknown_endpoint"]

log = logging.getLogger(__name__)

_CHAT_PATH = "/v1/chat/completions"
_TEXT_PATH = "/v1/completions"
_MODELS_PATH = "/v1/models"
_MODELS_PREFIX = "/v1/models/"
_STREAMS_PREFIX = "/v1/streams/"
_RESPONSES_PATH = "/v1/responses"
_RESPONSES_PREFIX = "/v1/responses/"
_MESSAGES_PATH = "/v1/messages"
_COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
_INPUT_TOKENS_PATH = "/v1/responses/input_tokens"
_TOKENIZE_PATH = "/tokenize"
_DETOKENIZE_PATH = "/detokenize"
_PROPS_PATH = "/props"
#: JSON endpoints outside ``/v1/`` (llama-server's names): not the native API's over HTTP/3.
_JSON_PATHS_OUTSIDE_V1 = frozenset({_TOKENIZE_PATH, _DETOKENIZE_PATH, _PROPS_PATH})
_MESSAGES_PREFIX = "/v1/messages/"
_GENERATE_PATH = http3.GENERATE_PATH.decode()
_RESUME_PATH = http3.RESUME_PATH.decode()

#: The endpoints whose request starts compute: a replay of its 0-RTT data would start it twice.
STARTS_COMPUTE = frozenset({"generate", "chat_completions", "completions", "responses", "messages"})


@dataclass(frozen=True, slots=True)
class _Route:
    """What a request was dispatched to."""

    answer: Callable[[], Awaitable[Response]]
    """The endpoint, its arguments bound."""
    generates: bool = False
    """Whether it starts or resumes a generation (refused while the server is not accepting)."""


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
        max_body_bytes: int,
        sse_keepalive_s: float = 0.0,
    ) -> None:
        self._sessions = sessions
        self._api_keys = api_keys
        self._plain = plain
        self._metrics = metrics
        self.model_id = model_id
        self.max_body_bytes = max_body_bytes
        keepalive = KeepAlive(KEEPALIVE_COMMENT, sse_keepalive_s) if sse_keepalive_s > 0 else None
        self._native = NativeEndpoints(sessions=sessions, max_body_bytes=max_body_bytes)
        self._completions = CompletionsEndpoints(
            sessions=sessions, model_id=model_id, keepalive=keepalive
        )
        self._responses = ResponsesEndpoints(
            sessions=sessions, model_id=model_id, keepalive=keepalive
        )
        # Anthropic's streams keep alive with its own event, which its SDKs skip.
        ping = KeepAlive(anthropic_stream.PING, sse_keepalive_s) if sse_keepalive_s > 0 else None
        self._anthropic = AnthropicEndpoints(sessions=sessions, model_id=model_id, keepalive=ping)
        self._tokens = TokenEndpoints(engine=sessions.engine, model_id=model_id)
        self.refusals: Counter[ErrorCode] = Counter()
        """Requests refused with a wire code, per code (401, 429, 503, 504, ...)."""
        self.early_starts_refused = 0
        """Requests that would start compute, refused ``too_early`` in 0-RTT data."""
        self.faults = StreamFaults()
        """Test faults: streams whose connection drops on demand."""

    @property
    def early_resumes(self) -> int:
        """Native resumes answered from 0-RTT data."""
        return self._native.early_resumes

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
        return _error_response(request, request_too_large(self.max_body_bytes))

    def refuse_websocket(self, path: str) -> FullResponse:
        """The answer to a WebSocket upgrade (OpenAI's WebSocket mode of ``/v1/responses``):
        no endpoint speaks WebSocket, so every upgrade is refused, 400 with a JSON error."""
        error = ApiError(
            400,
            f"{path[:200]} does not take a WebSocket upgrade: this server has no WebSocket mode; "
            "send POST /v1/responses with stream: true for a stream of events",
            code="websocket_not_supported",
        )
        self._metrics.request_finished(_endpoint(path), error.code)
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
        who: ClientId | None = None
        response: Response
        try:
            who = self._api_keys.authorize(
                _credential(request), connection=request.connection, address=request.address
            )
            if request.early_data and endpoint in STARTS_COMPUTE:
                # A replayed 0-RTT flight would start the compute twice (RFC 8470 §5.2).
                raise RequestRejected(
                    ErrorCode.TOO_EARLY,
                    f"{request.method} {bare} is not accepted in 0-RTT data: "
                    "send it again after the handshake",
                    0.0,
                )
            if is_native:
                route = self._native_route(request, who, bare)
            else:
                route = self._json_route(request, who, bare, query)
            if route.generates:
                # The one "not accepting" guard: the hand-over to the next process has begun.
                self._sessions.check_accepting()
            response = await route.answer()
        except asyncio.CancelledError:
            raise
        except ApiError as exc:
            self._refused(request, endpoint, exc.status, exc.code, exc.message)
            response = _error_response(request, exc)
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
                response = native.error_response(refusal)
            else:
                response = _error_response(request, refusal.api_error())
        else:
            self._metrics.request_finished(endpoint, "ok")
        if who is not None and endpoint in STARTS_COMPUTE:
            response = self._with_rate_headers(response, who)
        return response

    def _with_rate_headers(self, response: Response, who: ClientId) -> Response:
        """``response`` with OpenAI's ``x-ratelimit-*`` headers when ``who`` is rate limited
        (an answer of an endpoint that starts compute, a refusal too)."""
        state = self._sessions.rates.state(who.quota)
        if state is None:
            return response
        if isinstance(response, SessionStream):
            response.headers += state.headers()
            return response
        return dataclasses.replace(response, headers=(*response.headers, *state.headers()))

    # --- routing ------------------------------------------------------------------------

    def _is_native(self, request: HttpRequest) -> bool:
        """Whether the native frame API answers ``request``: its paths, and over HTTP/3 every
        path outside the JSON API's ``/v1/`` (so that a wrong path gets an ERROR frame)."""
        bare = request.path.partition("?")[0]
        return request.http3 and (
            bare in (_GENERATE_PATH, _RESUME_PATH)
            or not (bare.startswith("/v1/") or bare in _JSON_PATHS_OUTSIDE_V1)
        )

    def _native_route(self, request: HttpRequest, who: ClientId, path: str) -> _Route:
        if path not in (_GENERATE_PATH, _RESUME_PATH):
            raise RequestRejected(ErrorCode.NOT_FOUND, f"no such path: {path!r}")
        if request.method != "POST":
            raise RequestRejected(ErrorCode.METHOD_NOT_ALLOWED, f"{path!r} takes POST")
        if path == _GENERATE_PATH:
            return _Route(functools.partial(self._native.generate, request, who), generates=True)
        return _Route(functools.partial(self._native.resume, request, who), generates=True)

    def _json_route(self, request: HttpRequest, who: ClientId, path: str, query: str) -> _Route:
        if len(request.body) > self.max_body_bytes:
            raise request_too_large(self.max_body_bytes)
        if path == _MODELS_PATH:
            _allow(request, "GET")
            return _Route(self._completions.models)
        if path.startswith(_MODELS_PREFIX):
            _allow(request, "GET")
            model = urllib.parse.unquote(path[len(_MODELS_PREFIX) :])
            return _Route(functools.partial(self._completions.model, model))
        if path in (_CHAT_PATH, _TEXT_PATH):
            _allow(request, "POST")
            chat = path == _CHAT_PATH
            create = functools.partial(self._completions.create, request, who, chat=chat)
            return _Route(create, generates=True)
        if path == _RESPONSES_PATH:
            _allow(request, "POST")
            return _Route(functools.partial(self._responses.create, request, who), generates=True)
        if path == _INPUT_TOKENS_PATH:
            _allow(request, "POST")
            return _Route(functools.partial(self._responses.input_tokens, request, who))
        if path.startswith(_RESPONSES_PREFIX):
            name, _, action = path[len(_RESPONSES_PREFIX) :].partition("/")
            if not name.startswith(responses_api.RESPONSE_PREFIX):
                # Another endpoint's name (OpenAI's /v1/responses/compact...),
                # not a response id this server could have issued.
                raise unknown_endpoint(request.method, path)
            session_id = responses_api.from_response_id(name)
            if action == "cancel":
                _allow(request, "POST")
                return _Route(functools.partial(self._responses.cancel, who, session_id))
            if action:
                raise unknown_endpoint(request.method, path)
            if request.method == "DELETE":
                return _Route(functools.partial(self._responses.delete, who, session_id))
            _allow(request, "GET", "DELETE")
            if responses_endpoints.streamed(query):
                events = functools.partial(self._responses.resume, request, who, session_id, query)
                return _Route(events, generates=True)
            return _Route(functools.partial(self._responses.retrieve, who, session_id))
        if path == _MESSAGES_PATH:
            _allow(request, "POST")
            return _Route(functools.partial(self._anthropic.create, request, who), generates=True)
        if path == _COUNT_TOKENS_PATH:
            _allow(request, "POST")
            return _Route(functools.partial(self._anthropic.count_tokens, request))
        if path == _TOKENIZE_PATH:
            _allow(request, "POST")
            return _Route(functools.partial(self._tokens.tokenize, request))
        if path == _DETOKENIZE_PATH:
            _allow(request, "POST")
            return _Route(functools.partial(self._tokens.detokenize, request))
        if path == _PROPS_PATH:
            _allow(request, "GET")
            return _Route(self._tokens.props)
        if path.startswith(_STREAMS_PREFIX):
            session_id = _session_id(path[len(_STREAMS_PREFIX) :])
            if request.method == "DELETE":
                return _Route(functools.partial(self._completions.stop, who, session_id))
            _allow(request, "GET", "DELETE")
            resume = functools.partial(self._resume_stream, request, who, session_id, query)
            return _Route(resume, generates=True)
        raise unknown_endpoint(request.method, path)

    async def _resume_stream(
        self, request: HttpRequest, who: ClientId, session_id: bytes, query: str
    ) -> SessionStream:
        """``GET /v1/streams/{session}``: the API whose stream the cursor names answers."""
        keys = self._sessions.keys.verifying_keys(time.time())
        cursor = read_cursor(request.headers.get(b"last-event-id"), query, session_id, keys)
        if cursor.messages:
            return await self._anthropic.resume(who, cursor)
        return await self._completions.resume(who, cursor)

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


def unknown_endpoint(method: str, path: str) -> ApiError:
    """The error of a path no endpoint answers (one stable code, whatever the path)."""
    return ApiError(
        404, f"Invalid URL ({method} {path}): no such endpoint", code="unknown_endpoint"
    )


def _credential(request: HttpRequest) -> bytes | None:
    """The API key a request presents: ``authorization`` (a Bearer key), else Anthropic's
    ``x-api-key``, read as the same key."""
    authorization = request.headers.get(b"authorization")
    if authorization is None and (key := request.headers.get(b"x-api-key")) is not None:
        return b"Bearer " + key.strip()
    return authorization


def _speaks_anthropic(request: HttpRequest) -> bool:
    """Whether a refusal of ``request`` takes Anthropic's shape: on its paths, and on the
    streams' resume route for a client that says ``anthropic-version``."""
    bare = request.path.partition("?")[0]
    if bare == _MESSAGES_PATH or bare.startswith(_MESSAGES_PREFIX):
        return True
    return bare.startswith(_STREAMS_PREFIX) and b"anthropic-version" in request.headers


def _error_response(request: HttpRequest, error: ApiError) -> FullResponse:
    """``error`` in the shape of the API ``request`` spoke (its headers: the 401 challenge,
    ``retry-after``)."""
    if _speaks_anthropic(request):
        return FullResponse(
            status=anthropic_status(error),
            body=json.dumps(anthropic_payload(error)).encode(),
            headers=error.response_headers(),
        )
    return FullResponse(status=error.status, body=error.body(), headers=error.response_headers())


def _endpoint(path: str) -> str:
    """The ``endpoint`` metrics label (bounded: anything unknown is "other")."""
    if path.startswith(_STREAMS_PREFIX):
        return "streams"
    if path == _INPUT_TOKENS_PATH:
        return "input_tokens"
    if path.startswith(_RESPONSES_PREFIX):
        return "response"
    if path.startswith(_MODELS_PREFIX):
        return "models"
    if path.startswith(_MESSAGES_PREFIX) and path != _COUNT_TOKENS_PATH:
        return "other"
    return {
        _CHAT_PATH: "chat_completions",
        _TEXT_PATH: "completions",
        _MODELS_PATH: "models",
        _RESPONSES_PATH: "responses",
        _MESSAGES_PATH: "messages",
        _COUNT_TOKENS_PATH: "count_tokens",
        _TOKENIZE_PATH: "tokenize",
        _DETOKENIZE_PATH: "detokenize",
        _PROPS_PATH: "props",
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
