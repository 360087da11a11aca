"""The prefix cache through the real server: a conversation's next turn reuses the cells of the
one before, and a kill -9 of the worker mid-turn changes nothing in what the reader gets.

Real model, real worker process, real QUIC on loopback.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from quicsrv.engine.supervisor import WorkerEngine
from quicsrv.settings import engine_settings_for, supervisor_settings_for
from quicsrv_client import Client, GenerationEnded, TokenReceived
from tests.helpers import running_server
from tests.quicsrv.test_metrics_e2e import delta, scrape, value

pytestmark = [pytest.mark.model, pytest.mark.asyncio, pytest.mark.slow]

FIRST = (
    "A bakery's notes for new staff. The oven is lit at five. Sourdough is shaped the evening "
    "before and proved overnight in the cold room; rye is baked first because it needs the "
    "hottest oven. Croissant dough is laminated on Tuesdays and Fridays. Customers may order "
    "cakes three days ahead; birthday cakes need a name and a date. The till is counted twice. "
    "Question: which bread is baked first, and why?\nAnswer:"
)
MORE = "\nQuestion: on which days is croissant dough laminated?\nAnswer:"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def cache_engine(model_path: Path) -> Iterator[WorkerEngine]:
    # Batch-invariant, as the other kill -9 tests: the replay meets other neighbours.
    settings = engine_settings_for(model_path, n_seq_max=2, max_queued=4, batch_invariant=True)
    engine = WorkerEngine(settings, supervisor_settings_for())
    yield engine
    engine.close()


async def _turn(client: Client, prompt: str, kill_at: int | None = None, engine=None):
    """One generation: (token ids, text, end); a kill -9 of the worker at token ``kill_at``."""
    ids: list[int] = []
    text: list[str] = []
    end = None
    async for event in client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True):
        if isinstance(event, TokenReceived):
            ids.append(event.token_id)
            text.append(event.text)
            if event.index == kill_at:
                assert engine is not None and engine.worker_pid is not None
                os.kill(engine.worker_pid, signal.SIGKILL)
        elif isinstance(event, GenerationEnded):
            text.append(event.text)
            end = event
    return ids, "".join(text), end


async def test_a_kill_9_mid_turn_2_of_a_conversation_that_hit_the_cache_changes_nothing(
    cache_engine, certs
):
    engine = cache_engine
    stats = engine.prefix_stats
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert, stall_timeout_s=None) as c:
            _ids, answer, _end = await _turn(c, FIRST)
            second = FIRST + answer + MORE
            hits, reused = stats.hits, stats.reused_tokens
            before = await scrape(c)
            reference = await _turn(c, second)
            after = await scrape(c)
            assert stats.hits == hits + 1
            turn_2_reused = stats.reused_tokens - reused
            # Turn 1's prompt at least (its answer, re-tokenized, mostly too).
            assert turn_2_reused >= len(engine.tokenize(FIRST, add_special=True)) - 2
            assert reference[2] is not None and reference[2].cached_tokens == turn_2_reused
            metric = "quicsrv_prompt_tokens_total"
            assert delta(before, after, metric, source="reused") == turn_2_reused
            assert delta(before, after, metric, source="prefilled") == (
                reference[2].prompt_tokens - turn_2_reused
            )
            assert delta(before, after, "quicsrv_prefix_cache_lookups_total", result="hit") == 1
            assert value(after, "quicsrv_prefix_cache_resident_tokens") > 0
            assert value(after, "quicsrv_prefix_cache_enabled") == 1

            # The same conversation again: turn 1 computes its cells the same way (a cold
            # prompt reuses only cells that were computed cold), then turn 2 hits them ...
            assert (await _turn(c, FIRST))[1] == answer
            hits, reused, restarts = stats.hits, stats.reused_tokens, engine.restarts
            # ... and its worker is killed mid-answer: the replay follows the recorded plan.
            cut = await _turn(c, second, kill_at=MAX_TOKENS // 3, engine=engine)
    assert engine.restarts == restarts + 1
    assert stats.hits >= hits + 1 and stats.reused_tokens - reused >= turn_2_reused
    assert cut == reference
    assert len(cut[0]) == MAX_TOKENS


async def test_the_same_prompt_again_computes_nothing_and_a_kill_9_changes_nothing(
    cache_engine, certs
):
    # A retry, a "regenerate": the whole prompt is in the cache with its last position's
    # logits, so nothing is computed before the first token -- and the plan on record is the
    # first run's, so that the replay after a kill -9 of the worker mid-answer is exact.
    engine = cache_engine
    prompt = FIRST.replace("bakery", "bookshop") + MORE
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert, stall_timeout_s=None) as c:
            reference = await _turn(c, prompt)
            assert reference[2] is not None
            n_prompt = reference[2].prompt_tokens
            before = await scrape(c)
            again = await _turn(c, prompt)
            after = await scrape(c)
            assert again[:2] == reference[:2]  # the cold run's logits: its answer
            assert again[2] is not None and again[2].cached_tokens == n_prompt
            metric = "quicsrv_prompt_tokens_total"
            assert delta(before, after, metric, source="prefilled") == 0
            assert delta(before, after, metric, source="reused") == n_prompt
            restarts = engine.restarts
            cut = await _turn(c, prompt, kill_at=MAX_TOKENS // 3, engine=engine)
    assert engine.restarts == restarts + 1
    assert cut == again
