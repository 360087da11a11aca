"""Wire error codes and the protocol error hierarchy.

Every error a peer can see has a stable numeric code (:class:`ErrorCode`). Codes never change
meaning once released; new ones are only ever added.

    ProtocolError              a frame or field violates the wire format (carries error_code)
    ├── BadMagic
    ├── UnsupportedVersion
    ├── UnknownFrameType
    ├── FrameTooLarge
    ├── MalformedPayload
    ├── TruncatedFrame
    ├── MissingField
    ├── InvalidField
    ├── UnknownField
    └── UnexpectedFrame
"""

from __future__ import annotations

from enum import IntEnum
from typing import ClassVar

__all__ = [
    "BadMagic",
    "ErrorCode",
    "FrameTooLarge",
    "InvalidField",
    "MalformedPayload",
    "MissingField",
    "ProtocolError",
    "TruncatedFrame",
    "UnexpectedFrame",
    "UnknownField",
    "UnknownFrameType",
    "UnsupportedVersion",
    "http_status_for",
]


class ErrorCode(IntEnum):
    """Stable wire codes carried by ERROR frames (and mapped onto HTTP statuses)."""

    # Framing and field validation: the request itself is wrong.
    BAD_MAGIC = 1
    UNSUPPORTED_VERSION = 2
    UNKNOWN_FRAME_TYPE = 3
    FRAME_TOO_LARGE = 4
    MALFORMED_PAYLOAD = 5
    TRUNCATED_FRAME = 6
    MISSING_FIELD = 7
    INVALID_FIELD = 8
    UNKNOWN_FIELD = 9
    UNEXPECTED_FRAME = 10
    # Request semantics.
    PROMPT_TOO_LONG = 20
    NOT_FOUND = 21
    METHOD_NOT_ALLOWED = 22
    # Capacity and lifecycle.
    OVERLOADED = 30
    SHUTTING_DOWN = 31
    TOO_EARLY = 32
    CLIENT_LIMIT = 33  # this client's own cap on active or queued generations, not the server's
    DEADLINE_EXCEEDED = 34  # the request could not start before its deadline
    RATE_LIMIT_EXCEEDED = 35  # the client's requests or generated tokens per minute are spent
    # Resumable sessions.
    UNKNOWN_SESSION = 40
    SESSION_EXPIRED = 41
    HASH_MISMATCH = 42
    INDEX_BEYOND_SNAPSHOT = 43
    MODEL_CHANGED = 44
    SESSION_BUSY = 45
    SESSION_KEY_MISMATCH = 46  # the session was started with another API key
    # Our fault, not the peer's.
    INTERNAL_ERROR = 50
    ENGINE_UNAVAILABLE = 51  # the engine worker crashes in a loop; sessions stay resumable
    STORE_UNAVAILABLE = 52  # the shared session store (Redis) cannot be reached; resume later
    # Access.
    UNAUTHORIZED = 60  # no API key, or one the server does not know

    @property
    def slug(self) -> str:
        """The lower-case name used in JSON output and logs, e.g. ``frame_too_large``."""
        return self.name.lower()


class ProtocolError(Exception):
    """A frame or one of its fields violates the wire format."""

    error_code: ClassVar[ErrorCode] = ErrorCode.MALFORMED_PAYLOAD

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.error_code.slug}: {self.message!r})"


class BadMagic(ProtocolError):
    error_code = ErrorCode.BAD_MAGIC


class UnsupportedVersion(ProtocolError):
    error_code = ErrorCode.UNSUPPORTED_VERSION


class UnknownFrameType(ProtocolError):
    error_code = ErrorCode.UNKNOWN_FRAME_TYPE


class FrameTooLarge(ProtocolError):
    error_code = ErrorCode.FRAME_TOO_LARGE


class MalformedPayload(ProtocolError):
    error_code = ErrorCode.MALFORMED_PAYLOAD


class TruncatedFrame(ProtocolError):
    error_code = ErrorCode.TRUNCATED_FRAME


class MissingField(ProtocolError):
    error_code = ErrorCode.MISSING_FIELD


class InvalidField(ProtocolError):
    error_code = ErrorCode.INVALID_FIELD


class UnknownField(ProtocolError):
    error_code = ErrorCode.UNKNOWN_FIELD


class UnexpectedFrame(ProtocolError):
    error_code = ErrorCode.UNEXPECTED_FRAME


_HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.FRAME_TOO_LARGE: 413,
    ErrorCode.PROMPT_TOO_LONG: 413,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.TOO_EARLY: 425,  # RFC 8470 §5.2
    ErrorCode.CLIENT_LIMIT: 429,
    ErrorCode.RATE_LIMIT_EXCEEDED: 429,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.UNKNOWN_SESSION: 404,
    ErrorCode.SESSION_EXPIRED: 410,
    ErrorCode.HASH_MISMATCH: 403,
    ErrorCode.INDEX_BEYOND_SNAPSHOT: 416,
    ErrorCode.MODEL_CHANGED: 409,
    ErrorCode.SESSION_BUSY: 409,
    ErrorCode.SESSION_KEY_MISMATCH: 403,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.ENGINE_UNAVAILABLE: 503,
    ErrorCode.STORE_UNAVAILABLE: 503,
    ErrorCode.UNAUTHORIZED: 401,
}


def http_status_for(code: int) -> int:
    """The HTTP status of a response whose body is an ERROR frame with ``code``.

    Codes without their own status are request errors: 400.
    """
    try:
        return _HTTP_STATUS.get(ErrorCode(code), 400)
    except ValueError:
        return 400
