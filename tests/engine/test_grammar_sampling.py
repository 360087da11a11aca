"""Grammar-constrained sampling in the real engine (worker process, real model): a resume's
tokens are checked against the grammar before the worker sees them, and an end token ends a
constrained generation even with ``ignore_eos``."""

from __future__ import annotations

import json

import pytest

from quicsrv.engine import (
    CannotReplay,
    FinishReason,
    ResumePoint,
    SamplingParams,
    SequenceRequest,
)
from tests.engine.sinks import RecordingSink

pytestmark = pytest.mark.model

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
)


def _request(engine, **changes) -> SequenceRequest:
    prompt = engine.tokenize("Is the sea blue? Answer in JSON.", add_special=True)
    fields = dict(
        prompt_tokens=tuple(prompt),
        max_tokens=64,
        sampling=SamplingParams(),
        grammar=engine.grammar_for(SCHEMA).gbnf,
    )
    return SequenceRequest(**(fields | changes))


def test_an_end_token_ends_a_constrained_generation_even_with_ignore_eos(engine):
    sink = RecordingSink()
    engine.submit(_request(engine, ignore_eos=True), sink)
    assert sink.done.wait(120)
    assert sink.reason is FinishReason.EOS
    assert json.loads(b"".join(sink.pieces)) in ({"answer": "yes"}, {"answer": "no"})
    assert sink.completion_tokens is not None and sink.completion_tokens < 64


def test_a_resume_whose_tokens_break_the_grammar_is_refused_and_the_worker_lives_on(engine):
    restarts = engine.restarts
    forbidden = tuple(engine.tokenize("hello there", add_special=False))  # not JSON
    with pytest.raises(CannotReplay, match="grammar"):
        engine.submit(_request(engine, resume=ResumePoint(generated=forbidden)), RecordingSink())
    sink = RecordingSink()  # the engine still runs, and so do constrained generations
    engine.submit(_request(engine), sink)
    assert sink.done.wait(120) and sink.reason is not None
    assert engine.restarts == restarts
