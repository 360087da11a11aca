"""Token selection: llama.cpp's own sampler chain filters, a counter-based draw picks.

llama.cpp's ``dist`` sampler keeps an RNG whose state cannot be saved. Here the uniform number
for token ``i`` is derived from ``(seed, i)`` with keyed BLAKE3, so a sequence's whole sampler
state is (parameters, seed, tokens so far): reproducible and restorable by construction.
"""

from __future__ import annotations

import ctypes

import blake3
import llama_cpp
import numpy as np
import numpy.typing as npt

from ._api import SamplingParams

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
_PENALTY_WINDOW = 64


def counter_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, index)."""
    key = blake3.blake3(seed.to_bytes(8, "little"), derive_key_context="quicsrv sampler v1")
    digest = blake3.blake3(index.to_bytes(8, "little"), key=key.digest()).digest(8)
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


class SequenceSampler:
    """One sequence's sampler: a native filter chain plus the counter-based draw."""

    def __init__(self, params: SamplingParams, n_vocab: int) -> None:
        self._params = params
        self._n_vocab = n_vocab
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
            self._ids = np.arange(n_vocab, dtype=np.int32)

    def accept(self, token_id: int) -> None:
        """Record a token (the penalties sampler keeps a window of recent tokens)."""
        if self._chain is not None:
            llama_cpp.llama_sampler_accept(self._chain, token_id)

    def sample(self, logits: npt.NDArray[np.float32], index: int) -> int:
        """Pick the token at generation position ``index`` from its logits."""
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
        weights = np.exp(kept_logits[finite] - kept_logits[finite].max())
        cumulative = np.cumsum(weights)
        target = counter_uniform(self._params.seed, index) * cumulative[-1]
        choice = int(np.searchsorted(cumulative, target, side="right"))
        return int(ids[min(choice, len(ids) - 1)])

    def close(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
