"""A response stream's H3 events become client events, a batch per DATA chunk (no sockets)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from aioquic.h3.events import DataReceived, HeadersReceived

import quicsrv_proto
from quicsrv_client import (
    CheckpointReceived,
    GenerationEnded,
    ServerError,
    SessionStarted,
    TokenReceived,
)
from quicsrv_client._generation import read_response
from quicsrv_client._protocol import H3Protocol

SESSION = "ab" * 16


class _Consumed:
    def __init__(self) -> None:
        self.offsets: list[int] = []

    def mark_consumed(self, stream_id: int, offset: int) -> None:
        self.offsets.append(offset)


def _data(*frames: quicsrv_proto.Frame) -> DataReceived:
    payload = b"".join(quicsrv_proto.encode_frame(f) for f in frames)
    return DataReceived(data=payload, stream_id=0, stream_ended=False)


async def _batches(*events: Any) -> tuple[list[list[Any]], BaseException | None]:
    queue: asyncio.Queue[Any] = asyncio.Queue()
    queue.put_nowait(
        (
            HeadersReceived(
                headers=[
                    (b":status", b"200"),
                    (quicsrv_proto.http3.SESSION_HEADER, SESSION.encode()),
                ],
                stream_id=0,
                stream_ended=False,
            ),
            0,
        )
    )
    for offset, event in enumerate(events, start=1):
        queue.put_nowait((event, offset))
    batches: list[list[Any]] = []
    try:
        async for batch in read_response(cast(H3Protocol, _Consumed()), 0, queue):
            batches.append(batch)
    except BaseException as exc:  # the test looks at what ended it
        return batches, exc
    return batches, None


@pytest.mark.asyncio
async def test_a_burst_in_one_data_chunk_is_one_batch_in_order():
    burst = _data(
        quicsrv_proto.Token(index=0, token_id=5, text="a"),
        quicsrv_proto.Checkpoint(
            session_id=bytes.fromhex(SESSION), index=0, snapshot_hash=b"h" * 32
        ),
        quicsrv_proto.Token(index=1, token_id=6, text="b"),
    )
    end = _data(
        quicsrv_proto.End(
            reason=quicsrv_proto.EndReason.LENGTH, prompt_tokens=1, completion_tokens=2
        )
    )
    batches, ended_by = await _batches(burst, end)
    assert ended_by is None
    assert [[type(e) for e in batch] for batch in batches] == [
        [SessionStarted],
        [TokenReceived, CheckpointReceived, TokenReceived],
        [GenerationEnded],
    ]
    assert [e.index for e in batches[1]] == [0, 0, 1]


@pytest.mark.asyncio
async def test_tokens_before_an_error_in_the_same_chunk_are_delivered_first():
    chunk = _data(
        quicsrv_proto.Token(index=0, token_id=5, text="a"),
        quicsrv_proto.Error(code=quicsrv_proto.ErrorCode.ENGINE_UNAVAILABLE, message="engine gone"),
    )
    batches, ended_by = await _batches(chunk)
    assert [[type(e) for e in batch] for batch in batches] == [[SessionStarted], [TokenReceived]]
    assert isinstance(ended_by, ServerError) and "engine gone" in str(ended_by)
