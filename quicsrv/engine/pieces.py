"""Which prompt pieces may share a ``llama_decode`` call, and where kept cells may be cut, so
that a token's numbers never depend on what it was computed with.

A *piece* is the tokens of one sequence's prompt fed in one step: positions ``end - length``
to ``end - 1``. What llama.cpp's CPU backend does with them (llama.cpp as llama-cpp-python
0.3.36 vendors it; a KV stream per sequence, ``kv_unified`` off):

- ``llama_decode`` splits a batch into micro-batches (``llama_batch_allocr::split_equal``) that
  hold the same number of tokens of every sequence in them, of consecutive sequence ids only;
- flash attention (``ggml_compute_forward_flash_attn_ext_f16``) then computes a token one of
  three ways, each rounding its own way (:class:`Way`): *tiled* where its sequence has 64 tokens
  or more in the micro-batch (``GGML_FA_TILE_Q``); *split over the cells* where it is the only
  token of the only sequence in the micro-batch and that sequence holds more than 256 cells
  (``n_kv`` is padded to 256, the split starts at 512); else *row by row*.

Within a way, a token's numbers depend on its own sequence's cells only: which other tokens
share its micro-batch, where a piece is split into micro-batches, and how many rows the weight
matmuls take change no bit (measured with this model and build, ``python -m
loadtest.bench.determinism``: the KV cells and logits of every sequence compared byte for byte).
So a piece is computed the same way whatever shares its call if each of its tokens takes the
way the piece takes alone. :func:`computed_alone` checks that for a call against a model of
``split_equal``, and :func:`share_calls` puts a piece in the first call where it holds.
What that allows, in short:

- pieces shorter than 64 tokens that end within the first 256 positions share any call:
  however ``split_equal`` cuts them, every token is computed row by row;
- tiled pieces share a call where every micro-batch holds 64 tokens or more of each: pieces of
  one length, or of any lengths where no neighbour of the next id leaves a sequence a
  remainder under 64 (``split_equal`` cuts all of a micro-batch's sequences at the shortest);
- a 1-token piece past position 256 is split over the cells only alone in its micro-batch (the
  split follows the thread count, which a resume must keep).

Consecutive tiled pieces of one sequence may be fed as one (:func:`merges`), and a run of them
may be fed cut anywhere that leaves every part 64 tokens or more (:func:`tiled_take`): tiled,
each token gets the numbers it gets in its own piece, so the plan still names the pieces.

The same rules tell where a kept piece may be cut (:func:`keeps_way`): its first tokens are
computed again the same way by a shorter piece if the shorter piece takes the same way. And a
prompt may start from cells another prompt computed tiled, where its own cold plan is tiled
there and feeds 64 tokens or more after them (:func:`tiled_head`): it gets its cold cells.

A decoding sequence's token is not a piece: decoded tokens share one call, each sequence's way
depending on its neighbours' ids once it holds more than 256 cells (row by row beside a
neighbour of the next id, split over the cells alone). ``batch_invariant`` decodes each
sequence alone, which takes one way by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple, TypeVar

from ._api import PrefillPlan, Segment

__all__ = [
    "ROWS_CELLS",
    "RULES_VERSION",
    "Shape",
    "TILE_TOKENS",
    "Way",
    "cold_plan",
    "computed_alone",
    "keeps_way",
    "merges",
    "share_calls",
    "tail",
    "tiled_head",
    "tiled_take",
    "way",
]

T = TypeVar("T")

TILE_TOKENS = 64
"""``GGML_FA_TILE_Q``: a sequence with this many tokens in a micro-batch is computed tiled."""

ROWS_CELLS = 256
"""A lone token of a sequence holding more cells than this is computed split over the cells
(``n_kv``, padded to 256, reaches the split path's 512); up to this many, row by row."""


class Way(Enum):
    """How flash attention computes a token (each rounds its own way)."""

    TILED = "tiled"
    SPLIT = "split over the cells"
    ROWS = "row by row"


def way(length: int, end: int) -> Way:
    """How the tokens of a piece of ``length`` tokens ending at position ``end`` (exclusive)
    are computed alone: one micro-batch, tiled from 64 tokens on."""
    if length >= TILE_TOKENS:
        return Way.TILED
    if length == 1 and end > ROWS_CELLS:
        return Way.SPLIT
    return Way.ROWS


def keeps_way(length: int, end: int, kept: int) -> bool:
    """Whether the first ``kept`` tokens of a piece of ``length`` tokens ending at ``end`` get
    the same cells when computed as a piece of their own (so its cells may be cut there)."""
    if kept == length:
        return True
    return 0 < kept < length and way(kept, end - length + kept) is way(length, end)


def merges(length: int) -> bool:
    """Whether a piece of ``length`` tokens may be fed in one micro-batch with the next pieces
    of the same sequence (each also mergeable), as one piece: tiled pieces only. A tiled
    token's numbers do not depend on how many of its sequence's tokens share its micro-batch
    (measured: a prompt's pieces of 64 fed one call each, four or seven to a call, and 64 +
    64 + 320, give the same cells and logits byte for byte; ``python -m
    loadtest.bench.determinism``), so the plan still names the pieces and a replay may feed
    them one a call. A row-by-row piece would turn tiled beside others: never merged."""
    return length >= TILE_TOKENS


def tiled_take(run: int, budget: int, *, spare: bool) -> int | None:
    """How many of the ``run`` tokens left of a run of tiled pieces (:func:`merges`) to feed in
    a step with ``budget`` tokens free: as many as fit, leaving the run either nothing or a
    tiled part (64 tokens or more), and leaving the step either full or room for a tiled piece
    where ``spare`` (other prompts wait for this step's room). None: no tiled part fits.

    Any such cut computes every token tiled, as the plan's pieces do (measured, ``python -m
    loadtest.bench.determinism``: a run fed as 100 + 170 + 114 and as pieces of 64 give the same
    cells and logits), so a step fills ``n_batch`` as llama-server's do, where whole pieces of 64
    left up to 63 of its tokens unused."""
    take = min(run, budget)
    if 0 < run - take < TILE_TOKENS:
        take = run - TILE_TOKENS
    if spare and take < run and 0 < budget - take < TILE_TOKENS <= budget - TILE_TOKENS:
        take = budget - TILE_TOKENS
    return take if take >= TILE_TOKENS else None


def tiled_head(segments: Sequence[Segment]) -> int:
    """Where the leading run of tiled pieces (64 tokens or more) of a plan ends: 0 where its
    first piece is row by row."""
    start = 0
    for segment in segments:
        at = start
        while at < segment.end:
            length = min(segment.step, segment.end - at)
            if length < TILE_TOKENS:
                return at
            at += length
        start = segment.end
    return start


def cold_plan(n_tokens: int, chunk: int, widest: int) -> PrefillPlan:
    """How a cold prompt is fed, whatever runs beside it: all but its :func:`tail` in chunks
    of ``chunk``, the last chunk taking the tokens left over too, so that every chunk is tiled
    and they merge (:func:`merges`: a prompt alone is one big ``llama_decode``, as llama-server
    computes it, where a row-by-row remainder of up to 63 tokens cost a call of its own, and in
    a burst one per prompt past 256 positions); then the tail, one position (two past 256),
    computed exactly as a later request that finds the whole prompt in the cache computes it
    again: the same prompt sent again gets the cold answer. Prompts too short for a tiled
    chunk, or a ``chunk`` below 64, are fed plain (:meth:`PrefillPlan.plain`)."""
    last = tail(n_tokens)
    head = n_tokens - last
    left = head % chunk
    if chunk < TILE_TOKENS or head < chunk or chunk + left > widest:
        return PrefillPlan.plain(n_tokens, chunk)
    segments: list[Segment] = []
    if left == 0:
        segments.append(Segment(head, chunk))
    else:
        if head - chunk - left:
            segments.append(Segment(head - chunk - left, chunk))
        segments.append(Segment(head, chunk + left))
    segments.append(Segment(n_tokens, last))
    return PrefillPlan(tuple(segments))


def tail(n_prompt: int) -> int:
    """The fewest last positions a prompt whose cells are all kept computes again (their logits
    were not kept): one, row by row; two past 256 positions, where one alone would be split
    over the cells (another rounding, and one that follows the thread count)."""
    return 1 if way(1, n_prompt) is Way.ROWS else 2


RULES_VERSION = 2
"""Part of what a kept cell's numbers depend on (``EngineSettings.numerics``): raised when these
rules change how some piece is computed, so that cells kept under older ones are not reused.
Version 1 was one piece a step, in the decoding sequences' call."""


class Shape(NamedTuple):
    """A piece as the call rules see it: positions ``end - length`` to ``end - 1`` of sequence
    ``seq``; ``sampled``: its last position's logits are sampled (a stream waits for them)."""

    seq: int
    length: int
    end: int
    sampled: bool = False


def computed_alone(call: Sequence[Shape], *, n_ubatch: int) -> bool:
    """Whether every token of the pieces in one ``llama_decode`` call, one per sequence, sent
    in id order, is computed the way its piece alone computes it (:func:`way`). llama.cpp's
    ``llama_batch_allocr::split_equal`` (sequential, as with a KV stream per sequence) cuts
    the call into micro-batches, each of the sequences of consecutive ids from the lowest
    left, with the same count of tokens of each: the fewest any of them has left, at most
    ``n_ubatch`` in all."""
    pieces = {piece.seq: piece for piece in call}
    left = {piece.seq: piece.length for piece in call}
    while left:
        chosen = [min(left)]
        while chosen[-1] + 1 in left:
            chosen.append(chosen[-1] + 1)
        count = min(min(left[seq] for seq in chosen), max(1, n_ubatch // len(chosen)))
        for seq in chosen:
            piece = pieces[seq]
            left[seq] -= count
            cells = piece.end - left[seq]
            if count >= TILE_TOKENS:
                computed = Way.TILED
            elif count == 1 and len(chosen) == 1 and cells > ROWS_CELLS:
                computed = Way.SPLIT
            else:
                computed = Way.ROWS
            if computed is not way(piece.length, piece.end):
                return False
            if not left[seq]:
                del left[seq]
    return True


def share_calls(pieces: Sequence[tuple[Shape, T]], *, pack: bool, n_ubatch: int) -> list[list[T]]:
    """Group pieces, given with what to carry, into ``llama_decode`` calls, in the order of each
    call's first piece, where ``pack`` (flash attention: the ways above are its kernel's; else
    one call a piece): each in the first call where every piece is still computed as alone
    (:func:`computed_alone`), after the call of any earlier piece of its sequence (a prompt's
    last piece after its merged tiled ones), and a tiled piece after every call that samples
    (it costs milliseconds a token: a stream waiting for a token there, the oldest prompt of a
    burst among them, would wait for it too)."""
    calls: list[list[T]] = []
    shapes: list[list[Shape]] = []
    last: dict[int, int] = {}
    sampling = -1  # the last call that samples
    for shape, carried in pieces:
        first = last[shape.seq] + 1 if shape.seq in last else 0
        if shape.length >= TILE_TOKENS:
            first = max(first, sampling + 1)
        for i in range(first, len(calls) if pack else 0):
            call = [*shapes[i], shape]
            fits = sum(piece.length for piece in call) <= n_ubatch  # a step may hold more
            if fits and computed_alone(call, n_ubatch=n_ubatch):
                break
        else:
            i = len(calls)
            calls.append([])
            shapes.append([])
        calls[i].append(carried)
        shapes[i].append(shape)
        last[shape.seq] = i
        if shape.sampled:
            sampling = max(sampling, i)
    return calls
