"""What a reader holds and how far the engine may run ahead of it (sessions.reader): no loop,
no port; writes and acknowledgements are numbers, time is passed in."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from quicsrv.sessions.flow import MAX_AHEAD_FACTOR
from quicsrv.sessions.reader import ALLOWANCE_STEPS, ReaderFlow
from quicsrv.sessions.settings import FlowSettings

AHEAD = 64
HIGH = 256
LOW = 64


def _flow(**changes: object) -> FlowSettings:
    fields: dict[str, object] = dict(
        max_tokens_ahead=AHEAD,
        high_watermark_bytes=HIGH,
        low_watermark_bytes=LOW,
        checkpoint_every_tokens=16,
        coalesce_s=0.0,
        inexact_reprefill=False,
        prefix_cache_shared=False,
    )
    fields.update(changes)
    return FlowSettings(**fields)  # type: ignore[arg-type]


# A step: write ``tokens`` more tokens in ``size`` more bytes, or acknowledge a fraction of
# what was written and not yet acknowledged.
_write = st.tuples(st.just("write"), st.integers(0, 20), st.integers(0, 300))
_ack = st.tuples(st.just("ack"), st.floats(0.0, 1.0), st.just(0))


@given(start=st.integers(0, 50), steps=st.lists(st.one_of(_write, _ack), max_size=40))
def test_acknowledged_tokens_never_decrease_nor_pass_what_was_written(start, steps):
    reader = ReaderFlow(_flow(), start)
    sent = acked = 0
    writes: list[tuple[int, int]] = []  # (tokens up to, stream offset) of every write
    holds = start  # what the reader holds, by the rule itself
    now = 0.0
    for kind, amount, size in steps:
        now += 0.01
        before = reader.acked_tokens
        if kind == "write":
            sent += size
            writes.append((reader.next_index + amount, sent))
            reader.wrote(reader.next_index + amount, sent, now)
        else:
            acked += int((sent - acked) * amount)
            reader.acknowledged(acked, sent, now)
            # The tokens of the last write acknowledged to its last byte.
            holds = max([holds] + [upto for upto, offset in writes if offset <= acked])
        assert before <= reader.acked_tokens <= reader.next_index
        assert reader.acked_tokens == holds


def test_a_reader_is_blocked_at_the_high_watermark_until_it_drains_to_the_low_one():
    reader = ReaderFlow(_flow(), 0)
    reader.wrote(10, 300, now=0.0)
    blocked = []
    for acked in (0, 40, 150, 236, 250, 280):  # unacknowledged: 300, 260, 150, 64, 50, 20
        reader.acknowledged(acked, 300, now=1.0)
        blocked.append(reader.blocked)
    assert blocked == [True, True, True, False, False, False]
    reader.wrote(20, 500, now=2.0)  # 220 unacknowledged: under the high watermark
    reader.acknowledged(280, 500, now=2.0)
    assert not reader.blocked


def test_a_blocked_reader_allows_no_token_past_those_generated():
    reader = ReaderFlow(_flow(), 0)
    reader.wrote(40, HIGH, now=0.0)
    reader.acknowledged(0, HIGH, now=0.0)
    assert reader.blocked
    assert reader.allowance(37) == 37


@given(acked=st.integers(0, 10_000))
def test_the_allowance_moves_in_quarter_steps_and_keeps_three_quarters_of_headroom(acked):
    reader = ReaderFlow(_flow(), acked)
    step = AHEAD // ALLOWANCE_STEPS
    allowance = reader.allowance(acked)
    assert allowance % step == 0
    assert acked + AHEAD - step < allowance <= acked + AHEAD


def test_the_allowance_follows_acknowledgements_only_a_step_at_a_time():
    reader = ReaderFlow(_flow(), 0)
    allowances = []
    for tokens in range(1, 40):
        reader.wrote(tokens, tokens * 10, now=0.0)
        reader.acknowledged(tokens * 10, tokens * 10, now=0.0)
        allowances.append(reader.allowance(tokens))
    assert sorted(set(allowances)) == [64, 80, 96]  # 39 acknowledgements, 2 changes


def test_a_reader_whose_acknowledgements_take_long_is_allowed_more_up_to_a_bound():
    reader = ReaderFlow(_flow(), 0)
    reader.delivery.run_started()
    for i in range(0, 101, 10):  # 100 tokens per second
        reader.delivery.recorded(i, now=i / 100)
    assert reader.tokens_ahead() == AHEAD
    reader.wrote(10, 100, now=1.0)
    reader.acknowledged(100, 100, now=1.5)  # half a second from write to acknowledgement
    assert reader.tokens_ahead() == 2 * AHEAD  # 2 x 100/s x 0.5 s = 100 wanted: doubled once
    reader.wrote(20, 200, now=2.0)
    reader.acknowledged(200, 200, now=62.0)  # a minute
    assert reader.tokens_ahead() == MAX_AHEAD_FACTOR * AHEAD


def test_a_paused_sequence_restarts_only_once_the_reader_caught_up_by_half_the_tokens_ahead():
    reader = ReaderFlow(_flow(), 0)
    # Paused at the allowance (64): the reader acknowledges, a token at a time.
    restart_at = None
    for acked in range(0, 65):
        reader.wrote(acked, acked, now=0.0)
        reader.acknowledged(acked, acked, now=0.0)
        if restart_at is None and reader.has_room(64):
            restart_at = acked
    # Room is the allowance (a multiple of 16) past the 64 generated: 32 once 32 are held.
    assert restart_at == 32


def test_a_blocked_reader_never_has_room():
    reader = ReaderFlow(_flow(), 0)
    reader.wrote(1, HIGH, now=0.0)
    reader.acknowledged(0, HIGH, now=0.0)
    assert not reader.has_room(0)
