"""The native frame API through the one router, without a socket: what each request becomes
(a session stream of frames, or the status of a wire code and one ERROR frame), the order of
the checks, and the 0-RTT rule. The engine is the fake one; the e2e tests run the real model."""

from __future__ import annotations

import asyncio
import logging

import pytest

import quicsrv_proto
from quicsrv.apikeys import hash_key, key_id
from quicsrv.http.messages import FullResponse, HttpRequest, SessionStream
from quicsrv.http.native import FRAMES
from quicsrv_proto import ErrorCode, http_status_for

from .routers import LIMIT, fake_router

pytestmark = pytest.mark.asyncio

SESSION = bytes(range(quicsrv_proto.SESSION_ID_BYTES))
GENERATE = quicsrv_proto.encode_frame(quicsrv_proto.Generate(prompt="hi", max_tokens=4))
RESUME = quicsrv_proto.encode_frame(
    quicsrv_proto.ResumeStream(
        session_id=SESSION, last_index=3, snapshot_hash=bytes(quicsrv_proto.SNAPSHOT_HASH_BYTES)
    )
)


def _request(
    path: str,
    body: bytes = b"",
    *,
    method: str = "POST",
    headers: dict[bytes, bytes] | None = None,
    early_data: bool = False,
    http3: bool = True,
) -> HttpRequest:
    return HttpRequest(
        method=method,
        path=path,
        headers=headers or {},
        body=body,
        connection="conn:1",
        arrived_at=asyncio.get_running_loop().time(),
        early_data=early_data,
        protocol="h3" if http3 else "http/1.1",
    )


def _refused(response: object) -> quicsrv_proto.Error:
    """The one ERROR frame of a native refusal, its status checked against its code."""
    assert isinstance(response, FullResponse), response
    assert response.content_type == FRAMES
    [frame] = quicsrv_proto.decode_frames(response.body)
    assert isinstance(frame, quicsrv_proto.Error)
    assert response.status == http_status_for(frame.code)
    return frame


@pytest.mark.parametrize(
    ("path", "method", "accepting", "body", "code"),
    [
        ("/nowhere", "POST", True, GENERATE, ErrorCode.NOT_FOUND),
        ("/v1/generate", "GET", True, b"", ErrorCode.METHOD_NOT_ALLOWED),
        ("/v1/generate", "POST", False, GENERATE, ErrorCode.SHUTTING_DOWN),
        ("/v1/resume", "POST", True, b"", ErrorCode.MISSING_FIELD),
    ],
)
async def test_what_is_not_a_request_gets_its_code(tmp_path, path, method, accepting, body, code):
    router = fake_router(tmp_path, accepting=accepting)
    response = await router.handle(_request(path, body, method=method))
    assert _refused(response).code == code
    assert router.refusals == {code: 1}


async def test_a_missing_key_is_refused_before_the_path_is_looked_at(tmp_path):
    response = await fake_router(tmp_path, keys=("secret",)).handle(_request("/nowhere"))
    assert _refused(response).code == ErrorCode.UNAUTHORIZED
    assert isinstance(response, FullResponse)
    assert (b"www-authenticate", b'Bearer realm="quicsrv"') in response.headers


async def test_a_generate_opens_a_frame_stream_for_its_key(tmp_path):
    router = fake_router(tmp_path, keys=("secret",))
    headers = {b"authorization": b"Bearer secret"}
    response = await router.handle(_request("/v1/generate", GENERATE, headers=headers))
    assert isinstance(response, SessionStream)
    assert (response.status, response.content_type) == (200, FRAMES)
    assert (b"quicsrv-session", response.session.session_id.hex().encode()) in response.headers
    assert response.session.record.owner == key_id(hash_key("secret"))


async def test_generate_in_early_data_is_too_early_but_resume_is_not(tmp_path):
    router = fake_router(tmp_path)
    too_early = _refused(await router.handle(_request("/v1/generate", GENERATE, early_data=True)))
    assert (too_early.code, too_early.retry_after_s) == (ErrorCode.TOO_EARLY, 0.0)
    assert router.early_starts_refused == 1
    headers = {b"quicsrv-session": SESSION.hex().encode()}
    resume = await router.handle(_request("/v1/resume", RESUME, headers=headers, early_data=True))
    # Looked up (no such session here), not refused for arriving early.
    assert _refused(resume).code == ErrorCode.UNKNOWN_SESSION


async def test_a_completion_in_early_data_is_too_early_too(tmp_path):
    body = b'{"model": "fake", "prompt": "hi", "max_tokens": 4}'
    response = await fake_router(tmp_path).handle(
        _request("/v1/completions", body, early_data=True)
    )
    assert isinstance(response, FullResponse)
    assert response.status == 425 and b'"too_early"' in response.body


@pytest.mark.parametrize(
    ("path", "body", "code"),
    [
        ("/v1/generate", GENERATE + GENERATE, ErrorCode.UNEXPECTED_FRAME),
        ("/v1/generate", RESUME, ErrorCode.UNEXPECTED_FRAME),
        ("/v1/resume", GENERATE, ErrorCode.UNEXPECTED_FRAME),
        ("/v1/generate", b"garbage!" * 4, ErrorCode.BAD_MAGIC),
        ("/v1/generate", GENERATE[:-1], ErrorCode.TRUNCATED_FRAME),
        ("/v1/generate", GENERATE[:5] + (LIMIT + 1).to_bytes(4, "big"), ErrorCode.FRAME_TOO_LARGE),
    ],
)
async def test_bad_bodies_get_their_codes(tmp_path, path, body, code):
    assert _refused(await fake_router(tmp_path).handle(_request(path, body))).code == code


async def test_a_malformed_session_header_is_an_invalid_field(tmp_path):
    headers = {b"quicsrv-session": b"zz"}
    response = await fake_router(tmp_path).handle(_request("/v1/resume", RESUME, headers=headers))
    assert _refused(response).code == ErrorCode.INVALID_FIELD


async def test_a_body_past_the_limit_is_refused_in_its_api_s_own_shape(tmp_path):
    router = fake_router(tmp_path)
    assert router.body_limit_bytes == LIMIT + quicsrv_proto.HEADER_SIZE
    assert _refused(router.too_large(_request("/v1/generate"))).code == ErrorCode.FRAME_TOO_LARGE
    json_error = router.too_large(_request("/v1/chat/completions"))
    assert json_error.status == 413 and b'"request_too_large"' in json_error.body


async def test_the_json_api_keeps_its_shape_over_http3(tmp_path):
    router = fake_router(tmp_path)
    unknown = await router.handle(_request("/v1/nope", method="GET"))
    assert isinstance(unknown, FullResponse)
    assert (unknown.status, unknown.content_type) == (404, "application/json")
    # The native paths are HTTP/3's: over TCP they are unknown JSON API paths.
    over_tcp = await router.handle(_request("/v1/generate", GENERATE, http3=False))
    assert isinstance(over_tcp, FullResponse)
    assert (over_tcp.status, over_tcp.content_type) == (404, "application/json")


async def test_a_refusal_is_not_logged_as_an_error(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="quicsrv"):
        await fake_router(tmp_path).handle(_request("/v1/generate", b"garbage!"))
    assert not caplog.records  # a peer's mistake is not an error of ours


async def test_an_unexpected_exception_is_an_internal_error_logged_once(
    tmp_path, caplog, monkeypatch
):
    router = fake_router(tmp_path)

    def broken(frame: object) -> object:
        raise KeyError("a bug")

    monkeypatch.setattr(router._sessions, "prepare", broken)
    with caplog.at_level(logging.ERROR, logger="quicsrv"):
        response = await router.handle(_request("/v1/generate", GENERATE))
    error = _refused(response)
    assert error.code == ErrorCode.INTERNAL_ERROR and "bug" not in error.message
    [record] = caplog.records
    assert record.exc_info is not None and isinstance(record.exc_info[1], KeyError)
