"""The token log with log-probabilities: packed, read back bit for bit, a torn entry dropped."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time

import pytest

from quicsrv.engine import TokenLogprobs
from quicsrv.sessions.record import SessionRecord
from quicsrv.sessions.tokens import LogprobLog, entry_bytes, pack_entry, unpack_log
from tests.sessions.test_store import _record, _store

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


def _scored_record(session: bytes, expires: float) -> SessionRecord:
    record = _record(session, expires=expires)
    spec = dataclasses.replace(record.spec, logprobs=2, score_prompt=True)
    return dataclasses.replace(record, spec=spec, logprobs=None)


def test_a_file_store_keeps_the_logprobs_of_the_tokens_and_the_prompt(tmp_path) -> None:
    store = _store(tmp_path)
    record = _scored_record(b"a" * 16, 100.0)
    store.add(record)
    record.prompt_logprobs, record.ended_by = (SECOND, FIRST), (12, SECOND)
    store.append_token(record, 7, FIRST)
    store.append_token(record, 12, SECOND)
    store.save(record)
    store.flush().result(timeout=10)
    again = _store(tmp_path).get(b"a" * 16)  # as after a kill -9: what reached the kernel
    assert again is not None and list(again.generated) == [7, 12]
    assert again.logprobs is not None and list(again.logprobs) == [FIRST, SECOND]
    assert (again.prompt_logprobs, again.ended_by) == ((SECOND, FIRST), (12, SECOND))
    assert store.usage().disk_bytes >= 2 * entry_bytes(2)


@pytest.mark.asyncio
async def test_another_process_reads_the_logprobs_from_redis(redis_url) -> None:
    from tests.sessions.test_redis_store import _Appended
    from tests.sessions.test_redis_store import _store as redis_store

    a, b = redis_store(redis_url, "a"), redis_store(redis_url, "b")
    appended = _Appended()
    a.on_appended = appended
    record = _scored_record(b"r" * 16, time.time() + 60)
    a.add(record)
    a.append_token(record, 7, FIRST)
    a.append_token(record, 12, SECOND)
    await appended.wait(record)
    await asyncio.wrap_future(a.flush())
    found = await b.fetch(record.session_id)
    assert found is not None and list(found.record.generated) == [7, 12]
    assert found.record.logprobs is not None and list(found.record.logprobs) == [FIRST, SECOND]
    await a.aclose()
    await b.aclose()
