"""The poison watch on its own: strikes, conviction, quarantine and trials, then random runs
of a simulated worker against one deterministic poison (Hypothesis): the poison is the only
generation ever convicted, and it is convicted."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quicsrv.engine.suspects import PoisonWatch, Suspicion


def test_a_lone_generation_is_convicted_on_its_second_death():
    watch = PoisonWatch(2)
    assert watch.worker_died({1: 5}) == frozenset()
    assert watch.suspicions[1] == Suspicion(1, 5)
    assert watch.worker_died({1: 5}) == {1}
    assert watch.convicted(1) and 1 not in watch.suspicions


def test_getting_past_the_death_point_wipes_the_strikes():
    watch = PoisonWatch(2)
    watch.worker_died({1: 5})
    assert not watch.progressed(1, 5)  # the replay is back where it died: not past yet
    assert watch.progressed(1, 6)
    assert not watch.knows(1)
    assert watch.worker_died({1: 9}) == frozenset()  # a first strike again


def test_co_suspects_are_quarantined_and_tried_one_at_a_time():
    watch = PoisonWatch(2)
    watch.worker_died({1: 0, 2: 3, 3: 4})
    assert watch.worker_died({1: 0, 2: 3, 3: 4}) == frozenset()
    assert watch.quarantined == {1, 2, 3}
    # They come back in some order: the first is tried alone, the others wait.
    assert not watch.arrived(2)
    assert watch.release() == [2] and watch.trial == 2
    assert not watch.arrived(1) and not watch.arrived(3)
    assert not watch.arrived(7)  # a newcomer waits for the trials too
    assert watch.release() == []
    assert watch.progressed(2, 4)  # past its death point: cleared, the next trial
    assert watch.release() == [1] and watch.trial == 1
    # The trial dies: it is the only one with enough strikes, the cleared 2 beside it is not.
    assert watch.worker_died({1: 0, 2: 6}) == {1}
    assert watch.suspicions[2] == Suspicion(1, 6)
    assert watch.release() == [3]  # the last suspect's trial
    assert watch.progressed(3, 5)
    assert watch.release() == [7]  # nobody in quarantine: the held go
    assert watch.arrived(2)  # 2 has one strike: no quarantine for it


def test_a_trial_that_leaves_the_worker_ends_and_is_tried_again_later():
    watch = PoisonWatch(2)
    watch.worker_died({1: 0, 2: 0})
    watch.worker_died({1: 0, 2: 0})
    watch.arrived(1)
    watch.arrived(2)
    assert watch.release() == [1]
    watch.left(1)  # paused before it got anywhere
    assert watch.release() == [2]
    watch.finished(2)
    assert not watch.knows(2)
    assert watch.release() == []
    assert not watch.arrived(1)  # still quarantined
    assert watch.release() == [1]


def test_a_held_generation_withdrawn_frees_the_others():
    watch = PoisonWatch(2)
    watch.worker_died({1: 0, 2: 0})
    watch.worker_died({1: 0, 2: 0})
    assert not watch.arrived(1)
    assert watch.release() == [1]
    assert not watch.arrived(9)
    watch.left(9)  # cancelled while held
    assert watch.held == ()


def test_a_conviction_outlives_finishing_but_not_forgetting():
    watch = PoisonWatch(1)
    assert watch.worker_died({4: 0}) == {4}
    watch.finished(4)
    assert watch.convicted(4)
    watch.forget(4)
    assert not watch.convicted(4) and not watch.knows(4)


def test_the_strike_count_must_be_positive():
    with pytest.raises(ValueError):
        PoisonWatch(0)


POISON = 0
TOKENS = 3  # what each neighbour generates


@settings(max_examples=300, deadline=None)
@given(
    strikes=st.integers(min_value=1, max_value=3),
    neighbours=st.integers(min_value=0, max_value=4),
    orders=st.lists(st.permutations(range(5)), min_size=60, max_size=60),
)
def test_only_the_poison_is_convicted_and_every_neighbour_finishes(strikes, neighbours, orders):
    """A simulated worker that dies at every step the poison (0) is in. Generations come back
    in random orders after each death; each neighbour needs TOKENS tokens."""
    watch = PoisonWatch(strikes)
    alive = set(range(neighbours + 1))
    tokens = dict.fromkeys(alive, 0)
    running: set[int] = set()
    for order in orders:
        for g in order:  # every generation not running comes (back) now
            if g in alive and g not in running and g not in watch.held and watch.arrived(g):
                running.add(g)
        running.update(watch.release())
        if POISON in running:
            convicted = watch.worker_died({g: tokens[g] for g in running})
            assert convicted <= {POISON}
            alive -= convicted
            running.clear()
            continue
        for g in sorted(running):  # a step: everyone running gets a token
            tokens[g] += 1
            if watch.progressed(g, tokens[g]):
                running.update(watch.release())
            if tokens[g] == TOKENS:
                watch.finished(g)
                running.discard(g)
                alive.discard(g)
                running.update(watch.release())
    assert alive == set() and watch.convicted(POISON)
    assert all(tokens[g] == TOKENS for g in range(1, neighbours + 1))
