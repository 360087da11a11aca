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
So a piece is computed the same way whatever shares its call if each of its tokens always
takes the way the piece takes alone, which these rules (:func:`call_key`) ensure:

- a piece of 64 tokens or more shares a call only with pieces of its own length: each sequence
  then has all its tokens in one micro-batch (tiled, as alone);
- a shorter piece that ends within the first 256 positions shares a call with any such piece:
  however ``split_equal`` cuts it, every token is computed row by row;
- another piece of 2 to 63 tokens shares a call with pieces of its own length (never a token
  alone in a micro-batch), and a 1-token piece past position 256 goes alone (split over the
  cells, as alone; the split follows the thread count, which a resume must keep).

Consecutive tiled pieces of one sequence may be fed as one (:func:`merges`): tiled, each token
gets the numbers it gets in its own piece.

The same rules tell where a kept piece may be cut (:func:`keeps_way`): its first tokens are
computed again the same way by a shorter piece if the shorter piece takes the same way.

A decoding sequence's token is not a piece: decoded tokens share one call, each sequence's way
depending on its neighbours' ids once it holds more than 256 cells (row by row beside a
neighbour of the next id, split over the cells alone). ``batch_invariant`` decodes each
sequence alone, which takes one way by construction.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from enum import Enum
from typing import TypeVar

from ._api import PrefillPlan, Segment

__all__ = [
    "ROWS_CELLS",
    "RULES_VERSION",
    "TILE_TOKENS",
    "Way",
    "call_key",
    "cold_plan",
    "keeps_way",
    "merges",
    "share_calls",
    "tail",
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
    are computed under :func:`call_key`'s rules: the way the piece takes alone."""
    if length >= TILE_TOKENS:
        return Way.TILED
    if length == 1 and end > ROWS_CELLS:
        return Way.SPLIT
    return Way.ROWS


def call_key(length: int, end: int) -> tuple[str, int] | None:
    """Which call a piece may share: pieces with equal keys go in one ``llama_decode`` (within
    the step's budget); None: a call of its own."""
    if length < TILE_TOKENS and end <= ROWS_CELLS:
        return ("rows", 0)  # row by row, however split_equal cuts them
    if length == 1:
        return None  # split over the cells only alone
    return ("length", length)  # one micro-batch per run of ids: the way it takes alone


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


def share_calls(
    pieces: Sequence[tuple[int, int, T]], *, pack: bool, alone: Set[int] = frozenset()
) -> list[list[T]]:
    """Group pieces, given as (length, end, what to carry), into ``llama_decode`` calls, in the
    order of each call's first piece: pieces with the same :func:`call_key` share one where
    ``pack`` (flash attention: the ways above are its kernel's); else one call a piece. The
    pieces at the indices in ``alone`` get a call of their own, where they come (a piece that
    must follow an earlier one of its sequence: a shared call might be computed before it)."""
    calls: list[list[T]] = []
    shared: dict[tuple[str, int], list[T]] = {}
    for i, (length, end, carried) in enumerate(pieces):
        key = call_key(length, end) if pack and i not in alone else None
        if key is None:
            calls.append([carried])
        elif key in shared:
            shared[key].append(carried)
        else:
            shared[key] = [carried]
            calls.append(shared[key])
    return calls
