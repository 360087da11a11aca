"""The Locust load test: its token-order check, and a bounded smoke load against the real server.

The smoke runs ``python -m loadtest.locust.smoke`` as a subprocess: Locust monkey-patches the whole
interpreter with gevent on import, which must never happen inside pytest.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.locust import smoke
from loadtest.locust.ledger import RunTally, TokenLedger

REPO = Path(__file__).resolve().parents[2]
#: Locust's run; server start-up, Locust start-up and both shutdowns add a few seconds.
SMOKE_RUN_TIME = "40s"
SMOKE_TIMEOUT_S = 120


def _ledger(*indices: int) -> TokenLedger:
    ledger = TokenLedger()
    for index in indices:
        ledger.add(index)
    return ledger


def test_each_index_once_and_in_order_passes():
    verdict = _ledger(0, 1, 2, 3).verdict(completion_tokens=4)
    assert verdict.ok and verdict.complete and verdict.received == 4


def test_a_lost_token_fails():
    verdict = _ledger(0, 1, 3).verdict(completion_tokens=4)
    assert (verdict.lost, verdict.duplicated, verdict.out_of_order) == (1, 0, 0)
    assert not verdict.ok


def test_a_missing_tail_is_lost_when_end_counted_it():
    assert _ledger(0, 1).verdict(completion_tokens=4).lost == 2


def test_a_repeated_token_fails():
    # A resume that replayed index 2 although the client already held it.
    verdict = _ledger(0, 1, 2, 2, 3).verdict(completion_tokens=4)
    assert (verdict.lost, verdict.duplicated) == (0, 1)
    assert verdict.out_of_order == 1  # 2 after 2 does not advance either
    assert not verdict.ok


def test_reordered_tokens_fail():
    verdict = _ledger(0, 2, 1, 3).verdict(completion_tokens=4)
    assert (verdict.lost, verdict.duplicated, verdict.out_of_order) == (0, 0, 1)


def test_indices_past_end_fail():
    assert not _ledger(0, 1, 2).verdict(completion_tokens=2).ok


def test_an_incomplete_generation_is_checked_as_a_prefix():
    assert _ledger(0, 1, 2).verdict(completion_tokens=None).ok
    gap = _ledger(0, 1, 4).verdict(completion_tokens=None)
    assert gap.lost == 2 and not gap.complete


def test_the_tally_adds_verdicts_up():
    tally = RunTally()
    tally.record(_ledger(0, 1).verdict(2))
    tally.record(_ledger(0, 0).verdict(2))
    tally.record(_ledger(0).verdict(None))
    summary = tally.as_dict()
    assert summary["generations_checked"] == 2
    assert summary["incomplete_generations"] == 1
    assert summary["lost_tokens"] == 1 and summary["duplicated_tokens"] == 1
    assert summary["order_failures"] == 1
    assert summary["tokens_checked"] == 5


def _passing_summary() -> dict:
    tally = RunTally()
    tally.record(_ledger(0, 1).verdict(2))
    tally.scenarios.update(dict.fromkeys(smoke.SCENARIOS, 1))
    tally.resume_paths["kv-restore"] += 1
    tally.expected_errors_ok["bad_magic"] += 1
    return tally.as_dict()


def _problems(summary: dict | None, *, locust_rc: int = 0, server_rc: int | None = 0) -> list:
    args = argparse.Namespace(require_scenarios=True)
    return smoke._verdict(args, locust_rc, server_rc, False, summary)


def test_the_smoke_verdict_passes_a_clean_run():
    assert _problems(_passing_summary()) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(lost_tokens=1), "lost_tokens"),
        (dict(duplicated_tokens=2), "duplicated_tokens"),
        (dict(order_failures=1), "order_failures"),
        (dict(unexpected_errors={"overloaded (30)": 1}), "unexpected errors"),
        (dict(expected_errors_wrong={"bad_magic": 1}), "wrong answer"),
        (dict(scenarios={"plain": 3}), "never ran"),
        (dict(resume_paths={}), "no resume"),
    ],
)
def test_the_smoke_verdict_fails_on_any_loss_or_surprise(change, expected):
    problems = _problems({**_passing_summary(), **change})
    assert any(expected in p for p in problems), problems


def test_the_smoke_verdict_fails_without_a_tally_or_with_a_failed_process():
    assert _problems(None)
    assert _problems(_passing_summary(), locust_rc=1)
    assert _problems(_passing_summary(), server_rc=None)


@pytest.mark.model
@pytest.mark.slow
def test_smoke_load_loses_no_token_and_meets_no_unexpected_error(model_path, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "loadtest.locust.smoke",
            "--users",
            "4",
            "--spawn-rate",
            "4",
            "--run-time",
            SMOKE_RUN_TIME,
            "--out",
            str(tmp_path),
            "--locust-arg=--quic-slow-pause=1.5",
            # One llama.cpp thread: the smoke checks correctness, not speed, and two-thread
            # spin barriers crawl when another model process shares the 2 cores.
            "--server-arg=--threads=1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    summary = report["summary"]
    assert summary["generations_checked"] > 0 and summary["tokens_checked"] > 0
    assert summary["lost_tokens"] == summary["duplicated_tokens"] == 0
    assert summary["out_of_order_tokens"] == summary["order_failures"] == 0
    assert summary["unexpected_errors"] == {} and summary["expected_errors_wrong"] == {}
    assert all(summary["scenarios"].get(s) for s in ("plain", "slow_reader", "drop_and_resume"))
    assert summary["resume_paths"] and summary["expected_errors_ok"]
    # The server's own counters, scraped during the run, saw the load (and were plotted).
    metrics = report["metrics"]
    assert metrics["errors"] == [] and metrics["scrapes"] >= 2
    assert metrics["generated_tokens"] >= summary["tokens_checked"] > 0
    assert (tmp_path / "metrics.png").read_bytes().startswith(b"\x89PNG")
