"""Rate limits as a pure policy: GCRA buckets on a clock the test moves, the refusal and its
retry hint, the debt a running generation leaves, the headers OpenAI sends, the bound."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quicsrv.rate_limits import (
    Gcra,
    Quota,
    RateLimited,
    RateLimiter,
    RateLimits,
    address_key,
    openai_duration,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limiter(**limits: int) -> tuple[RateLimiter, Quota, Clock]:
    clock = Clock()
    return RateLimiter(clock=clock), Quota("key:alice", RateLimits(**limits)), clock


def test_a_minutes_requests_pass_at_once_then_one_per_interval():
    rates, quota, clock = _limiter(requests_per_minute=3)
    for _ in range(3):
        rates.admit(quota)
    with pytest.raises(RateLimited) as refused:
        rates.admit(quota)
    assert refused.value.limit == "requests"
    assert refused.value.retry_after_s == pytest.approx(20.0)
    assert "Limit 3" in refused.value.message and "try again in 20s" in refused.value.message
    clock.now += 19.9
    with pytest.raises(RateLimited):
        rates.admit(quota)  # a refusal spends nothing: still 0.1 s to wait
    clock.now += 0.1
    rates.admit(quota)
    assert rates.refusals == {"requests": 2}


def test_a_running_generation_is_charged_past_its_budget_and_the_debt_delays_the_next():
    rates, quota, clock = _limiter(tokens_per_minute=600)  # one token per 0.1 s
    rates.admit(quota)
    rates.charge_tokens(quota.key, 900)  # never refused: 300 tokens of debt
    state = rates.state(quota)
    assert state is not None and state.remaining_tokens == 0
    assert state.reset_tokens_s == pytest.approx(90.0)
    with pytest.raises(RateLimited) as refused:
        rates.admit(quota)
    assert refused.value.limit == "tokens"
    assert refused.value.retry_after_s == pytest.approx(30.1)  # the debt, then one token
    clock.now += 30.1
    rates.admit(quota)


def test_the_longer_wait_of_two_spent_limits_is_the_hint():
    rates, quota, _ = _limiter(requests_per_minute=1, tokens_per_minute=60)
    rates.admit(quota)
    rates.charge_tokens(quota.key, 120)
    with pytest.raises(RateLimited) as refused:
        rates.admit(quota)
    assert refused.value.limit == "tokens"
    assert refused.value.retry_after_s == pytest.approx(61.0)


def test_no_limits_no_buckets_and_tokens_of_an_unknown_client_cost_nothing():
    rates, quota, _ = _limiter()
    for _ in range(1000):
        rates.admit(quota)
    rates.charge_tokens("key:nobody", 10**6)
    assert len(rates) == 0 and rates.state(quota) is None


def test_the_headers_say_what_openai_says():
    rates, quota, clock = _limiter(requests_per_minute=60, tokens_per_minute=1000)
    rates.admit(quota)
    rates.charge_tokens(quota.key, 100)
    clock.now += 0.5
    state = rates.state(quota)
    assert state is not None
    assert dict(state.headers()) == {
        b"x-ratelimit-limit-requests": b"60",
        # The one request spent comes back 1 s after it, so 0.5 s from now; 59 fit meanwhile.
        b"x-ratelimit-remaining-requests": b"59",
        b"x-ratelimit-reset-requests": b"500ms",
        b"x-ratelimit-limit-tokens": b"1000",
        # 100 tokens are 6 s of the minute, 0.5 s of them gone: 5.5 s is 91.67 tokens.
        b"x-ratelimit-remaining-tokens": b"908",
        b"x-ratelimit-reset-tokens": b"5.5s",
    }


def test_only_the_limits_that_are_set_have_headers():
    rates, quota, _ = _limiter(tokens_per_minute=10)
    state = rates.state(quota)
    assert state is not None
    assert {name for name, _ in state.headers()} == {
        b"x-ratelimit-limit-tokens",
        b"x-ratelimit-remaining-tokens",
        b"x-ratelimit-reset-tokens",
    }


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.12, "120ms"), (0.0004, "1ms"), (1, "1s"), (8.64, "8.64s"), (360, "6m0s")]
    + [(3723.5, "1h2m3.5s"), (61.25, "1m1.25s")],
)
def test_durations_are_written_as_openai_writes_them(seconds, text):
    assert openai_duration(seconds) == text


def test_a_changed_limit_keeps_what_was_spent():
    rates, quota, _ = _limiter(requests_per_minute=2)
    rates.admit(quota)
    rates.admit(quota)
    rates.admit(Quota(quota.key, RateLimits(requests_per_minute=3)))  # 2 of 3 were spent
    with pytest.raises(RateLimited):
        rates.admit(Quota(quota.key, RateLimits(requests_per_minute=3)))
    with pytest.raises(RateLimited):
        rates.admit(Quota(quota.key, RateLimits(requests_per_minute=1)))  # 3 spent, 1 allowed


def test_the_table_is_bounded_full_buckets_first_then_the_oldest():
    clock = Clock()
    rates = RateLimiter(clock=clock, max_clients=10)
    limits = RateLimits(requests_per_minute=1)
    for n in range(10):
        rates.admit(Quota(f"addr:10.0.0.{n}", limits))
    clock.now += 60.0  # every bucket full again: the same as none
    rates.admit(Quota("addr:10.0.1.0", limits))
    assert len(rates) == 1
    for n in range(20):
        rates.admit(Quota(f"addr:10.0.2.{n}", limits))  # none full: the oldest go
    assert len(rates) <= 10
    with pytest.raises(RateLimited):
        rates.admit(Quota("addr:10.0.2.19", limits))  # the newest are kept


@pytest.mark.parametrize(
    ("address", "key"),
    [
        ("192.0.2.7", "addr:192.0.2.7"),
        ("::ffff:192.0.2.7", "addr:192.0.2.7"),
        ("2001:db8:1:2:3:4:5:6", "addr:2001:db8:1:2::/64"),
        ("conn:4", "addr:conn:4"),
    ],
)
def test_an_open_servers_clients_are_their_addresses_ipv6_per_64(address, key):
    assert address_key(address) == key


@given(
    limit=st.integers(1, 1000),
    steps=st.lists(st.tuples(st.floats(0, 30), st.integers(0, 50)), max_size=40),
)
def test_a_bucket_never_lets_more_than_limit_plus_elapsed_through(limit, steps):
    """GCRA's promise, whatever the arrivals: in any run from a full bucket, what passed is
    at most the limit plus what the elapsed time earned (rate x time)."""
    now = 0.0
    bucket = Gcra(limit, now)
    passed = 0
    for advance, tries in steps:
        now += advance
        for _ in range(tries):
            if bucket.fits(now):
                bucket.take(now, 1)
                passed += 1
        assert passed <= limit + now / bucket.interval_s + 1e-6
        assert 0 <= bucket.remaining(now) <= limit
