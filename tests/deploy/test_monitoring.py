"""deploy/monitoring: the alert rules pass promtool's check and their unit tests, and every
metric the Grafana dashboard or the rules name is one a real server exports (scraped)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from quicsrv_client import Client
from tests.helpers import running_server

MONITORING = Path(__file__).resolve().parents[2] / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULES = MONITORING / "alerts.yaml"
RULE_TESTS = MONITORING / "alerts_test.yaml"
#: Series Prometheus makes itself, not the server: `up` (was the scrape answered).
PROMETHEUS_OWN = {"up"}
METRIC = re.compile(r"\b(quicsrv_[a-z0-9_]+)\b|\b(up)\{")


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian's `prometheus`: `make system-deps`)")
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_promtool_checks_the_rules() -> None:
    done = _promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    done = _promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_the_issue_names_is_unit_tested() -> None:
    alerts = {
        rule["alert"]
        for group in yaml.safe_load(RULES.read_text())["groups"]
        for rule in group["rules"]
    }
    tested = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts == tested  # each fires in some test
    assert {
        "QuicsrvEngineDown",
        "QuicsrvBreakerOpen",
        "QuicsrvTimeToFirstTokenSlow",
        "QuicsrvInterTokenSlow",
        "QuicsrvQueueFull",
        "QuicsrvResumesFailing",
        "QuicsrvStoreUnreachable",
        "QuicsrvWorkerRestarts",
    } <= alerts


def _expressions() -> dict[str, list[str]]:
    """Where each PromQL expression comes from (dashboard panel or alert) -> expressions."""
    found: dict[str, list[str]] = {}
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.setdefault(f"panel {panel['title']!r}", []).append(target["expr"])
    for variable in dashboard["templating"]["list"]:
        if isinstance(variable.get("query"), dict):
            found.setdefault(f"variable {variable['name']}", []).append(variable["query"]["query"])
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            found.setdefault(f"alert {rule['alert']}", []).append(rule["expr"])
    return found


def _named(expression: str) -> set[str]:
    return {quicsrv or up for quicsrv, up in METRIC.findall(expression)}


def test_the_dashboard_has_its_panels_and_names_metrics() -> None:
    expressions = _expressions()
    panels = [where for where in expressions if where.startswith("panel")]
    assert len(panels) >= 12
    assert all(_named(e) for exprs in expressions.values() for e in exprs)


def _exported(text: str) -> set[str]:
    """Every series name a scrape can hold, also for a family without samples yet (a counter
    with labels no event has used): a counter's _total, a histogram's _bucket/_sum/_count."""
    names: set[str] = set()
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "gauge": ("",),
    }
    for family in text_string_to_metric_families(text):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


@pytest.mark.model
@pytest.mark.asyncio
async def test_every_metric_the_dashboard_and_the_rules_name_is_exported(engine, certs) -> None:
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            await c.generate_text("Hello", max_tokens=2)
            response = await c.get("/metrics")
    assert response.status == 200
    exported = _exported(response.text) | PROMETHEUS_OWN
    missing = {
        where: sorted(_named(e) - exported)
        for where, expressions in _expressions().items()
        for e in expressions
        if _named(e) - exported
    }
    assert not missing, f"named but not exported: {missing}"
    # The engine worker's and the server's memory and open files among them.
    for name in (
        "quicsrv_process_resident_memory_bytes",
        "quicsrv_process_open_fds",
        "quicsrv_engine_worker_process_resident_memory_bytes",
        "quicsrv_engine_worker_process_open_fds",
    ):
        assert name in exported
