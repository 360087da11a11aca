"""A greedy pick under a grammar is the masked argmax, whether it was found by asking about the
likeliest tokens one by one or by masking the whole vocabulary (no model: a set of allowed
tokens stands in for the grammar)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quicsrv.engine import SamplingParams
from quicsrv.engine.sampling import GREEDY_PROBES, SequenceSampler

N_VOCAB = 48


class AllowedSet:
    """A grammar that allows a fixed set of tokens, counting what it is asked."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.asked = 0
        self.masks = 0
        self.accepted = 0

    def allows(self, token_id: int) -> bool:
        self.asked += 1
        return token_id in self.allowed

    def mask(self, logits, ids):
        self.masks += 1
        masked = np.full(len(ids), -np.inf, dtype=np.float32)
        for token in self.allowed:
            masked[token] = logits[token]
        return masked


def _masked_argmax(logits, allowed: set[int]) -> int:
    masked = np.full(len(logits), -np.inf, dtype=np.float32)
    for token in allowed:
        masked[token] = logits[token]
    return int(np.argmax(masked))


# Few distinct logits: ties everywhere, at the probes' edge too.
LOGITS = hnp.arrays(np.float32, N_VOCAB, elements=st.integers(-6, 6).map(float))
ALLOWED = st.sets(st.integers(0, N_VOCAB - 1), min_size=1, max_size=8)


@settings(max_examples=100, derandomize=True)
@given(LOGITS, ALLOWED)
def test_a_greedy_pick_is_the_masked_argmax(logits, allowed):
    grammar = AllowedSet(allowed)
    sampler = SequenceSampler(SamplingParams(), N_VOCAB, grammar)  # type: ignore[arg-type]
    assert sampler.sample(logits, 0) == _masked_argmax(logits, allowed)


def test_a_likely_allowed_token_is_found_without_masking_the_vocabulary():
    logits = np.arange(N_VOCAB, dtype=np.float32)  # the higher the id, the likelier
    grammar = AllowedSet({N_VOCAB - 5, 3})
    sampler = SequenceSampler(SamplingParams(), N_VOCAB, grammar)  # type: ignore[arg-type]
    assert sampler.sample(logits, 0) == N_VOCAB - 5
    assert grammar.masks == 0 and grammar.asked == 1 + 5  # the draw's own check, then 5 asked
    far = AllowedSet({3})  # beyond the probes: the whole vocabulary is masked
    sampler = SequenceSampler(SamplingParams(), N_VOCAB, far)  # type: ignore[arg-type]
    assert sampler.sample(logits, 0) == 3
    assert far.masks == 1 and far.asked == 1 + GREEDY_PROBES - 1


def test_a_tie_at_the_edge_of_the_probes_goes_to_the_lower_id():
    logits = np.zeros(N_VOCAB, dtype=np.float32)
    logits[1:GREEDY_PROBES] = 5.0  # refused, and likelier than the two below
    logits[[0, N_VOCAB - 1]] = 1.0  # only one of these two is among the probes
    grammar = AllowedSet({0, N_VOCAB - 1})
    sampler = SequenceSampler(SamplingParams(), N_VOCAB, grammar)  # type: ignore[arg-type]
    assert sampler.sample(logits, 0) == 0
