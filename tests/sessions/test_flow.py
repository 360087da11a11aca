"""How far the engine may run ahead of a reader: the rule and the meter it reads."""

from __future__ import annotations

import pytest

from quicsrv.sessions.flow import MAX_AHEAD_FACTOR, DeliveryMeter, tokens_ahead


@pytest.mark.parametrize(
    ("tokens_per_s", "delay_s", "expected"),
    [
        (0.0, 10.0, 64),  # nothing timed yet: the configured allowance
        (100.0, 0.1, 64),  # 20 tokens wanted: the configured allowance covers them
        (100.0, 0.425, 128),  # 85 wanted (a 300 ms round trip): doubled once
        (300.0, 0.425, 256),  # 255 wanted: doubled twice
        (1000.0, 5.0, 64 * MAX_AHEAD_FACTOR),  # a reader slow on purpose gets no more
    ],
)
def test_the_allowance_covers_twice_the_tokens_in_flight_in_doublings(
    tokens_per_s, delay_s, expected
):
    assert tokens_ahead(64, tokens_per_s, delay_s) == expected


def test_the_rate_counts_running_time_only():
    meter = DeliveryMeter()
    meter.run_started()
    meter.recorded(1, now=10.0)  # the first token, after the prefill: no rate yet
    meter.recorded(9, now=10.1)  # 8 tokens in 0.1 s
    assert meter.tokens_per_s == pytest.approx(80.0)
    meter.run_started()  # paused for a minute, then restarted: that minute is no decoding
    meter.recorded(9, now=70.0)
    meter.recorded(17, now=70.1)
    assert meter.tokens_per_s == pytest.approx(80.0)


def test_a_rate_is_not_guessed_from_a_token_or_an_instant():
    one_token = DeliveryMeter()
    one_token.recorded(1, now=0.0)
    one_token.recorded(2, now=0.1)
    assert one_token.tokens_per_s == 0.0
    instant = DeliveryMeter()
    instant.recorded(2, now=1.0)
    instant.recorded(60, now=1.001)  # a burst that came all at once
    assert instant.tokens_per_s == 0.0


def test_the_acknowledgement_delay_rises_at_once_and_decays_smoothly():
    meter = DeliveryMeter()
    meter.acknowledged(written_at=0.0, now=0.3)
    assert meter.ack_delay_s == pytest.approx(0.3)
    meter.acknowledged(written_at=1.0, now=1.01)
    assert meter.ack_delay_s == pytest.approx(0.875 * 0.3 + 0.125 * 0.01)
    meter.acknowledged(written_at=2.0, now=2.5)
    assert meter.ack_delay_s == pytest.approx(0.5)
