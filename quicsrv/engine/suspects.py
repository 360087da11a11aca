"""Which generation keeps killing the engine worker: deaths attributed to the batch, pure.

No process, thread or clock here: :class:`PoisonWatch` is told of deaths, tokens and arrivals,
and answers which generation is convicted and which arrivals go to the worker now. Its keeper
in a running engine (:mod:`.quarantine`) names each generation by an ``int`` (its sink's id),
which is the same across the generation's resumes.

**Strikes.** A worker's death gives every generation it held a strike, and remembers how many
tokens each had then. A generation that generates past that count has survived the step that
was running when the worker died: its strikes are wiped.

**Conviction.** A death after which exactly one generation of its batch has ``strikes`` strikes
(``worker_poison_strikes``, 2 by default) convicts it: it fails alone (``engine_unavailable`` for
its client) and is refused from then on; the rest of the batch resumes.

**Quarantine.** When several generations of a batch reach that count together (a poisonous one
and the neighbours that shared its batches), none is convicted yet: they are *quarantined* and
tried one at a time. While a quarantined generation waits for its trial or runs it, every other
arrival (resumes and new requests alike) is held back, so the next death's batch holds exactly
one quarantined generation, beside at most generations with fewer strikes that were running
already or have passed their own trials. A trial ends when the generation gets past its death
point (cleared: the next trial starts, or the held ones go), leaves the worker (paused or
finished: it is tried again when it comes back), or the worker dies.

So a neighbour is never convicted for a neighbour's crash: to be convicted it must be the only
generation with ``strikes`` strikes in a dying batch, that is, have died ``strikes`` times in a
row without getting a single token further, and the last time without another suspect beside
it. A poisonous generation is convicted at the latest on its first trial.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PoisonWatch", "Suspicion"]


@dataclass(frozen=True, slots=True)
class Suspicion:
    strikes: int
    """Worker deaths in a row this generation was in, without getting further in between."""
    at_tokens: int
    """How many tokens it had generated at the last of them."""


class PoisonWatch:
    """See the module docstring. Not thread-safe: the supervisor's lock guards its keeper."""

    def __init__(self, strikes_to_convict: int) -> None:
        if strikes_to_convict < 1:
            raise ValueError("strikes_to_convict must be at least 1")
        self._strikes_to_convict = strikes_to_convict
        self._suspicions: dict[int, Suspicion] = {}
        self._convicted: set[int] = set()
        self._held: list[int] = []  # arrivals waiting, in the order they came
        self._trial: int | None = None

    # --- what the keeper reads ---------------------------------------------------------

    @property
    def suspicions(self) -> Mapping[int, Suspicion]:
        return self._suspicions

    @property
    def quarantined(self) -> frozenset[int]:
        """Generations with enough strikes to convict, waiting to be tried alone."""
        return frozenset(
            who for who, s in self._suspicions.items() if s.strikes >= self._strikes_to_convict
        )

    @property
    def held(self) -> tuple[int, ...]:
        return tuple(self._held)

    @property
    def trial(self) -> int | None:
        """The quarantined generation on trial now, if any."""
        return self._trial

    def knows(self, who: int) -> bool:
        """Whether anything is remembered of ``who`` (a suspicion, a conviction, a hold)."""
        return (
            who in self._suspicions
            or who in self._convicted
            or who in self._held
            or who == self._trial
        )

    def convicted(self, who: int) -> bool:
        return who in self._convicted

    # --- what happens -------------------------------------------------------------------

    def worker_died(self, batch: Mapping[int, int]) -> frozenset[int]:
        """A worker died holding ``batch`` (each generation and the tokens it had then): the
        generations it convicts (each to fail alone). Held arrivals stay held: they never
        reached the dead worker."""
        self._trial = None
        for who, tokens in batch.items():
            before = self._suspicions.get(who)
            strikes = 1 if before is None else before.strikes + 1
            self._suspicions[who] = Suspicion(strikes, tokens)
        repeated = [who for who in batch if self._is_quarantined(who)]
        if len(repeated) != 1:
            return frozenset()
        (guilty,) = repeated
        del self._suspicions[guilty]
        self._convicted.add(guilty)
        return frozenset(repeated)

    def arrived(self, who: int) -> bool:
        """``who`` is submitted: True, send it now; False, it is held until :meth:`release`
        names it (call that next: it may start its trial at once)."""
        if (
            self._is_quarantined(who)
            or self._trial is not None
            or any(self._is_quarantined(h) for h in self._held)
        ):
            self._held.append(who)
            return False
        return True

    def progressed(self, who: int, tokens: int) -> bool:
        """``who`` has ``tokens`` tokens now. True when that cleared it (call :meth:`release`:
        its trial, if it ran one, is over)."""
        before = self._suspicions.get(who)
        if before is None or tokens <= before.at_tokens:
            return False
        del self._suspicions[who]
        if self._trial == who:
            self._trial = None
        return True

    def left(self, who: int) -> None:
        """``who`` left the worker (paused) or was withdrawn while held: its trial, or its
        place among the held, is over; its strikes stay."""
        if self._trial == who:
            self._trial = None
        if who in self._held:
            self._held.remove(who)

    def finished(self, who: int) -> None:
        """``who``'s generation ended: nothing but a conviction is kept."""
        self.left(who)
        self._suspicions.pop(who, None)

    def forget(self, who: int) -> None:
        """``who`` is gone for good (its name may be reused): a conviction goes too."""
        self.finished(who)
        self._convicted.discard(who)

    def release(self) -> list[int]:
        """The held generations to send now: the next quarantined one alone (its trial), or,
        when none waits and none is on trial, every held one."""
        if self._trial is not None:
            return []
        for who in self._held:
            if self._is_quarantined(who):
                self._held.remove(who)
                self._trial = who
                return [who]
        released, self._held = self._held, []
        return released

    def _is_quarantined(self, who: int) -> bool:
        suspicion = self._suspicions.get(who)
        return suspicion is not None and suspicion.strikes >= self._strikes_to_convict
