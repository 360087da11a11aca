"""The one error table: every refusal, whoever raised it, as one wire code and its renderings."""

from __future__ import annotations

import pytest

import quicsrv_proto
from quicsrv.apikeys import AccessDenied
from quicsrv.engine import EngineError, EngineUnavailable, Overloaded, PromptTooLong
from quicsrv.http.errors import CHALLENGE, refusal_for
from quicsrv.rate_limits import RateLimited
from quicsrv.sessions.errors import RequestRejected
from quicsrv_proto import ErrorCode


@pytest.mark.parametrize(
    ("exc", "code", "status", "openai_type", "retry_after_s"),
    [
        (Overloaded("full", retry_after_s=2.5), ErrorCode.OVERLOADED, 503, "server_error", 2.5),
        (PromptTooLong("long"), ErrorCode.PROMPT_TOO_LONG, 413, "invalid_request_error", None),
        (EngineUnavailable("gone"), ErrorCode.ENGINE_UNAVAILABLE, 503, "server_error", None),
        (EngineError("closing"), ErrorCode.SHUTTING_DOWN, 503, "server_error", None),
        (
            RequestRejected(ErrorCode.CLIENT_LIMIT, "yours", 4.0),
            ErrorCode.CLIENT_LIMIT,
            429,
            "rate_limit_error",
            4.0,
        ),
        (
            RateLimited("spent", limit="tokens", retry_after_s=7.5),
            ErrorCode.RATE_LIMIT_EXCEEDED,
            429,
            "tokens",  # OpenAI's type says which limit: "requests" or "tokens"
            7.5,
        ),
        (
            quicsrv_proto.FrameTooLarge("big"),
            ErrorCode.FRAME_TOO_LARGE,
            413,
            "invalid_request_error",
            None,
        ),
        (
            AccessDenied("who", presented=False),
            ErrorCode.UNAUTHORIZED,
            401,
            "authentication_error",
            None,
        ),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else None,
)
def test_each_error_maps_to_its_code_status_type_and_hint(
    exc, code, status, openai_type, retry_after_s
):
    refusal = refusal_for(exc)
    assert refusal is not None
    assert (refusal.code, refusal.status, refusal.openai_type) == (code, status, openai_type)
    assert refusal.retry_after_s == retry_after_s
    assert refusal.message == str(exc)
    frame = refusal.frame()
    assert (frame.code, frame.retry_after_s) == (code, retry_after_s)
    error = refusal.api_error()
    assert (error.status, error.code) == (status, code.slug)
    assert error.payload()["error"]["type"] == openai_type


def test_a_401_carries_its_challenge_in_both_renderings():
    refusal = refusal_for(AccessDenied("no key", presented=False))
    assert refusal is not None
    assert refusal.headers == CHALLENGE
    assert set(CHALLENGE) <= set(refusal.api_error().response_headers())


def test_anything_else_is_no_refusal():
    assert refusal_for(KeyError("a bug")) is None
    assert refusal_for(RuntimeError("another")) is None
