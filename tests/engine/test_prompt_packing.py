"""Several pending prompts per step with the real model: a burst is prefilled in fewer
``llama_decode`` calls than it has prompts, and no sequence's tokens depend on what shared its
calls (greedy and seeded), including the resume of one prefilled in a burst."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest

from quicsrv.engine import (
    PausedState,
    PrefillPlan,
    ResumePath,
    ResumePoint,
    SamplingParams,
    SequenceHandle,
    SequenceRequest,
)
from quicsrv.engine.first_text import FirstText
from quicsrv.engine.llama import EngineObserver, LlamaEngine
from quicsrv.settings import engine_settings_for
from tests.engine.sinks import RecordingSink

pytestmark = pytest.mark.model

SHORT = [
    "The history of the printing press",
    "Write a recipe for tomato soup.",
    "Explain how a bicycle gear works.",
    "def fibonacci(n):",
    "Why is the ocean salty?",
    "A haiku about autumn leaves:",
]
# About 150 tokens: pieces of 64 (shared only with pieces of 64), then a short tail.
LONG = [
    "A bakery's notes for new staff. The oven is lit at five. Sourdough is shaped the evening "
    "before and proved overnight in the cold room; rye is baked first because it needs the "
    "hottest oven. Croissant dough is laminated on Tuesdays and Fridays. Customers may order "
    "cakes three days ahead; birthday cakes need a name and a date. " * 2 + "Question: ",
    "The lighthouse keeper's log. Wind from the south-west, rising. The lamp was lit at dusk "
    "and its wick trimmed at midnight. A schooner passed close inshore at two bells, showing no "
    "lights; the fog horn was sounded for an hour. Stores: oil for nine weeks, biscuit for "
    "six, water ample. The relief boat is a week late. " * 2 + "Next entry: ",
]
MAX_TOKENS = 12


class Counting(EngineObserver):
    """Counts ``llama_decode`` calls and steps; ``gate``: set, the engine thread waits at the
    end of each step until it is released (the test submits a burst meanwhile)."""

    def __init__(self) -> None:
        self.decodes = 0
        self.steps = 0
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()
        self.log: list[str] = []  # "decode", "sampled", "step", and the sinks' "first"

    def decode_started(self) -> None:
        self.decodes += 1
        self.log.append("decode")

    def tokens_sampled(self) -> None:
        self.log.append("sampled")

    def step_finished(self) -> None:
        self.steps += 1
        self.log.append("step")
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait()


class FirstToken(RecordingSink):
    """Notes the decode call and step in which its first token came."""

    def __init__(self, observer: Counting) -> None:
        super().__init__()
        self.observer = observer
        self.first: tuple[int, int] | None = None
        self.first_out = threading.Event()
        self.logged = 0  # where its first token is in the observer's log
        self.paused_state: PausedState | None = None

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        if self.first is None:
            self.first = (self.observer.decodes, self.observer.steps)
            self.logged = len(self.observer.log)
            self.observer.log.append("first")
            self.first_out.set()
        super().token_generated(index, token_id, piece, logprobs)

    def sequence_paused(self, state: PausedState) -> None:
        self.paused_state = state
        super().sequence_paused(state)


@pytest.fixture(scope="module")
def packing(model_path, cpu_extra_buffers) -> Iterator[tuple[LlamaEngine, Counting]]:
    observer = Counting()
    settings = engine_settings_for(
        model_path, n_seq_max=8, prefix_cache=False, cpu_extra_buffers=cpu_extra_buffers
    )
    engine = LlamaEngine(settings, observer)
    yield engine, observer
    engine.close()


def _request(engine: LlamaEngine, text: str, seed: int | None) -> SequenceRequest:
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.9, seed=seed)
    return SequenceRequest(
        prompt_tokens=tuple(engine.tokenize(text, add_special=True)),
        max_tokens=MAX_TOKENS,
        sampling=sampling,
        ignore_eos=True,
    )


def _alone(engine: LlamaEngine, observer: Counting, request: SequenceRequest) -> FirstToken:
    sink = FirstToken(observer)
    engine.submit(request, sink)
    assert sink.done.wait(120)
    return sink


class Stepped(FirstToken):
    """Also notes the step in which each of its tokens came."""

    def __init__(self, observer: Counting) -> None:
        super().__init__(observer)
        self.steps: list[int] = []

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        self.steps.append(self.observer.steps)
        super().token_generated(index, token_id, piece, logprobs)


def _burst(
    engine: LlamaEngine,
    observer: Counting,
    requests: list[SequenceRequest],
    allow: int = 0,
    sink_type: type[FirstToken] = FirstToken,
) -> tuple[list[FirstToken], int, int]:
    """Submit ``requests`` while the engine thread waits between two steps, so that they all
    reach the same step (``allow``: each pauses itself after that many tokens): their sinks,
    and the decode calls and steps made before them."""
    observer.gate.clear()
    observer.waiting.clear()
    opener = FirstToken(observer)
    engine.submit(dataclasses.replace(_request(engine, "Hi", None), max_tokens=1), opener)
    assert observer.waiting.wait(60) and opener.done.wait(60)  # its slot is free again
    sinks = [sink_type(observer) for _ in requests]
    for request, sink in zip(requests, sinks, strict=True):
        handle = engine.submit(request, sink)
        if allow:
            handle.allow(allow)
    decodes, steps = observer.decodes, observer.steps
    observer.gate.set()
    for sink in sinks:
        assert sink.done.wait(120)
    return sinks, decodes, steps


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_burst_is_prefilled_in_fewer_calls_than_prompts_and_each_equals_its_solo_run(
    packing, seeded
):
    engine, observer = packing
    texts = [*SHORT, *LONG]
    requests = [_request(engine, t, 100 + i if seeded else None) for i, t in enumerate(texts)]
    solo = [_alone(engine, observer, r).tokens for r in requests]

    sinks, decodes, steps = _burst(engine, observer, requests)
    assert [s.tokens for s in sinks] == solo
    # A step takes the oldest prompts until it holds half the waiting prompt tokens (so the
    # burst's first half does not wait for its second). Step one: the short prompts share one
    # call; the first long one's tiled chunks (pieces.cold_plan: the last one takes the
    # remainder) merge into one piece (tiled, as alone), then its last position (row by row,
    # as a request finding the whole prompt computes it) in a call of its own. Step two: the
    # decoded tokens (every sequence under 256 cells: row by row, one call), then the second
    # long one's piece and last position. Eight first tokens in two steps and six calls,
    # where one prompt a step took twelve steps (each long prompt three).
    firsts = [s.first for s in sinks]
    calls = [f[0] - decodes for f in firsts if f is not None]
    in_step = [f[1] - steps for f in firsts if f is not None]
    assert len(calls) == len(texts)
    assert calls == [1] * len(SHORT) + [3, 6]
    assert in_step == [0] * (len(texts) - 1) + [1]


class LoggedTokens(FirstToken):
    """Also puts each of its tokens in the observer's log."""

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        super().token_generated(index, token_id, piece, logprobs)
        self.observer.log.append("token")


class HeldAfterFirst(LoggedTokens):
    """Holds the engine thread at the end of the step that samples its first token (cleared
    on that thread, within the step: no earlier step can be the one held)."""

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        if not self.tokens:
            self.observer.gate.clear()
        super().token_generated(index, token_id, piece, logprobs)


def _decoding_and_held(
    engine: LlamaEngine, observer: Counting, request: SequenceRequest
) -> tuple[SequenceHandle, HeldAfterFirst]:
    """``request`` decoding (up to 500 tokens), and the engine thread held at the end of the
    step of its first token (``observer.gate.set()`` lets it go on)."""
    sink = HeldAfterFirst(observer)
    observer.waiting.clear()  # an earlier test's hold
    handle = engine.submit(dataclasses.replace(request, max_tokens=500), sink)
    assert observer.waiting.wait(60)
    return handle, sink


def _of_length(engine: LlamaEngine, n_tokens: int, seed: int) -> SequenceRequest:
    """A prompt of exactly ``n_tokens`` tokens (LONG's, repeated)."""
    tokens = engine.tokenize(" ".join(LONG * 4), add_special=True)
    return dataclasses.replace(
        _request(engine, "", seed), prompt_tokens=tuple(tokens[seed : seed + n_tokens])
    )


def test_a_prompt_of_n_batch_tokens_beside_a_decoding_one_completes_in_one_step(packing):
    # The oldest waiting prompt may fill a call of n_batch tokens (the decoded token has its
    # own) and its tail goes past the budget: one step, not two, as in llama-server.
    engine, observer = packing
    n_batch = engine.settings.n_batch
    prompt = _of_length(engine, n_batch, 1)
    solo = _alone(engine, observer, prompt).tokens
    handle, decoding = _decoding_and_held(engine, observer, _request(engine, SHORT[0], None))
    sink = FirstToken(observer)
    engine.submit(prompt, sink)
    steps = observer.steps
    observer.gate.set()
    assert sink.done.wait(120)
    # Its prompt's cells are its solo run's; past 256 cells a decoded token's numbers follow
    # its neighbours (README, "Determinism and batch composition"): the first token.
    assert sink.tokens[0] == solo[0]
    assert sink.first is not None and sink.first[1] == steps  # in the first step
    assert not decoding.done.is_set()  # it decoded beside it all along
    handle.cancel()
    assert decoding.done.wait(60)


def test_a_first_token_leaves_after_its_call_not_after_the_step(packing):
    # Two prompts of 600 tokens: the oldest completes early in step two (its last chunk and
    # its tail), and the step then runs on with the next one's chunks. Its first token is
    # reported before those calls, not after them.
    engine, observer = packing
    prompts = [_of_length(engine, 600, seed) for seed in (2, 3)]
    solo = [_alone(engine, observer, p).tokens for p in prompts]
    sinks, _, _ = _burst(engine, observer, prompts)
    # As above: the first tokens.
    assert [s.tokens[0] for s in sinks] == [tokens[0] for tokens in solo]
    log = observer.log[sinks[0].logged :]
    assert log[:3] == ["first", "sampled", "decode"]  # the next call comes after the report
    assert log.index("step") > 2


def test_decoded_tokens_past_256_cells_come_after_a_prompts_calls_in_the_same_step(packing):
    # Past 256 cells a decoded token has a call of its own, after the prompt's (as
    # llama-server's batch hands everything out after its prompt): the new prompt's first
    # token leaves after its own two calls (its tiled chunk, then its last position), and
    # the decoded token after that.
    engine, observer = packing
    handle, decoding = _decoding_and_held(engine, observer, _of_length(engine, 300, 4))
    assert decoding.pieces[0]  # its reader has text: nothing puts its next token first
    sink = FirstToken(observer)
    engine.submit(_of_length(engine, 200, 5), sink)
    start = len(observer.log)
    observer.gate.set()
    assert sink.done.wait(120)
    log = observer.log[start:]
    assert log[: log.index("step")] == ["decode", "decode", "first", "sampled", "decode", "token"]
    handle.cancel()
    assert decoding.done.wait(60)


def test_a_reader_without_text_gets_its_next_token_before_a_prompts_call(packing):
    # Greedy under ignore_eos this prompt's first token is an end of turn, which shows its
    # reader no text: its next token is decoded in a call of its own and handed on before the
    # new prompt's call (short decoded tokens share that call otherwise).
    engine, observer = packing
    handle, decoding = _decoding_and_held(engine, observer, _request(engine, SHORT[1], None))
    assert decoding.pieces == [b""]
    sink = FirstToken(observer)
    engine.submit(_request(engine, SHORT[3], None), sink)
    start = len(observer.log)
    observer.gate.set()
    assert sink.done.wait(120)
    log = observer.log[start:]
    assert log[: log.index("step")] == ["decode", "token", "sampled", "decode", "first"]
    assert decoding.pieces[1]  # the text it waited for
    handle.cancel()
    assert decoding.done.wait(60)


def test_a_burst_that_fits_one_call_gets_every_first_token_before_a_readers_next_token(
    packing,
):
    # Six short prompts fit one call, as in llama-server's one batch. The half rule feeds the
    # oldest half a step ahead of the rest; the decoders whose readers see text then wait for
    # the rest, so the burst's last first token waits for no decoded token.
    engine, observer = packing
    requests = [_request(engine, text, None) for text in SHORT]
    solo = [_alone(engine, observer, r).tokens for r in requests]
    sinks, _, steps = _burst(engine, observer, requests, sink_type=Stepped)
    assert [s.tokens for s in sinks] == solo
    stepped = [s for s in sinks if isinstance(s, Stepped)]
    last_first = max(s.steps[0] for s in stepped)
    assert last_first > steps  # the half rule took more than one step
    showing = [s for s in stepped if s.steps[0] < last_first and FirstText().feed(s.pieces[0])]
    assert showing  # a reader with text had its first token before the last one
    assert all(s.steps[1] > last_first for s in showing)


def test_a_sequence_prefilled_in_a_burst_resumes_exactly_by_replay_and_by_kv_restore(packing):
    engine, observer = packing
    texts = [*SHORT[:3], *LONG]
    requests = [_request(engine, t, 7 + i) for i, t in enumerate(texts)]
    solo = [_alone(engine, observer, r) for r in requests]
    cut = 5
    sinks, _, _ = _burst(engine, observer, requests)
    reference = [s.tokens for s in sinks]
    assert reference == [s.tokens for s in solo]

    # The same burst again, each pausing itself after `cut` tokens (its cells captured), then
    # resumed with fresh prompts prefilled beside them: from the blob, by replaying the
    # recorded plan, and from the tokens alone (the cold plan).
    paused, _, _ = _burst(engine, observer, requests, allow=cut)
    states = [s.paused_state for s in paused]
    assert all(s is not None and s.kv_state and len(s.generated) == cut for s in states)
    plans = [s.plans[0] for s in paused]
    assert plans == [s.plans[0] for s in solo]  # planned as alone: a burst changes no plan

    resumes: list[SequenceRequest] = []
    for i, (request, state) in enumerate(zip(requests, states, strict=True)):
        assert state is not None
        if i % 3 == 0:
            point = ResumePoint(generated=state.generated, kv_state=state.kv_state)
            resumes.append(dataclasses.replace(request, resume=point))
        else:
            point = ResumePoint(generated=state.generated)
            plan: PrefillPlan | None = plans[i] if i % 3 == 1 else None
            resumes.append(dataclasses.replace(request, resume=point, prefill_plan=plan))
    fresh = [_request(engine, t, 50 + i) for i, t in enumerate(SHORT[3:])]
    resumed, _, _ = _burst(engine, observer, [*resumes, *fresh])
    for i, sink in enumerate(resumed[: len(resumes)]):
        assert sink.tokens == reference[i][cut:], i
        path = ResumePath.KV_RESTORE if i % 3 == 0 else ResumePath.REPLAY
        assert sink.paths == [path], i
