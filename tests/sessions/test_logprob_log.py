"""The token log with log-probabilities: packed, read back bit for bit, a torn entry dropped."""

from __future__ import annotations

import math

from quicsrv.engine import TokenLogprobs
from quicsrv.sessions.tokens import LogprobLog, entry_bytes, pack_entry, unpack_log

# float32 values, as the engine makes them.
FIRST = TokenLogprobs(-0.125, ((7, -0.125), (9, -2.5)))
SECOND = TokenLogprobs(-3.0, ((4, -0.75), (12, -1.5)))


def test_an_entry_is_the_token_then_its_logprobs_and_reads_back_exactly() -> None:
    raw = pack_entry(7, 2, FIRST) + pack_entry(12, 2, SECOND)
    assert len(raw) == 2 * entry_bytes(2) == 2 * (4 + 4 + 2 * 8)
    tokens, log = unpack_log(raw, 2)
    assert list(tokens) == [7, 12]
    assert log is not None and list(log) == [FIRST, SECOND]


def test_a_torn_last_entry_is_dropped() -> None:
    raw = pack_entry(7, 2, FIRST) + pack_entry(12, 2, SECOND)[:-3]
    tokens, log = unpack_log(raw, 2)
    assert list(tokens) == [7] and log is not None and list(log) == [FIRST]


def test_without_logprobs_an_entry_is_the_token_alone() -> None:
    assert pack_entry(7, None, None) == (7).to_bytes(4, "little")
    tokens, log = unpack_log(pack_entry(7, None, None), None)
    assert list(tokens) == [7] and log is None


def test_missing_logprobs_are_kept_as_nans_in_their_place() -> None:
    log = LogprobLog(2)
    log.append(None)
    log.append(SECOND)
    assert math.isnan(log[0].logprob) and len(log[0].top) == 2
    assert log[1] == SECOND and len(log) == 2
