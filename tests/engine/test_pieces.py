"""Which prompt pieces share a ``llama_decode`` call (no model): against a model of what
llama.cpp does with a call (``split_equal``'s micro-batches, flash attention's three ways), every
token of every piece is computed the way the piece alone computes it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from quicsrv.engine import Segment
from quicsrv.engine.pieces import (
    ROWS_CELLS,
    TILE_TOKENS,
    Shape,
    Way,
    cold_plan,
    computed_alone,
    keeps_way,
    share_calls,
    tail,
    tiled_head,
    tiled_take,
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
        [(Shape(seq, length, end), (seq, length, end)) for seq, length, end in pieces],
        pack=True,
        n_ubatch=512,
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
    # A neighbour of the next id with fewer tokens leaves a tiled piece a row-by-row remainder.
    assert _ways([(3, 130, 130), (4, 100, 100)])[(3, 129)] is Way.ROWS
    assert not computed_alone([Shape(3, 130, 130), Shape(4, 100, 100)], n_ubatch=512)


@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 400)), min_size=1, max_size=8))
def test_computed_alone_agrees_with_the_model_of_split_equal(shapes):
    call = [(seq, length, length + start) for seq, (length, start) in enumerate(shapes)]
    if sum(length for _, length, _ in call) > 512:
        return
    computed = _ways(call)
    same = all(
        computed[(seq, p)] is way(length, end)
        for seq, length, end in call
        for p in range(end - length, end)
    )
    assert computed_alone([Shape(*piece) for piece in call], n_ubatch=512) == same


def _shared(*pieces: tuple[int, int, int, bool]) -> list[list[int]]:
    """Which of ``pieces`` (sequence, length, end, sampled) share calls: their indices."""
    shapes = [(Shape(*piece), i) for i, piece in enumerate(pieces)]
    return share_calls(shapes, pack=True, n_ubatch=512)


def test_tiled_pieces_of_different_lengths_share_a_call_where_split_equal_keeps_them_tiled():
    # A burst of long prompts: the oldest's merged chunks beside the next one's first 64.
    assert _shared((0, 448, 448, False), (1, 64, 64, False)) == [[0, 1]]
    # Ids 2 and 4 are never in one micro-batch: any lengths.
    assert _shared((2, 130, 600, False), (4, 100, 100, False)) == [[0, 1]]
    assert _shared((3, 130, 130, False), (4, 100, 100, False)) == [[0], [1]]


def test_a_tiled_piece_never_goes_ahead_of_a_sampled_token():
    # The oldest prompt's last chunk and its tail (sampled: its first token), then the next
    # prompts' chunks: they follow the tail, sharing a call of their own.
    assert _shared(
        (0, 82, 530, False), (0, 2, 532, True), (1, 364, 428, False), (2, 64, 64, False)
    ) == [[0], [1], [2, 3]]
    # Decoded tokens within 256 cells share the short pieces' call, never a tiled one's.
    assert _shared((0, 1, 100, True), (2, 9, 9, False), (4, 300, 300, True)) == [[0, 1], [2]]
    # A short piece may join a tiled one's call, sampled or not (a call of its own would come
    # after it all the same).
    assert _shared((0, 300, 300, False), (2, 9, 9, True), (4, 9, 9, False)) == [[0, 1, 2]]


@given(st.integers(1, 2000), st.integers(0, 512), st.booleans())
def test_a_tiled_run_is_cut_into_tiled_parts_as_far_as_the_budget_goes(run, budget, spare):
    take = tiled_take(run, budget, spare=spare)
    tiled = [
        t
        for t in range(TILE_TOKENS, min(run, budget) + 1)
        if run - t == 0 or run - t >= TILE_TOKENS
    ]
    if take is None:
        assert not tiled
        return
    assert take in tiled
    roomy = [t for t in tiled if t == run or budget - t == 0 or budget - t >= TILE_TOKENS]
    # The most that leaves the step full or with room for another prompt's tiled piece.
    assert take == (max(roomy) if spare and roomy else max(tiled))


def test_a_long_burst_fills_the_step():
    # 8 prompts of 520 tokens (a cold plan's run of 518 tiled tokens, then 2): the oldest
    # leaves the next a tiled piece's room, the next takes it.
    assert tiled_take(518, 512, spare=True) == 448
    assert tiled_take(518, 64, spare=True) == 64
    assert tiled_take(518, 512, spare=False) == 454
    assert tiled_take(454, 440, spare=True) == 376
    assert tiled_take(70, 512, spare=True) == 70


def test_without_packing_every_piece_has_a_call_of_its_own_in_order():
    pieces = [(3, 10, 10), (1, 10, 10), (2, 64, 64)]
    shapes = [(Shape(*piece), piece[0]) for piece in pieces]
    assert share_calls(shapes, pack=False, n_ubatch=512) == [[3], [1], [2]]
    assert share_calls(shapes, pack=True, n_ubatch=512) == [[3, 1], [2]]


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


def test_the_tiled_head_of_a_plan_ends_at_its_first_row_by_row_piece():
    # A cold prompt's chunks are tiled up to its tail; a plain plan's last chunk may not be.
    assert tiled_head(cold_plan(300, 64, 504).segments) == 298
    assert tiled_head(cold_plan(92, 64, 504).segments) == 91
    assert tiled_head((Segment(200, 64),)) == 192  # the last 8 tokens come row by row
    assert tiled_head((Segment(128, 64), Segment(140, 1), Segment(300, 64))) == 128
    assert tiled_head((Segment(40, 40), Segment(300, 64))) == 0
    assert tiled_head(()) == 0


def test_a_piece_that_must_follow_an_earlier_one_of_its_sequence_gets_a_call_after_it():
    # A prompt's merged tiled chunks, then its last position in the same step: the last
    # position may not join the row-by-row call made before its chunks' call.
    assert _shared(
        (0, 10, 10, False), (1, 128, 128, False), (1, 1, 129, True), (2, 9, 9, False)
    ) == [
        [0, 3],
        [1],
        [2],
    ]
