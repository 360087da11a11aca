"""The engine's sink of a session (sessions.sink): reports made on the engine thread go to the
loop one post each, with a paused sequence's cells stored before (no loop: the inbox records);
and the link to its session, which lasts no longer than the session runs."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Sequence

import pytest

import quicsrv_proto
from quicsrv.engine import FinishReason, PausedState, PrefillPlan, ResumePath
from quicsrv.sessions.manager import SessionManager
from quicsrv.sessions.sink import LoopSink
from quicsrv.settings import session_settings_for
from tests.fakes import FakeEngine

SESSION = b"s" * 16


class _Inbox:
    def __init__(self) -> None:
        self.posted: list[tuple[object, tuple[object, ...]]] = []

    def post(self, callback: object, *args: object) -> None:
        self.posted.append((callback, args))


class _KV:
    def __init__(self) -> None:
        self.put_calls: list[tuple[bytes, int, bytes]] = []

    def put(self, session: bytes, n_generated: int, blob: bytes) -> None:
        self.put_calls.append((session, n_generated, blob))


class _Session:
    """Where the reports go (the session's loop-side TokenSink methods)."""

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None: ...

    def prompt_scored(self, logprobs: object, ended: object) -> None: ...

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None: ...

    def sequence_paused(self, state: PausedState) -> None: ...

    def sequence_resumed(self, path: ResumePath) -> None: ...

    def sequence_planned(self, plan: PrefillPlan) -> None: ...


def _sink() -> tuple[LoopSink, _Inbox, _KV]:
    inbox, kv = _Inbox(), _KV()
    return LoopSink(inbox=inbox, kv=kv, session_id=SESSION), inbox, kv  # type: ignore[arg-type]


def test_every_report_is_one_post_of_the_targets_same_method_in_order():
    sink, inbox, _ = _sink()
    target = _Session()
    sink.target = target
    plan = PrefillPlan.plain(3, 16)
    sink.sequence_planned(plan)
    sink.token_generated(0, 7, b"a", None)
    sink.token_generated(1, 8, b"b", None)
    sink.sequence_resumed(ResumePath.REPLAY)
    sink.sequence_finished(FinishReason.EOS, 2)
    assert inbox.posted == [
        (target.sequence_planned, (plan,)),
        (target.token_generated, (0, 7, b"a", None)),
        (target.token_generated, (1, 8, b"b", None)),
        (target.sequence_resumed, (ResumePath.REPLAY,)),
        (target.sequence_finished, (FinishReason.EOS, 2)),
    ]


def test_a_pauses_cells_are_stored_on_the_engine_thread_and_not_sent_to_the_loop():
    sink, inbox, kv = _sink()
    target = _Session()
    sink.target = target
    sink.sequence_paused(PausedState(generated=(5, 6, 7), kv_state=b"cells"))
    assert kv.put_calls == [(SESSION, 3, b"cells")]
    assert inbox.posted == [
        (target.sequence_paused, (PausedState(generated=(5, 6, 7), kv_state=None),))
    ]
    sink.sequence_paused(PausedState(generated=(5,), kv_state=None))  # none captured
    assert len(kv.put_calls) == 1


def test_without_a_target_nothing_is_posted():
    sink, inbox, kv = _sink()
    sink.token_generated(0, 7, b"a", None)
    sink.sequence_paused(PausedState(generated=(7,), kv_state=b"cells"))
    assert inbox.posted == []
    assert kv.put_calls == [(SESSION, 1, b"cells")]  # the cells are kept all the same


def test_the_engine_may_hold_it_by_a_weak_reference():
    """The engine's poison watch names a generation by its sink and holds it weakly: a sink
    it could not reference weakly would be kept, and its session with it."""
    sink, _, _ = _sink()
    reference = weakref.ref(sink)
    assert reference() is sink
    del sink
    assert reference() is None


@pytest.mark.asyncio
async def test_an_idle_session_is_freed_at_once_though_the_engine_keeps_its_sink(tmp_path):
    """The sink's link to its session lasts from a submit until the session is idle: no
    reference cycle outlives the run, so nothing waits for the cycle collector."""
    engine = FakeEngine()
    manager = SessionManager(engine, session_settings_for(tmp_path, max_tokens_limit=64))
    frame = quicsrv_proto.Generate(prompt="hi", max_tokens=2)
    session = manager.start(frame, slot=await manager.gate.acquire("client"))
    port = _Port()
    session.attach(port, 0)
    sink = engine.sinks[-1]
    assert isinstance(sink, LoopSink) and sink.target is session
    engine.emit([b"a", b"b"], FinishReason.LENGTH)
    await port.ended.wait()
    await session.idle.wait()
    assert sink.target is None
    freed = weakref.ref(session)
    gc.disable()
    try:
        del session
        assert freed() is None
    finally:
        gc.enable()
    manager.close()


class _Port:
    def __init__(self) -> None:
        self.sent = 0
        self.ended = asyncio.Event()

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None:
        self.sent += 1
        if end_stream:
            self.ended.set()

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        self.sent += len(frames)

    def sent_offset(self) -> int:
        return self.sent

    def acked_offset(self) -> int:
        return self.sent
