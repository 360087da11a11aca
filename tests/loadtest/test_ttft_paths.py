"""``python -m loadtest.bench.ttft_paths``: how it tells a first token in either encoding (the
measuring itself is a benchmark), and the nanosecond CPU meter the CPU benchmark reads."""

from __future__ import annotations

import os

import quicsrv_proto
from loadtest.bench.machine import threads_cpu_s
from loadtest.bench.ttft_paths import _event_text, _holds_a_token


def test_a_first_token_is_told_in_frames():
    checkpoint = quicsrv_proto.Checkpoint(
        session_id=bytes(16), index=-1, snapshot_hash=bytes(quicsrv_proto.SNAPSHOT_HASH_BYTES)
    )
    opening = quicsrv_proto.encode_frame(checkpoint)
    token = quicsrv_proto.encode_frame(quicsrv_proto.Token(index=0, token_id=5, text="Hi"))
    assert not _holds_a_token(opening)
    assert not _holds_a_token(opening + token[:-1])  # a frame still incomplete
    assert _holds_a_token(opening + token)


def test_a_first_token_is_told_in_sse_events():
    opening = b'data: {"choices": [{"text": "", "index": 0}]}\n\n'
    token = b'data: {"choices": [{"text": "Hi", "index": 0}]}\n\n'
    assert not _holds_a_token(opening)
    assert _holds_a_token(opening + token)
    assert _event_text("data: [DONE]") == ""
    assert _event_text(": keep-alive") == ""


def test_the_thread_meter_counts_this_process_and_nothing_for_a_gone_one():
    before = threads_cpu_s(os.getpid())
    sum(i * i for i in range(200_000))
    assert threads_cpu_s(os.getpid()) > before > 0
    assert threads_cpu_s(2**22 + 12345) == 0.0
