"""What the log says of a pause that did not land in the shutdown's grace period."""

from __future__ import annotations

from quicsrv.engine import EngineHealth
from quicsrv.sessions.handover import late_pause_reason


def test_an_engine_that_takes_no_work_says_why():
    reason = late_pause_reason(EngineHealth(failure="breaker open"), "pausing", 0)
    assert reason == "the engine takes no work (breaker open)"


def test_a_restarting_worker_is_named():
    assert "worker died" in late_pause_reason(EngineHealth(restarting=True), "pausing", 0)


def test_tokens_after_the_pause_was_asked_mean_the_engine_had_not_reached_it():
    reason = late_pause_reason(EngineHealth(), "pausing", 7)
    assert "7 tokens since the pause was asked" in reason and "not reached" in reason


def test_no_token_since_means_a_slow_or_stuck_step():
    reason = late_pause_reason(EngineHealth(), "pausing", 0)
    assert "decoded nothing for it" in reason and "stuck" in reason
