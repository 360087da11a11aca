"""Whether a grammar lets a model write a text: llama.cpp's own grammar engine (the sampler the
server constrains with), fed the text's tokens one by one (model tests: it needs a vocabulary)."""

from __future__ import annotations

import ctypes

import llama_cpp
import numpy as np

from quicsrv.engine.vocab import Vocabulary

__all__ = ["matches"]

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)


def _allows(sampler: llama_cpp.llama_sampler_p, token: int) -> bool:
    one = np.zeros(1, dtype=_TOKEN_DATA)
    one["id"] = token
    array = llama_cpp.llama_token_data_array(
        data=one.ctypes.data_as(llama_cpp.llama_token_data_p), size=1, selected=-1, sorted=False
    )
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    return bool(np.isfinite(one["logit"][0]))


def matches(vocab: Vocabulary, gbnf: str, text: str) -> bool:
    """Whether the grammar lets a model write exactly ``text`` and stop."""
    handle = vocab.handle
    sampler = llama_cpp.llama_sampler_init_grammar(handle, gbnf.encode(), b"root")
    assert sampler, "the grammar does not compile"
    try:
        tokens = vocab.tokenize(text, add_special=False)
        # Some code points (unassigned planes) lose a byte in llama.cpp's tokenizer.
        assert b"".join(map(vocab.piece, tokens)) == text.encode(), f"{text!r} does not round-trip"
        for token in tokens:
            if not _allows(sampler, token):  # accepting it would abort the process
                return False
            llama_cpp.llama_sampler_accept(sampler, token)
        return _allows(sampler, llama_cpp.llama_vocab_eos(handle))
    finally:
        llama_cpp.llama_sampler_free(sampler)
