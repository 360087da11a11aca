"""Metrics, plain routes, JSON logs and tracing set-up, without sockets or the model
(the end-to-end proof is tests/quicsrv/test_metrics_e2e.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from quicsrv.apikeys import ApiKeys, new_key
from quicsrv.engine import EngineHealth, ResumePath
from quicsrv.http.operator import (
    PlainRoutes,
    authorize_metrics,
    plain_endpoint,
    readiness,
)
from quicsrv.logs import JsonFormatter, log_handler, quiet_exception_handler
from quicsrv.metrics import MAX_REFUSAL_SERIES, OTHER_CLIENTS, ServerMetrics, SessionFacts
from quicsrv.tracing import configure_exporter, configured_tracer
from quicsrv_proto import ErrorCode
from tests.fakes import FakeEngine


def samples(metrics: ServerMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[sample.name, frozenset(sample.labels.items())] = sample.value
    return out


def test_each_server_counts_in_its_own_registry():
    a, b = ServerMetrics(), ServerMetrics()
    a.request_finished("generate", "ok")
    assert (
        samples(a)["quicsrv_requests_total", frozenset({("endpoint", "generate"), ("code", "ok")})]
        == 1
    )
    assert (
        "quicsrv_requests_total",
        frozenset({("endpoint", "generate"), ("code", "ok")}),
    ) not in samples(b)


def test_an_inter_token_gap_needs_the_same_sequence_in_consecutive_steps():
    metrics = ServerMetrics()
    # Step times come from the worker: steps delivered together still have their own gaps.
    metrics.engine_stepped([1, 2], 10.000)  # first step: no previous one
    metrics.engine_stepped([2, 3], 10.010)  # 2 again: a gap of 10 ms
    metrics.engine_stepped([4], 10.020)  # nobody from the step before (a new one after idling)
    metrics.engine_stepped([4], 10.050)  # a gap of 30 ms
    values = samples(metrics)
    assert values["quicsrv_decode_steps_total", frozenset()] == 4
    assert values["quicsrv_decode_step_sequences_sum", frozenset()] == 6
    assert values["quicsrv_inter_token_seconds_count", frozenset()] == 2
    assert values["quicsrv_inter_token_seconds_sum", frozenset()] == pytest.approx(0.040)


def test_a_generation_trace_observes_ttft_once_and_resumes_by_path():
    metrics = ServerMetrics()
    trace = metrics.trace(b"\x01" * 16, resumed=False)
    trace.started(prompt_tokens=7, arrived_at=None)
    for _ in range(3):
        trace.token_recorded()
    trace.restart_wanted()
    trace.resumed(ResumePath.REPREFILL)
    trace.resumed(ResumePath.REPLAY)  # no restart asked for: counted, no latency
    trace.closed("length")
    values = samples(metrics)
    assert values["quicsrv_prompt_tokens_total", frozenset()] == 7
    assert values["quicsrv_generated_tokens_total", frozenset()] == 3
    assert values["quicsrv_time_to_first_token_seconds_count", frozenset()] == 1
    assert values["quicsrv_resumes_total", frozenset({("path", "reprefill")})] == 1
    assert values["quicsrv_resumes_total", frozenset({("path", "replay")})] == 1
    assert values["quicsrv_resumes_total", frozenset({("path", "kv_restore")})] == 0
    assert values["quicsrv_resume_seconds_count", frozenset({("path", "reprefill")})] == 1
    assert ("quicsrv_resume_seconds_count", frozenset({("path", "replay")})) not in values


def _facts(**given: Any) -> SessionFacts:
    nothing: dict[str, Any] = dict(
        active=0, queued=0, live=0, paused=0, stored=0, kv_bytes=(0, 0), kv_blobs=(0, 0)
    )
    return SessionFacts(**{**nothing, **given})


def test_refusals_are_exported_per_code_and_client():
    metrics = ServerMetrics()
    facts = _facts(
        active=1,
        queued=2,
        stored=5,
        kv_bytes=(10, 0),
        kv_blobs=(1, 0),
        refusals={(ErrorCode.CLIENT_LIMIT, "key:alice"): 3, (ErrorCode.OVERLOADED, "conn:7"): 1},
    )
    metrics.bind_sessions(lambda: facts)
    values = samples(metrics)
    labels = frozenset({("code", "client_limit"), ("client", "key:alice")})
    assert values["quicsrv_refusals_total", labels] == 3
    assert (
        values["quicsrv_refusals_total", frozenset({("code", "overloaded"), ("client", "conn:7")})]
        == 1
    )
    assert values["quicsrv_generations_queued", frozenset()] == 2
    assert values["quicsrv_kv_store_bytes", frozenset({("where", "memory")})] == 10


def test_the_slots_the_resumes_in_line_and_the_sessions_states_are_exported():
    metrics = ServerMetrics()
    facts = _facts(
        active=8,
        queued=5,
        slots=8,
        queued_resumes=3,
        states={"starting": 3, "running": 8},
        refusals={},
    )
    metrics.bind_sessions(lambda: facts)
    values = samples(metrics)
    assert values["quicsrv_generations_slots", frozenset()] == 8
    assert values["quicsrv_resumes_queued", frozenset()] == 3
    assert values["quicsrv_sessions_by_state", frozenset({("state", "starting")})] == 3
    assert values["quicsrv_sessions_by_state", frozenset({("state", "running")})] == 8


def test_the_server_and_the_engine_worker_export_their_memory_and_open_files():
    metrics = ServerMetrics()
    engine = FakeEngine()
    metrics.bind_engine(engine)  # type: ignore[arg-type]
    names = {name for name, _ in samples(metrics)}
    assert {"quicsrv_process_resident_memory_bytes", "quicsrv_process_open_fds"} <= names
    assert not any(name.startswith("quicsrv_engine_worker_process_") for name in names)
    # A process standing in for the worker; its first line says it runs (its open files are
    # then its own, not the ones a fork inherits before the exec).
    stand_in = "import sys, time; print('ready', flush=True); time.sleep(60)"
    with subprocess.Popen([sys.executable, "-c", stand_in], stdout=subprocess.PIPE) as worker:
        assert worker.stdout is not None and worker.stdout.readline() == b"ready\n"
        try:
            engine.state = EngineHealth(worker_pid=worker.pid)
            values = samples(metrics)
            fds = len(os.listdir(f"/proc/{worker.pid}/fd"))
        finally:
            worker.kill()
    assert values["quicsrv_engine_worker_process_resident_memory_bytes", frozenset()] > 0
    assert values["quicsrv_engine_worker_process_open_fds", frozenset()] == fds
    # Not this process's numbers: the worker's own start time.
    assert (
        values["quicsrv_engine_worker_process_start_time_seconds", frozenset()]
        > values["quicsrv_process_start_time_seconds", frozenset()]
    )


def test_shared_store_failures_are_counted():
    metrics = ServerMetrics()
    metrics.bind_sessions(lambda: _facts(refusals={}, store_failures=4))
    assert samples(metrics)["quicsrv_store_failures_total", frozenset()] == 4


def test_refusal_series_are_bounded_whatever_the_clients():
    metrics = ServerMetrics()
    refusals = {(ErrorCode.OVERLOADED, f"conn:{i}"): 1 for i in range(MAX_REFUSAL_SERIES + 50)}
    refusals[ErrorCode.CLIENT_LIMIT, "conn:hog"] = 9
    facts = _facts(refusals=refusals)
    metrics.bind_sessions(lambda: facts)
    series = {k: v for k, v in samples(metrics).items() if k[0] == "quicsrv_refusals_total"}
    assert len(series) == MAX_REFUSAL_SERIES + 1
    assert (
        series[
            "quicsrv_refusals_total", frozenset({("code", "client_limit"), ("client", "conn:hog")})
        ]
        == 9
    )
    others = frozenset({("code", "overloaded"), ("client", OTHER_CLIENTS)})
    assert series["quicsrv_refusals_total", others] == 51
    assert sum(series.values()) == sum(refusals.values())


def _routes(ready: str | None = None, authorized: bool = True) -> PlainRoutes:
    return PlainRoutes(
        metrics=ServerMetrics(), readiness=lambda: ready, authorize_metrics=lambda h: authorized
    )


def test_plain_routes_answer_by_path_and_method():
    assert _routes().handle(b"GET", b"/healthz", {}).status == 200
    assert _routes().handle(b"GET", b"/readyz", {}).status == 200
    not_ready = _routes(ready="shutting down").handle(b"GET", b"/readyz", {})
    assert (not_ready.status, not_ready.body) == (503, b"not ready: shutting down\n")
    assert _routes().handle(b"POST", b"/healthz", {}).status == 405
    assert _routes().handle(b"GET", b"/nope", {}).status == 404
    refused = _routes(authorized=False).handle(b"GET", b"/metrics", {})
    assert refused.status == 401 and dict(refused.headers)[b"www-authenticate"]
    page = _routes().handle(b"GET", b"/metrics?x=1", {})
    assert page.status == 200 and page.content_type.startswith("text/plain; version=0.0.4")
    assert plain_endpoint(b"/metrics?x") == "metrics"
    assert plain_endpoint(b"/v1/generate") is None
    assert plain_endpoint(None) is None


def test_metrics_authorization_follows_the_keys_and_metrics_public():
    key = new_key()
    keys = ApiKeys([key])
    good = {b"authorization": f"Bearer {key}".encode()}
    assert authorize_metrics({}, api_keys=ApiKeys(), metrics_public=False)  # open server
    assert not authorize_metrics({}, api_keys=keys, metrics_public=False)
    assert not authorize_metrics(
        {b"authorization": b"Bearer x"}, api_keys=keys, metrics_public=False
    )
    assert authorize_metrics(good, api_keys=keys, metrics_public=False)
    assert authorize_metrics({}, api_keys=keys, metrics_public=True)


def test_readiness_names_what_is_missing():
    healthy = FakeEngine()
    assert readiness(healthy, accepting=True) is None
    assert readiness(healthy, accepting=False) == "shutting down"
    assert readiness(healthy, accepting=True, store_outage="Connection refused") == (
        "the session store cannot be reached: Connection refused"
    )
    failed = FakeEngine(state=EngineHealth(failure="crash loop", restarting=True))
    assert "crash loop" in readiness(failed, accepting=True)  # type: ignore[operator]
    restarting = FakeEngine(state=EngineHealth(restarting=True))
    assert "restarting" in readiness(restarting, accepting=True)  # type: ignore[operator]


def test_json_log_lines_carry_the_known_fields():
    record = logging.LogRecord("quicsrv", logging.INFO, __file__, 1, "a\nb %d", (3,), None)
    record.__dict__.update(event="stream_ended", session_id="ab", stream_id=4, duration_s=0.5)
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["message"] == "a\nb 3"
    assert (parsed["event"], parsed["session_id"], parsed["stream_id"]) == ("stream_ended", "ab", 4)
    assert parsed["duration_s"] == 0.5 and parsed["level"] == "info"
    assert "peer" not in parsed  # absent fields are left out, not null
    plain = logging.LogRecord("quicsrv", logging.INFO, __file__, 1, "hello", (), None)
    assert json.loads(JsonFormatter().format(plain))["event"] == "log"


def test_log_and_exporter_settings_are_checked():
    assert isinstance(log_handler("json").formatter, JsonFormatter)
    assert not isinstance(log_handler("plain").formatter, JsonFormatter)
    with pytest.raises(ValueError, match="log_format"):
        log_handler("xml")
    with pytest.raises(ValueError, match="otel_exporter"):
        configure_exporter("zipkin")
    configure_exporter("none")  # nothing to do, nothing set
    assert configured_tracer() is None  # the API's default provider records nothing
    assert "opentelemetry" in sys.modules  # installed here, yet off


def test_a_cancelled_task_left_behind_is_one_debug_line(caplog):
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.DEBUG):
            quiet_exception_handler(
                loop,
                {"message": "exception was never retrieved", "exception": asyncio.CancelledError()},
            )
    finally:
        loop.close()
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert not caplog.records[0].exc_info


def test_anything_else_left_behind_keeps_its_traceback(caplog):
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR):
            quiet_exception_handler(loop, {"message": "a bug", "exception": KeyError("bug")})
    finally:
        loop.close()
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
