"""Which prompt pieces share a ``llama_decode`` call (no model): against a model of what
llama.cpp does with a call (``split_equal``'s micro-batches, flash attention's three ways), every
token of every piece is computed the way the piece alone computes it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from quicsrv.engine.pieces import (
    ROWS_CELLS,
    TILE_TOKENS,
    Way,
    call_key,
    keeps_way,
    share_calls,
    tail,
    way,
)

Piece = tuple[int, int, int]
"""(sequence id, length, end): positions ``end - length`` to ``end - 1`` of that sequence."""


def _ways(call: list[Piece], n_ubatch: int = 512) -> dict[tuple[int, int], Way]:
    """How each (sequence, position) of one call is computed: ``llama_batch_allocr::split_equal``
    (sequential: a KV stream per sequence) cuts the batch, in id order as the engine sends it,
    into micro-batches of equal counts per sequence, of consecutive ids; then a sequence with 64
    tokens or more in a micro-batch is tiled, a lone token of a lone sequence holding more than
    256 cells is split over the cells, and the rest row by row."""
    tokens = [(seq, p) for seq, length, end in sorted(call) for p in range(end - length, end)]
    used = [False] * len(tokens)
    ways: dict[tuple[int, int], Way] = {}
    while not all(used):
        chosen: list[int] = []
        for i, (seq, _) in enumerate(tokens):
            if not used[i] and seq not in chosen and (not chosen or seq == chosen[-1] + 1):
                chosen.append(seq)
        queues = {
            s: [i for i, (q, _) in enumerate(tokens) if q == s and not used[i]] for s in chosen
        }
        taken: dict[int, list[int]] = {s: [] for s in chosen}
        while all(queues[s] for s in chosen):
            for s in chosen:
                i = queues[s].pop(0)
                taken[s].append(i)
                used[i] = True
            if (len(taken[chosen[0]]) + 1) * len(chosen) > n_ubatch:
                break
        for s in chosen:
            count = len(taken[s])
            cells = tokens[taken[s][-1]][1] + 1
            for i in taken[s]:
                if count >= TILE_TOKENS:
                    ways[tokens[i]] = Way.TILED
                elif count == 1 and len(chosen) == 1 and cells > ROWS_CELLS:
                    ways[tokens[i]] = Way.SPLIT
                else:
                    ways[tokens[i]] = Way.ROWS
    return ways


@st.composite
def steps(draw: st.DrawFn) -> list[Piece]:
    """One step's pieces: distinct sequences, within a budget of 512 tokens."""
    ids = draw(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True))
    pieces, budget = [], 512
    for seq in ids:
        length = draw(st.one_of(st.integers(1, 70), st.integers(1, 300)))
        if length > budget:
            break
        budget -= length
        end = length + draw(st.integers(0, 400))
        pieces.append((seq, length, end))
    return pieces


@given(steps())
def test_every_token_of_a_shared_call_is_computed_as_its_piece_alone(pieces):
    calls = share_calls(
        [(length, end, (seq, length, end)) for seq, length, end in pieces], pack=True
    )
    assert sorted(p for call in calls for p in call) == sorted(pieces)
    for call in calls:
        computed = _ways(call)
        for seq, length, end in call:
            alone = _ways([(seq, length, end)])
            assert all(computed[(seq, p)] is alone[(seq, p)] for p in range(end - length, end))
            assert set(alone.values()) == {way(length, end)}


def test_the_rules_that_sharing_would_break():
    # What the checks above rely on: llama.cpp's cuts are real. A piece of 64 beside a decoded
    # token of the next-lower id loses its tiling (the rule until now); a 1-token piece past
    # 256 beside another is row by row instead of split over the cells.
    assert set(_ways([(2, 1, 8), (3, 64, 64)]).values()) == {Way.ROWS}
    assert _ways([(3, 64, 64)])[(3, 0)] is Way.TILED
    assert _ways([(3, 1, 300), (4, 1, 300)])[(3, 299)] is Way.ROWS
    assert _ways([(3, 1, 300)])[(3, 299)] is Way.SPLIT
    assert call_key(64, 64) == call_key(64, 500) != call_key(63, 64)
    assert call_key(1, ROWS_CELLS + 1) is None and call_key(1, ROWS_CELLS) == call_key(40, 200)


def test_without_packing_every_piece_has_a_call_of_its_own_in_order():
    pieces = [(3, 10, 10), (1, 10, 10), (2, 64, 64)]
    calls = share_calls([(n, e, s) for s, n, e in pieces], pack=False)
    assert calls == [[3], [1], [2]]
    shared = share_calls([(n, e, s) for s, n, e in pieces], pack=True)
    assert shared == [[3, 1], [2]]


@given(st.integers(1, 300), st.integers(0, 400), st.data())
def test_a_piece_may_be_cut_where_its_first_tokens_alone_are_computed_as_before(
    length, start, data
):
    kept = data.draw(st.integers(1, length))
    end = start + length
    whole = _ways([(3, length, end)])
    first = _ways([(3, kept, start + kept)])
    same = all(first[(3, p)] is whole[(3, p)] for p in range(start, start + kept))
    assert keeps_way(length, end, kept) == same


def test_a_prompt_found_whole_computes_its_last_positions_row_by_row():
    assert tail(ROWS_CELLS) == 1 and tail(ROWS_CELLS + 1) == 2
    for n in (70, ROWS_CELLS, 300, 2000):
        assert set(_ways([(3, tail(n), n)]).values()) == {Way.ROWS}


def test_a_piece_that_must_follow_an_earlier_one_of_its_sequence_gets_a_call_after_it():
    # A prompt's merged tiled chunks, then its last position in the same step: shared, the
    # last position would join the row-by-row call made before its chunks' call.
    pieces = [(10, 10, "a"), (128, 128, "b chunks"), (1, 129, "b last"), (9, 9, "c")]
    assert share_calls(pieces, pack=True) == [["a", "b last", "c"], ["b chunks"]]
    alone = share_calls(pieces, pack=True, alone={2})
    assert alone == [["a", "c"], ["b chunks"], ["b last"]]
