"""A peer's errors: recognised, counted, logged at most once per source and interval, never
with a traceback; everything else keeps its traceback."""

from __future__ import annotations

import asyncio
import logging
import ssl

import h2.exceptions
import h11
import pytest

from quicsrv import peer_errors
from quicsrv.logs import quiet_exception_handler
from quicsrv.peer_errors import PeerErrorLog, install_filters, is_peer_error


@pytest.mark.parametrize(
    "exc",
    [
        ssl.SSLError(1, "[SSL: APPLICATION_DATA_AFTER_CLOSE_NOTIFY]"),
        ConnectionResetError(104, "reset by peer"),
        BrokenPipeError(),
        h11.RemoteProtocolError("illegal request line"),
        h2.exceptions.ProtocolError("too many resets"),
        asyncio.IncompleteReadError(b"GET /", 100),
        BaseExceptionGroup(
            "unhandled errors in a TaskGroup",
            [ssl.SSLError(1, "bad record mac"), asyncio.CancelledError()],
        ),
    ],
    ids=["tls", "reset", "pipe", "h11", "h2", "incomplete", "group"],
)
def test_what_a_peer_causes_is_recognised(exc):
    assert is_peer_error(exc)


@pytest.mark.parametrize(
    "exc",
    [
        KeyError("bug"),
        asyncio.CancelledError(),
        ExceptionGroup("mixed", [ssl.SSLError(1, "x"), KeyError("bug")]),
        BaseExceptionGroup("cancelled only", [asyncio.CancelledError()]),
    ],
    ids=["bug", "cancelled", "mixed-group", "cancelled-group"],
)
def test_what_a_peer_does_not_cause_is_not(exc):
    assert not is_peer_error(exc)


def test_a_flood_is_one_line_per_interval_and_every_error_is_counted(caplog):
    now = [100.0]
    errors = PeerErrorLog(interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="quicsrv.peer"):
        for _ in range(500):
            errors.report("tcp", "reset")
        errors.report("quic", "bad frame")  # another source has its own interval
        now[0] += 10.0
        errors.report("tcp", "reset")
    assert errors.counts == {"tcp": 501, "quic": 1}
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "peer error (tcp): reset",
        "peer error (quic): bad frame",
        "peer error (tcp): reset (and 499 more since the last such line)",
    ]
    assert not any(r.exc_info for r in caplog.records)


@pytest.fixture
def fresh_peer_log(monkeypatch):
    errors = PeerErrorLog(interval_s=3600.0)
    monkeypatch.setattr(peer_errors, "PEER_ERRORS", errors)
    import quicsrv.logs

    monkeypatch.setattr(quicsrv.logs, "PEER_ERRORS", errors)
    install_filters()
    return errors


def test_hypercorns_and_aioquics_loggers_report_a_peers_errors_without_a_traceback(
    fresh_peer_log, caplog
):
    tcp = logging.getLogger("quicsrv.tcp")  # hypercorn's error logger
    quic = logging.getLogger("quic")
    with caplog.at_level(logging.INFO):
        for _ in range(50):
            try:
                raise ssl.SSLError(1, "[SSL: APPLICATION_DATA_AFTER_CLOSE_NOTIFY]")
            except ssl.SSLError:
                tcp.exception("Error in ASGI Framework")
            quic.warning("Frame type 0x1e is not allowed in this packet")
    assert fresh_peer_log.counts == {"tcp": 50, "quic": 50}
    assert [r.name for r in caplog.records] == ["quicsrv.peer", "quicsrv.peer"]
    assert not any(r.exc_info for r in caplog.records)


def test_a_bug_on_those_loggers_keeps_its_traceback(fresh_peer_log, caplog):
    with caplog.at_level(logging.INFO):
        try:
            raise KeyError("bug")
        except KeyError:
            logging.getLogger("quicsrv.tcp").exception("Error in ASGI Framework")
    [record] = caplog.records
    assert record.exc_info is not None and fresh_peer_log.counts == {}


def test_the_event_loop_reports_a_peers_error_left_behind(fresh_peer_log, caplog):
    loop = asyncio.new_event_loop()
    group = BaseExceptionGroup("unhandled errors in a TaskGroup", [ConnectionResetError()])
    try:
        with caplog.at_level(logging.DEBUG):
            for exc in (ssl.SSLError(1, "bad record mac"), group):
                quiet_exception_handler(
                    loop, {"message": "Task exception was never retrieved", "exception": exc}
                )
    finally:
        loop.close()
    assert fresh_peer_log.counts == {"loop": 2}
    assert len(caplog.records) == 1 and not caplog.records[0].exc_info
