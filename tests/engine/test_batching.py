"""The continuous-batching engine with the real model (no network)."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from quicsrv.engine import (
    FinishReason,
    Overloaded,
    PausedState,
    ResumePoint,
    SamplingParams,
    SequenceRequest,
)
from quicsrv.engine.llama import LlamaEngine
from quicsrv.settings import engine_settings_for

pytestmark = pytest.mark.model


class Recorder:
    """A sink that logs every callback into a list shared by all sequences (engine-thread order)."""

    def __init__(self, name: str, log: list[tuple[str, int]]) -> None:
        self.name = name
        self.log = log
        self.tokens: list[int] = []
        self.first_token = threading.Event()
        self.done = threading.Event()
        self.reason: FinishReason | None = None

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        self.tokens.append(token_id)
        self.log.append((self.name, index))
        self.first_token.set()

    def prompt_scored(self, logprobs: object, ended: object) -> None:
        pass  # never asked for here

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self.reason = reason
        self.done.set()

    def sequence_planned(self, plan: object) -> None:
        pass


def _request(engine: LlamaEngine, text: str, max_tokens: int) -> SequenceRequest:
    return SequenceRequest(
        prompt_tokens=tuple(engine.tokenize(text, add_special=True)),
        max_tokens=max_tokens,
        sampling=SamplingParams(),
        ignore_eos=True,
    )


def test_a_long_prompt_is_prefilled_within_the_step_budget_between_decode_steps(
    model_path, cpu_extra_buffers
):
    settings = engine_settings_for(
        model_path, prefill_chunk=128, cpu_extra_buffers=cpu_extra_buffers
    )
    engine = LlamaEngine(settings)
    try:
        log: list[tuple[str, int]] = []
        streams = [Recorder(f"s{i}", log) for i in range(4)]
        for sink in streams:
            engine.submit(_request(engine, "Count slowly:", 400), sink)
        for sink in streams:
            assert sink.first_token.wait(60)
        long_prompt = _request(engine, "word " * 1000, 4)
        n_prompt = len(long_prompt.prompt_tokens)
        chunks = -(-n_prompt // 128)
        steps = -(-n_prompt // (settings.n_batch - len(streams)))  # the fewest it may take
        long_sink = Recorder("long", log)
        mark = len(log)
        engine.submit(long_prompt, long_sink)
        assert long_sink.done.wait(120)
        window = log[mark : log.index(("long", 0))]
        # Every step gives each stream a token first and then feeds at most n_batch tokens in
        # all: the streams go on while the prompt is fed, in as many steps as the budget
        # needs, its tiled chunks merged (fewer steps than chunks, as llama-server's batches).
        for sink in streams:
            got = sum(1 for name, _ in window if name == sink.name)
            assert steps - 1 <= got < chunks - 1, (sink.name, got, steps, chunks)
    finally:
        engine.close()


def test_cancelled_sequences_free_their_cells(model_path, cpu_extra_buffers):
    engine = LlamaEngine(
        engine_settings_for(
            model_path,
            n_seq_max=4,
            context_per_sequence=256,
            max_queued=0,
            cpu_extra_buffers=cpu_extra_buffers,
        )
    )
    try:
        log: list[tuple[str, int]] = []
        for _round in range(3):
            sinks = [Recorder(f"r{i}", log) for i in range(4)]
            handles = [engine.submit(_request(engine, "Hello", 200), s) for s in sinks]
            for sink in sinks:
                assert sink.first_token.wait(60)
            for handle in handles:
                handle.cancel()
            for sink in sinks:
                assert sink.done.wait(60)
                assert sink.reason is FinishReason.CANCELLED
        # A full burst still fits and runs to the end: nothing leaked.
        sinks = [Recorder(f"b{i}", log) for i in range(4)]
        for sink in sinks:
            engine.submit(_request(engine, "Hello", 200), sink)
        for sink in sinks:
            assert sink.done.wait(120)
            assert sink.reason is FinishReason.LENGTH and len(sink.tokens) == 200
    finally:
        engine.close()


def test_over_the_admission_limit_is_overloaded_and_the_engine_goes_on(
    model_path, cpu_extra_buffers
):
    engine = LlamaEngine(
        engine_settings_for(
            model_path, n_seq_max=2, max_queued=1, cpu_extra_buffers=cpu_extra_buffers
        )
    )
    try:
        log: list[tuple[str, int]] = []
        sinks = [Recorder(f"a{i}", log) for i in range(3)]
        for sink in sinks:
            engine.submit(_request(engine, "Hi", 16), sink)
        with pytest.raises(Overloaded) as info:
            engine.submit(_request(engine, "Hi", 16), Recorder("x", log))
        assert info.value.retry_after_s > 0
        for sink in sinks:
            assert sink.done.wait(60) and len(sink.tokens) == 16
        after = Recorder("after", log)
        engine.submit(_request(engine, "Hi", 16), after)
        assert after.done.wait(60) and len(after.tokens) == 16
    finally:
        engine.close()


def test_a_failed_decode_ends_every_sequence_failed_and_refuses_new_work(
    model_path, cpu_extra_buffers, monkeypatch
):
    import llama_cpp

    from quicsrv.engine import EngineUnavailable

    engine = LlamaEngine(
        engine_settings_for(model_path, n_seq_max=2, cpu_extra_buffers=cpu_extra_buffers)
    )
    try:
        log: list[tuple[str, int]] = []
        first = Recorder("first", log)
        engine.submit(_request(engine, "Hi", 400), first)
        assert first.first_token.wait(60)
        monkeypatch.setattr(llama_cpp, "llama_decode", lambda ctx, batch: 1)
        assert first.done.wait(60)
        assert first.reason is FinishReason.FAILED
        # Nobody would ever serve a request queued now: it is refused instead.
        with pytest.raises(EngineUnavailable):
            engine.submit(_request(engine, "Hi", 4), Recorder("late", log))
    finally:
        monkeypatch.undo()
        engine.close()


class Pausable(Recorder):
    """A Recorder that also keeps what a pause handed back."""

    def __init__(self, name: str, log: list[tuple[str, int]]) -> None:
        super().__init__(name, log)
        self.paused = threading.Event()
        self.state: PausedState | None = None

    def sequence_paused(self, state: PausedState) -> None:
        self.state = state
        self.paused.set()

    def sequence_resumed(self, path: object) -> None:
        pass


def test_a_kv_resume_paused_before_its_admission_hands_its_point_back_whole(
    model_path, cpu_extra_buffers
):
    # A reader that leaves again before its resumed sequence got a slot: the tokens and the
    # blob must come back as they went in, or the next resume rebuilds by replay for nothing.
    engine = LlamaEngine(
        engine_settings_for(
            model_path, n_seq_max=1, max_queued=4, cpu_extra_buffers=cpu_extra_buffers
        )
    )
    try:
        log: list[tuple[str, int]] = []
        original = Pausable("original", log)
        handle = engine.submit(_request(engine, "Hello", 200), original)
        assert original.first_token.wait(60)
        handle.pause()
        assert original.paused.wait(60)
        point = original.state
        assert point is not None and point.generated and point.kv_state

        blocker = Recorder("blocker", log)
        blocking = engine.submit(_request(engine, "Count slowly:", 400), blocker)
        assert blocker.first_token.wait(60)  # it holds the only slot
        resumed = Pausable("resumed", log)
        request = dataclasses.replace(
            _request(engine, "Hello", 200),
            resume=ResumePoint(generated=point.generated, kv_state=point.kv_state),
        )
        engine.submit(request, resumed).pause()
        assert resumed.paused.wait(60)
        assert resumed.state == point
        assert resumed.tokens == []
        blocking.cancel()
    finally:
        engine.close()
