"""Plain HTTP endpoints for operators: ``GET /metrics``, ``GET /healthz``, ``GET /readyz``.

Transport-independent: the router (:mod:`.router`) hands these paths to
:meth:`PlainRoutes.handle`, which takes a method, a path and the request headers and returns a
:class:`~.messages.FullResponse` (plain text), so every listener serves the very same answers.

- ``/healthz``: 200 while the process runs (liveness).
- ``/readyz``: 200 when the model is loaded, the engine worker is up and healthy, a shared
  session store (Redis) answers and the server is not shutting down; else 503 with the reason
  (readiness, for a load balancer). While the
  worker restart breaker is open (a crash loop) the reason says when a worker is tried again;
  half-open, the server takes work and is ready.
- ``/metrics``: the Prometheus text exposition. When API keys are configured it needs one
  (``authorization: Bearer``) unless ``metrics_public = true``; without one it answers 401.

Health and readiness never need a key: a load balancer probing them holds none, and they tell
nothing but up or not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ..apikeys import ApiKeys
from ..engine import Engine
from ..metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from ..metrics import ServerMetrics
from .errors import CHALLENGE
from .messages import FullResponse

__all__ = [
    "PLAIN_PATHS",
    "PlainRoutes",
    "authorize_metrics",
    "plain_endpoint",
    "readiness",
]

METRICS_PATH = b"/metrics"
HEALTHZ_PATH = b"/healthz"
READYZ_PATH = b"/readyz"
PLAIN_PATHS = frozenset({METRICS_PATH, HEALTHZ_PATH, READYZ_PATH})
TEXT = "text/plain; charset=utf-8"


def plain_endpoint(path: bytes | None) -> str | None:
    """The endpoint name ("metrics", "healthz", "readyz") of a request path, query ignored;
    None for every other path."""
    if path is None:
        return None
    bare = path.partition(b"?")[0]
    return bare[1:].decode() if bare in PLAIN_PATHS else None


def authorize_metrics(
    headers: Mapping[bytes, bytes], *, api_keys: ApiKeys, metrics_public: bool
) -> bool:
    """Whether a ``/metrics`` request may read: public metrics, an open server (no keys
    configured), or a valid API key in ``authorization``."""
    if metrics_public or not api_keys.enabled:
        return True
    return api_keys.identify(headers.get(b"authorization")) is not None


def readiness(engine: Engine, *, accepting: bool, store_outage: str | None = None) -> str | None:
    """Why the server cannot take generations now, or None when it can (``store_outage``:
    why the shared session store cannot be reached, as its last call or probe found)."""
    if not accepting:
        return "shutting down"
    if store_outage is not None:
        return f"the session store cannot be reached: {store_outage}"
    health = engine.health()
    if health.failure is not None:
        return f"the engine failed: {health.failure}"
    # A worker engine between a worker's death and its replacement has no worker process.
    if health.restarting:
        return "the engine worker is restarting"
    return None


class PlainRoutes:
    """The operator endpoints of one server; see the module docstring."""

    def __init__(
        self,
        *,
        metrics: ServerMetrics,
        readiness: Callable[[], str | None],
        authorize_metrics: Callable[[Mapping[bytes, bytes]], bool],
    ) -> None:
        self._metrics = metrics
        self._readiness = readiness
        self._authorize_metrics = authorize_metrics

    def handle(
        self, method: bytes | None, path: bytes | None, headers: Mapping[bytes, bytes]
    ) -> FullResponse:
        """Answer a request for one of :data:`PLAIN_PATHS` (anything else: 404)."""
        endpoint = plain_endpoint(path)
        response = self._answer(endpoint, method, headers)
        self._metrics.request_finished(endpoint or "other", _outcome(response.status))
        return response

    def _answer(
        self, endpoint: str | None, method: bytes | None, headers: Mapping[bytes, bytes]
    ) -> FullResponse:
        if endpoint is None:
            return _text(status=404, body=b"not found\n")
        if method != b"GET":
            return _text(status=405, body=b"use GET\n", headers=((b"allow", b"GET"),))
        if endpoint == "healthz":
            return _text(status=200, body=b"ok\n")
        if endpoint == "readyz":
            reason = self._readiness()
            if reason is not None:
                return _text(status=503, body=f"not ready: {reason}\n".encode())
            return _text(status=200, body=b"ready\n")
        if not self._authorize_metrics(headers):
            return _text(
                status=401,
                body=b"an API key is required (authorization: Bearer <key>)\n",
                headers=CHALLENGE,
            )
        return _text(status=200, body=self._metrics.render(), content_type=METRICS_CONTENT_TYPE)


def _outcome(status: int) -> str:
    """The ``code`` label of a plain answer, in the error codes' words where one fits."""
    return {
        200: "ok",
        401: "unauthorized",
        404: "not_found",
        405: "method_not_allowed",
        503: "not_ready",
    }.get(status, str(status))


def _text(
    *,
    status: int,
    body: bytes,
    content_type: str = TEXT,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> FullResponse:
    return FullResponse(status=status, body=body, content_type=content_type, headers=headers)
