"""Sessions with a scripted engine: UTF-8 safety, stop sequences, limits, checkpoints, flow."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

import quicsrv_proto
from quicsrv.engine import CannotReplay, FinishReason, PromptTooLong
from quicsrv.sessions.admission import Slot
from quicsrv.sessions.generation import (
    INLINE_PROMPT_CHARS,
    RequestRejected,
    build_request,
    prepare_off_loop,
)
from quicsrv.sessions.manager import SessionManager
from quicsrv.settings import session_settings_for
from tests.fakes import FakeEngine


class FakePort:
    """A response stream whose acknowledgements the test controls."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.acked = 0
        self.ended = asyncio.Event()
        self.writes: list[tuple[int, int]] = []  # each send_frames: (frames, offset after)

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None:
        self.sent.extend(quicsrv_proto.encode_frame(frame))
        if end_stream:
            self.ended.set()

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        for frame in frames:
            self.send_frame(frame, False)
        self.writes.append((len(frames), len(self.sent)))

    def sent_offset(self) -> int:
        return len(self.sent)

    def acked_offset(self) -> int:
        return self.acked

    @property
    def frames(self) -> list[quicsrv_proto.Frame]:
        return quicsrv_proto.decode_frames(bytes(self.sent))


def _manager(tmp_path, engine: FakeEngine, **flow) -> SessionManager:
    return SessionManager(engine, session_settings_for(tmp_path, max_tokens_limit=64, **flow))


async def _drain_callbacks() -> None:
    # Engine callbacks hop to the loop with call_soon_threadsafe: one turn runs them all.
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def _slot(manager: SessionManager) -> Slot:
    return await manager.gate.acquire("test-client")


async def _stream(tmp_path, pieces: list[bytes], *, stop=(), finish=FinishReason.LENGTH):
    engine = FakeEngine()
    manager = _manager(tmp_path, engine)
    frame = quicsrv_proto.Generate(prompt="hi", max_tokens=len(pieces) or 1, stop=stop)
    session = manager.start(frame, slot=await _slot(manager))
    port = FakePort()
    session.attach(port, 0)
    engine.emit(pieces, finish)
    await port.ended.wait()
    return port.frames, engine, manager


@pytest.mark.asyncio
async def test_a_character_split_across_tokens_is_never_sent_broken(tmp_path):
    euro = "€".encode()  # three bytes
    frames, _, _ = await _stream(tmp_path, [b"a", euro[:1], euro[1:2], euro[2:], b"b"])
    texts = [f.text for f in frames if isinstance(f, quicsrv_proto.Token)]
    assert texts == ["a", "", "", "€", "b"]
    assert [f.index for f in frames if isinstance(f, quicsrv_proto.Token)] == [0, 1, 2, 3, 4]


@pytest.mark.asyncio
async def test_stop_sequence_across_tokens_is_held_back_and_not_emitted(tmp_path):
    frames, engine, _ = await _stream(
        tmp_path, [b"Hel", b"lo ", b"EN", b"D", b"more"], stop=("END",)
    )
    tokens = [f for f in frames if isinstance(f, quicsrv_proto.Token)]
    end = frames[-1]
    assert isinstance(end, quicsrv_proto.End) and end.reason is quicsrv_proto.EndReason.STOP
    assert "".join(t.text for t in tokens) == "Hello "
    assert engine.handles[-1].cancelled  # the engine stops generating at once


@pytest.mark.asyncio
async def test_held_back_prefix_is_released_in_end_when_no_stop_follows(tmp_path):
    frames, _, _ = await _stream(tmp_path, [b"abc", b"E"], stop=("END",))
    tokens = [f for f in frames if isinstance(f, quicsrv_proto.Token)]
    end = frames[-1]
    assert isinstance(end, quicsrv_proto.End) and end.reason is quicsrv_proto.EndReason.LENGTH
    assert "".join(t.text for t in tokens) + end.text == "abcE"


@pytest.mark.asyncio
async def test_eos_ends_with_usage(tmp_path):
    frames, _, _ = await _stream(tmp_path, [b"x", b"y"], finish=FinishReason.EOS)
    end = frames[-1]
    assert isinstance(end, quicsrv_proto.End)
    assert (end.reason, end.prompt_tokens, end.completion_tokens) == (
        quicsrv_proto.EndReason.EOS,
        2,
        2,
    )


@pytest.mark.asyncio
async def test_first_frame_is_a_checkpoint_naming_the_session(tmp_path):
    frames, _, manager = await _stream(tmp_path, [b"x"] * 20)
    first = frames[0]
    assert isinstance(first, quicsrv_proto.Checkpoint) and first.index == -1
    checkpoints = [f for f in frames if isinstance(f, quicsrv_proto.Checkpoint)]
    assert [c.index for c in checkpoints] == [-1, 15]
    record = manager.store.get(first.session_id)
    assert record is not None
    for c in checkpoints:
        assert record.snapshot().verify([manager.keys.current], c.index, c.snapshot_hash)


@pytest.mark.asyncio
async def test_a_resume_replays_exactly_the_frames_after_last_index(tmp_path):
    pieces = [b"a", "é".encode()[:1], "é".encode()[1:], b" b", b"c"]
    frames, _, manager = await _stream(tmp_path, pieces)
    checkpoint = frames[0]
    assert isinstance(checkpoint, quicsrv_proto.Checkpoint)
    for cut in range(-1, len(pieces)):
        resume = quicsrv_proto.ResumeStream(
            session_id=checkpoint.session_id,
            last_index=cut,
            snapshot_hash=checkpoint.snapshot_hash,
            hash_index=-1,
        )
        session = await manager.resume(resume, checkpoint.session_id)
        port = FakePort()
        session.attach(port, cut + 1)
        await port.ended.wait()
        replayed = [
            f for f in port.frames if isinstance(f, quicsrv_proto.Token | quicsrv_proto.End)
        ]
        original = [f for f in frames if isinstance(f, quicsrv_proto.Token | quicsrv_proto.End)]
        assert replayed == original[cut + 1 :]


@pytest.mark.asyncio
async def test_a_reader_that_stops_acknowledging_pauses_the_engine(tmp_path):
    engine = FakeEngine()
    manager = _manager(tmp_path, engine, max_tokens_ahead=4)
    session = manager.start(
        quicsrv_proto.Generate(prompt="hi", max_tokens=60), slot=await _slot(manager)
    )
    port = FakePort()
    session.attach(port, 0)
    handle = engine.handles[-1]
    assert handle.allowed == 4  # nothing acknowledged yet: 4 tokens ahead at most
    engine.emit([b"x"] * 4)
    await _drain_callbacks()
    port.acked = port.sent_offset()
    session.on_transport_progress()
    assert handle.allowed == 8
    # The engine obeys its allowance and pauses itself: the session is idle, nothing lost.
    engine.emit([b"y"] * 4, start=4)
    engine.pause_latest(tuple(range(1000, 1008)))
    await session.paused.wait()
    assert not session.running
    resubmitted = len(engine.handles)
    engine.submitted.clear()
    port.acked = port.sent_offset()
    session.on_transport_progress()  # drained: the session runs again without a new request
    await engine.submitted.wait()
    assert len(engine.handles) == resubmitted + 1
    resumed = engine.handles[-1].request.resume
    assert resumed is not None and resumed.generated == tuple(range(1000, 1008))
    assert resumed.kv_state == b"kv"


@pytest.mark.asyncio
async def test_a_burst_leaves_in_one_write_per_checkpoint_interval(tmp_path):
    engine = FakeEngine()
    manager = _manager(tmp_path, engine, max_tokens_ahead=64)
    session = manager.start(
        quicsrv_proto.Generate(prompt="hi", max_tokens=60), slot=await _slot(manager)
    )
    port = FakePort()
    session.attach(port, 0)
    engine.emit([b"x"] * 20)  # one burst, as one worker message delivers it
    await _drain_callbacks()
    # Tokens 0-15 and the checkpoint at 15, then tokens 16-19: two writes, not 21.
    assert [frames for frames, _ in port.writes] == [17, 4]
    # A reader holds a write's tokens once its last byte is acknowledged, not before.
    (_, first_end), (_, second_end) = port.writes
    port.acked = first_end - 1
    session.on_transport_progress()
    assert session.acknowledged_tokens == 0
    port.acked = first_end
    session.on_transport_progress()
    assert session.acknowledged_tokens == 16
    port.acked = second_end
    session.on_transport_progress()
    assert session.acknowledged_tokens == 20


def test_limits_are_checked_before_admission():
    engine = FakeEngine(context_per_sequence=10)
    with pytest.raises(RequestRejected) as too_long:
        build_request(
            engine, quicsrv_proto.Generate(prompt="x" * 8, max_tokens=4), max_tokens_limit=64
        )
    assert too_long.value.code == quicsrv_proto.ErrorCode.PROMPT_TOO_LONG
    with pytest.raises(RequestRejected) as over:
        build_request(
            engine, quicsrv_proto.Generate(prompt="x", max_tokens=65), max_tokens_limit=64
        )
    assert over.value.code == quicsrv_proto.ErrorCode.INVALID_FIELD
    assert not engine.sinks


class _ThreadRecordingEngine(FakeEngine):
    """Notes the thread each prompt is tokenized on."""

    def __init__(self) -> None:
        super().__init__(context_per_sequence=4096)
        self.tokenized_on: list[int] = []

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        self.tokenized_on.append(threading.get_ident())
        return super().tokenize(text, add_special=add_special, parse_special=parse_special)


@pytest.mark.asyncio
async def test_a_short_prompt_is_tokenized_on_the_loop_and_a_long_one_on_a_thread(tmp_path):
    engine = _ThreadRecordingEngine()
    manager = SessionManager(engine, session_settings_for(tmp_path, max_tokens_limit=64))
    loop_thread = threading.get_ident()
    many_empty = [quicsrv_proto.ChatMessage(role="user", content="")] * 64
    frames = [
        quicsrv_proto.Generate(prompt="x" * INLINE_PROMPT_CHARS, max_tokens=4),
        quicsrv_proto.Generate(prompt="x" * (INLINE_PROMPT_CHARS + 1), max_tokens=4),
        quicsrv_proto.Generate(
            messages=(quicsrv_proto.ChatMessage(role="user", content="hi"),), max_tokens=4
        ),
        quicsrv_proto.Generate(messages=tuple(many_empty), max_tokens=4),
    ]
    for frame in frames:
        request = await prepare_off_loop(manager.prepare, frame)
        assert request.spec.prompt_tokens == manager.prepare(frame).spec.prompt_tokens
    on_loop = [thread == loop_thread for thread in engine.tokenized_on[::2]]
    assert on_loop == [True, False, True, False]


@pytest.mark.asyncio
async def test_open_generation_starts_a_persisted_session(tmp_path):
    engine = FakeEngine()
    manager = _manager(tmp_path, engine)
    frame = quicsrv_proto.Generate(prompt="hi", max_tokens=4)
    now = asyncio.get_running_loop().time()
    session = await manager.open_generation(frame, client="c", owner="key-1", arrived_at=now)
    assert session.record.owner == "key-1"
    assert manager.store.get(session.session_id) is not None
    assert len(engine.sinks) == 1


@pytest.mark.asyncio
async def test_open_generation_refuses_once_shutting_down_and_gives_the_slot_back(tmp_path):
    engine = FakeEngine()
    manager = _manager(tmp_path, engine)
    manager.shutdown()
    frame = quicsrv_proto.Generate(prompt="hi", max_tokens=4)
    now = asyncio.get_running_loop().time()
    with pytest.raises(RequestRejected) as refused:
        await manager.open_generation(frame, client="c", owner="", arrived_at=now)
    assert refused.value.code == quicsrv_proto.ErrorCode.SHUTTING_DOWN
    assert manager.gate.active == 0
    assert not engine.sinks


class _RefusingResumes(FakeEngine):
    """Runs a first start; refuses every resume with ``refusal``."""

    refusal: Exception | None = None

    def submit(self, request, sink):
        if request.resume is not None and self.refusal is not None:
            raise self.refusal
        return super().submit(request, sink)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("refusal", "code"),
    [
        (CannotReplay("the plan no longer fits"), quicsrv_proto.ErrorCode.MODEL_CHANGED),
        (PromptTooLong("the context shrank"), quicsrv_proto.ErrorCode.PROMPT_TOO_LONG),
    ],
)
async def test_a_resume_the_engine_can_never_run_fails_its_reader_at_once(tmp_path, refusal, code):
    engine = _RefusingResumes()
    manager = _manager(tmp_path, engine)
    frame = quicsrv_proto.Generate(prompt="hi", max_tokens=8)
    session = manager.start(frame, slot=await _slot(manager))
    port = FakePort()
    session.attach(port, 0)
    engine.emit([b"a", b"b"])
    engine.pause_latest((1000, 1001), kv=None)
    await _drain_callbacks()
    checkpoint = port.frames[0]
    assert isinstance(checkpoint, quicsrv_proto.Checkpoint)
    engine.refusal = refusal
    resume = quicsrv_proto.ResumeStream(
        session_id=checkpoint.session_id,
        last_index=1,
        snapshot_hash=checkpoint.snapshot_hash,
        hash_index=-1,
    )
    resumed = await manager.resume(resume, checkpoint.session_id)
    again = FakePort()
    resumed.attach(again, 2)
    await asyncio.wait_for(again.ended.wait(), 10)  # not a retry every second, for ever
    (error,) = [f for f in again.frames if isinstance(f, quicsrv_proto.Error)]
    assert error.code == code


@pytest.mark.asyncio
async def test_an_unattended_session_runs_on_whoever_reads_it_and_leaves(tmp_path):
    """A background response: nobody reading never pauses it, a reader that stops reading
    only loses its stream, and one that leaves hands it back to the stand-in."""
    engine = FakeEngine()
    manager = _manager(tmp_path, engine, max_tokens_ahead=4)
    frame = quicsrv_proto.Generate(prompt="hi", max_tokens=32)
    session = manager.start(frame, slot=await _slot(manager), unattended=True)
    handle = engine.handles[-1]
    assert session.unattended and session.record.unattended and not session.attached
    engine.emit([b"a"] * 12)
    await _drain_callbacks()
    assert not handle.pause_requested and handle.allowed >= 12 + 4  # no reader holds it back
    reader = FakePort()  # one that never acknowledges
    session.attach(reader, 12)
    assert session.attached
    session.detach(reader)
    assert not handle.pause_requested and not session.attached
    engine.emit([b"b"] * 8, start=12)
    await _drain_callbacks()
    assert not handle.pause_requested and handle.allowed >= 20 + 4
    session.abandon()  # a stream that went before it learned the id: nothing to stop here
    assert not handle.pause_requested
    engine.emit([b"c"] * 4, FinishReason.EOS, start=20)
    await session.idle.wait()
    assert session.record.end is not None and len(session.record.generated) == 24
    stored = manager.store.get(session.session_id)
    assert stored is not None and stored.unattended
