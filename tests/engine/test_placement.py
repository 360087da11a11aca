"""Slot placement's decisions over a fake llama.cpp context (the real one is in
test_prefix_reuse.py): the kept entries' cells saved while the engine waits, and used when a
new prompt takes their slot."""

from __future__ import annotations

from typing import Any, cast

from quicsrv.engine import SamplingParams, Segment, SequenceRequest
from quicsrv.engine.placement import KvCells, SlotPlacement
from quicsrv.engine.prefix_cache import BLOCK_TOKENS, PrefixCache


class FakeCells:
    """Each slot's blob is its bytes; every save is counted."""

    def __init__(self, size: int = 100) -> None:
        self.blob_size = size
        self.saves: list[int] = []

    def size(self, seq_id: int) -> int:
        return self.blob_size

    def save(self, seq_id: int) -> bytes | None:
        self.saves.append(seq_id)
        return bytes([seq_id]) * self.blob_size

    def load(self, seq_id: int, blob: bytes) -> bool:
        return True

    def cut(self, seq_id: int, length: int) -> bool:
        return True

    def clear(self, seq_id: int) -> None:
        pass


def _placement(cells: FakeCells, max_blob_bytes: int = 1000) -> tuple[SlotPlacement, PrefixCache]:
    cache = PrefixCache(b"numerics", max_blob_bytes=max_blob_bytes)
    return SlotPlacement(cast(KvCells, cells), cache), cache


def _keep(placement: SlotPlacement, slot: int, first: int) -> None:
    tokens = tuple(range(first, first + 2 * BLOCK_TOKENS))
    request = SequenceRequest(prompt_tokens=tokens, max_tokens=1, sampling=SamplingParams())
    assert placement.keep(slot, request, (), len(tokens), (Segment(len(tokens), 64),))


def test_kept_cells_are_saved_one_at_a_time_oldest_first_then_a_new_prompt_copies_nothing():
    cells = FakeCells()
    placement, cache = _placement(cells)
    for slot, first in ((0, 0), (1, 1000)):
        _keep(placement, slot, first)
    assert placement.snapshot_one() and cells.saves == [0]  # used longest ago: next to leave
    assert placement.snapshot_one() and cells.saves == [0, 1]
    assert not placement.snapshot_one()  # nothing left to save
    assert cache.stats.blob_bytes == 200  # counted in the budget
    # Every slot is kept: a new prompt takes the oldest one's, whose cells are saved already.
    new = SequenceRequest(prompt_tokens=(7,) * 80, max_tokens=1, sampling=SamplingParams())
    slot, reused = placement.slot_for(None, [0, 1], new)
    assert slot == 0 and reused is None and cells.saves == [0, 1]
    hit = cache.find("", [*range(2 * BLOCK_TOKENS), 5])
    assert hit is not None and hit.entry.blob == bytes([0]) * 100  # found as a blob
    assert cache.stats.blob_bytes == 200  # moved from snapshot to blob, not counted twice
    # A hit takes the other's slot: its snapshot goes with the entry.
    hit = cache.find("", [*range(1000, 1000 + 2 * BLOCK_TOKENS), 5])
    assert hit is not None and hit.entry.slot == 1
    cache.take(hit.entry)
    assert cache.stats.blob_bytes == 100


def test_the_entry_used_last_is_spared_until_asked_for_then_saved_last():
    cells = FakeCells()
    placement, cache = _placement(cells)
    _keep(placement, 0, 0)
    assert not placement.snapshot_one(spare_last=True)  # a chat's only entry: its next turn
    _keep(placement, 1, 1000)
    assert placement.snapshot_one(spare_last=True) and cells.saves == [0]
    assert not placement.snapshot_one(spare_last=True) and cells.saves == [0]
    # A hit makes slot 0's entry the one used last: slot 1's is the one to save now.
    hit = cache.find("", [*range(2 * BLOCK_TOKENS), 5])
    assert hit is not None and hit.entry.slot == 0
    cache.touch(hit.entry)
    assert placement.snapshot_one(spare_last=True) and cells.saves == [0, 1]
    assert not placement.snapshot_one()  # both saved: nothing left, spared or not


def test_no_save_past_the_blob_budget_and_none_without_one():
    cells = FakeCells(size=600)
    placement, cache = _placement(cells)
    _keep(placement, 0, 0)
    _keep(placement, 1, 1000)
    assert placement.snapshot_one()
    assert not placement.snapshot_one() and cells.saves == [0]  # 1200 > 1000: not even tried
    off, _ = _placement(FakeCells(), max_blob_bytes=0)
    _keep(off, 0, 0)
    assert not off.snapshot_one()


def test_saved_cells_push_older_blobs_to_the_shelf_as_a_spill_does():
    cells = FakeCells(size=400)
    placement, cache = _placement(cells)
    shelved: list[Any] = []
    cache.shelf = cast(Any, type("Shelf", (), {"put": lambda self, e, b: shelved.append(e)})())
    _keep(placement, 0, 0)
    other = SequenceRequest(prompt_tokens=(9,) * 80, max_tokens=1, sampling=SamplingParams())
    placement.slot_for(None, [0], other)  # slot 0's entry becomes a blob (400)
    assert cache.stats.blob_bytes == 400
    _keep(placement, 0, 1000)
    _keep(placement, 1, 2000)
    assert placement.snapshot_one()  # 400 + 400 <= 1000
    assert placement.snapshot_one()  # the old blob goes to the shelf to make room
    assert len(shelved) == 1 and cache.stats.blob_bytes == 800
