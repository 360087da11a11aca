"""The native request intake, sans-I/O: H3 events in, actions out (no socket, no clock)."""

from __future__ import annotations

import logging

import pytest
from aioquic.h3.events import DataReceived, HeadersReceived

import quicsrv_proto
from quicsrv.apikeys import ApiKeys
from quicsrv.sessions.generation import RequestRejected
from quicsrv.transport.requests import (
    IncomingRequest,
    Reject,
    RequestIntake,
    StartGeneration,
    StartResume,
    error_response,
    rejection_for,
)
from quicsrv_proto import ErrorCode

SESSION = bytes(range(quicsrv_proto.SESSION_ID_BYTES))
GENERATE = quicsrv_proto.encode_frame(quicsrv_proto.Generate(prompt="hi", max_tokens=4))
RESUME = quicsrv_proto.encode_frame(
    quicsrv_proto.ResumeStream(
        session_id=SESSION, last_index=3, snapshot_hash=bytes(quicsrv_proto.SNAPSHOT_HASH_BYTES)
    )
)


def _intake(keys: tuple[str, ...] = ()) -> RequestIntake:
    return RequestIntake(api_keys=ApiKeys(keys), connection="conn:1", max_request_bytes=4096)


def _headers(
    path: bytes,
    *,
    stream_id: int = 0,
    method: bytes = b"POST",
    extra: tuple[tuple[bytes, bytes], ...] = (),
    ended: bool = False,
) -> HeadersReceived:
    headers = [(b":method", method), (b":path", path), *extra]
    return HeadersReceived(headers=headers, stream_id=stream_id, stream_ended=ended)


def _send(
    intake: RequestIntake,
    path: bytes,
    body: bytes,
    *,
    early: bool = False,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> object:
    assert intake.headers_received(_headers(path, extra=extra), now=1.0, accepting=True) is None
    return intake.data_received(
        DataReceived(data=body, stream_id=0, stream_ended=True), early=early
    )


def _code(action: object) -> ErrorCode:
    assert isinstance(action, Reject), action
    return action.code


@pytest.mark.parametrize(
    ("path", "method", "accepting", "ended", "code"),
    [
        (b"/nowhere", b"POST", True, False, ErrorCode.NOT_FOUND),
        (b"/v1/generate", b"GET", True, False, ErrorCode.METHOD_NOT_ALLOWED),
        (b"/v1/generate", b"POST", False, False, ErrorCode.SHUTTING_DOWN),
        (b"/v1/resume", b"POST", True, True, ErrorCode.MISSING_FIELD),
    ],
)
def test_headers_alone_can_decide_a_rejection(
    path: bytes, method: bytes, accepting: bool, ended: bool, code: ErrorCode
) -> None:
    action = _intake().headers_received(
        _headers(path, method=method, ended=ended), now=1.0, accepting=accepting
    )
    assert _code(action) == code


def test_a_missing_key_is_refused_before_the_path_is_looked_at() -> None:
    action = _intake(("secret",)).headers_received(_headers(b"/nowhere"), now=1.0, accepting=True)
    assert _code(action) == ErrorCode.UNAUTHORIZED
    assert isinstance(action, Reject)
    assert (b"www-authenticate", b'Bearer realm="quicsrv"') in action.extra_headers


def test_a_known_key_names_the_client() -> None:
    intake = _intake(("secret",))
    action = _send(intake, b"/v1/generate", GENERATE, extra=((b"authorization", b"Bearer secret"),))
    assert isinstance(action, StartGeneration)
    assert action.request.key_id is not None
    assert action.request.client.startswith("key:")


def test_a_whole_generate_starts_a_generation() -> None:
    intake = _intake()
    assert intake.headers_received(_headers(b"/v1/generate"), now=7.5, accepting=True) is None
    # Frames arrive in pieces of any size.
    assert intake.data_received(DataReceived(GENERATE[:3], 0, False), early=False) is None
    action = intake.data_received(DataReceived(GENERATE[3:], 0, True), early=False)
    assert isinstance(action, StartGeneration)
    assert action.frame == quicsrv_proto.Generate(prompt="hi", max_tokens=4)
    assert action.request.arrived_at == 7.5
    assert action.request.client == "conn:1"
    assert action.request.endpoint == "generate"


def test_generate_in_early_data_is_too_early_but_resume_is_not() -> None:
    too_early = _send(_intake(), b"/v1/generate", GENERATE, early=True)
    assert _code(too_early) == ErrorCode.TOO_EARLY
    assert isinstance(too_early, Reject) and too_early.retry_after_s == 0.0
    resume = _send(
        _intake(),
        b"/v1/resume",
        RESUME,
        early=True,
        extra=((b"quicsrv-session", SESSION.hex().encode()),),
    )
    assert isinstance(resume, StartResume)
    assert resume.early and resume.header_session == SESSION
    assert resume.frame.last_index == 3


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        (b"/v1/generate", b"", ErrorCode.MISSING_FIELD),
        (b"/v1/generate", GENERATE + GENERATE, ErrorCode.UNEXPECTED_FRAME),
        (b"/v1/generate", RESUME, ErrorCode.UNEXPECTED_FRAME),
        (b"/v1/resume", GENERATE, ErrorCode.UNEXPECTED_FRAME),
        (b"/v1/generate", b"garbage!" * 4, ErrorCode.BAD_MAGIC),
        (b"/v1/generate", GENERATE[:-1], ErrorCode.TRUNCATED_FRAME),
    ],
)
def test_bad_bodies_get_their_codes(path: bytes, body: bytes, code: ErrorCode) -> None:
    assert _code(_send(_intake(), path, body)) == code


def test_a_malformed_session_header_is_an_invalid_field() -> None:
    action = _send(_intake(), b"/v1/resume", RESUME, extra=((b"quicsrv-session", b"zz"),))
    assert _code(action) == ErrorCode.INVALID_FIELD


def test_after_a_rejection_the_rest_of_the_body_is_ignored() -> None:
    intake = _intake()
    assert intake.headers_received(_headers(b"/v1/generate"), now=1.0, accepting=True) is None
    first = intake.data_received(DataReceived(b"garbage!", 0, False), early=False)
    assert _code(first) == ErrorCode.BAD_MAGIC
    assert intake.data_received(DataReceived(GENERATE, 0, True), early=False) is None


def test_a_forgotten_stream_yields_nothing() -> None:
    intake = _intake()
    assert intake.headers_received(_headers(b"/v1/generate"), now=1.0, accepting=True) is None
    intake.forget(0)
    assert intake.data_received(DataReceived(GENERATE, 0, True), early=False) is None


def _pending_request() -> IncomingRequest:
    intake = _intake()
    intake.headers_received(_headers(b"/v1/resume"), now=1.0, accepting=True)
    action = intake.data_received(DataReceived(RESUME, 0, True), early=False)
    assert isinstance(action, StartResume)
    return action.request


def test_refusals_keep_their_code_and_retry_hint(caplog: pytest.LogCaptureFixture) -> None:
    request = _pending_request()
    with caplog.at_level(logging.ERROR, logger="quicsrv"):
        reject = rejection_for(RequestRejected(ErrorCode.OVERLOADED, "full", 2.5), request)
        protocol = rejection_for(quicsrv_proto.InvalidField("bad"), request)
    assert (reject.code, reject.message, reject.retry_after_s) == (
        ErrorCode.OVERLOADED,
        "full",
        2.5,
    )
    assert protocol.code == ErrorCode.INVALID_FIELD
    assert not caplog.records  # a peer's mistake is not an error of ours


def test_an_unexpected_exception_is_an_internal_error_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    request = _pending_request()
    with caplog.at_level(logging.ERROR, logger="quicsrv"):
        reject = rejection_for(KeyError("a bug"), request)
    assert reject.code == ErrorCode.INTERNAL_ERROR
    assert "bug" not in reject.message
    [record] = caplog.records
    assert record.exc_info is not None and isinstance(record.exc_info[1], KeyError)


def test_an_error_response_is_its_status_and_one_error_frame() -> None:
    request = _pending_request()
    reject = Reject(request, ErrorCode.TOO_EARLY, "later", 0.0, ((b"x-extra", b"1"),))
    headers, body = error_response(reject)
    assert headers[0] == (b":status", b"425")
    assert (b"content-type", quicsrv_proto.http3.CONTENT_TYPE) in headers
    assert (b"x-extra", b"1") in headers
    assert quicsrv_proto.decode_frames(body) == [
        quicsrv_proto.Error(code=ErrorCode.TOO_EARLY, message="later", retry_after_s=0.0)
    ]
