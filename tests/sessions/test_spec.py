"""A generation's spec is carried whole: record, persisted metadata, snapshot and engine request
all hold what the spec says, whatever it says (no model, no sockets)."""

from __future__ import annotations

import dataclasses
from array import array

import cbor2
from hypothesis import given
from hypothesis import strategies as st

from quicsrv.engine import Grammar, PrefillPlan, ResumePoint, SamplingParams, SequenceRequest
from quicsrv.sessions.record import SessionRecord
from quicsrv.sessions.spec import GenerationSpec
from quicsrv_proto import canonical_cbor

# (x + 0.0: -0.0 is 0.0, as equal specs go, though not as bits)
_FINITE = st.floats(allow_nan=False, allow_infinity=False, width=32).map(lambda x: x + 0.0)

# Fields not named here are drawn from their types: a field added to the spec is covered at
# once, and fails below until it has its wire mapping.
SPECS = st.builds(
    GenerationSpec,
    prompt_tokens=st.lists(st.integers(0, 2**31 - 1), max_size=16).map(tuple),
    sampling=st.builds(
        SamplingParams,
        temperature=_FINITE,
        top_p=_FINITE,
        top_k=st.integers(0, 1000),
        min_p=_FINITE,
        repeat_penalty=_FINITE,
        seed=st.integers(0, 2**64 - 1),
    ),
    max_tokens=st.integers(1, 1 << 20),
    stop=st.lists(st.text(max_size=8), max_size=4).map(tuple),
    ignore_eos=st.booleans(),
    prefill_chunk=st.integers(1, 4096),
    grammar=st.none()
    | st.builds(Grammar, gbnf=st.text(max_size=32), digest=st.binary(min_size=32, max_size=32)),
)


def _record(spec: GenerationSpec, generated: list[int]) -> SessionRecord:
    return SessionRecord(
        session_id=b"s" * 16,
        model_digest=b"m" * 32,
        spec=spec,
        created_at_s=1.0,
        expires_at_s=2.0,
        generated=array("I", generated),
    )


@given(SPECS, st.lists(st.integers(0, 2**31 - 1), max_size=8))
def test_every_spec_field_survives_the_record_its_metadata_and_the_snapshot(spec, generated):
    record = _record(spec, generated)
    stored = cbor2.loads(canonical_cbor(record.meta()))  # as a store writes and reads it
    again = SessionRecord.from_meta(stored, array("I", generated))
    assert again.spec == spec
    assert again.snapshot() == record.snapshot()
    assert record.snapshot().spec is spec


@given(SPECS, st.booleans())
def test_the_engine_request_says_what_the_spec_says(spec, resumed):
    resume = ResumePoint(generated=(1, 2)) if resumed else None
    plan = PrefillPlan.plain(len(spec.prompt_tokens) or 1, spec.prefill_chunk)
    request = spec.request(resume=resume, prefill_plan=plan, cache_scope="key")
    carried = {f.name for f in dataclasses.fields(SequenceRequest)}
    for field in dataclasses.fields(GenerationSpec):
        value = getattr(spec, field.name)
        if field.name == "grammar":
            assert request.grammar == (None if value is None else value.gbnf)
        elif field.name in carried:
            assert getattr(request, field.name) == value, field.name
    assert (request.resume, request.prefill_plan, request.cache_scope) == (resume, plan, "key")


@given(SPECS, SPECS)
def test_two_specs_name_the_same_checkpoints_only_when_they_are_equal(a, b):
    key = b"k" * 32
    same_hash = _record(a, [7]).snapshot().mac(key, 0) == _record(b, [7]).snapshot().mac(key, 0)
    # The grammar's text is named by its digest; everything else enters the MAC itself.
    if a.grammar is not None and b.grammar is not None and a.grammar.digest == b.grammar.digest:
        b = dataclasses.replace(b, grammar=a.grammar)
    assert same_hash == (a == b)
