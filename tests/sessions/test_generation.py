"""GenerationStream with a scripted engine: UTF-8 safety, stop sequences, limits."""

from __future__ import annotations

import asyncio

import pytest

import proto
from quicsrv.engine import FinishReason
from quicsrv.sessions import GenerationStream, RequestRejected, build_request
from tests.fakes import FakeEngine


async def _stream(pieces: list[bytes], *, stop: tuple[str, ...] = (), finish=FinishReason.LENGTH):
    engine = FakeEngine()
    loop = asyncio.get_running_loop()
    sent = bytearray()
    ended = asyncio.Event()

    def send(data: bytes, end: bool) -> None:
        sent.extend(data)
        if end:
            ended.set()

    request = build_request(
        engine, proto.Generate(prompt="hi", max_tokens=len(pieces) or 1), max_tokens_limit=64
    )
    stream = GenerationStream(
        engine=engine, request=request, stop=stop, send=send, loop=loop, on_done=lambda _s: None
    )
    stream.start()
    engine.emit(pieces, finish)
    await ended.wait()
    return proto.decode_frames(bytes(sent)), engine


@pytest.mark.asyncio
async def test_a_character_split_across_tokens_is_never_sent_broken():
    euro = "€".encode()  # three bytes
    frames, _ = await _stream([b"a", euro[:1], euro[1:2], euro[2:], b"b"])
    texts = [f.text for f in frames if isinstance(f, proto.Token)]
    assert texts == ["a", "", "", "€", "b"]
    assert [f.index for f in frames if isinstance(f, proto.Token)] == [0, 1, 2, 3, 4]


@pytest.mark.asyncio
async def test_stop_sequence_across_tokens_is_held_back_and_not_emitted():
    frames, engine = await _stream([b"Hel", b"lo ", b"EN", b"D", b"more"], stop=("END",))
    tokens = [f for f in frames if isinstance(f, proto.Token)]
    end = frames[-1]
    assert isinstance(end, proto.End) and end.reason is proto.EndReason.STOP
    assert "".join(t.text for t in tokens) == "Hello "
    assert engine.handles[-1].cancelled  # the engine stops generating at once


@pytest.mark.asyncio
async def test_held_back_prefix_is_released_in_end_when_no_stop_follows():
    frames, _ = await _stream([b"abc", b"E"], stop=("END",), finish=FinishReason.LENGTH)
    tokens = [f for f in frames if isinstance(f, proto.Token)]
    end = frames[-1]
    assert isinstance(end, proto.End) and end.reason is proto.EndReason.LENGTH
    assert "".join(t.text for t in tokens) + end.text == "abcE"


@pytest.mark.asyncio
async def test_eos_ends_with_usage():
    frames, _ = await _stream([b"x", b"y"], finish=FinishReason.EOS)
    end = frames[-1]
    assert isinstance(end, proto.End)
    assert (end.reason, end.prompt_tokens, end.completion_tokens) == (proto.EndReason.EOS, 2, 2)


def test_limits_are_checked_before_admission():
    engine = FakeEngine(context_per_sequence=10)
    with pytest.raises(RequestRejected) as too_long:
        build_request(engine, proto.Generate(prompt="x" * 8, max_tokens=4), max_tokens_limit=64)
    assert too_long.value.code == proto.ErrorCode.PROMPT_TOO_LONG
    with pytest.raises(RequestRejected) as over:
        build_request(engine, proto.Generate(prompt="x", max_tokens=65), max_tokens_limit=64)
    assert over.value.code == proto.ErrorCode.INVALID_FIELD
    assert not engine.sinks
