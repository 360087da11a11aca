"""The messages between the server and its engine worker process.

Both directions carry one message per batch: the server sends the commands gathered since its
last send (``list[Command]``), the worker sends the decode steps that are due (``list[Step]``,
each with every sequence's events of that step; :mod:`.coalescing` says when). Messages are
small (token ids, counts); KV blobs travel as files in a spool directory (on ``/dev/shm`` where
there is one), named in the message, never pickled through the pipe.

Sequences are named by a *key* the server assigns; a worker never sees session ids.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum
from operator import attrgetter
from typing import Any, TypeVar

from ._api import FinishReason, PrefillPlan, ResumePath, SequenceRequest, TokenLogprobs

__all__ = [
    "Allow",
    "Cancel",
    "Command",
    "Event",
    "Pause",
    "PrefixHeld",
    "PromptScored",
    "Ready",
    "SequenceCommand",
    "SequenceFinished",
    "SequencePaused",
    "SequencePlanned",
    "SequenceResumed",
    "Step",
    "Stop",
    "Submit",
    "TokenGenerated",
    "WorkerPhase",
]


class WorkerPhase(IntEnum):
    """What the worker was doing, kept in shared memory so it survives the worker's death:
    a fault while ``DECODING`` died inside llama.cpp's compute kernels."""

    LOADING = 0
    CANARY = 1
    IDLE = 2
    DECODING = 3


_T = TypeVar("_T")


def _pickled_as_fields(cls: type[_T]) -> type[_T]:
    """Pickle ``cls`` as its constructor call. A frozen dataclass with slots otherwise goes
    through ``dataclasses._dataclass_setstate`` (a ``fields()`` walk and an
    ``object.__setattr__`` per field): four times slower to load, on the event loop, for every
    event of every step."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    get = attrgetter(*names)
    single = len(names) == 1  # attrgetter of one name returns the value, not a tuple

    def __reduce__(self: Any) -> tuple[type[_T], tuple[object, ...]]:
        values = get(self)
        return cls, ((values,) if single else values)

    cls.__reduce__ = __reduce__  # type: ignore[method-assign]
    return cls


# --- server -> worker ---------------------------------------------------------------------


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class Submit:
    key: int
    request: SequenceRequest
    """With ``resume.kv_state`` stripped: the blob, if any, is in ``kv_file``."""
    kv_file: str | None = None


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class Cancel:
    key: int


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class Pause:
    key: int
    capture_kv: bool


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class Allow:
    key: int
    n_tokens: int


@dataclass(frozen=True, slots=True)
class Stop:
    """Finish every sequence and exit."""


SequenceCommand = Submit | Cancel | Pause | Allow
Command = SequenceCommand | Stop


# --- worker -> server ---------------------------------------------------------------------


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class Ready:
    """Sent once, after the model loaded and the canary decoded."""

    pid: int
    cpu_extra_buffers: bool
    load_s: float
    canary_s: float
    prefix_cache: bool
    """Whether its prefix cache is on (off by configuration, or for a sliding-window model)."""


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class TokenGenerated:
    key: int
    index: int
    token_id: int
    piece: bytes
    logprobs: TokenLogprobs | None


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class PromptScored:
    key: int
    logprobs: tuple[TokenLogprobs, ...]
    ended: tuple[int, TokenLogprobs] | None


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class SequenceFinished:
    key: int
    reason: FinishReason
    completion_tokens: int


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class SequencePaused:
    key: int
    generated: tuple[int, ...]
    kv_file: str | None


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class SequenceResumed:
    key: int
    path: ResumePath


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class SequencePlanned:
    """How the sequence's prompt was computed (sent before any of its tokens)."""

    key: int
    plan: PrefillPlan


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class PrefixHeld:
    """What the worker's prefix cache holds, after a sequence started or left (metrics)."""

    key: int
    resident_tokens: int
    blob_bytes: int
    disk_bytes: int
    shelf_dropped: int = 0


Event = (
    TokenGenerated
    | PromptScored
    | SequenceFinished
    | SequencePaused
    | SequenceResumed
    | SequencePlanned
    | PrefixHeld
)


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class Step:
    """One decode step's events (possibly none: a step is also the worker's heartbeat)."""

    events: tuple[Event, ...]
    finished_at: float
    """``time.monotonic()`` in the worker when the step ended (one clock for both processes)."""
