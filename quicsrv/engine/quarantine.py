"""The poison watch at work in a running engine: the generations it holds back, whom it
remembers, and a log line for each conviction.

:mod:`.suspects` decides (pure, on ints); a :class:`Quarantine` keeps the one
:class:`~.suspects.PoisonWatch` of a :class:`~.supervisor.WorkerEngine` and what the watch does
not hold: the sequences it holds back until it releases them, and each remembered generation's
sink by a weak reference. The watch names a generation by its sink's id, and an id outlives its
object: a new sink that got a dead one's id must not inherit its record. Not thread-safe: the
supervisor calls it under its lock.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from .suspects import PoisonWatch

__all__ = ["Quarantine", "Suspect"]

log = logging.getLogger("quicsrv.engine")


class Suspect(Protocol):
    """A sequence as the quarantine sees it."""

    @property
    def who(self) -> int:
        """The generation across its resumes (its sink's id): the watch's name for it."""

    @property
    def key(self) -> int:
        """This sequence's key (for log lines)."""

    @property
    def sink(self) -> object: ...

    @property
    def history(self) -> list[int]:
        """Every token it has: the resumed ones, then what it generated."""

    @property
    def cancelled(self) -> bool: ...


S = TypeVar("S", bound=Suspect)


class Quarantine(Generic[S]):
    """See the module docstring. ``strikes``: worker deaths in a row that convict."""

    def __init__(self, strikes: int) -> None:
        self._watch = PoisonWatch(strikes)
        self._strikes = strikes
        self._held: dict[int, S] = {}  # by who: the arrivals the watch holds back
        self._names: dict[int, Callable[[], object]] = {}  # who -> its sink, while remembered

    def convicted(self, who: int, sink: object) -> bool:
        """Whether the generation ``who`` of ``sink`` kept killing the worker (refuse it). What
        is remembered of another sink that had the same id is forgotten first."""
        if self._watch.knows(who) and self._names.get(who, _nobody)() is not sink:
            self._watch.forget(who)
        return self._watch.convicted(who)

    def arrived(self, sequence: S) -> bool:
        """``sequence`` is submitted: True, send it now; False, it is held until
        :meth:`release` gives it (call that next: it may start its trial at once)."""
        if self._watch.arrived(sequence.who):
            return True
        self._held[sequence.who] = sequence
        return False

    def release(self) -> list[S]:
        """The held sequences to send now (a trial, or the held ones after it)."""
        released = (self._held.pop(who, None) for who in self._watch.release())
        return [sequence for sequence in released if sequence is not None]

    def progressed(self, who: int, tokens: int) -> bool:
        """``who`` has ``tokens`` tokens now; True when that cleared it (call :meth:`release`)."""
        return self._watch.progressed(who, tokens)

    def left(self, who: int) -> None:
        """``who`` left the worker paused: its trial is over, its strikes stay."""
        self._watch.left(who)

    def finished(self, who: int) -> None:
        """``who``'s generation ended: nothing but a conviction is kept."""
        self._watch.finished(who)

    def withdraw(self, who: int, *, finished: bool) -> None:
        """A held ``who`` stops before it reached a worker: cancelled (``finished``) or
        paused."""
        self._held.pop(who, None)
        if finished:
            self._watch.finished(who)
        else:
            self._watch.left(who)

    def clear(self) -> None:
        """Hold nothing more (the breaker opened, or the engine closes)."""
        self._held.clear()

    def worker_died(self, victims: list[S]) -> list[S]:
        """A worker died holding ``victims``: the ones it convicts, each to fail alone (the
        others resume; those held back meanwhile never reached it)."""
        for sequence in victims:
            self._names[sequence.who] = _reference(sequence.sink)
        convicted = self._watch.worker_died(
            {s.who: len(s.history) for s in victims if not s.cancelled}
        )
        for who, name in list(self._names.items()):
            if name() is None:
                self._watch.forget(who)  # its sink is gone: its id may be reused
            if name() is None or not self._watch.knows(who):
                del self._names[who]
        guilty = [s for s in victims if s.who in convicted]
        for sequence in guilty:
            log.error(
                "POISON: a generation (sequence %d, %d tokens) was in %d worker deaths in a "
                "row, the last with no other suspect; it ends with engine_unavailable and is "
                "not run again, the others resume",
                sequence.key,
                len(sequence.history),
                self._strikes,
            )
        quarantined = len(self._watch.quarantined)
        if quarantined > 1 and not guilty:
            log.warning(
                "%d generations were in %d worker deaths in a row together; they resume one "
                "at a time to find the one that kills the worker",
                quarantined,
                self._strikes,
            )
        return guilty


def _reference(sink: object) -> Callable[[], object]:
    """A call that returns ``sink`` while it lives (None after), without keeping it alive."""
    try:
        return weakref.ref(sink)
    except TypeError:  # a sink without weak references is kept until the watch forgets it
        return lambda: sink


def _nobody() -> None:
    return None
