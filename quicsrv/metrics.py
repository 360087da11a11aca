"""What the server counts, in Prometheus form (``GET /metrics``), and per-generation traces.

Each server owns a :class:`ServerMetrics` with its own ``CollectorRegistry`` (never the global
one), so several servers in one process (tests, benchmarks) keep separate counts.

Two kinds of numbers. *Events* are counted where they happen, by a line at that place: requests
and their outcome, tokens, resumes, decode steps. *States* are read only when scraped (a
collector asks the session manager, the engine and the transport): sessions active, queued and
paused, KV bytes, connections, worker restarts. The per-token path does one counter increment;
inter-token gaps are observed once per decode step, not once per token, because the event
loop's CPU per token is what limits a busy server.

Every name starts with ``quicsrv_``; the README's Observability section lists them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from quicsrv_proto import ErrorCode

from .peer_errors import PEER_ERRORS
from .tracing import GenerationSpans, configured_tracer

if TYPE_CHECKING:
    from .engine import Engine, ResumePath
    from .engine.prefix_cache import PrefixStats

__all__ = ["CONTENT_TYPE", "GenerationTrace", "ServerMetrics", "SessionFacts", "TransportFacts"]

#: Prometheus text exposition format 0.0.4.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_GAP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
#: Refusal series with a client label of their own; the rest are summed under OTHER_CLIENTS.
MAX_REFUSAL_SERIES = 100
OTHER_CLIENTS = "(others)"


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionFacts:
    """The sessions' state at one scrape (the session manager tells it: this module imports
    nothing of the sessions)."""

    active: int
    """Engine slots in use."""
    queued: int
    """Requests and resumes waiting for a slot."""
    live: int
    """Sessions running or read now (in memory)."""
    paused: int
    """Live, unfinished sessions whose engine sequence is paused."""
    stored: int
    """Sessions in the store."""
    kv_bytes: tuple[int, int]
    """Paused sessions' KV blobs' bytes: in memory, on disk."""
    kv_blobs: tuple[int, int]
    """...and their count: in memory, on disk."""
    refusals: Mapping[tuple[ErrorCode, str], int]
    """New requests refused at admission, by code and client."""
    slots: int = 0
    """Engine slots the server hands out (0: not told)."""
    queued_resumes: int = 0
    """Returning sessions (a reader's resume) waiting for a slot; they go before new requests."""
    states: Mapping[str, int] = field(default_factory=dict)
    """Live sessions by lifecycle state (what a stalled resume waits on: a slot, the engine)."""
    rate_limited: Mapping[str, int] = field(default_factory=dict)
    """New generations refused by a rate limit, by limit (``requests``, ``tokens``)."""
    rate_limit_clients: int = 0
    """Clients whose rate-limit buckets are kept (not full)."""
    store_failures: int = 0
    """Operations the shared session store failed (0 for the file store)."""


class TransportFacts:
    """What the transport tells the collector when asked (defaults: a transport not yet bound)."""

    def open_connections(self) -> int:
        return 0

    def early_resumes(self) -> int:
        return 0

    def early_generates_refused(self) -> int:
        return 0

    def accepting(self) -> bool:
        return True


class ServerMetrics:
    """One server's instruments; see the module docstring. ``tracer``: an OpenTelemetry tracer
    for per-generation spans (default: :func:`quicsrv.tracing.configured_tracer`)."""

    def __init__(self, *, tracer: Any | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.tracer = tracer if tracer is not None else configured_tracer()
        registry = self.registry
        self.requests = Counter(
            "quicsrv_requests",
            "Requests by endpoint and outcome (ok, or the error code's slug)",
            ["endpoint", "code"],
            registry=registry,
        )
        self.requests_by_protocol = Counter(
            "quicsrv_requests_by_protocol",
            "Requests answered by the router, by what carried them (h3, h2, http/1.1)",
            ["protocol"],
            registry=registry,
        )
        for protocol in ("h3", "h2", "http/1.1"):
            self.requests_by_protocol.labels(protocol=protocol)
        self.ttft = Histogram(
            "quicsrv_time_to_first_token_seconds",
            "From a GENERATE's arrival to its first token",
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.inter_token = Histogram(
            "quicsrv_inter_token_seconds",
            "Gap between consecutive decode steps that gave the same sequence a token "
            "(one observation per step)",
            buckets=_GAP_BUCKETS_S,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "quicsrv_prompt_tokens", "Prompt tokens of started generations", registry=registry
        )
        self.generated_tokens = Counter(
            "quicsrv_generated_tokens",
            "Tokens recorded by sessions (what readers are sent)",
            registry=registry,
        )
        self.decode_steps = Counter(
            "quicsrv_decode_steps", "Engine decode steps that sampled tokens", registry=registry
        )
        self.step_sequences = Histogram(
            "quicsrv_decode_step_sequences",
            "Sequences given a token per decode step",
            buckets=_BATCH_BUCKETS,
            registry=registry,
        )
        self.resumes = Counter(
            "quicsrv_resumes",
            "Engine sequences brought back, by how their KV cells were rebuilt "
            "(client resumes and flow-control restarts)",
            ["path"],
            registry=registry,
        )
        self.resume_latency = Histogram(
            "quicsrv_resume_seconds",
            "From a session's restart being wanted to the engine having its KV cells back",
            ["path"],
            buckets=_LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.connections_opened = Counter(
            "quicsrv_connections_opened", "QUIC connections accepted", registry=registry
        )
        for path in ("kv_restore", "replay", "reprefill"):  # present from the first scrape
            self.resumes.labels(path=path)
        self._state = _StateCollector()
        registry.register(self._state)
        # Memory, open files and CPU of this process and of the engine worker (a process of its
        # own, which holds the model and the KV cells): quicsrv_process_* and
        # quicsrv_engine_worker_process_* (resident_memory_bytes, open_fds, max_fds, ...).
        ProcessCollector(namespace="quicsrv", registry=registry)
        registry.register(_WorkerProcessCollector(self._state))
        self._last_step_keys: frozenset[int] = frozenset()
        self._last_step_at = 0.0

    # --- binding the parts whose state is read at scrape time ---------------------------

    def bind_sessions(self, facts: Callable[[], SessionFacts]) -> None:
        """Read the sessions' state when scraped, from ``facts()``."""
        self._state.sessions = facts

    def bind_engine(self, engine: Engine) -> None:
        """Read the engine's health when scraped, and count the decode steps it reports."""
        self._state.engine = engine
        engine.on_step = self.engine_stepped

    def unbind_engine(self, engine: Engine) -> None:
        """The server stops: an engine that outlives it (tests) stops reporting here."""
        if engine.on_step == self.engine_stepped:
            engine.on_step = None

    def bind_transport(self, facts: TransportFacts) -> None:
        self._state.transport = facts

    # --- events -------------------------------------------------------------------------

    def request_finished(self, endpoint: str, code: str) -> None:
        """A request was answered: ``code`` is "ok" or an error code's slug."""
        self.requests.labels(endpoint=endpoint, code=code).inc()

    def engine_stepped(self, keys: Sequence[int], at: float) -> None:
        """One decode step, ended at ``at`` (monotonic), gave the sequences ``keys`` a token each
        (any thread). Steps arrive in order, possibly several at once (engine.coalescing)."""
        self.decode_steps.inc()
        self.step_sequences.observe(len(keys))
        # A gap counts only when some sequence had a token in the previous step too: the
        # engine idling, or a sequence prefilling, is no inter-token gap.
        current = frozenset(keys)
        if not current.isdisjoint(self._last_step_keys):
            self.inter_token.observe(at - self._last_step_at)
        self._last_step_keys, self._last_step_at = current, at

    def trace(self, session_id: bytes, *, resumed: bool) -> GenerationTrace:
        """The recorder of one session object's life (see :class:`GenerationTrace`)."""
        spans = (
            GenerationSpans(self.tracer, session_id.hex(), resumed=resumed)
            if self.tracer is not None
            else None
        )
        return GenerationTrace(self, spans)

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)


class GenerationTrace:
    """One session object's life as the metrics and the spans see it. Called on the event
    loop, with the loop's clock (``time.monotonic``)."""

    __slots__ = ("_metrics", "_spans", "_first_token_from", "_restart_from")

    def __init__(self, metrics: ServerMetrics, spans: GenerationSpans | None) -> None:
        self._metrics = metrics
        self._spans = spans
        self._first_token_from: float | None = None
        self._restart_from: float | None = None

    def started(self, prompt_tokens: int, arrived_at: float | None) -> None:
        """A new generation was submitted; it arrived at ``arrived_at`` (None: just now)."""
        now = time.monotonic()
        self._metrics.prompt_tokens.inc(prompt_tokens)
        self._first_token_from = now if arrived_at is None else arrived_at
        if self._spans is not None:
            if arrived_at is not None:
                self._spans.begin("queue", since=arrived_at)
            self._spans.begin("prefill")

    def token_recorded(self) -> None:
        """Per token: keep it cheap."""
        self._metrics.generated_tokens.inc()
        if self._first_token_from is not None:
            self._metrics.ttft.observe(time.monotonic() - self._first_token_from)
            self._first_token_from = None
            if self._spans is not None:
                self._spans.begin("decode")

    def restart_wanted(self) -> None:
        """The engine sequence is to run again (a resume, or a drained reader)."""
        self._restart_from = time.monotonic()
        if self._spans is not None:
            self._spans.begin("resume")

    def resumed(self, path: ResumePath) -> None:
        label = path.name.lower()  # kv_restore, replay, reprefill
        self._metrics.resumes.labels(path=label).inc()
        if self._restart_from is not None:
            self._metrics.resume_latency.labels(path=label).observe(
                time.monotonic() - self._restart_from
            )
            self._restart_from = None
        if self._spans is not None:
            self._spans.annotate(resume_path=label)
            self._spans.begin("decode")

    def paused(self) -> None:
        if self._spans is not None:
            self._spans.begin("pause")

    def closed(self, outcome: str) -> None:
        """Nobody reads and the engine holds nothing: the session object is done."""
        if self._spans is not None:
            self._spans.end(outcome=outcome)
            self._spans = None


class _StateCollector(Collector):
    """Gauges and counters read from their owners when scraped."""

    def __init__(self) -> None:
        self.sessions: Callable[[], SessionFacts] | None = None
        self.engine: Engine | None = None
        self.transport = TransportFacts()

    def collect(self) -> Iterator[Metric]:
        yield from self._sessions()
        yield from self._engine()
        yield from self._transport()

    def _sessions(self) -> Iterator[Metric]:
        if self.sessions is None:
            return
        facts = self.sessions()
        yield _gauge("quicsrv_generations_active", "Engine slots in use", facts.active)
        yield _gauge("quicsrv_generations_slots", "Engine slots handed out in all", facts.slots)
        yield _gauge(
            "quicsrv_generations_queued", "Requests and resumes waiting for a slot", facts.queued
        )
        yield _gauge(
            "quicsrv_resumes_queued",
            "Returning sessions waiting for a slot (they go before new requests)",
            facts.queued_resumes,
        )
        yield _labelled(
            GaugeMetricFamily,
            "quicsrv_sessions_by_state",
            "Live sessions by lifecycle state: queued (a new generation in line), starting (a "
            "resume waiting for a slot and its KV cells), running, pausing, parked, ...",
            "state",
            sorted(facts.states.items()),
        )
        yield _gauge(
            "quicsrv_sessions_live", "Sessions running or read now (in memory)", facts.live
        )
        yield _gauge(
            "quicsrv_sessions_paused",
            "Live, unfinished sessions whose engine sequence is paused",
            facts.paused,
        )
        yield _gauge("quicsrv_sessions_stored", "Sessions in the store", facts.stored)
        yield _labelled(
            GaugeMetricFamily,
            "quicsrv_kv_store_bytes",
            "Paused sessions' KV blobs, by where they are",
            "where",
            [("memory", facts.kv_bytes[0]), ("disk", facts.kv_bytes[1])],
        )
        yield _labelled(
            GaugeMetricFamily,
            "quicsrv_kv_store_blobs",
            "Paused sessions' KV blobs, by where they are",
            "where",
            [("memory", facts.kv_blobs[0]), ("disk", facts.kv_blobs[1])],
        )
        failures = CounterMetricFamily(
            "quicsrv_store_failures",
            "Operations the shared session store (Redis) failed: unreachable, or an error "
            "answer; always 0 for the file store",
        )
        failures.add_metric([], facts.store_failures)
        yield failures
        refusals = CounterMetricFamily(
            "quicsrv_refusals",
            "New requests refused at admission, by code and client (API key id or connection)",
            labels=["code", "client"],
        )
        # Every connection is a client on an open server: the busiest few get series of their
        # own, the rest are summed per code, so a scrape's size stays bounded.
        ranked = sorted(facts.refusals.items(), key=lambda item: (-item[1], item[0]))
        others: dict[str, float] = {}
        for rank, ((code, client), count) in enumerate(ranked):
            if rank < MAX_REFUSAL_SERIES:
                refusals.add_metric([code.slug, client], count)
            else:
                others[code.slug] = others.get(code.slug, 0) + count
        for slug, summed in sorted(others.items()):
            refusals.add_metric([slug, OTHER_CLIENTS], summed)
        yield refusals
        limited = CounterMetricFamily(
            "quicsrv_rate_limited",
            "New generations refused rate_limit_exceeded, by the limit spent",
            labels=["limit"],
        )
        for limit in ("requests", "tokens"):
            limited.add_metric([limit], facts.rate_limited.get(limit, 0))
        yield limited
        yield _gauge(
            "quicsrv_rate_limit_clients",
            "Clients (API keys, or source addresses) with rate-limit buckets kept",
            facts.rate_limit_clients,
        )

    def _engine(self) -> Iterator[Metric]:
        engine = self.engine
        if engine is None:
            return
        health = engine.health()
        yield _gauge("quicsrv_engine_up", "1 while the engine takes work", health.up)
        restarts = CounterMetricFamily(
            "quicsrv_engine_worker_restarts", "Engine worker processes replaced after a death"
        )
        restarts.add_metric([], health.restarts)
        yield restarts
        if health.threads:
            yield _gauge(
                "quicsrv_engine_threads",
                "llama.cpp threads the engine decodes with (by default every CPU this process "
                "may use: its affinity mask and cgroup quota, split across --workers)",
                health.threads,
            )
        if health.breaker is not None:  # a worker engine (engine/restarts.py, engine/suspects.py)
            yield _gauge(
                "quicsrv_engine_breaker_state",
                "The worker restart breaker: 0 closed, 1 open (crash loop: new work refused), "
                "2 half-open (one worker on probation)",
                int(health.breaker),
            )
            for name, documentation, value in (
                (
                    "worker_deaths",
                    "Engine worker processes that died or were killed",
                    health.worker_deaths,
                ),
                (
                    "breaker_opens",
                    "Crash loops: times the worker restart breaker opened",
                    health.breaker_opens,
                ),
                (
                    "poisoned_generations",
                    "Generations that kept killing the worker, failed alone",
                    health.poisoned_generations,
                ),
            ):
                counter = CounterMetricFamily(f"quicsrv_engine_{name}", documentation)
                counter.add_metric([], value)
                yield counter
        if health.prefix_cache is not None:
            yield from _prefix_cache(health.prefix_cache)
        if health.cpu_extra_buffers is not None:
            yield _gauge(
                "quicsrv_engine_cpu_extra_buffers",
                "1: llama.cpp's extra CPU buffers are on; 0: off (safe mode after the canary, "
                "or configured off)",
                health.cpu_extra_buffers,
            )

    def _transport(self) -> Iterator[Metric]:
        facts = self.transport
        yield _gauge("quicsrv_connections_open", "QUIC connections open", facts.open_connections())
        yield _gauge(
            "quicsrv_accepting", "1 until the server starts shutting down", facts.accepting()
        )
        yield _labelled(
            CounterMetricFamily,
            "quicsrv_zero_rtt_requests",
            "Requests that arrived whole in 0-RTT data: RESUME_STREAMs answered (accepted), "
            "GENERATEs refused with too_early (refused)",
            "outcome",
            [
                ("accepted", facts.early_resumes()),
                ("refused", facts.early_generates_refused()),
            ],
        )
        yield _labelled(
            CounterMetricFamily,
            "quicsrv_peer_errors",
            "Errors a peer caused (abrupt close, TLS error, protocol violation), by where they "
            "surfaced: tcp (HTTP/1.1, HTTP/2), quic, loop; logged at most once per source and "
            "10 s",
            "source",
            sorted(PEER_ERRORS.counts.items()),
        )


class _WorkerProcessCollector(Collector):
    """prometheus_client's process metrics, read from /proc, for the engine worker running at
    scrape time; nothing while none runs (a restart) or the engine has none."""

    def __init__(self, state: _StateCollector) -> None:
        self._state = state
        self._pid = 0
        self._process = ProcessCollector(
            namespace="quicsrv_engine_worker", pid=lambda: self._pid, registry=None
        )

    def collect(self) -> Iterable[Metric]:
        engine = self._state.engine
        pid = engine.health().worker_pid if engine is not None else None
        if pid is None:
            return []
        self._pid = pid
        return self._process.collect()


def _prefix_cache(stats: PrefixStats) -> Iterator[Metric]:
    yield _labelled(
        CounterMetricFamily,
        "quicsrv_prompt_tokens",
        "Prompt tokens of started generations: reused from kept cells, or prefilled",
        "source",
        [("reused", stats.reused_tokens), ("prefilled", stats.prefilled_tokens)],
    )
    yield CounterMetricFamily(
        "quicsrv_prefix_cache_shelf_dropped",
        "Evicted entries not written to disk: too many waited for the writer, which writes only "
        "while the engine waits for work",
        value=float(stats.shelf_dropped),
    )
    yield _labelled(
        CounterMetricFamily,
        "quicsrv_prefix_cache_lookups",
        "Generations that started from kept cells (hit) or computed their whole prompt (miss)",
        "result",
        [("hit", stats.hits), ("miss", stats.misses)],
    )
    for name, documentation, value in (
        (
            "enabled",
            "1 while kept KV cells are reused (off by configuration, or for a sliding-window "
            "model)",
            stats.enabled,
        ),
        ("resident_tokens", "Tokens whose cells are kept in released slots", stats.resident_tokens),
        (
            "blob_bytes",
            "Bytes of blobs in the engine worker's memory: evicted entries, and kept ones saved "
            "ahead of need",
            stats.blob_bytes,
        ),
        (
            "disk_bytes",
            "Bytes of entries on disk (prefix_cache_disk_bytes; shared by this node's processes)",
            stats.disk_bytes,
        ),
    ):
        yield _gauge(f"quicsrv_prefix_cache_{name}", documentation, value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=float(value))


def _labelled(
    family: Callable[..., Any],
    name: str,
    documentation: str,
    label: str,
    values: Iterable[tuple[str, float]],
) -> Metric:
    metric = family(name, documentation, labels=[label])
    for label_value, value in values:
        metric.add_metric([label_value], value)
    return metric  # type: ignore[no-any-return]
