"""When the engine worker sends its steps (quicsrv.engine.coalescing), without a model."""

from __future__ import annotations

from quicsrv.engine import FinishReason, ResumePath
from quicsrv.engine.coalescing import HEARTBEAT_S, StepCoalescer
from quicsrv.engine.ipc import (
    Event,
    SequenceFinished,
    SequencePaused,
    SequenceResumed,
    Step,
    TokenGenerated,
)

WINDOW_S = 0.020
STEP_S = 0.008


def token(key: int, index: int) -> TokenGenerated:
    return TokenGenerated(key, index, 100 + index, b"x", None)


def step(at: float, *events: Event) -> Step:
    return Step(tuple(events), at)


def sent_tokens(batches: list[list[Step]]) -> list[tuple[int, int]]:
    return [
        (event.key, event.index)
        for batch in batches
        for s in batch
        for event in s.events
        if isinstance(event, TokenGenerated)
    ]


def run(coalescer: StepCoalescer, steps: list[Step]) -> list[list[Step]]:
    """Every message the worker would send, in order."""
    return [due for s in steps if (due := coalescer.step_finished(s))]


def test_window_zero_sends_every_step_even_empty_ones():
    coalescer = StepCoalescer(0.0)
    steps = [step(0.0, token(1, 0)), step(0.008, token(1, 1)), step(0.016)]
    assert run(coalescer, steps) == [[s] for s in steps]


def test_a_first_token_leaves_at_once_and_later_ones_wait_at_most_the_window():
    coalescer = StepCoalescer(WINDOW_S)
    steps = [step(i * STEP_S, token(1, i)) for i in range(12)]
    batches = run(coalescer, steps)
    assert [[e.index for s in b for e in s.events] for b in batches][0] == [0]
    assert sent_tokens(batches) == [(1, i) for i in range(len(sent_tokens(batches)))]
    for batch in batches[1:]:
        held_for = batch[-1].finished_at - batch[0].finished_at
        assert held_for < WINDOW_S  # sent before the next step would take it past the window
        assert len(batch) > 1  # and something was coalesced
    # Whatever is still held leaves with the next flush, nothing lost or reordered.
    rest = coalescer.flush(1.0)
    assert sent_tokens([*batches, rest]) == [(1, i) for i in range(12)]


def test_tokens_leave_at_once_until_one_shows_text():
    # An end-of-generation token under ignore_eos (no text), then the first two bytes of "“"
    # (no text yet): the reader has seen nothing, so none of them waits.
    pieces = [b"", b"\xe2\x80", b"\x9c", b" said", b" she"]
    coalescer = StepCoalescer(WINDOW_S)
    due = [
        coalescer.step_finished(step(i * 0.001, TokenGenerated(1, i, 100 + i, piece, None)))
        for i, piece in enumerate(pieces)
    ]
    assert [d is not None for d in due] == [True, True, True, False, False]
    assert sent_tokens([d for d in due if d]) == [(1, 0), (1, 1), (1, 2)]


def test_a_token_with_text_after_the_first_waits_as_before():
    coalescer = StepCoalescer(WINDOW_S)
    assert coalescer.step_finished(step(0.000, TokenGenerated(1, 0, 10, b"\n", None)))
    assert coalescer.step_finished(step(0.001, TokenGenerated(1, 1, 11, b"", None))) is None


def test_an_end_forgets_a_sequence_that_showed_no_text():
    coalescer = StepCoalescer(WINDOW_S)
    assert coalescer.step_finished(step(0.000, TokenGenerated(1, 0, 2, b"\xf0", None)))
    coalescer.step_finished(step(0.001, SequencePaused(1, (2,), None)))
    # Its resume decodes afresh: a lone continuation byte shows as a replacement character.
    assert coalescer.step_finished(step(0.002, TokenGenerated(1, 1, 3, b"\x9f", None)))
    assert coalescer.step_finished(step(0.003, TokenGenerated(1, 2, 4, b"x", None))) is None


def test_a_call_within_a_step_sends_only_what_must_not_wait():
    # A step's decode call before a long prompt's call: a first text leaves after it...
    coalescer = StepCoalescer(WINDOW_S)
    assert coalescer.step_finished(step(0.000, TokenGenerated(1, 0, 2, b"", None)))
    assert coalescer.step_finished(step(0.001, token(2, 0)))
    due = coalescer.call_finished(step(0.002, TokenGenerated(1, 1, 3, b"\n", None), token(2, 1)))
    assert due is not None and sent_tokens([due]) == [(1, 1), (2, 1)]
    # ...streaming tokens wait for the step's end, which times the window as a whole step.
    assert coalescer.call_finished(step(0.003, token(1, 2), token(2, 2))) is None
    assert coalescer.holding
    assert coalescer.step_finished(step(0.004)) is None
    assert sent_tokens([coalescer.flush(0.005)]) == [(1, 2), (2, 2)]


def test_an_end_within_a_step_leaves_with_what_was_held_before_it():
    # A sequence's last token and end come out of the decode call, a prompt's call follows:
    # the server frees its slot now, not after that call.
    coalescer = StepCoalescer(WINDOW_S)
    coalescer.step_finished(step(0.000, token(1, 0)))
    assert coalescer.step_finished(step(0.001, token(1, 1))) is None
    end = SequenceFinished(1, FinishReason.LENGTH, 3)
    due = coalescer.call_finished(step(0.002, token(1, 2), end))
    assert due is not None and [e for s in due for e in s.events] == [token(1, 1), token(1, 2), end]


def test_a_call_within_a_step_is_sent_at_once_without_a_window():
    coalescer = StepCoalescer(0.0)
    assert coalescer.call_finished(step(0.000, token(1, 0)))
    assert coalescer.call_finished(step(0.001, token(1, 1)))
    assert coalescer.call_finished(step(0.002)) is None  # nothing to send


def test_ends_pauses_and_resumes_leave_at_once_with_everything_held_before_them():
    for end in (
        SequenceFinished(1, FinishReason.LENGTH, 4),
        SequencePaused(1, (1, 2, 3), None),
        SequenceResumed(1, ResumePath.REPLAY),
    ):
        coalescer = StepCoalescer(WINDOW_S)
        assert coalescer.step_finished(step(0.000, token(1, 0)))  # first token
        assert coalescer.step_finished(step(0.001, token(1, 1))) is None
        due = coalescer.step_finished(step(0.002, token(1, 2), end))
        assert due is not None
        assert [e for s in due for e in s.events] == [token(1, 1), token(1, 2), end]
        assert not coalescer.holding


def test_a_new_sequences_first_token_is_not_held_behind_another_stream():
    coalescer = StepCoalescer(WINDOW_S)
    assert coalescer.step_finished(step(0.000, token(1, 0)))
    assert coalescer.step_finished(step(0.001, token(1, 1))) is None
    due = coalescer.step_finished(step(0.002, token(1, 2), token(2, 0)))
    assert due is not None and sent_tokens([due]) == [(1, 1), (1, 2), (2, 0)]


def test_a_sequence_that_paused_and_came_back_under_the_same_key_starts_fresh():
    coalescer = StepCoalescer(WINDOW_S)
    coalescer.step_finished(step(0.000, token(1, 0)))
    coalescer.step_finished(step(0.001, SequencePaused(1, (100,), None)))
    assert coalescer.step_finished(step(0.002, token(1, 1))) is not None  # its resume's first


def test_steps_without_events_are_a_heartbeat_at_a_bounded_rate():
    coalescer = StepCoalescer(WINDOW_S)
    empty = [step(i * 0.001) for i in range(int(3 * HEARTBEAT_S / 0.001))]
    beats = run(coalescer, empty)
    assert 2 <= len(beats) <= 4  # about one per HEARTBEAT_S, not one per step
    assert all(s.events == () for batch in beats for s in batch)


def test_a_long_step_sends_what_is_held_before_it_can_wait_longer():
    coalescer = StepCoalescer(WINDOW_S)
    coalescer.step_finished(step(0.000, token(1, 0)))
    assert coalescer.step_finished(step(0.002, token(1, 1))) is None
    # The previous step took 15 ms; another like it would take token 2 past the window.
    assert coalescer.step_finished(step(0.017, token(1, 2))) is not None


def test_send_now_flushes_in_order_and_counts_its_events():
    coalescer = StepCoalescer(WINDOW_S)
    coalescer.step_finished(step(0.000, token(1, 0)))
    coalescer.step_finished(step(0.001, token(1, 1)))
    paused = SequencePaused(1, (100, 101), "blob")
    due = coalescer.send_now(step(0.0015, paused))
    assert [e for s in due for e in s.events] == [token(1, 1), paused]
    # The pause ended key 1's stream: a later first token (a resume) is not held.
    assert coalescer.step_finished(step(0.002, token(1, 2))) is not None
