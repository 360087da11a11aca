"""A live session's lifecycle as one lookup table: ``TRANSITIONS[(state, event)]``.

Pure: no I/O, no event loop. :class:`~.session.Session` holds one :class:`SessionState` and
changes it only through :func:`next_state`; the side effects (pausing the engine sequence,
cancelling a queued restart, telling the reader) stay in the session and follow the transition.
A pair the table does not list raises :class:`IllegalTransition`: a bug in this package, never
something a peer can cause, so it is no wire error.

The states say what the engine holds for this session object and whether it may still write
the session; whether a reader is attached is orthogonal (a sequence runs before its stream
attaches, and a reader may come back while a pause is on its way): attaching changes no
state, a reader leaving asks a running sequence to pause, and the table says where each
reader event may happen. The main roads::

    CREATED -SUBMITTED-> RUNNING -DETACHED-> PAUSING -ENGINE_PAUSED-> PARKED
    CREATED -QUEUED (no slot free)-> QUEUED -SUBMITTED-> RUNNING
    QUEUED -RESUME_DROPPED (its turn came with nobody reading)-> PARKED
    RUNNING -ENGINE_PAUSED (out of allowance, worker restart)-> PARKED
    PARKED -RESUME_QUEUED-> STARTING -SUBMITTED-> RUNNING
    RUNNING -STOP_MATCHED / CANCELLED-> STOPPING -ENGINE_*-> ENDED
    RUNNING -ENGINE_COMPLETED-> ENDED;  PARKED -CANCELLED-> ENDED
    any open state -OWNERSHIP_LOST-> HANDING_OVER -ENGINE_*-> HANDED_OVER (or straight there)

ENDED and HANDED_OVER are final: no event leads from them to a state that runs anything.
Expiry is no state here: the manager expires only records that no live session object holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType

__all__ = [
    "HOLDS_SEQUENCE",
    "IDLE",
    "STALE",
    "TRANSITIONS",
    "WAITING",
    "IllegalTransition",
    "allows",
    "SessionEvent",
    "SessionState",
    "next_state",
]


class SessionState(Enum):
    CREATED = "created"
    """This object has not run the engine yet (a new generation, or a record read back)."""
    QUEUED = "queued"
    """A new generation waits for its fair turn at a slot. Its record exists and its reader
    was told the session id; a reader that leaves meanwhile keeps the place in line."""
    STARTING = "starting"
    """A reader wants the sequence back: waiting for a slot and the KV blob to resubmit."""
    RUNNING = "running"
    """The engine generates the sequence."""
    PAUSING = "pausing"
    """A pause was asked (the reader left, shutdown); the engine still holds the sequence."""
    STOPPING = "stopping"
    """The record ended (cancel, stop sequence) while the engine still holds the sequence."""
    PARKED = "parked"
    """Open, and the engine holds nothing: paused for flow control, a departed reader or a
    worker restart (its KV spilled, or dropped and rebuilt by replay); resumable."""
    ENDED = "ended"
    """The record ended and the engine holds nothing: readers may replay it, nothing runs."""
    HANDING_OVER = "handing-over"
    """Another process owns the session now (or the store failed); the engine still holds the
    sequence this object started, and will report it gone."""
    HANDED_OVER = "handed-over"
    """Stale: another process owns the session, and the engine holds nothing of this object."""


class SessionEvent(Enum):
    QUEUED = "queued"
    """A new generation took its place in line for a slot (none was free)."""
    SUBMITTED = "submitted"
    """The engine accepted a sequence (a new generation, or a resume)."""
    RESUME_QUEUED = "resume-queued"
    """A reader with room is attached: a restart waits for a slot and the KV blob."""
    RESUME_DROPPED = "resume-dropped"
    """A queued start gave up: the reader left meanwhile (its turn then goes to the next),
    the engine refused it, or the queue wait ran out."""
    ATTACHED = "attached"
    """A reader's stream attached (superseding any other)."""
    DETACHED = "detached"
    """The attached reader's stream went away: the sequence is asked to pause."""
    ABANDONED = "abandoned"
    """A new generation's stream went away before it was told the session id."""
    READER_ENDED = "reader-ended"
    """The reader was sent every token and the END."""
    READER_FAILED = "reader-failed"
    """The reader was sent ERROR(engine_unavailable): it may resume later."""
    CANCELLED = "cancelled"
    """An explicit stop: the record ends at the tokens generated so far."""
    STOP_MATCHED = "stop-matched"
    """A stop sequence completed: the record ends there, the engine is told to cancel."""
    ENGINE_PAUSED = "engine-paused"
    """The engine released the sequence paused (asked to, out of allowance, worker restart)."""
    ENGINE_COMPLETED = "engine-completed"
    """The engine finished the sequence (length, EOS): the record ends, unless it had."""
    ENGINE_STOPPED = "engine-stopped"
    """The engine ended the sequence early (cancelled, shutting down): resumable if open."""
    ENGINE_FAILED = "engine-failed"
    """The engine failed for good and dropped the sequence: resumable once it is back."""
    SHUT_DOWN = "shut-down"
    """The server is going: the reader is told, the sequence asked to pause."""
    OWNERSHIP_LOST = "ownership-lost"
    """Another process took the session over, or the shared store failed."""


S = SessionState
E = SessionEvent

HOLDS_SEQUENCE = frozenset({S.RUNNING, S.PAUSING, S.STOPPING, S.HANDING_OVER})
"""States in which the engine holds a sequence of this object (and its handle is live)."""
IDLE = frozenset({S.CREATED, S.PARKED, S.ENDED, S.HANDED_OVER})
"""States in which nothing runs or waits to run for this object."""
WAITING = frozenset({S.QUEUED, S.STARTING})
"""States in which this object waits for a slot (and the engine holds nothing yet)."""
STALE = frozenset({S.HANDING_OVER, S.HANDED_OVER})
"""States in which this object may no longer write the session."""

_EVERY_STATE = {state: state for state in S}
# The engine reports a sequence gone exactly once, from any state that holds one. Which
# report comes may race with what was asked: a cancel may meet a pause the engine had
# already decided on, a pause may meet the sequence's natural end.
_SEQUENCE_RELEASED = {
    S.RUNNING: S.PARKED,
    S.PAUSING: S.PARKED,
    S.STOPPING: S.ENDED,
    S.HANDING_OVER: S.HANDED_OVER,
}
# Whoever stops reading: a running sequence is asked to pause (again, if it was already),
# a queued restart is given up. A new generation in line keeps its place: a reader cut while
# it waits (a proxy's read timeout) comes back to it.
_READER_GONE = _EVERY_STATE | {S.RUNNING: S.PAUSING, S.STARTING: S.PARKED}
# Those that leave the line: the server goes, the peer never learned the id, another process
# owns the session now.
_OUT_OF_LINE = {S.QUEUED: S.PARKED}

_BY_EVENT: dict[SessionEvent, dict[SessionState, SessionState]] = {
    E.QUEUED: {S.CREATED: S.QUEUED},
    E.SUBMITTED: {S.CREATED: S.RUNNING, S.QUEUED: S.RUNNING, S.STARTING: S.RUNNING},
    E.RESUME_QUEUED: {S.CREATED: S.STARTING, S.PARKED: S.STARTING},
    E.RESUME_DROPPED: {S.QUEUED: S.PARKED, S.STARTING: S.PARKED},
    # A reader may attach anywhere: to replay an ended record, to wait for a pause to land,
    # or (a take-over racing the attach) to a stale copy that then never runs.
    E.ATTACHED: _EVERY_STATE,
    E.DETACHED: _READER_GONE,
    E.SHUT_DOWN: _READER_GONE | _OUT_OF_LINE,
    # No reader yet, so no queued restart to give up.
    E.ABANDONED: _EVERY_STATE | {S.RUNNING: S.PAUSING} | _OUT_OF_LINE,
    # Only a record that has ended has an END to send (a stale copy may still hold one).
    E.READER_ENDED: {
        S.STOPPING: S.STOPPING,
        S.ENDED: S.ENDED,
        S.HANDING_OVER: S.HANDING_OVER,
        S.HANDED_OVER: S.HANDED_OVER,
    },
    E.READER_FAILED: {S.PARKED: S.PARKED, S.ENDED: S.ENDED, S.HANDED_OVER: S.HANDED_OVER},
    E.CANCELLED: {
        S.CREATED: S.ENDED,
        S.QUEUED: S.ENDED,
        S.STARTING: S.ENDED,
        S.PARKED: S.ENDED,
        S.RUNNING: S.STOPPING,
        S.PAUSING: S.STOPPING,
        # A stale copy records no end: the owner does.
        S.HANDING_OVER: S.HANDING_OVER,
        S.HANDED_OVER: S.HANDED_OVER,
    },
    E.STOP_MATCHED: {S.RUNNING: S.STOPPING, S.PAUSING: S.STOPPING},
    E.ENGINE_PAUSED: _SEQUENCE_RELEASED,
    E.ENGINE_STOPPED: _SEQUENCE_RELEASED,
    E.ENGINE_FAILED: _SEQUENCE_RELEASED,
    E.ENGINE_COMPLETED: _SEQUENCE_RELEASED | {S.RUNNING: S.ENDED, S.PAUSING: S.ENDED},
    E.OWNERSHIP_LOST: {
        S.CREATED: S.HANDED_OVER,
        S.QUEUED: S.HANDED_OVER,
        S.STARTING: S.HANDED_OVER,
        S.PARKED: S.HANDED_OVER,
        S.ENDED: S.HANDED_OVER,
        S.RUNNING: S.HANDING_OVER,
        S.PAUSING: S.HANDING_OVER,
        S.STOPPING: S.HANDING_OVER,
    },
}

TRANSITIONS: Mapping[tuple[SessionState, SessionEvent], SessionState] = MappingProxyType(
    {(state, event): after for event, row in _BY_EVENT.items() for state, after in row.items()}
)
"""``(state, event) -> next state``; a pair not listed is a bug (:class:`IllegalTransition`)."""


class IllegalTransition(RuntimeError):
    """An event arrived in a state the lifecycle does not allow it in: a bug in quicsrv."""

    def __init__(self, state: SessionState, event: SessionEvent) -> None:
        super().__init__(f"session lifecycle: {event.name} is not allowed in state {state.name}")
        self.state = state
        self.event = event


def next_state(state: SessionState, event: SessionEvent) -> SessionState:
    """The state ``event`` leads to from ``state``; raises IllegalTransition if unlisted."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(state, event) from None


def allows(state: SessionState, event: SessionEvent) -> bool:
    """Whether the table lists ``event`` in ``state`` (for a caller that only then acts)."""
    return (state, event) in TRANSITIONS
