"""An unexpected exception while answering a request is a bug: the peer gets
``internal_error`` (500) and an ERROR frame instead of a stream left hanging, the log gets the
traceback once, and the connection and its other streams go on."""

from __future__ import annotations

import logging
import secrets

import pytest

import quicsrv_proto
from quicsrv_proto import ErrorCode
from tests.helpers import raw_connection, running_server

pytestmark = [pytest.mark.model, pytest.mark.asyncio]


def _tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info is not None and "boom" in str(r.exc_info[1])]


def _resume_frame() -> bytes:
    return quicsrv_proto.encode_frame(
        quicsrv_proto.ResumeStream(
            session_id=secrets.token_bytes(quicsrv_proto.SESSION_ID_BYTES),
            last_index=0,
            snapshot_hash=bytes(quicsrv_proto.SNAPSHOT_HASH_BYTES),
        )
    )


async def test_a_bug_in_a_resume_answers_internal_error_and_the_connection_goes_on(
    engine, certs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_server(engine, certs) as server:

        def boom(*args: object, **kwargs: object) -> None:
            raise RuntimeError("boom: a bug in resume")

        monkeypatch.setattr(server.app.sessions, "resume", boom)
        async with raw_connection(server.port, certs.ca_cert) as conn:
            with caplog.at_level(logging.ERROR, logger="quicsrv"):
                response = await conn.request("POST", "/v1/resume", _resume_frame())
            assert response.status == 500
            [frame] = response.frames
            assert isinstance(frame, quicsrv_proto.Error)
            assert frame.code == ErrorCode.INTERNAL_ERROR
            assert "boom" not in frame.message  # no internals for the peer
            assert len(_tracebacks(caplog)) == 1
            # Same connection, next request: served.
            ok = await conn.request(
                "POST",
                "/v1/generate",
                quicsrv_proto.encode_frame(
                    quicsrv_proto.Generate(prompt="Hi", max_tokens=4, ignore_eos=True)
                ),
            )
            assert ok.status == 200
            assert isinstance(ok.frames[-1], quicsrv_proto.End)


async def test_a_bug_while_starting_a_generation_answers_internal_error(
    engine, certs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_server(engine, certs) as server:
        real_prepare = server.app.sessions.prepare
        calls = 0

        def prepare_once_broken(frame: quicsrv_proto.Generate) -> object:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("boom: a bug while preparing")
            return real_prepare(frame)

        monkeypatch.setattr(server.app.sessions, "prepare", prepare_once_broken)
        body = quicsrv_proto.encode_frame(
            quicsrv_proto.Generate(prompt="Hi", max_tokens=4, ignore_eos=True)
        )
        async with raw_connection(server.port, certs.ca_cert) as conn:
            with caplog.at_level(logging.ERROR, logger="quicsrv"):
                broken = await conn.request("POST", "/v1/generate", body)
            assert broken.status == 500
            [frame] = broken.frames
            assert isinstance(frame, quicsrv_proto.Error) and frame.code == ErrorCode.INTERNAL_ERROR
            assert len(_tracebacks(caplog)) == 1
            served = await conn.request("POST", "/v1/generate", body)
            assert served.status == 200
            assert isinstance(served.frames[-1], quicsrv_proto.End)
        assert server.app.refusals[ErrorCode.INTERNAL_ERROR] == 1
