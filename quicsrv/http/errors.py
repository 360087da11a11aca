"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every refusal on the JSON API becomes one :class:`ApiError`, in one place per cause: request
validation raises it directly (OpenAI's own codes such as ``unknown_parameter``), and the
server's wire errors (:class:`~quicsrv.sessions.RequestRejected`, ``proto`` errors) are turned
into one by :func:`from_code`, keeping the native protocol's stable slugs (``client_limit``,
``hash_mismatch``...) as ``code`` and its HTTP status.
"""

from __future__ import annotations

import json
from typing import Any

from quicsrv_proto import ErrorCode, http_status_for

__all__ = ["ApiError", "error_type_for", "from_code"]

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

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        retry_after_s: float | None = None,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = headers

    def payload(self) -> dict[str, Any]:
        """The error object, as the body's ``error`` (and an SSE error event's data) holds it."""
        error: dict[str, Any] = {
            "message": self.message,
            "type": error_type_for(self.status),
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
