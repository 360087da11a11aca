"""The poison watch's keeper: what it holds back and releases, whom it remembers, without a
worker (the watch's own rules: test_suspects.py)."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field

from quicsrv.engine.quarantine import Quarantine


class _Sink:
    pass


@dataclass(eq=False)
class _Sequence:
    sink: _Sink
    key: int = 0
    history: list[int] = field(default_factory=list)
    cancelled: bool = False
    who: int = -1  # the supervisor's name for the generation: its sink's id

    def __post_init__(self) -> None:
        if self.who < 0:
            self.who = id(self.sink)


def test_a_generation_alone_in_two_deaths_is_convicted_and_refused_by_its_sink_only(caplog):
    quarantine: Quarantine[_Sequence] = Quarantine(2)
    sink = _Sink()
    poison = _Sequence(sink, key=7, history=[1, 2])
    assert quarantine.worker_died([poison]) == []
    with caplog.at_level(logging.ERROR, logger="quicsrv.engine"):
        assert quarantine.worker_died([poison]) == [poison]
    assert "POISON: a generation (sequence 7, 2 tokens)" in caplog.text
    assert quarantine.convicted(poison.who, sink)
    # Another sink that got the same id is not the convicted generation.
    assert not quarantine.convicted(poison.who, _Sink())
    assert not quarantine.convicted(poison.who, sink)  # and the record is gone for good


def test_generations_that_died_together_are_tried_one_at_a_time(caplog):
    quarantine: Quarantine[_Sequence] = Quarantine(2)
    first, second = _Sequence(_Sink(), key=1), _Sequence(_Sink(), key=2)
    quarantine.worker_died([first, second])
    with caplog.at_level(logging.WARNING, logger="quicsrv.engine"):
        assert quarantine.worker_died([first, second]) == []
    assert "2 generations were in 2 worker deaths in a row together" in caplog.text
    assert not quarantine.arrived(first)
    assert quarantine.release() == [first]  # its trial
    assert not quarantine.arrived(second)
    newcomer = _Sequence(_Sink(), key=3)
    assert not quarantine.arrived(newcomer)  # nothing goes beside a trial
    assert quarantine.release() == []
    assert quarantine.progressed(first.who, 1)  # past its death point: cleared
    assert quarantine.release() == [second]  # the next trial, alone
    assert quarantine.progressed(second.who, 1)
    assert quarantine.release() == [newcomer]


def test_a_held_generation_withdrawn_is_never_released():
    quarantine: Quarantine[_Sequence] = Quarantine(2)
    suspect, neighbour = _Sequence(_Sink()), _Sequence(_Sink())
    quarantine.worker_died([suspect, neighbour])
    quarantine.worker_died([suspect, neighbour])
    assert not quarantine.arrived(suspect)
    assert quarantine.release() == [suspect]
    assert not quarantine.arrived(neighbour)
    quarantine.withdraw(neighbour.who, finished=True)  # cancelled while held
    quarantine.left(suspect.who)  # paused: its trial is over
    assert quarantine.release() == []


def test_a_cancelled_sequence_gets_no_strike():
    quarantine: Quarantine[_Sequence] = Quarantine(1)
    cancelled = _Sequence(_Sink(), cancelled=True)
    assert quarantine.worker_died([cancelled]) == []
    assert quarantine.arrived(cancelled)


def test_a_quarantined_generation_whose_sink_is_gone_is_forgotten_at_the_next_death():
    quarantine: Quarantine[_Sequence] = Quarantine(2)
    gone, neighbour = _Sequence(_Sink()), _Sequence(_Sink())
    quarantine.worker_died([gone, neighbour])
    quarantine.worker_died([gone, neighbour])
    quarantine.finished(neighbour.who)
    stranger = _Sequence(_Sink(), who=gone.who)  # a new sink that got the same id
    assert not quarantine.arrived(stranger)  # taken for the quarantined generation, still
    quarantine.withdraw(stranger.who, finished=False)
    gone.sink = _Sink()  # the generation's sink dies
    gc.collect()
    quarantine.worker_died([])
    assert quarantine.arrived(stranger)  # forgotten: nothing holds it back
