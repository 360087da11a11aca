"""The prefix cache's bookkeeping: plans, cuts, lookups by block hash, budgets (no model)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quicsrv.engine import PrefillPlan, Segment, prefix_cache
from quicsrv.engine.pieces import cold_plan
from quicsrv.engine.prefix_cache import (
    BLOCK_TOKENS,
    EndLogits,
    PrefixCache,
    PrefixShelf,
    boundaries,
    cut,
    extend,
    rest,
)

B = BLOCK_TOKENS


def _cache(max_blob_bytes: int = 1000) -> PrefixCache:
    return PrefixCache(b"numerics", max_blob_bytes=max_blob_bytes)


def _steps(segments: tuple[Segment, ...]) -> list[tuple[int, int]]:
    """Every (start, end) a plan feeds in one step: what it means, spelled out."""
    fed, start = [], 0
    for segment in segments:
        position = start
        while position < segment.end:
            end = min(position + segment.step, segment.end)
            fed.append((position, end))
            position = end
        start = segment.end
    return fed


def test_a_plan_is_kept_in_its_canonical_form():
    # A decoded answer after a chunked prompt is a new segment; a second answer continues it.
    plan = extend(extend((), 150, 64), 170, 1)
    assert plan == (Segment(150, 64), Segment(170, 1))
    assert extend(plan, 180, 1) == (Segment(150, 64), Segment(180, 1))
    # A chunked segment continues a chunked one only where its steps would have fallen.
    assert extend((Segment(128, 64),), 200, 64) == (Segment(200, 64),)
    assert extend((Segment(130, 64),), 200, 64) == (Segment(130, 64), Segment(200, 64))
    # A last piece shorter than the step is the same computation as one more step cut short.
    assert extend((Segment(128, 64),), 150, 22) == (Segment(150, 64),)
    assert extend((), 50, 64) == (Segment(50, 50),)
    assert PrefillPlan.plain(200, 64).is_cold(64)
    assert PrefillPlan(extend((Segment(128, 64),), 200, 64), reused=128).is_cold(64)
    assert not PrefillPlan((Segment(130, 64), Segment(200, 64))).is_cold(64)
    assert not PrefillPlan((Segment(200, 200),)).is_cold(64)


plans = st.lists(
    st.tuples(st.integers(1, 90), st.sampled_from([1, 7, 16, 64])), min_size=1, max_size=5
).map(lambda parts: _build(parts))


def _build(parts: list[tuple[int, int]]) -> tuple[Segment, ...]:
    segments: tuple[Segment, ...] = ()
    end = 0
    for length, step in parts:
        end += length
        segments = extend(segments, end, step)
    return segments


@given(plans, st.data())
def test_a_cut_plan_feeds_exactly_the_steps_the_whole_plan_fed_before_the_cut(plan, data):
    at = data.draw(st.sampled_from(list(boundaries(plan))))
    head = cut(plan, at)
    assert head[-1].end == at
    assert _steps(head) == [s for s in _steps(plan) if s[1] <= at]
    # ...and feeding the rest from the cut gives the remaining steps, as the engine does.
    tail_steps = []
    position = at
    for segment in rest(plan, at):
        while position < segment.end:
            end = min(position + segment.step, segment.end)
            tail_steps.append((position, end))
            position = end
    assert _steps(head) + tail_steps == _steps(plan)


def test_a_conversation_turn_finds_the_previous_turn_up_to_where_they_differ():
    cache = _cache()
    prompt = list(range(100, 100 + 3 * B + 10))
    answer = [7, 8, 9, 10, 11]
    cells = [*prompt, *answer[:-1]]  # the last answer token was sampled, never decoded
    cache.keep(0, "", cells, extend(extend((), len(prompt), 64), len(cells), 1))
    next_turn = [*prompt, *answer[:3], 99, 98, *range(50)]
    hit = cache.find("", next_turn)
    assert hit is not None and hit.entry.slot == 0
    assert hit.length == len(prompt) + 3  # decoded one by one: any position is a boundary
    # Another scope (API key) never sees it.
    assert cache.find("other key", next_turn) is None
    # Less than a block in common is no hit.
    assert cache.find("", prompt[: B - 1] + [5] * 100) is None


def test_the_last_prompt_token_is_always_computed_for_its_logits():
    cache = _cache()
    prompt = list(range(2 * B))
    cache.keep(3, "", prompt, (Segment(len(prompt), 1),))
    hit = cache.find("", prompt)
    assert hit is not None and hit.length == len(prompt) - 1


def test_reuse_stops_at_a_step_boundary_of_the_kept_cells():
    cache = _cache()
    tokens = list(range(5 * B))
    cache.keep(0, "", tokens, (Segment(len(tokens), 64),))
    hit = cache.find("", [*tokens[: 3 * B + 20], -1, -2])
    assert hit is not None and hit.length == 3 * B  # not 3B+20: cells there were mid-step


def test_a_replay_only_reuses_cells_computed_its_own_way():
    cache = _cache()
    tokens = list(range(4 * B))
    cache.keep(0, "", tokens, (Segment(2 * B + 10, 64), Segment(len(tokens), 1)))
    prompt = [*tokens, 5, 6]
    # A replay whose prompt was prefilled cold (chunks of 64 from 0) may take the first two
    # chunks, not the cells after them (those were computed in a chunk of 10, then alone).
    hit = cache.find("", prompt, (Segment(len(prompt), 64),))
    assert hit is not None and hit.length == 2 * B
    # One recorded with the same segments takes everything but the last token.
    same = (Segment(2 * B + 10, 64), Segment(len(prompt), 1))
    hit = cache.find("", prompt, same)
    assert hit is not None and hit.length == len(tokens)


def test_a_spilled_entry_is_found_as_a_blob_and_the_budget_drops_the_oldest():
    cache = _cache(max_blob_bytes=250)
    first, second, third = (list(range(k, k + 2 * B)) for k in (0, 1000, 2000))
    for slot, tokens in enumerate((first, second, third)):
        cache.keep(slot, "", tokens, (Segment(len(tokens), 64),))
    assert cache.stats.resident_tokens == 6 * B
    victim = cache.least_used([0, 1, 2])
    assert victim is not None and victim.slot == 0
    cache.spill(victim, b"x" * 100)
    second_entry = cache.entry_in(1)
    assert second_entry is not None
    cache.spill(second_entry, b"y" * 100)
    assert cache.stats.blob_bytes == 200 and cache.stats.resident_tokens == 2 * B
    hit = cache.find("", [*first, 1])
    assert hit is not None and hit.entry.blob == b"x" * 100 and hit.length == 2 * B
    third_entry = cache.entry_in(2)
    assert third_entry is not None
    cache.spill(third_entry, b"z" * 100)  # over 250: the oldest blob goes
    assert cache.find("", [*first, 1]) is None
    assert cache.stats.blob_bytes == 200
    # A blob larger than the whole budget is not kept at all.
    cache.keep(5, "", first, (Segment(len(first), 64),))
    big = cache.entry_in(5)
    assert big is not None
    cache.spill(big, b"w" * 1000)
    assert cache.find("", [*first, 1]) is None


def test_taking_an_entry_removes_it_and_a_slot_keeps_one_entry():
    cache = _cache()
    tokens = list(range(2 * B))
    cache.keep(0, "", tokens, (Segment(len(tokens), 64),))
    cache.keep(0, "", [t + 1 for t in tokens], (Segment(len(tokens), 64),))  # the slot was reused
    assert cache.find("", [*tokens, 0]) is None
    hit = cache.find("", [*(t + 1 for t in tokens), 0])
    assert hit is not None
    cache.take(hit.entry)
    assert cache.entry_in(0) is None and cache.stats.resident_tokens == 0
    assert cache.find("", [*(t + 1 for t in tokens), 0]) is None


@given(plans, st.integers(1, 90), st.sampled_from([1, 7, 16, 64, 200]))
def test_extending_a_plan_feeds_the_old_steps_then_the_new_ones(plan, length, step):
    start = plan[-1].end
    new = [(p, min(p + step, start + length)) for p in range(start, start + length, step)]
    assert _steps(extend(plan, start + length, step)) == _steps(plan) + new


def test_the_shelf_keeps_what_memory_cannot_and_another_cache_finds_it(tmp_path):
    first, second = list(range(3 * B)), list(range(1000, 1000 + 3 * B))
    writer = _cache(max_blob_bytes=150)
    writer.shelf = PrefixShelf(tmp_path, max_bytes=10_000, stats=writer.stats)
    for slot, tokens in enumerate((first, second)):
        writer.keep(slot, "key", tokens, (Segment(len(tokens), 64),))
    for slot, blob in ((0, b"a" * 100), (1, b"b" * 100)):
        entry = writer.entry_in(slot)
        assert entry is not None
        writer.spill(entry, blob)  # the second pushes the first out of memory, onto the shelf
    writer.shelf.flush()
    assert writer.stats.blob_bytes == 100 and writer.stats.disk_bytes > 100
    # Another engine (a replacement worker, another process) with the same directory.
    reader = _cache()
    reader.shelf = PrefixShelf(tmp_path, max_bytes=10_000, stats=reader.stats)
    hit = reader.find("key", [*first, 5, 6])
    assert hit is not None and hit.entry.blob == b"a" * 100 and hit.length == 3 * B
    assert reader.find("another key", [*first, 5, 6]) is None
    assert reader.find("key", [*second, 5]) is None  # it never left the writer's memory
    # A damaged file is no hit, and is removed.
    (damaged,) = tmp_path.glob("*.prefix")
    damaged.write_bytes(b"\xff")
    assert reader.find("key", [*first, 5, 6]) is None
    assert not damaged.exists()


def test_the_shelf_drops_the_oldest_past_its_budget(tmp_path):
    cache = _cache(max_blob_bytes=0)
    cache.shelf = PrefixShelf(tmp_path, max_bytes=2_500, stats=cache.stats)
    prompts = [list(range(k, k + 2 * B)) for k in (0, 1000, 2000)]
    for slot, tokens in enumerate(prompts):
        cache.keep(slot, "", tokens, (Segment(len(tokens), 64),))
        entry = cache.entry_in(slot)
        assert entry is not None
        cache.spill(entry, bytes(1000))
    cache.shelf.flush()
    assert cache.stats.disk_bytes <= 2_500
    assert cache.find("", [*prompts[0], 1]) is None
    assert cache.find("", [*prompts[2], 1]) is not None


def test_a_shelved_entry_is_found_from_memory_until_its_file_is_written(tmp_path, monkeypatch):
    # The writer is held: spilling never waits for the disk, and nothing is lost meanwhile.
    release = threading.Event()
    real_write = prefix_cache.write_atomically

    def held_write(path: Path, *parts: bytes | memoryview, **kwargs: object) -> None:
        assert release.wait(30)
        real_write(path, *parts)

    monkeypatch.setattr(prefix_cache, "write_atomically", held_write)
    cache = _cache(max_blob_bytes=0)
    cache.shelf = PrefixShelf(tmp_path, max_bytes=10_000, stats=cache.stats)
    tokens = list(range(2 * B))
    cache.keep(0, "key", tokens, (Segment(len(tokens), 64),))
    entry = cache.entry_in(0)
    assert entry is not None
    cache.spill(entry, b"c" * 100)  # returns with the writer still held
    assert not list(tmp_path.glob("*.prefix"))
    hit = cache.find("key", [*tokens, 1])
    assert hit is not None and hit.entry.blob == b"c" * 100
    release.set()
    cache.shelf.flush()
    reader = _cache()
    reader.shelf = PrefixShelf(tmp_path, max_bytes=10_000, stats=reader.stats)
    hit = reader.find("key", [*tokens, 1])
    assert hit is not None and hit.entry.blob == b"c" * 100


def test_the_shelf_is_written_only_while_the_engine_waits_for_work(tmp_path):
    cache = _cache(max_blob_bytes=0)
    shelf = cache.shelf = PrefixShelf(tmp_path, max_bytes=10_000, stats=cache.stats)
    shelf.engine_idle.clear()  # computing
    tokens = list(range(2 * B))
    cache.keep(0, "key", tokens, (Segment(len(tokens), 64),))
    entry = cache.entry_in(0)
    assert entry is not None
    cache.spill(entry, b"d" * 100)
    flushed = threading.Thread(target=shelf.flush)
    flushed.start()
    flushed.join(0.5)
    assert flushed.is_alive() and not list(tmp_path.glob("*.prefix"))
    hit = cache.find("key", [*tokens, 1])
    assert hit is not None and hit.entry.blob == b"d" * 100  # from memory meanwhile
    shelf.engine_idle.set()  # waiting for work
    flushed.join(30)
    assert not flushed.is_alive() and len(list(tmp_path.glob("*.prefix"))) == 1


def test_a_failed_write_costs_its_entry_and_the_writer_goes_on(tmp_path, monkeypatch, caplog):
    real_write = prefix_cache.write_atomically
    failing = {"first": True}

    def write_once_broken(path: Path, *parts: bytes | memoryview, **kwargs: object) -> None:
        if failing.pop("first", False):
            raise RuntimeError("not an OSError: the writer must survive it too")
        real_write(path, *parts)

    monkeypatch.setattr(prefix_cache, "write_atomically", write_once_broken)
    cache = _cache(max_blob_bytes=0)
    shelf = cache.shelf = PrefixShelf(tmp_path, max_bytes=10_000, stats=cache.stats)
    prompts = [list(range(k, k + 2 * B)) for k in (0, 1000)]
    for slot, tokens in enumerate(prompts):
        cache.keep(slot, "", tokens, (Segment(len(tokens), 64),))
        entry = cache.entry_in(slot)
        assert entry is not None
        cache.spill(entry, bytes(100))
    shelf.flush()  # returns: the failed entry is no longer waiting
    assert "cannot write" in caplog.text
    assert cache.find("", [*prompts[0], 1]) is None
    assert cache.find("", [*prompts[1], 1]) is not None


def test_past_the_pending_budget_an_eviction_is_not_shelved_and_a_closing_put_waits(
    tmp_path, monkeypatch
):
    written: list[Path] = []
    release = threading.Event()
    real_write = prefix_cache.write_atomically

    def held_write(path: Path, *parts: bytes | memoryview, **kwargs: object) -> None:
        assert release.wait(30)
        real_write(path, *parts)
        written.append(path)

    monkeypatch.setattr(prefix_cache, "write_atomically", held_write)
    cache = _cache(max_blob_bytes=0)
    shelf = cache.shelf = PrefixShelf(
        tmp_path, max_bytes=10_000, stats=cache.stats, max_pending_bytes=150
    )
    entries = []
    for slot, start in enumerate((0, 1000, 2000)):
        cache.keep(slot, "", list(range(start, start + 2 * B)), (Segment(2 * B, 64),))
        entry = cache.entry_in(slot)
        assert entry is not None
        entries.append(entry)
    cache.spill(entries[0], bytes(100))
    cache.spill(entries[1], bytes(100))  # 200 bytes would wait: not shelved, not waited for
    assert cache.stats.shelf_dropped == 1
    assert cache.find("", [*entries[1].tokens, 1]) is None
    closing = threading.Thread(
        target=shelf.put, args=(entries[2], bytes(100)), kwargs={"wait": True}
    )
    closing.start()
    assert not written  # the writer is still held, so the closing put cannot have gone through
    release.set()
    closing.join(30)
    assert not closing.is_alive()
    shelf.flush()
    assert len(written) == 2 and cache.stats.shelf_dropped == 1


def test_a_recorded_plan_this_engine_cannot_follow_is_refused_not_replayed_otherwise(
    model_path,
):
    from quicsrv.engine import CannotReplay, ResumePoint, SamplingParams, SequenceRequest
    from quicsrv.engine.request_checks import check_request
    from quicsrv.settings import engine_settings_for

    settings = engine_settings_for(model_path)  # steps of at most n_batch - n_seq_max (504)
    request = SequenceRequest(
        prompt_tokens=tuple(range(1000)),
        max_tokens=8,
        sampling=SamplingParams(),
        resume=ResumePoint(generated=(1, 2)),
    )
    fits = PrefillPlan((Segment(600, 64), Segment(1000, 400)), reused=600)
    check_request(settings, dataclasses.replace(request, prefill_plan=fits))
    too_wide = PrefillPlan((Segment(1000, 1000),))
    wrong_length = PrefillPlan((Segment(900, 64),))
    for plan in (too_wide, wrong_length):
        with pytest.raises(CannotReplay):
            check_request(settings, dataclasses.replace(request, prefill_plan=plan))


def test_a_half_written_shelf_file_is_swept_when_a_shelf_opens(tmp_path):
    leftover = tmp_path / f".{'ab' * 16}.prefix.1234abcd.tmp"
    leftover.write_bytes(b"half")
    PrefixShelf(tmp_path, max_bytes=1000, stats=_cache().stats)
    assert not leftover.exists()


def test_a_prompt_found_whole_reuses_all_but_the_positions_computed_again():
    cache = _cache()
    tokens = list(range(1000, 1400))
    for slot, length in enumerate((100, 300, 128)):
        cache.keep(slot, f"s{slot}", [*tokens[:length], 1, 2], extend(plain(length), length + 2, 1))
    # The last position again (row by row), the last two past 256 (one alone would be split
    # over the cells), and a whole tiled last piece of 64, cut nowhere inside, again.
    for slot, (length, reused) in enumerate(((100, 99), (300, 298), (128, 64))):
        hit = cache.find(f"s{slot}", tokens[:length])
        assert hit is not None and hit.length == reused, length
        assert cut(hit.entry.segments, reused)[-1].end == reused


def test_a_prompt_found_whole_with_its_kept_logits_reuses_every_position():
    tokens = list(range(2000, 2300))
    for n in (100, 300):  # the tail: one position, two past 256
        cache = _cache(max_blob_bytes=10**6)
        end = EndLogits(n, np.arange(8, dtype=np.float32))
        cold = cold_plan(n, 64, 504).segments
        cache.keep(0, "", [*tokens[:n], 7, 8], extend(cold, n + 2, 1), end)
        hit = cache.find("", tokens[:n])
        assert hit is not None and hit.length == n and hit.end is end
        # Another prompt, even one that the entry's cells serve whole, computes its tail.
        for other in (tokens[: n - 1], [*tokens[: n - 1], 5], [*tokens[:n], 7]):
            hit = cache.find("", other)
            assert hit is not None and hit.end is None and hit.length < len(other)
        # A replay follows its recorded plan, which computes the last position.
        hit = cache.find("", tokens[:n], cold)
        assert hit is not None and hit.end is None and hit.length < n
        # Spilled as a blob, the logits go along and count with it.
        cache.spill(cache.entry_in(0), b"x" * 100)  # type: ignore[arg-type]
        assert cache.stats.blob_bytes == 100 + end.logits.nbytes
        hit = cache.find("", tokens[:n])
        assert hit is not None and hit.end is end
        cache.take(hit.entry)
        assert cache.stats.blob_bytes == 0


def test_kept_logits_serve_the_whole_prompt_whatever_piece_computed_its_last_position():
    # They are that computation's numbers, and the prompt found whole records its plan.
    tokens = list(range(2000, 2100))
    end = EndLogits(100, np.zeros(8, dtype=np.float32))
    for plan in (plain(100), (Segment(100, 50),), ((Segment(64, 64), Segment(100, 36)))):
        for cuts_inside_pieces in (True, False):
            cache = PrefixCache(b"n", max_blob_bytes=0, cuts_inside_pieces=cuts_inside_pieces)
            cache.keep(0, "", [*tokens, 1], extend(plan, 101, 1), end)
            hit = cache.find("", tokens)
            assert hit is not None and hit.end is end and hit.length == 100
            assert cut(hit.entry.segments, 100) == cut(plan, 100)


def test_cells_are_cut_inside_a_piece_only_where_its_first_tokens_keep_their_way():
    cache = _cache()
    tokens = list(range(3 * B + 22))  # pieces of 64, 64, 64 (tiled) and 22 (row by row)
    cache.keep(0, "", tokens, plain(len(tokens)))
    assert _found(cache, [*tokens[: 3 * B + 10], -1]) == 3 * B + 10  # inside the 22
    assert _found(cache, [*tokens[: 2 * B + 40], -1]) == 2 * B  # not inside a tiled 64
    # A replay's recorded plan is fed from its own boundaries: a cut must be one of them.
    recorded = (Segment(3 * B + 10, 64), Segment(3 * B + 12, 1))
    hit = cache.find("", [*tokens[: 3 * B + 10], 5, 6], recorded)
    assert hit is not None and hit.length == 3 * B + 10
    # Without flash attention (whose kernel the ways are) at step boundaries only.
    strict = PrefixCache(b"numerics", max_blob_bytes=0, cuts_inside_pieces=False)
    strict.keep(0, "", tokens, plain(len(tokens)))
    assert _found(strict, [*tokens[: 3 * B + 10], -1]) == 3 * B
    assert _found(strict, tokens) == 3 * B


def plain(n: int) -> tuple[Segment, ...]:
    return PrefillPlan.plain(n, 64).segments


def _found(cache: PrefixCache, prompt: list[int]) -> int:
    hit = cache.find("", prompt)
    return 0 if hit is None else hit.length


def test_a_short_prompt_is_found_whole_with_its_logits_in_a_free_slot_s_scrap():
    cache = _cache()
    prompt = list(range(20))
    end = EndLogits(20, np.ones(4, dtype=np.float32))
    cache.keep(2, "a", [*prompt, 5, 6], extend(plain(20), 22, 1), end)
    cache.keep(3, "a", [*prompt, 5, 6], extend(plain(20), 22, 1))  # the same, without logits
    hit = cache.kept_whole([0, 2, 3], "a", prompt)
    assert hit is not None and hit.entry.slot == 2 and hit.length == 20 and hit.end is end
    assert cache.kept_whole([0, 3], "a", prompt) is None  # its slot is not free
    assert cache.kept_whole([2], "b", prompt) is None  # another key's
    assert cache.kept_whole([2], "a", prompt[:-1]) is None  # another prompt
    assert cache.find("a", prompt) is None  # never looked up


def test_fewer_cells_than_a_block_stay_as_a_scrap_that_a_short_prompt_in_its_slot_reuses():
    cache = _cache()
    long = list(range(500, 500 + 2 * B))
    cache.keep(1, "a", long, plain(len(long)))
    short = list(range(30))  # a prompt of 20, then 10 decoded tokens
    assert cache.keep(0, "a", short, extend(plain(20), 30, 1))
    scrap = cache.entry_in(0)
    assert scrap is not None and scrap.blocks == ()
    assert cache.find("a", [*short, 99]) is None  # never looked up: found in its slot only
    assert cache.reusable(scrap, "a", [*short[:12], 7, 8]) == 12
    assert cache.reusable(scrap, "a", short[:12]) == 11  # the last position computed again
    assert cache.reusable(scrap, "b", [*short[:12], 7, 8]) == 0  # another key's cells
    assert cache.reusable(scrap, "a", [*short, *range(100, 100 + B)]) == 0  # a tiled prompt
    # The slot of a scrap goes first, though the block's entry was used longer ago; it
    # leaves no blob (nothing would look it up).
    assert cache.least_used([0, 1]) is scrap
    cache.spill(scrap, b"cells")
    assert cache.entry_in(0) is None and cache.stats.blob_bytes == 0
    assert cache.stats.resident_tokens == len(long)


def test_a_long_prompt_reuses_the_start_its_slot_s_cells_computed_tiled():
    """Fewer positions than a block, found in the slot given to the prompt (as a chat
    template's system prompt is): as many as the entry computed tiled and the prompt's cold
    plan allows (``tiled``: it feeds 64 tiled tokens or more after them)."""
    cache = _cache()
    system = list(range(900, 920))
    kept = [*system, *range(1000, 1000 + 3 * B)]
    answered = extend(cold_plan(len(kept), B, 504).segments, len(kept) + 2, 1)
    cache.keep(0, "a", [*kept, 5, 6], answered)
    entry = cache.entry_in(0)
    assert entry is not None
    prompt = [*system, *range(2000, 2000 + 2 * B)]
    assert cache.reusable(entry, "a", prompt, tiled=100) == len(system)
    assert cache.reusable(entry, "a", prompt, tiled=12) == 12
    assert cache.reusable(entry, "a", prompt) == 0  # its cold plan has no tiled start
    assert cache.reusable(entry, "b", prompt, tiled=100) == 0  # another key's cells
    # Cells computed row by row (pieces of 16), or tiled only from position 10, serve none.
    cache.keep(1, "a", kept, (Segment(len(kept), 16),))
    rows = cache.entry_in(1)
    assert rows is not None and cache.reusable(rows, "a", prompt, tiled=100) == 0
    cache.keep(1, "a", kept, (Segment(10, 10), Segment(len(kept), 64)))
    late = cache.entry_in(1)
    assert late is not None and cache.reusable(late, "a", prompt, tiled=100) == 0
    # Without flash attention the ways of .pieces are not the kernel's: nothing is taken.
    other = PrefixCache(b"numerics", max_blob_bytes=1000, cuts_inside_pieces=False)
    other.keep(0, "a", kept, cold_plan(len(kept), B, 504).segments)
    kept_there = other.entry_in(0)
    assert kept_there is not None and other.reusable(kept_there, "a", prompt, tiled=100) == 0
