"""``Engine.health()``: what each engine says of itself, and the metrics made of it."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from quicsrv.engine import EngineHealth
from quicsrv.engine.llama import LlamaEngine
from quicsrv.engine.prefix_cache import PrefixStats
from quicsrv.engine.restarts import Breaker
from quicsrv.metrics import ServerMetrics
from quicsrv.settings import engine_settings_for
from tests.fakes import FakeEngine


def _engine_samples(metrics: ServerMetrics) -> dict[str, float]:
    return {
        sample.name + "".join(f"{{{v}}}" for v in sample.labels.values()): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
        if sample.name.startswith(("quicsrv_engine_", "quicsrv_prefix_cache_"))
        or (sample.name == "quicsrv_prompt_tokens_total" and sample.labels)
    }


def test_an_engine_with_nothing_to_report_is_up_with_no_restarts():
    metrics = ServerMetrics()
    engine = FakeEngine()
    metrics.bind_engine(engine)
    assert engine.health().up
    assert _engine_samples(metrics) == {
        "quicsrv_engine_up": 1.0,
        "quicsrv_engine_worker_restarts_total": 0.0,
    }


def test_every_field_of_the_health_is_a_metric():
    metrics = ServerMetrics()
    prefix = PrefixStats(hits=2, misses=3, reused_tokens=64, prefilled_tokens=100)
    prefix.resident_tokens, prefix.blob_bytes, prefix.disk_bytes = 128, 4096, 8192
    prefix.shelf_dropped = 3
    engine = FakeEngine(
        state=EngineHealth(
            failure="a crash loop",
            restarts=5,
            breaker=Breaker.OPEN,
            worker_deaths=6,
            breaker_opens=1,
            poisoned_generations=2,
            prefix_cache=prefix,
            cpu_extra_buffers=False,
            threads=6,
        )
    )
    metrics.bind_engine(engine)
    assert not engine.health().up
    assert _engine_samples(metrics) == {
        "quicsrv_engine_up": 0.0,
        "quicsrv_engine_worker_restarts_total": 5.0,
        "quicsrv_engine_threads": 6.0,
        "quicsrv_engine_breaker_state": 1.0,
        "quicsrv_engine_worker_deaths_total": 6.0,
        "quicsrv_engine_breaker_opens_total": 1.0,
        "quicsrv_engine_poisoned_generations_total": 2.0,
        "quicsrv_prompt_tokens_total{reused}": 64.0,
        "quicsrv_prompt_tokens_total{prefilled}": 100.0,
        "quicsrv_prefix_cache_shelf_dropped_total": 3.0,
        "quicsrv_prefix_cache_lookups_total{hit}": 2.0,
        "quicsrv_prefix_cache_lookups_total{miss}": 3.0,
        "quicsrv_prefix_cache_enabled": 1.0,
        "quicsrv_prefix_cache_resident_tokens": 128.0,
        "quicsrv_prefix_cache_blob_bytes": 4096.0,
        "quicsrv_prefix_cache_disk_bytes": 8192.0,
        "quicsrv_engine_cpu_extra_buffers": 0.0,
    }


def test_the_metrics_count_the_steps_an_engine_reports_until_unbound():
    metrics, other = ServerMetrics(), ServerMetrics()
    engine = FakeEngine()
    metrics.bind_engine(engine)
    assert engine.on_step is not None
    engine.on_step([1, 2], 10.0)
    other.unbind_engine(engine)  # another server's metrics leave this binding alone
    assert engine.on_step is not None
    metrics.unbind_engine(engine)
    assert engine.on_step is None
    assert _decode_steps(metrics) == 1.0


def _decode_steps(metrics: ServerMetrics) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "quicsrv_decode_steps_total":
                return sample.value
    raise AssertionError("no quicsrv_decode_steps_total")


@pytest.mark.model
def test_the_worker_engine_reports_a_running_worker(engine):
    health = engine.health()
    assert health.up and health.failure is None and not health.restarting
    assert health.breaker is Breaker.CLOSED
    assert (health.restarts, health.worker_deaths) == (engine.restarts, engine.worker_deaths)
    assert health.poisoned_generations == engine.poisoned_generations
    assert health.cpu_extra_buffers == engine.cpu_extra_buffers
    assert health.threads == engine.settings.n_threads > 0
    # A copy: what the engine counts later does not change an answer already given.
    assert health.prefix_cache == engine.prefix_stats
    assert health.prefix_cache is not engine.prefix_stats


@pytest.mark.model
def test_the_in_process_engine_reports_its_prefix_cache_only(model_path, cpu_extra_buffers):
    settings = engine_settings_for(model_path, n_seq_max=2, cpu_extra_buffers=cpu_extra_buffers)
    engine = LlamaEngine(settings)
    try:
        health = engine.health()
        assert health == EngineHealth(prefix_cache=engine.prefix_stats, threads=settings.n_threads)
        assert health.prefix_cache is not engine.prefix_stats
    finally:
        engine.close()
