"""The restart policy on its own: every row of its table, and the breaker's round trip."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from quicsrv.engine.restarts import (
    Action,
    Breaker,
    RestartPolicy,
    RestartState,
    WorkerDeath,
    decide,
    half_open,
    proven,
    worker_ready,
)

POLICY = RestartPolicy(
    max_restarts=2,
    window_s=60.0,
    cooldown_s=10.0,
    max_cooldown_s=35.0,
    probation_steps=3,
    auto_safe_mode=True,
)
RUNNING = RestartState(extra_buffers=False, ever_ready=True)


def _death(at: float = 100.0, **facts: bool) -> WorkerDeath:
    return WorkerDeath(
        at=at,
        before_ready=facts.get("before_ready", False),
        in_canary=facts.get("in_canary", False),
        kernel_fault=facts.get("kernel_fault", False),
    )


def test_restarts_within_the_budget_are_counted_in_the_window():
    first = decide(POLICY, RUNNING, _death(at=100.0))
    assert first.action is Action.RESTART and first.state.restarts == (100.0,)
    second = decide(POLICY, first.state, _death(at=110.0))
    assert second.action is Action.RESTART and second.state.restarts == (100.0, 110.0)
    # The first restart left the window: room for one more.
    third = decide(POLICY, second.state, _death(at=161.0))
    assert third.action is Action.RESTART and third.state.restarts == (110.0, 161.0)


def test_a_crash_loop_opens_the_breaker_for_the_cool_down():
    state = dataclasses.replace(RUNNING, restarts=(100.0, 110.0))
    opened = decide(POLICY, state, _death(at=120.0))
    assert opened.action is Action.OPEN
    assert opened.state.breaker is Breaker.OPEN
    assert opened.state.retry_at == 130.0 and opened.state.cooldown_s == 10.0
    assert opened.state.restarts == ()


def test_a_crash_loop_before_any_worker_was_ready_gives_up():
    state = RestartState(extra_buffers=False, restarts=(100.0, 110.0))
    given_up = decide(POLICY, state, _death(at=120.0, before_ready=True))
    assert given_up.action is Action.GIVE_UP
    assert given_up.state.breaker is Breaker.CLOSED


def test_half_open_then_probation_closes_and_forgets_the_history():
    opened = decide(POLICY, dataclasses.replace(RUNNING, restarts=(1.0, 2.0)), _death(at=3.0))
    trying = half_open(POLICY, opened.state)
    assert trying.breaker is Breaker.HALF_OPEN and trying.probation_left == 3
    assert trying.retry_at is None
    assert proven(trying, 2).breaker is Breaker.HALF_OPEN
    closed = proven(proven(trying, 2))
    assert closed.breaker is Breaker.CLOSED
    assert closed.restarts == () and closed.cooldown_s == 0.0
    assert proven(closed) == closed  # steps of a closed breaker change nothing


def test_a_failed_half_open_try_doubles_the_cool_down_up_to_the_cap():
    state = half_open(
        POLICY,
        decide(POLICY, dataclasses.replace(RUNNING, restarts=(1.0, 2.0)), _death(at=3.0)).state,
    )
    cooldowns = []
    now = 50.0
    for _ in range(4):
        decision = decide(POLICY, state, _death(at=now))
        assert decision.action is Action.OPEN
        assert decision.state.retry_at == now + decision.state.cooldown_s
        cooldowns.append(decision.state.cooldown_s)
        state = half_open(POLICY, decision.state)
        now += 100.0
    assert cooldowns == [20.0, 35.0, 35.0, 35.0]
    # Before ready counts as failed too, and a closed breaker starts from the base again.
    again = decide(POLICY, state, _death(at=now, before_ready=True))
    assert again.action is Action.OPEN and again.state.cooldown_s == 35.0
    closed = proven(half_open(POLICY, again.state), 3)
    loop = decide(POLICY, dataclasses.replace(closed, restarts=(now, now)), _death(at=now + 1))
    assert loop.state.cooldown_s == 10.0


def test_only_an_open_breaker_half_opens():
    with pytest.raises(ValueError):
        half_open(POLICY, RUNNING)


def test_a_canary_crash_with_extra_buffers_is_safe_mode_and_not_counted():
    state = RestartState(extra_buffers=True)
    for facts in ({"in_canary": True}, {"kernel_fault": True}):
        decision = decide(POLICY, state, _death(before_ready=True, **facts))
        assert decision.action is Action.SAFE_MODE
        assert decision.state.extra_buffers is False and decision.state.restarts == ()


def test_two_kernel_faults_in_a_row_while_running_are_safe_mode():
    state = RestartState(extra_buffers=True, ever_ready=True)
    first = decide(POLICY, state, _death(at=1.0, kernel_fault=True))
    assert first.action is Action.RESTART and first.state.extra_buffers
    assert first.state.kernel_faults_in_a_row == 1
    second = decide(POLICY, first.state, _death(at=2.0, kernel_fault=True))
    assert second.action is Action.SAFE_MODE and not second.state.extra_buffers
    assert second.state.restarts == (1.0, 2.0)  # a running worker's restart counts
    interrupted = decide(POLICY, first.state, _death(at=2.0))
    assert interrupted.action is Action.RESTART and interrupted.state.kernel_faults_in_a_row == 0


def test_without_auto_the_extra_buffers_stay_as_configured():
    forced = dataclasses.replace(POLICY, auto_safe_mode=False)
    state = RestartState(extra_buffers=True)
    decision = decide(forced, state, _death(before_ready=True, in_canary=True))
    assert decision.action is Action.RESTART and decision.state.extra_buffers


def test_every_state_and_death_has_exactly_one_sensible_decision():
    """Exhaustively: breaker x budget x readiness x buffers x auto x the death's facts."""
    for breaker, full, ever_ready, extra, auto, before, canary, fault in itertools.product(
        [Breaker.CLOSED, Breaker.HALF_OPEN], *[[False, True]] * 7
    ):
        policy = dataclasses.replace(POLICY, auto_safe_mode=auto)
        state = RestartState(
            extra_buffers=extra,
            breaker=breaker,
            restarts=(95.0, 99.0) if full else (),
            ever_ready=ever_ready or breaker is Breaker.HALF_OPEN,
            cooldown_s=10.0 if breaker is Breaker.HALF_OPEN else 0.0,
        )
        death = _death(before_ready=before, in_canary=canary, kernel_fault=fault)
        decision = decide(policy, state, death)
        after = decision.state
        assert after.extra_buffers <= extra  # safe mode is one way
        if not (extra and auto):
            assert after.extra_buffers == extra
        if breaker is Breaker.HALF_OPEN:
            assert decision.action is Action.OPEN and after.cooldown_s == 20.0
        elif decision.action is Action.GIVE_UP:
            assert full and not state.ever_ready
        elif decision.action is Action.OPEN:
            assert full and state.ever_ready and after.retry_at == 110.0
        elif decision.action is Action.SAFE_MODE:
            assert extra and auto and not after.extra_buffers
        else:
            assert decision.action is Action.RESTART and after.restarts[-1] == 100.0
        assert (after.breaker is Breaker.OPEN) == (decision.action is Action.OPEN)
        assert after.retry_at is None or after.breaker is Breaker.OPEN


def test_a_ready_worker_turns_giving_up_into_opening():
    state = worker_ready(RestartState(extra_buffers=False, restarts=(1.0, 2.0)))
    assert decide(POLICY, state, _death(at=3.0)).action is Action.OPEN
