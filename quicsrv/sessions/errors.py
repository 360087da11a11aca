"""The sessions' refusals, each with its wire code: :class:`RequestRejected`, and the one table
that gives the engine's refusals theirs (most specific class first).

Every place that tells a peer why the engine would not run something (a refused request, a
resume whose restart was refused) takes the code from :func:`engine_error_code`; the front door
renders both (:mod:`quicsrv.http.errors`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from quicsrv_proto import ErrorCode

from ..engine import CannotReplay, EngineError, EngineUnavailable, Overloaded, PromptTooLong

__all__ = ["ENGINE_CODES", "RequestRejected", "engine_error_code"]


class RequestRejected(Exception):
    """A request the server refuses before any token, with its wire code."""

    def __init__(self, code: ErrorCode, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


ENGINE_CODES: Mapping[type[EngineError], ErrorCode] = MappingProxyType(
    {
        PromptTooLong: ErrorCode.PROMPT_TOO_LONG,
        CannotReplay: ErrorCode.MODEL_CHANGED,
        EngineUnavailable: ErrorCode.ENGINE_UNAVAILABLE,
        Overloaded: ErrorCode.OVERLOADED,
        EngineError: ErrorCode.SHUTTING_DOWN,
    }
)
"""Engine error class -> wire code, most specific first (``EngineError`` itself: the engine is
shutting down, or the request can never run on it)."""


def engine_error_code(exc: EngineError) -> ErrorCode:
    """The wire code of an engine refusal: that of the first class in :data:`ENGINE_CODES`
    that ``exc`` is an instance of."""
    return next(code for kind, code in ENGINE_CODES.items() if isinstance(exc, kind))
