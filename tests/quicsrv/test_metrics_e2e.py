"""Observability end to end: /metrics after a known workload, /healthz, /readyz, JSON logs and
per-generation spans. The real model, the real server, real QUIC on loopback."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections import Counter
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from quicsrv.apikeys import new_key
from quicsrv.logs import JsonFormatter
from quicsrv.metrics import ServerMetrics
from quicsrv.sessions.flow import MAX_AHEAD_FACTOR
from quicsrv.sessions.manager import SessionManager
from quicsrv_client import (
    CheckpointReceived,
    Client,
    GenerationEnded,
    SessionStarted,
    TokenReceived,
)
from tests.helpers import raw_connection, running_server, session_settings

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

PROMPT = "Write a long story about a lighthouse keeper."

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


async def scrape(client: Client) -> Samples:
    response = await client.get("/metrics")
    assert response.status == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse(response.text)


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


async def test_metrics_move_by_what_a_known_workload_did(engine, certs):
    max_tokens = 12
    records = io.StringIO()
    handler = logging.StreamHandler(records)
    handler.setFormatter(JsonFormatter())
    quicsrv_log = logging.getLogger("quicsrv")
    quicsrv_log.addHandler(handler)
    old_level = quicsrv_log.level
    quicsrv_log.setLevel(logging.INFO)
    try:
        async with running_server(engine, certs) as server:
            async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
                before = await scrape(c)
                received, prompt_tokens, session_ids = 0, 0, []
                for _ in range(2):  # one after the other: each step gives one sequence a token
                    async for event in c.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True):
                        if isinstance(event, TokenReceived):
                            received += 1
                        elif isinstance(event, SessionStarted):
                            session_ids.append(event.session_id)
                        elif isinstance(event, GenerationEnded):
                            prompt_tokens += event.prompt_tokens
                after = await scrape(c)
    finally:
        quicsrv_log.removeHandler(handler)
        quicsrv_log.setLevel(old_level)

    assert received == 2 * max_tokens
    assert delta(before, after, "quicsrv_requests_total", endpoint="generate", code="ok") == 2
    assert delta(before, after, "quicsrv_requests_total", endpoint="metrics", code="ok") == 1
    assert delta(before, after, "quicsrv_generated_tokens_total") == received
    assert delta(before, after, "quicsrv_prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "quicsrv_time_to_first_token_seconds_count") == 2
    assert delta(before, after, "quicsrv_time_to_first_token_seconds_sum") > 0
    # Every sampled token went through a decode step; the generations ran one at a time.
    assert delta(before, after, "quicsrv_decode_step_sequences_sum") == received
    assert delta(before, after, "quicsrv_decode_steps_total") == received
    # A gap per token after each generation's first.
    assert delta(before, after, "quicsrv_inter_token_seconds_count") == 2 * (max_tokens - 1)
    for path in ("kv_restore", "replay", "reprefill"):
        assert delta(before, after, "quicsrv_resumes_total", path=path) == 0
    assert delta(before, after, "quicsrv_connections_opened_total") == 0  # one connection
    assert value(after, "quicsrv_connections_open") == 1
    assert value(after, "quicsrv_generations_active") == 0
    assert value(after, "quicsrv_generations_queued") == 0
    assert value(after, "quicsrv_sessions_stored") == 2
    assert value(after, "quicsrv_engine_up") == 1
    assert value(after, "quicsrv_accepting") == 1
    assert ("quicsrv_engine_worker_restarts_total", frozenset()) in after
    assert ("quicsrv_kv_store_bytes", frozenset({("where", "disk")})) in after

    lines = [json.loads(line) for line in records.getvalue().splitlines()]
    ended = [line for line in lines if line["event"] == "stream_ended"]
    assert sorted(line["session_id"] for line in ended) == sorted(session_ids)
    for line in ended:
        assert line["peer"].startswith("127.0.0.1:")
        assert isinstance(line["stream_id"], int)
        assert line["duration_s"] > 0
        assert line["level"] == "info"


@pytest.mark.parametrize(("kv_budget", "expected_path"), [(256 << 20, "kv_restore"), (0, "replay")])
async def test_a_resume_counts_by_its_path_and_traces_its_phases(
    engine, certs, tmp_path: Path, kv_budget, expected_path
):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = ServerMetrics(tracer=provider.get_tracer("test"))
    sessions = SessionManager(
        engine,
        session_settings(
            tmp_path, kv_memory_budget_bytes=kv_budget, kv_disk_budget_bytes=kv_budget
        ),
        metrics=metrics,
    )
    # Cut after 16 tokens: the reader's allowance (16 + at most MAX_AHEAD_FACTOR ×
    # max_tokens_ahead, sessions.flow) is below max_tokens, so the abandoned generation pauses
    # rather than finishes, on any CPU.
    max_tokens = 16 + MAX_AHEAD_FACTOR * session_settings(tmp_path).flow.max_tokens_ahead + 1
    async with running_server(engine, certs, sessions=sessions) as server:
        ca = certs.ca_cert
        async with Client("127.0.0.1", server.port, ca=ca) as observer:
            before = await scrape(observer)
            received: set[int] = set()
            cut = Client("127.0.0.1", server.port, ca=ca)
            await cut.connect()
            generation = cut.generate(PROMPT, max_tokens=max_tokens, ignore_eos=True)
            async for event in generation:
                if isinstance(event, TokenReceived):
                    received.add(event.index)
                elif isinstance(event, CheckpointReceived) and event.index == 15:
                    break
            position = generation.position
            assert position is not None and position.last_index == 15
            await cut.close()
            first = server.sessions.live(bytes.fromhex(position.session_id))
            if first is not None:
                await asyncio.wait_for(first.idle.wait(), timeout=60)

            resumed = None
            async with Client("127.0.0.1", server.port, ca=ca) as again:
                async for event in again.resume_from(position):
                    if isinstance(event, SessionStarted):
                        assert event.resume_path == expected_path.replace("_", "-")
                        resumed = server.sessions.live(bytes.fromhex(event.session_id))
                    elif isinstance(event, TokenReceived):
                        received.add(event.index)
                    elif isinstance(event, GenerationEnded):
                        assert event.completion_tokens == max_tokens
            assert resumed is not None
            await asyncio.wait_for(resumed.idle.wait(), timeout=60)
            after = await scrape(observer)

    assert received == set(range(max_tokens))
    assert delta(before, after, "quicsrv_requests_total", endpoint="generate", code="ok") == 1
    assert delta(before, after, "quicsrv_requests_total", endpoint="resume", code="ok") == 1
    assert delta(before, after, "quicsrv_generated_tokens_total") == max_tokens
    # Resumes by path moved by exactly what the engine reported for the session (the client's
    # resume, plus any flow-control restart), the client's one among them.
    paths = Counter(path.name.lower() for path in resumed.resume_paths)
    assert paths[expected_path] >= 1
    for path in ("kv_restore", "replay", "reprefill"):
        assert delta(before, after, "quicsrv_resumes_total", path=path) == paths[path]
        assert delta(before, after, "quicsrv_resume_seconds_count", path=path) == paths[path]

    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "generation"]
    assert len(roots) == 2  # the first session object's life, then the resumed one's
    assert all(r.attributes["quicsrv.session_id"] == position.session_id for r in roots)
    started, again_root = sorted(roots, key=lambda r: r.start_time)
    assert started.attributes["quicsrv.resumed"] is False
    assert again_root.attributes["quicsrv.resumed"] is True
    assert again_root.attributes["quicsrv.outcome"] == "length"

    def phases(root):
        children = [
            s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id
        ]
        return [s.name for s in sorted(children, key=lambda s: s.start_time)]

    assert phases(started)[:3] == ["queue", "prefill", "decode"]
    assert "pause" in phases(started)
    assert phases(again_root)[:2] == ["resume", "decode"]
    resume_span = next(
        s for s in spans if s.name == "resume" and s.parent.span_id == again_root.context.span_id
    )
    assert resume_span.attributes["quicsrv.resume_path"] == expected_path


async def test_health_readiness_and_metrics_access(engine, certs):
    key = new_key()
    async with running_server(engine, certs, api_key=key) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert, api_key="") as c:
            c.api_key = None
            health = await c.get("/healthz")
            ready = await c.get("/readyz")
            refused = await c.get("/metrics")
            c.api_key = key
            allowed = await c.get("/metrics?name=quicsrv_requests_total")
            server.sessions.accepting = False  # what shutdown sets first
            draining = await c.get("/readyz")
            still_alive = await c.get("/healthz")
            server.sessions.accepting = True
        async with raw_connection(server.port, certs.ca_cert) as raw:
            post = await raw.request("POST", "/metrics", b"")
            # A body nobody reads: the answer comes anyway, the peer is told to stop sending.
            with_body = await raw.request("POST", "/healthz", b"x" * 5000)
            after = await raw.request("GET", "/healthz", b"")  # the connection goes on
    assert (health.status, health.text) == (200, "ok\n")
    assert (ready.status, ready.text) == (200, "ready\n")
    assert refused.status == 401
    assert refused.headers["www-authenticate"].startswith("Bearer")
    assert allowed.status == 200
    assert 'quicsrv_requests_total{code="unauthorized",endpoint="metrics"} 1.0' in allowed.text
    assert draining.status == 503 and "shutting down" in draining.text
    assert still_alive.status == 200
    assert post.status == 405
    assert with_body.status == 405
    assert after.status == 200 and bytes(after.body) == b"ok\n"


async def test_metrics_public_needs_no_key(engine, certs):
    async with running_server(engine, certs, api_key=new_key(), metrics_public=True) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert, api_key="") as c:
            c.api_key = None
            response = await c.get("/metrics")
            generate = c.generate_text("Hi", max_tokens=2)
            with pytest.raises(Exception) as info:  # generations still need the key
                await generate
    assert response.status == 200
    assert "quicsrv_generations_active" in response.text
    assert getattr(info.value, "http_status", None) == 401


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "http2"])
async def test_metrics_over_the_tcp_listener_count_the_http_api(engine, certs, http2):
    """/metrics on the TCP listener too, behind the API key: a completion over TCP moves it."""
    from tests.http.helpers import tcp_client

    key = new_key()
    async with running_server(engine, certs, api_key=key) as server:
        async with tcp_client(server, certs, http2=http2) as anonymous:
            refused = await anonymous.get("/metrics")
        async with tcp_client(server, certs, http2=http2, authorization=f"Bearer {key}") as tcp:

            async def scrape_tcp() -> Samples:
                response = await tcp.get("/metrics")
                assert response.status_code == 200, response.text
                assert response.headers["alt-svc"].startswith("h3=")
                return parse(response.text)

            before = await scrape_tcp()
            models = (await tcp.get("/v1/models")).json()
            completion = await tcp.post(
                "/v1/completions",
                json={
                    "model": models["data"][0]["id"],
                    "prompt": "The capital of France is",
                    "max_tokens": 5,
                    "temperature": 0,
                },
            )
            after = await scrape_tcp()
    assert refused.status_code == 401
    assert completion.status_code == 200, completion.text
    generated = completion.json()["usage"]["completion_tokens"]
    assert 1 <= generated <= 5, completion.json()
    assert delta(before, after, "quicsrv_requests_total", endpoint="completions", code="ok") == 1
    assert delta(before, after, "quicsrv_requests_total", endpoint="models", code="ok") == 1
    assert delta(before, after, "quicsrv_generated_tokens_total") == generated
