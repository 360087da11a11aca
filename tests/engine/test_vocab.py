"""The vocabulary's per-token lookups, cached for the decode thread, answer what llama.cpp does."""

from __future__ import annotations

import llama_cpp
import pytest

from quicsrv.engine.vocab import Vocabulary


@pytest.fixture(scope="module")
def vocabulary(model_path):
    loaded = Vocabulary.load(model_path)
    yield loaded
    loaded.close()


def test_cached_pieces_and_end_of_generation_flags_match_llama_cpp(vocabulary):
    model = vocabulary._model
    n_vocab = vocabulary.n_vocab
    ids = [*range(0, n_vocab, 97), *range(16), n_vocab - 1]
    for _ in range(2):  # the second pass answers from the caches
        for token_id in ids:
            assert vocabulary.piece(token_id) == vocabulary._look_up_piece(token_id)
            assert vocabulary.is_end_of_generation(token_id) == bool(
                llama_cpp.llama_vocab_is_eog(model.vocab, token_id)
            )
    assert any(vocabulary.is_end_of_generation(t) for t in range(16))  # e.g. <|im_end|>


@pytest.mark.parametrize("token_id", [-1, "past the end"])
def test_an_id_outside_the_vocabulary_raises(vocabulary, token_id):
    token = vocabulary.n_vocab if token_id == "past the end" else token_id
    with pytest.raises(IndexError):
        vocabulary.piece(token)
    with pytest.raises(IndexError):
        vocabulary.is_end_of_generation(token)
