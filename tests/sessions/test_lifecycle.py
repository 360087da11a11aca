"""The session lifecycle table on its own: every state x event, and random event sequences.

Real sessions driven through the table by random interleavings: test_lifecycle_machine.py.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quicsrv.sessions.lifecycle import (
    HOLDS_SEQUENCE,
    IDLE,
    STALE,
    TRANSITIONS,
    IllegalTransition,
    SessionEvent,
    SessionState,
    allows,
    next_state,
)

S = SessionState
E = SessionEvent

ENGINE_RELEASES = {E.ENGINE_PAUSED, E.ENGINE_COMPLETED, E.ENGINE_STOPPED, E.ENGINE_FAILED}
# Events that would make the engine do (or prepare) work for the session.
PROGRESS = {E.SUBMITTED, E.RESUME_QUEUED}
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
    assert not _reachable(FINAL) & (HOLDS_SEQUENCE | {S.STARTING})


def test_an_ended_record_never_reopens():
    assert _reachable({S.STOPPING, S.ENDED}) == {S.STOPPING, S.ENDED} | STALE


def test_a_stale_copy_stays_stale_and_is_the_only_one_that_loses_ownership_no_more():
    assert _reachable(STALE) == STALE
    assert {s for s in S if not allows(s, E.OWNERSHIP_LOST)} == STALE


def test_idle_and_holding_partition_all_but_starting():
    assert IDLE | HOLDS_SEQUENCE | {S.STARTING} == set(S)
    assert not IDLE & HOLDS_SEQUENCE and S.STARTING not in IDLE | HOLDS_SEQUENCE


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
