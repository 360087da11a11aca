"""The session lifecycle: the table on its own (every state x event, random event sequences),
then real sessions driven by a scripted engine through random interleavings of attach,
detach, acknowledgements, engine pauses and finishes, cancels, worker restarts, shutdown and
hand-over (a Hypothesis rule-based state machine).
"""

from __future__ import annotations

import asyncio
import inspect
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import quicsrv_proto
from quicsrv.engine import EngineUnavailable, FinishReason, PausedState, SequenceRequest, TokenSink
from quicsrv.sessions.admission import Slot
from quicsrv.sessions.lifecycle import (
    HOLDS_SEQUENCE,
    IDLE,
    STALE,
    TRANSITIONS,
    WAITING,
    IllegalTransition,
    SessionEvent,
    SessionState,
    allows,
    next_state,
)
from quicsrv.sessions.manager import SessionManager
from quicsrv.settings import session_settings_for
from tests.fakes import FakeEngine, FakeHandle

S = SessionState
E = SessionEvent

ENGINE_RELEASES = {E.ENGINE_PAUSED, E.ENGINE_COMPLETED, E.ENGINE_STOPPED, E.ENGINE_FAILED}
# Events that would make the engine do (or prepare) work for the session.
PROGRESS = {E.SUBMITTED, E.RESUME_QUEUED, E.QUEUED}
FINAL = {S.ENDED, S.HANDED_OVER}


def _reachable(start: set[SessionState]) -> set[SessionState]:
    seen, todo = set(start), deque(start)
    while todo:
        state = todo.popleft()
        for (before, _), after in TRANSITIONS.items():
            if before is state and after not in seen:
                seen.add(after)
                todo.append(after)
    return seen


@pytest.mark.parametrize("state", list(S))
@pytest.mark.parametrize("event", list(E))
def test_every_pair_follows_the_table_or_raises(state, event):
    if (state, event) in TRANSITIONS:
        assert allows(state, event)
        assert next_state(state, event) is TRANSITIONS[(state, event)]
    else:
        assert not allows(state, event)
        with pytest.raises(IllegalTransition) as raised:
            next_state(state, event)
        assert (raised.value.state, raised.value.event) == (state, event)
        assert event.name in str(raised.value) and state.name in str(raised.value)


def test_the_table_cannot_be_changed():
    with pytest.raises(TypeError):
        TRANSITIONS[(S.ENDED, E.SUBMITTED)] = S.RUNNING  # type: ignore[index]


def test_every_state_is_reachable_and_every_event_used():
    assert _reachable({S.CREATED}) == set(S)
    assert {event for _, event in TRANSITIONS} == set(E)


def test_the_engine_holds_a_sequence_exactly_between_a_submit_and_its_one_release():
    for (before, event), after in TRANSITIONS.items():
        if event is E.SUBMITTED:
            assert before not in HOLDS_SEQUENCE and after in HOLDS_SEQUENCE
        elif event in ENGINE_RELEASES:
            assert before in HOLDS_SEQUENCE and after not in HOLDS_SEQUENCE
        else:
            assert (before in HOLDS_SEQUENCE) == (after in HOLDS_SEQUENCE), (before, event)
    # ...and every state holding one accepts every release report (a report always lands).
    for state in HOLDS_SEQUENCE:
        assert all(allows(state, event) for event in ENGINE_RELEASES)


def test_final_states_never_run_again():
    for state in FINAL:
        assert not any(allows(state, event) for event in PROGRESS | ENGINE_RELEASES)
    assert _reachable(FINAL) <= FINAL
    assert not _reachable(FINAL) & (HOLDS_SEQUENCE | WAITING)


def test_an_ended_record_never_reopens():
    assert _reachable({S.STOPPING, S.ENDED}) == {S.STOPPING, S.ENDED} | STALE


def test_a_stale_copy_stays_stale_and_is_the_only_one_that_loses_ownership_no_more():
    assert _reachable(STALE) == STALE
    assert {s for s in S if not allows(s, E.OWNERSHIP_LOST)} == STALE


def test_idle_holding_and_waiting_partition_the_states():
    assert IDLE | HOLDS_SEQUENCE | WAITING == set(S)
    assert not IDLE & HOLDS_SEQUENCE and not WAITING & (IDLE | HOLDS_SEQUENCE)


def test_a_new_generation_in_line_keeps_its_place_when_its_reader_leaves():
    assert next_state(S.QUEUED, E.DETACHED) is S.QUEUED
    # ...and leaves the line only when nobody can come back to it here.
    for event in (E.SHUT_DOWN, E.ABANDONED, E.RESUME_DROPPED):
        assert next_state(S.QUEUED, event) is S.PARKED
    assert next_state(S.QUEUED, E.CANCELLED) is S.ENDED
    assert next_state(S.QUEUED, E.OWNERSHIP_LOST) is S.HANDED_OVER
    assert _reachable({S.QUEUED}) == set(S) - {S.CREATED}


def test_readers_may_always_attach_and_leave():
    for state in S:
        assert allows(state, E.ATTACHED) and next_state(state, E.ATTACHED) is state
        assert allows(state, E.DETACHED) and allows(state, E.SHUT_DOWN)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([S.CREATED, S.ENDED]),
    st.lists(st.sampled_from(list(E)), max_size=40),
)
def test_random_event_sequences_follow_the_table_or_raise(start, events):
    state = start
    ended = start is S.ENDED
    for event in events:
        try:
            after = next_state(state, event)
        except IllegalTransition:
            assert (state, event) not in TRANSITIONS
            continue  # a refused event leaves the state as it was
        assert TRANSITIONS[(state, event)] is after
        if state in FINAL:
            assert after in FINAL and event not in PROGRESS
        if ended:  # once the record ended, nothing opens or runs it again
            assert after in {S.STOPPING, S.ENDED} | STALE
        ended = ended or after in {S.STOPPING, S.ENDED}
        state = after


# --- real sessions, a scripted engine -------------------------------------------------------

MAX_TOKENS = 12
# The rules that end a session's run for good act only on a quarter of their draws, so that
# more interleavings get to pauses, restarts and returning readers first.
RARELY = st.integers(0, 3).map(lambda n: n == 0)
STOP = "Z"  # a token whose piece is this completes the stop sequence


class FailingEngine(FakeEngine):
    """The fake engine, able to fail for good (new work refused) and to come back."""

    failed: bool = False

    def submit(self, request: SequenceRequest, sink: TokenSink) -> FakeHandle:
        if self.failed:
            raise EngineUnavailable("the engine failed")
        return super().submit(request, sink)


class Reader:
    """A response stream: records every frame; the machine acknowledges its bytes at will."""

    def __init__(self, from_index: int) -> None:
        self.from_index = from_index
        self.frames: list[quicsrv_proto.Frame] = []
        self.sent = 0
        self.acked = 0
        self.ended = False  # it was sent its last frame (end_stream)
        self.left = False  # its stream went away (the machine detached it)
        self.late: list[quicsrv_proto.Frame] = []  # frames after it ended or left: must stay empty

    def send_frame(self, frame: quicsrv_proto.Frame, end_stream: bool) -> None:
        if self.ended or self.left:
            self.late.append(frame)
        self.frames.append(frame)
        self.sent += len(quicsrv_proto.encode_frame(frame))
        self.ended = self.ended or end_stream

    def send_frames(self, frames: Sequence[quicsrv_proto.Frame]) -> None:
        for frame in frames:
            self.send_frame(frame, False)

    def sent_offset(self) -> int:
        return self.sent

    def acked_offset(self) -> int:
        return self.acked

    @property
    def open(self) -> bool:
        return not (self.ended or self.left)


@dataclass
class EngineSequence:
    """What the scripted engine holds for one submit."""

    handle: FakeHandle
    sink: TokenSink
    generated: list[int]
    released: bool = False


class SessionLifecycleMachine(RuleBasedStateMachine):
    #: Start the generation while another client holds the only slot: it waits in line.
    queued = False

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.loop = asyncio.new_event_loop()
        self.errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _loop, context: self.errors.append(context))
        # One slot: another client holding it keeps a queued restart waiting (STARTING).
        self.engine = FailingEngine(n_seq_max=1)
        self.blocker: Slot | None = None
        self.sequences: list[EngineSequence] = []
        self.readers: list[Reader] = []
        self.reader: Reader | None = None  # the newest one attached
        self.stale = False
        self.log: list[int] = []
        self.end: tuple[quicsrv_proto.EndReason, int] | None = None
        self.submits_at_end: int | None = None
        self.loop.run_until_complete(self._start())

    async def _start(self) -> None:
        settings = session_settings_for(
            Path(self.dir.name),
            max_tokens_limit=64,
            max_tokens_ahead=4,
            checkpoint_every_tokens=4,
            high_watermark_bytes=256,
            low_watermark_bytes=64,
        )
        self.manager = SessionManager(self.engine, settings)
        frame = quicsrv_proto.Generate(prompt="hi", max_tokens=MAX_TOKENS, stop=(STOP,))
        if self.queued:
            self.blocker = await self.manager.gate.acquire("other")
            self.session = await self.manager.open_generation(
                frame, client="client", owner="", arrived_at=asyncio.get_running_loop().time()
            )
            assert self.session.state is S.QUEUED
        else:
            slot = await self.manager.gate.acquire("client")
            self.session = self.manager.start(frame, slot=slot)
        self.record = self.session.record
        await self._after()

    def teardown(self) -> None:
        pending = asyncio.all_tasks(self.loop)
        for task in pending:  # a (re)start still waiting for the slot
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.wait(pending))
        self.manager.close()
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()
        self.dir.cleanup()

    def _do(self, action: Any) -> None:
        async def step() -> None:
            done = action()
            if inspect.isawaitable(done):  # the manager's resume, reattach and cancel
                await done
            await self._after()

        self.loop.run_until_complete(step())

    async def _settle(self) -> None:
        """Run the loop until nothing is left to do: every posted engine callback, every task
        (a queued restart waits for the slot, then reads the KV blob on a worker thread) unless
        it waits for the slot another client holds."""
        me = asyncio.current_task()
        while True:
            for _ in range(3):  # the inbox drains in a later turn than the post
                await asyncio.sleep(0)
            others = asyncio.all_tasks() - {me}
            if not others or self.blocker is not None:
                return
            done, _ = await asyncio.wait(others)
            for task in done:
                if not task.cancelled():
                    task.result()  # an exception in a restart (IllegalTransition...) fails here

    async def _after(self) -> None:
        await self._settle()
        for index in range(len(self.sequences), len(self.engine.handles)):
            # One engine sequence at a time: a submit only follows the last one's release.
            assert all(sequence.released for sequence in self.sequences)
            handle = self.engine.handles[index]
            resume = handle.request.resume
            generated = list(resume.generated) if resume is not None else []
            self.sequences.append(EngineSequence(handle, self.engine.sinks[index], generated))
        live = self.manager.live(self.session.session_id)
        if live is not None:
            self.session = live

    def _running(self) -> EngineSequence | None:
        latest = self.sequences[-1] if self.sequences else None
        return latest if latest is not None and not latest.released else None

    # --- the reader's side --------------------------------------------------------------

    @rule(back=st.integers(0, 3), slot_taken=st.booleans())
    def reader_attaches(self, back: int, slot_taken: bool) -> None:
        self._take_the_slot_if(slot_taken)
        from_index = max(0, len(self.record.generated) - back)
        reader = Reader(from_index)

        async def attach() -> None:
            if not self.stale:
                self.session = await self.manager.reattach(self.session.session_id, from_index)
            self.session.attach(reader, from_index)

        self._do(attach)
        self.readers.append(reader)
        self.reader = reader

    @precondition(lambda self: self.reader is not None and self.reader.open)
    @rule(capture_kv=st.booleans())
    def reader_leaves(self, capture_kv: bool) -> None:
        reader = self.reader
        assert reader is not None
        reader.left = True
        self._do(lambda: self.session.detach(reader, capture_kv=capture_kv))

    @precondition(lambda self: self.reader is not None and self.reader.open)
    @rule(everything=st.booleans(), slot_taken=st.booleans())
    def reader_acknowledges(self, everything: bool, slot_taken: bool) -> None:
        self._take_the_slot_if(slot_taken)
        reader = self.reader
        assert reader is not None
        reader.acked = reader.sent if everything else (reader.acked + reader.sent) // 2
        self._do(self.session.on_transport_progress)

    @rule(now=RARELY)
    def client_cancels(self, now: bool) -> None:
        if not now:
            return
        if self.stale:
            self._do(self.session.cancel)
        else:
            self._do(lambda: self.manager.cancel(self.session.session_id))

    @rule()
    def server_shuts_down(self) -> None:
        self._do(self.session.end_for_shutdown if self.stale else self.manager.shutdown)

    @precondition(lambda self: not self.readers)
    @rule()
    def stream_abandoned_before_it_was_read(self) -> None:
        self._do(self.session.abandon)

    def _take_the_slot_if(self, wanted: bool) -> None:
        """Another client takes the only slot, if it is free: a restart then waits."""
        if wanted and self.blocker is None and self.manager.gate.active == 0:
            self.blocker = self.loop.run_until_complete(self.manager.gate.acquire("other"))

    @precondition(lambda self: self.blocker is not None)
    @rule()
    def another_client_gives_the_slot_back(self) -> None:
        blocker, self.blocker = self.blocker, None
        assert blocker is not None
        self._do(blocker.release)

    @precondition(lambda self: not self.stale)
    @rule(failure=st.booleans(), now=RARELY)
    def another_process_takes_over(self, failure: bool, now: bool) -> None:
        if not now:
            return
        self.stale = True
        self._do(lambda: self.session.lose_ownership("the store failed" if failure else None))
        self.submits_at_stale = len(self.engine.handles)
        self.log_at_stale = list(self.record.generated)

    # --- the engine's side --------------------------------------------------------------

    @precondition(lambda self: self._running() is not None)
    @rule(n_tokens=st.integers(1, 3), stop=st.booleans())
    def engine_generates(self, n_tokens: int, stop: bool) -> None:
        sequence = self._running()
        assert sequence is not None

        def generate() -> None:
            for i in range(n_tokens):
                index = len(sequence.generated)
                if index >= min(MAX_TOKENS, sequence.handle.allowed):
                    return  # the engine keeps to its allowance and the length limit
                stops = stop and i == n_tokens - 1
                token_id = (3000 if stops else 1000) + index
                piece = STOP.encode() if stops else b"a"
                self.engine.pieces[token_id] = piece
                sequence.generated.append(token_id)
                sequence.sink.token_generated(index, token_id, piece, None)

        self._do(generate)

    @precondition(lambda self: self._running() is not None)
    @rule(kv=st.booleans())
    def engine_pauses(self, kv: bool) -> None:
        """Asked to, out of allowance, or (no KV cells) its worker died and was replaced."""
        sequence = self._running()
        assert sequence is not None
        sequence.released = True
        state = PausedState(generated=tuple(sequence.generated), kv_state=b"kv" if kv else None)
        self._do(lambda: sequence.sink.sequence_paused(state))

    @precondition(lambda self: self._running() is not None)
    @rule(reason=st.sampled_from(list(FinishReason)), now=RARELY)
    def engine_finishes(self, reason: FinishReason, now: bool) -> None:
        if not now:
            return
        sequence = self._running()
        assert sequence is not None
        if reason is FinishReason.LENGTH and len(sequence.generated) < MAX_TOKENS:
            reason = FinishReason.EOS
        if reason is FinishReason.CANCELLED and not sequence.handle.cancelled:
            reason = FinishReason.SHUTDOWN
        if reason is FinishReason.FAILED:
            self.engine.failed = True
        sequence.released = True
        n_generated = len(sequence.generated)
        self._do(lambda: sequence.sink.sequence_finished(reason, n_generated))

    @precondition(lambda self: self.engine.failed)
    @rule()
    def engine_comes_back(self) -> None:
        self.engine.failed = False

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def nothing_went_wrong_on_the_loop(self) -> None:
        # An IllegalTransition in an engine callback would surface here (the inbox reports it).
        assert self.errors == []

    @invariant()
    def the_engine_holds_a_sequence_exactly_while_the_state_says_so(self) -> None:
        if self.manager.live(self.session.session_id) is self.session or self.stale:
            assert (self.session.state in HOLDS_SEQUENCE) == (self._running() is not None)
            assert self.session.running == (self.session.state not in IDLE)

    @invariant()
    def a_start_waits_for_a_slot_exactly_while_the_state_says_so(self) -> None:
        pending = asyncio.all_tasks(self.loop)
        assert (self.session.state in WAITING) == bool(pending)

    @invariant()
    def a_session_is_idle_exactly_when_nobody_reads_and_nothing_runs(self) -> None:
        if self.stale:
            return  # a reader may still attach to a stale copy that was forgotten
        if self.manager.live(self.session.session_id) is self.session:
            quiet = not self.session.attached and self.session.state in IDLE
            assert not quiet  # it would have been forgotten
        else:
            assert not self.session.attached and self.session.state in IDLE
            assert self.session.idle.is_set()

    @invariant()
    def the_state_agrees_with_the_record(self) -> None:
        if not self.stale and self.manager.live(self.session.session_id) is self.session:
            ended = self.session.state in {S.STOPPING, S.ENDED}
            assert ended == (self.record.end is not None)
        assert self.session.stale == self.stale == (self.session.state in STALE)

    @invariant()
    def an_ended_session_keeps_no_kv_cells(self) -> None:
        if self.record.end is not None and not self.stale:
            assert self.manager.kv.usage().memory_blobs + self.manager.kv.usage().disk_blobs == 0

    @invariant()
    def at_most_one_reader_is_attached(self) -> None:
        open_readers = [reader for reader in self.readers if reader.open]
        assert len(open_readers) <= 1
        if open_readers:
            assert open_readers[0] is self.reader and self.session.attached

    @invariant()
    def readers_get_each_token_once_in_order_and_as_recorded(self) -> None:
        generated = self.record.generated
        for reader in self.readers:
            assert reader.late == []
            tokens = [f for f in reader.frames if isinstance(f, quicsrv_proto.Token)]
            indexes = [t.index for t in tokens]
            assert indexes == list(range(reader.from_index, reader.from_index + len(tokens)))
            assert all(t.token_id == generated[t.index] for t in tokens)
            last = reader.frames[-1] if reader.frames else None
            if isinstance(last, quicsrv_proto.End) and last.reason not in (
                quicsrv_proto.EndReason.SUPERSEDED,
                quicsrv_proto.EndReason.SHUTDOWN,
            ):
                end = self.record.end
                assert end is not None and last.reason is end.reason
                assert last.completion_tokens == end.completion_tokens == len(generated)
                assert reader.from_index + len(tokens) == len(generated)

    @invariant()
    def the_log_only_grows_and_an_ended_session_never_generates_again(self) -> None:
        generated = list(self.record.generated)
        assert generated[: len(self.log)] == self.log
        self.log = generated
        end = self.record.end
        if end is not None:
            assert end.completion_tokens == len(generated)
            if self.end is None:
                self.end = (end.reason, end.completion_tokens)
                self.submits_at_end = len(self.engine.handles)
            assert self.end == (end.reason, end.completion_tokens)
            assert len(self.engine.handles) == self.submits_at_end
        if self.stale:  # a stale copy writes nothing and starts nothing
            assert generated == self.log_at_stale
            assert len(self.engine.handles) == self.submits_at_stale


SessionLifecycleMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
test_real_sessions_follow_the_lifecycle = SessionLifecycleMachine.TestCase


class QueuedSessionLifecycleMachine(SessionLifecycleMachine):
    queued = True


QueuedSessionLifecycleMachine.TestCase.settings = SessionLifecycleMachine.TestCase.settings
test_real_queued_sessions_follow_the_lifecycle = QueuedSessionLifecycleMachine.TestCase


def _check_invariants(machine: SessionLifecycleMachine) -> None:
    machine.nothing_went_wrong_on_the_loop()
    machine.the_engine_holds_a_sequence_exactly_while_the_state_says_so()
    machine.a_start_waits_for_a_slot_exactly_while_the_state_says_so()
    machine.a_session_is_idle_exactly_when_nobody_reads_and_nothing_runs()
    machine.the_state_agrees_with_the_record()
    machine.an_ended_session_keeps_no_kv_cells()
    machine.at_most_one_reader_is_attached()
    machine.readers_get_each_token_once_in_order_and_as_recorded()
    machine.the_log_only_grows_and_an_ended_session_never_generates_again()


@pytest.mark.parametrize(
    ("leave", "then"),
    [
        ("reader_leaves", S.PARKED),
        ("client_cancels", S.ENDED),
        ("server_shuts_down", S.PARKED),
        ("another_process_takes_over", S.HANDED_OVER),
    ],
)
def test_a_restart_waiting_for_the_slot_is_given_up_when_its_reader_goes(leave, then):
    # A path the random runs reach only now and then, spelled out.
    machine = SessionLifecycleMachine()
    try:
        machine.reader_attaches(back=0, slot_taken=False)
        machine.engine_generates(n_tokens=3, stop=False)
        machine.engine_generates(n_tokens=3, stop=False)  # stops at the allowance: 4
        machine.engine_pauses(kv=True)
        assert machine.session.state is S.PARKED and machine.session.attached
        machine.reader_acknowledges(everything=True, slot_taken=True)
        assert machine.session.state is S.STARTING
        _check_invariants(machine)
        arguments = {
            "reader_leaves": {"capture_kv": True},
            "client_cancels": {"now": True},
            "server_shuts_down": {},
            "another_process_takes_over": {"failure": False, "now": True},
        }[leave]
        getattr(machine, leave)(**arguments)
        assert machine.session.state is then
        _check_invariants(machine)
        machine.another_client_gives_the_slot_back()
        _check_invariants(machine)
        assert len(machine.engine.handles) == 1  # the restart never reached the engine
    finally:
        machine.teardown()


def test_a_reader_cut_while_in_line_keeps_the_place_and_costs_no_compute_until_it_returns():
    machine = QueuedSessionLifecycleMachine()
    try:
        machine.reader_attaches(back=0, slot_taken=False)
        assert machine.session.state is S.QUEUED
        first = machine.readers[0]
        assert isinstance(first.frames[0], quicsrv_proto.Checkpoint)
        assert first.frames[0].index == -1  # the reader holds a resumable cursor at once
        machine.reader_leaves(capture_kv=True)
        assert machine.session.state is S.QUEUED  # the place is kept
        assert machine.manager.gate.queued == 1
        machine.another_client_gives_the_slot_back()
        # Its turn came while nobody read: the slot went on, nothing reached the engine.
        assert machine.session.state is S.PARKED and machine.engine.handles == []
        assert machine.manager.gate.active == 0
        _check_invariants(machine)
        machine.reader_attaches(back=0, slot_taken=False)  # the reader comes back
        assert machine.session.state is S.RUNNING and len(machine.engine.handles) == 1
        assert machine.engine.handles[0].request.resume is None  # a plain start, no replay
        machine.engine_generates(n_tokens=3, stop=False)
        _check_invariants(machine)
    finally:
        machine.teardown()


def test_a_generation_in_line_starts_for_its_reader_when_the_slot_comes():
    machine = QueuedSessionLifecycleMachine()
    try:
        machine.reader_attaches(back=0, slot_taken=False)
        assert machine.session.state is S.QUEUED and machine.engine.handles == []
        machine.another_client_gives_the_slot_back()
        assert machine.session.state is S.RUNNING and len(machine.engine.handles) == 1
        machine.engine_generates(n_tokens=2, stop=False)
        _check_invariants(machine)
        tokens = [f for f in machine.readers[0].frames if isinstance(f, quicsrv_proto.Token)]
        assert [t.index for t in tokens] == [0, 1]
    finally:
        machine.teardown()
