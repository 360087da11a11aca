"""Every refusal, whatever raised it, as one wire code: the one table, and its two renderings.

:func:`refusal_for` maps an exception from the engine (``Overloaded``, ``PromptTooLong``...:
the sessions' table, :func:`~quicsrv.sessions.errors.engine_error_code`), the sessions
(:class:`~quicsrv.sessions.errors.RequestRejected`), access control
(:class:`~quicsrv.apikeys.AccessDenied`), rate limits (:class:`~quicsrv.rate_limits.RateLimited`:
OpenAI's ``rate_limit_exceeded``, its ``type`` saying which limit, ``requests`` or ``tokens``)
or the wire format (``quicsrv_proto`` errors) to a :class:`Refusal`: its stable
:class:`~quicsrv_proto.ErrorCode`, which fixes the HTTP status and OpenAI's error ``type``, its
message, and its retry hint (a typed field on each of those errors,
never guessed). Anything else is a bug: ``refusal_for`` returns None and the caller answers
``internal_error``. A native request is answered with the status and one ERROR frame; the JSON
API with an OpenAI-style :class:`ApiError` (``{"error": {"message", "type", "param", "code"}}``),
which request validation also raises directly with OpenAI's own codes (``unknown_parameter``);
Anthropic's Messages API renders the same :class:`ApiError` in Anthropic's shape
(:func:`anthropic_status`, :func:`anthropic_payload`: ``{"type": "error", "error": {"type",
"message", "details": {"error_code"}}}``), the stable code in ``details.error_code``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import quicsrv_proto
from quicsrv_proto import ErrorCode, http_status_for

from ..apikeys import AccessDenied
from ..engine import EngineError
from ..rate_limits import RateLimited
from ..sessions.errors import RequestRejected, engine_error_code

__all__ = [
    "CHALLENGE",
    "ApiError",
    "Refusal",
    "anthropic_payload",
    "anthropic_status",
    "error_type_for",
    "from_code",
    "refusal_for",
]

# Who gets a Bearer challenge (RFC 6750 §3) with a 401.
CHALLENGE = ((b"www-authenticate", b'Bearer realm="quicsrv"'),)


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """A request refused before it produced anything: what every front end answers with."""

    code: ErrorCode
    """The stable wire code: the HTTP status and OpenAI's error type follow from it."""
    message: str
    """For people; never parsed."""
    retry_after_s: float | None = None
    """When trying again may succeed (None: no hint)."""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    """Extra response headers (a 401's challenge)."""
    error_type: str | None = None
    """OpenAI's error ``type`` where it is not the status's (a rate limit: which one)."""

    @property
    def status(self) -> int:
        return http_status_for(self.code)

    @property
    def openai_type(self) -> str:
        return self.error_type or error_type_for(self.status)

    def frame(self) -> quicsrv_proto.Error:
        """The native answer's body: one ERROR frame."""
        return quicsrv_proto.Error(
            code=self.code, message=self.message, retry_after_s=self.retry_after_s
        )

    def api_error(self) -> ApiError:
        """The JSON API's answer."""
        error = from_code(self.code, self.message, self.retry_after_s)
        error.headers = self.headers
        error.error_type = self.error_type
        return error


def refusal_for(exc: BaseException) -> Refusal | None:
    """The refusal ``exc`` stands for; None when it is none (a bug, to be logged)."""
    if isinstance(exc, RequestRejected):
        return Refusal(code=exc.code, message=exc.message, retry_after_s=exc.retry_after_s)
    if isinstance(exc, quicsrv_proto.ProtocolError):
        return Refusal(code=exc.error_code, message=exc.message)
    if isinstance(exc, RateLimited):
        return Refusal(
            code=ErrorCode.RATE_LIMIT_EXCEEDED,
            message=exc.message,
            retry_after_s=exc.retry_after_s,
            error_type=exc.limit,
        )
    if isinstance(exc, AccessDenied):
        return Refusal(code=ErrorCode.UNAUTHORIZED, message=exc.message, headers=CHALLENGE)
    if isinstance(exc, EngineError):
        code = engine_error_code(exc)
        return Refusal(code=code, message=str(exc), retry_after_s=exc.retry_after_s)
    return None


# OpenAI's error types, by HTTP status (what its SDKs map onto exception classes).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    410: "not_found_error",
    413: "invalid_request_error",
    416: "invalid_request_error",
    425: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type_for(status: int) -> str:
    """OpenAI's ``type`` for an HTTP status (5xx: ``server_error``)."""
    return _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


class ApiError(Exception):
    """A request refused with an HTTP status and an OpenAI-style error body."""

    headers: tuple[tuple[bytes, bytes], ...]

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after_s: float | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = headers
        self.error_type = error_type
        """OpenAI's ``type`` when not the status's (None: :func:`error_type_for`)."""

    def payload(self) -> dict[str, Any]:
        """The error object, as the body's ``error`` (and an SSE error event's data) holds it."""
        error: dict[str, Any] = {
            "message": self.message,
            "type": self.error_type or error_type_for(self.status),
            "param": self.param,
            "code": self.code,
        }
        if self.retry_after_s is not None:
            error["retry_after_s"] = round(self.retry_after_s, 3)
        return {"error": error}

    def body(self) -> bytes:
        return json.dumps(self.payload()).encode()

    def response_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """Extra headers: ``retry-after`` (whole seconds, RFC 9110 §10.2.3) when known."""
        if self.retry_after_s is None:
            return self.headers
        seconds = max(1, int(self.retry_after_s + 0.999))
        return (*self.headers, (b"retry-after", str(seconds).encode()))


def from_code(
    code: ErrorCode | int,
    message: str,
    retry_after_s: float | None = None,
    *,
    param: str | None = None,
) -> ApiError:
    """The server's wire error ``code`` as an OpenAI-style error (same status, slug as code)."""
    try:
        slug = ErrorCode(code).slug
    except ValueError:  # a code this build does not know: still stable, by number
        slug = f"error_{int(code)}"
    return ApiError(
        http_status_for(code), message, code=slug, param=param, retry_after_s=retry_after_s
    )


# --- Anthropic's rendering ------------------------------------------------------------------

# Anthropic's error types, by the status Anthropic answers with (its "Errors" page); another
# 4xx is an invalid_request_error there too, another 5xx an api_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Where Anthropic's status differs from quicsrv's for the same refusal: a prompt over the
# context is a 400 there (413 is for bytes, before the request is read), and a server that is
# out of capacity answers 529 (its SDK retries it like any 5xx).
_ANTHROPIC_STATUS = {
    ErrorCode.PROMPT_TOO_LONG.slug: 400,
    ErrorCode.OVERLOADED.slug: 529,
}


def anthropic_status(error: ApiError) -> int:
    """The HTTP status Anthropic's API gives the refusal ``error`` stands for."""
    return _ANTHROPIC_STATUS.get(error.code, error.status)


def anthropic_payload(error: ApiError) -> dict[str, Any]:
    """``error`` as Anthropic's error body (and its SSE ``error`` event's data): its type by
    status, the message, and in ``details`` the stable code (its SDKs expose it as
    ``error_code``) and the field at fault when one is."""
    status = anthropic_status(error)
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    details: dict[str, Any] = {"error_code": error.code}
    if error.param is not None:
        details["param"] = error.param
    if error.retry_after_s is not None:
        details["retry_after_s"] = round(error.retry_after_s, 3)
    return {
        "type": "error",
        "error": {"type": kind, "message": error.message, "details": details},
    }
