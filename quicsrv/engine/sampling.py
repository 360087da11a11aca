"""Token selection: llama.cpp's own sampler chain filters, a counter-based draw picks.

llama.cpp's ``dist`` sampler keeps an RNG whose state cannot be saved. Here the uniform number
for token ``i`` is derived from ``(seed, i)`` with keyed BLAKE3, so a sequence's whole sampler
state is (parameters, seed, tokens so far): reproducible and restorable by construction.

A grammar (structured output: a JSON schema made GBNF) constrains the pick *sample, then
check* (:data:`~._api.CONSTRAINED_SAMPLING`): the token drawn from the unconstrained distribution is
kept when the grammar allows it; otherwise the grammar masks every candidate (3.7-10.8 ms a
token on these machines, against ~9 ms for a decode step, and far more inside a JSON string:
see :func:`_likeliest_allowed`) and the same uniform number draws again among the allowed ones.
Greedy decoding gets the allowed argmax either way, and asks about its likeliest candidates one
by one before it masks everything (the same token, found sooner); sampled
decoding gets a distribution slightly different from masking first, as llama-server's does,
for a fraction of the cost. The grammar's state is the tokens it accepted: a resume replays
them into a fresh grammar (:class:`GrammarState`), each checked first, since llama.cpp aborts
the whole process on a token its grammar forbids.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import blake3
import llama_cpp
import numpy as np
import numpy.typing as npt

from ._api import SamplingParams, TokenLogprobs

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
_PENALTY_WINDOW = 64
GREEDY_PROBES = 32
"""Candidates a greedy pick the grammar refused asks about one by one before masking all."""


class GrammarViolation(ValueError):
    """A token the grammar forbids: a record that does not fit its grammar (or a grammar that
    changed under it). Raised before llama.cpp would abort the process on it."""


class GrammarState:
    """A llama.cpp grammar sampler and the tokens it has accepted."""

    def __init__(self, vocab: llama_cpp.llama_vocab_p, gbnf: str) -> None:
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
        if not sampler:
            raise GrammarViolation("the grammar does not parse")
        self._sampler: llama_cpp.llama_sampler_p | None = sampler
        self._one = np.zeros(1, dtype=_TOKEN_DATA)
        self.accepted = 0

    def allows(self, token_id: int) -> bool:
        """Whether the grammar, as it stands, lets ``token_id`` come next."""
        one = self._one
        one["id"] = token_id
        one["logit"] = 0.0
        self._apply(one)
        return bool(np.isfinite(one["logit"][0]))

    def mask(
        self, logits: npt.NDArray[np.float32], ids: npt.NDArray[np.int32]
    ) -> npt.NDArray[np.float32]:
        """``logits`` with every token the grammar forbids now at -inf (a copy)."""
        candidates = np.zeros(len(ids), dtype=_TOKEN_DATA)
        candidates["id"] = ids
        candidates["logit"] = logits
        self._apply(candidates)
        masked = np.full(len(ids), -np.inf, dtype=np.float32)
        masked[candidates["id"]] = candidates["logit"]
        return masked

    def accept(self, token_id: int, *, checked: bool = False) -> None:
        """Advance over ``token_id``, checked first unless :meth:`allows` just said yes
        (``checked``); raises GrammarViolation."""
        if not checked and not self.allows(token_id):
            raise GrammarViolation(
                f"token {token_id} at position {self.accepted} is not allowed by the grammar"
            )
        llama_cpp.llama_sampler_accept(self._sampler, token_id)
        self.accepted += 1

    def close(self) -> None:
        if self._sampler is not None:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None

    def _apply(self, candidates: npt.NDArray[np.void]) -> None:
        array = llama_cpp.llama_token_data_array(
            data=candidates.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=len(candidates),
            selected=-1,
            sorted=False,
        )
        llama_cpp.llama_sampler_apply(self._sampler, ctypes.byref(array))


def _likeliest_allowed(logits: npt.NDArray[np.float32], grammar: GrammarState) -> int:
    """The token greedy decoding picks from the masked logits (``np.argmax``'s: the highest
    logit, the lowest id among equals), found by asking the grammar about the likeliest
    :data:`GREEDY_PROBES` one at a time; -1 when none of them is allowed, or when the one
    allowed could tie with a token not asked about. Masking the whole vocabulary instead walks
    every token through the grammar: inside a JSON string, where nearly every token is allowed,
    12-13 ms (0.4 ms for the probes) on this 2-core Xeon when quiet, 370 ms under load; a model
    that wants a raw newline in a string is refused at every line."""
    probed = np.argpartition(logits, -GREEDY_PROBES)[-GREEDY_PROBES:]
    order = probed[np.lexsort((probed, -logits[probed]))]
    lowest = logits[order[-1]]  # a token not asked about may have this logit too
    for token in order:
        if logits[token] <= lowest:
            break
        if grammar.allows(int(token)):
            return int(token)
    return -1


def check_replay(vocab: llama_cpp.llama_vocab_p, gbnf: str, tokens: Sequence[int]) -> None:
    """Raise GrammarViolation unless ``tokens`` are a sequence the grammar allows (before a
    resume sends them to the engine, whose process a forbidden token would abort)."""
    grammar = GrammarState(vocab, gbnf)
    try:
        for token in tokens:
            grammar.accept(token)
    finally:
        grammar.close()


def token_logprobs(logits: npt.NDArray[np.float32], token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under the softmax of ``logits`` (the model's distribution,
    before any sampler touched it), with the ``top`` most likely tokens'. A function of the
    logits alone: an exact replay that recomputes a token's logits gets the same numbers."""
    peak = float(logits.max())
    # exp in float32 (vectorised: a sixth of float64's time over a 49k vocabulary), summed in
    # float64; each result rounded to a float32, what a token log keeps.
    log_total = peak + math.log(float(np.exp(logits - peak).sum(dtype=np.float64)))

    def logprob(i: int) -> float:
        return float(np.float32(float(logits[i]) - log_total))

    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = np.argpartition(logits, -top)[-top:]
        ids = ids[np.lexsort((ids, -logits[ids]))]  # most likely first, ties by id
        best = tuple((int(i), logprob(int(i))) for i in ids)
    return TokenLogprobs(logprob(token), best)


def counter_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, index)."""
    key = blake3.blake3(seed.to_bytes(8, "little"), derive_key_context="quicsrv sampler v1")
    digest = blake3.blake3(index.to_bytes(8, "little"), key=key.digest()).digest(8)
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


class SequenceSampler:
    """One sequence's sampler: a native filter chain plus the counter-based draw."""

    def __init__(
        self, params: SamplingParams, n_vocab: int, grammar: GrammarState | None = None
    ) -> None:
        self._params = params
        self._n_vocab = n_vocab
        self._grammar = grammar
        self._accepted = 0
        self._checked = -1  # the token the grammar allowed at this step (no second check)
        self._chain: llama_cpp.llama_sampler_p | None = None
        if not params.greedy:
            chain = llama_cpp.llama_sampler_chain_init(
                llama_cpp.llama_sampler_chain_default_params()
            )
            if params.repeat_penalty != 1.0:
                llama_cpp.llama_sampler_chain_add(
                    chain,
                    llama_cpp.llama_sampler_init_penalties(
                        _PENALTY_WINDOW, params.repeat_penalty, 0.0, 0.0
                    ),
                )
            if params.top_k > 0:
                llama_cpp.llama_sampler_chain_add(
                    chain, llama_cpp.llama_sampler_init_top_k(params.top_k)
                )
            if params.top_p < 1.0:
                llama_cpp.llama_sampler_chain_add(
                    chain, llama_cpp.llama_sampler_init_top_p(params.top_p, 1)
                )
            if params.min_p > 0.0:
                llama_cpp.llama_sampler_chain_add(
                    chain, llama_cpp.llama_sampler_init_min_p(params.min_p, 1)
                )
            llama_cpp.llama_sampler_chain_add(
                chain, llama_cpp.llama_sampler_init_temp(params.temperature)
            )
            self._chain = chain
            self._candidates = np.zeros(n_vocab, dtype=_TOKEN_DATA)
        if self._chain is not None or grammar is not None:  # a greedy pick needs no ids
            self._ids = np.arange(n_vocab, dtype=np.int32)

    @property
    def constrained(self) -> bool:
        return self._grammar is not None

    def catch_up(self, tokens: Sequence[int]) -> None:
        """Advance the grammar over tokens generated before a resume, checked one by one
        (raises GrammarViolation); :meth:`accept` then skips them for the grammar."""
        if self._grammar is not None:
            for token in tokens[self._grammar.accepted :]:
                self._grammar.accept(token)

    def accept(self, token_id: int) -> None:
        """Record a token (the penalties sampler keeps a window of recent tokens, the grammar
        its parse state); raises GrammarViolation for a token the grammar forbids."""
        grammar = self._grammar
        self._accepted += 1
        if grammar is not None and grammar.accepted < self._accepted:
            grammar.accept(token_id, checked=token_id == self._checked)
        self._checked = -1
        if self._chain is not None:
            llama_cpp.llama_sampler_accept(self._chain, token_id)

    def sample(self, logits: npt.NDArray[np.float32], index: int) -> int:
        """Pick the token at generation position ``index`` from its logits."""
        token = self._draw(logits, index)
        grammar = self._grammar
        if grammar is None:
            return token
        if not grammar.allows(token):
            token = _likeliest_allowed(logits, grammar) if self._chain is None else -1
            if token < 0:
                masked = grammar.mask(logits, self._ids)
                if not np.isfinite(masked).any():
                    raise GrammarViolation("the grammar allows no token here")
                token = self._draw(masked, index)
        self._checked = token
        return token

    def _draw(self, logits: npt.NDArray[np.float32], index: int) -> int:
        if self._chain is None:
            return int(np.argmax(logits))
        candidates = self._candidates
        candidates["id"] = self._ids
        candidates["logit"] = logits
        candidates["p"] = 0.0
        array = llama_cpp.llama_token_data_array(
            data=candidates.ctypes.data_as(llama_cpp.llama_token_data_p),
            size=self._n_vocab,
            selected=-1,
            sorted=False,
        )
        llama_cpp.llama_sampler_apply(self._chain, ctypes.byref(array))
        kept = np.ctypeslib.as_array(
            ctypes.cast(array.data, ctypes.POINTER(ctypes.c_uint8)),
            shape=(array.size * _TOKEN_DATA.itemsize,),
        ).view(_TOKEN_DATA)
        # Order candidates by id so the draw does not depend on how the chain sorted them.
        order = np.argsort(kept["id"], kind="stable")
        kept_logits = kept["logit"][order].astype(np.float64)
        finite = np.isfinite(kept_logits)
        ids = kept["id"][order][finite]
        if not len(ids):
            raise GrammarViolation("the grammar allows no token here")
        weights = np.exp(kept_logits[finite] - kept_logits[finite].max())
        cumulative = np.cumsum(weights)
        target = counter_uniform(self._params.seed, index) * cumulative[-1]
        choice = int(np.searchsorted(cumulative, target, side="right"))
        return int(ids[min(choice, len(ids) - 1)])

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
        if self._grammar is not None:
            self._grammar.close()
