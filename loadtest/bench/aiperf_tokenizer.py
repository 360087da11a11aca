"""A Hugging Face tokenizer directory made offline from a GGUF's own vocabulary, for AIPerf.

AIPerf sizes its synthetic prompts and counts the tokens it receives with a Hugging Face
tokenizer, which it would fetch from the hub by model name. The hub is out of reach here, and
the tokenizer that matters is the one the servers run anyway: llama.cpp's, built from the GGUF's
``tokenizer.ggml.*`` keys. This module writes those keys out as ``tokenizer.json`` (the
``tokenizers`` library's format: byte-level BPE, the same merges, the same pre-tokenizer split),
``tokenizer_config.json`` and ``special_tokens_map.json``, so that AIPerf's
``--tokenizer DIR`` loads it with ``HF_HUB_OFFLINE=1``.

``transformers`` can read a GGUF's tokenizer itself (``gguf_file=``), but only with PyTorch
installed; the ``gguf`` package alone reads the keys, and the rest is the JSON below.

Only byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) whose pre-tokenizer is in
:data:`PRE_TOKENIZERS` are supported (SmolLM2, the default model, is ``smollm``); anything else is
refused by name rather than tokenized differently from llama.cpp.
:func:`loadtest.bench.aiperf_run` checks the result token for token against llama.cpp before a
run.

Runs in AIPerf's own environment (which has ``tokenizers`` and ``gguf``), never in the project's::

    AIPERF_PY=~/.cache/quicsrv/aiperf/venv/bin/python
    $AIPERF_PY -m loadtest.bench.aiperf_tokenizer build GGUF DIR
    $AIPERF_PY -m loadtest.bench.aiperf_tokenizer encode DIR < texts.json   # JSON list of str

The functions that build the JSON are pure (lists in, dicts out) and imported by the tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PRE_TOKENIZERS",
    "GgufVocabulary",
    "UnsupportedVocabulary",
    "main",
    "read_gguf_vocabulary",
    "tokenizer_files",
    "write_tokenizer",
]

#: llama.cpp's ``token_type`` values (``llama_token_type``): 3 control, 4 user-defined. Both are
#: matched whole before BPE (llama.cpp's "special" tokens); only control ones are special to HF.
_CONTROL = 3
_USER_DEFINED = 4

_BYTE_LEVEL = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": True,
}

#: llama.cpp's pre-tokenizer (``tokenizer.ggml.pre``) -> the ``tokenizers`` pre-tokenizer that
#: splits text the same way. ``smollm``: llama.cpp's regexes are ``\p{N}`` (every digit alone)
#: then GPT-2's; ``gpt-2``: GPT-2's alone (``ByteLevel(use_regex=True)`` is GPT-2's regex).
PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    },
    "gpt-2": _BYTE_LEVEL,
}


class UnsupportedVocabulary(ValueError):
    """The GGUF's tokenizer is not one this module can reproduce exactly."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GgufVocabulary:
    """The ``tokenizer.ggml.*`` keys of a GGUF file, as plain values."""

    model: str
    """``tokenizer.ggml.model``: ``gpt2`` is byte-level BPE."""
    pre: str
    """``tokenizer.ggml.pre``: llama.cpp's name for the pre-tokenizer regexes."""
    tokens: Sequence[str]
    """Token text by id (byte-level: a space is ``Ġ``)."""
    token_types: Sequence[int]
    """``llama_token_type`` by id (1 normal, 3 control, 4 user-defined...)."""
    merges: Sequence[str]
    """BPE merges in rank order, each ``"left right"``."""
    bos_id: int | None = None
    """Beginning-of-sequence token id."""
    eos_id: int | None = None
    """End-of-sequence token id."""
    unk_id: int | None = None
    """Unknown token id."""
    pad_id: int | None = None
    """Padding token id."""
    add_bos: bool = False
    """Whether llama.cpp puts BOS in front of a tokenized prompt."""
    chat_template: str | None = None
    """The Jinja chat template the GGUF carries."""
    context_length: int | None = None
    """The model's training context (``<arch>.context_length``)."""


def _merge_pair(merge: str) -> list[str]:
    """``"Ġ t"`` -> ``["Ġ", "t"]``. Byte-level tokens hold no space (a space byte is ``Ġ``), so
    the one space is the separator."""
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise UnsupportedVocabulary(f"merge {merge!r} is not two tokens")
    return [left, right]


def _added_tokens(vocabulary: GgufVocabulary) -> list[dict[str, Any]]:
    """Control and user-defined tokens, matched whole before BPE as llama.cpp does."""
    added = []
    for token_id, (text, kind) in enumerate(
        zip(vocabulary.tokens, vocabulary.token_types, strict=True)
    ):
        if kind in (_CONTROL, _USER_DEFINED):
            added.append(
                {
                    "id": token_id,
                    "content": text,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": kind == _CONTROL,
                }
            )
    return added


def _token(vocabulary: GgufVocabulary, token_id: int | None) -> str | None:
    return None if token_id is None else vocabulary.tokens[token_id]


def tokenizer_files(vocabulary: GgufVocabulary) -> dict[str, dict[str, Any]]:
    """The JSON files of a Hugging Face tokenizer directory for ``vocabulary``, by file name.

    Raises :class:`UnsupportedVocabulary` for anything but byte-level BPE with a known
    pre-tokenizer, and for a BOS that llama.cpp would add (the post-processor here adds none).
    """
    if vocabulary.model != "gpt2":
        raise UnsupportedVocabulary(
            f"tokenizer.ggml.model {vocabulary.model!r}: only byte-level BPE ('gpt2') is built"
        )
    if vocabulary.pre not in PRE_TOKENIZERS:
        raise UnsupportedVocabulary(
            f"tokenizer.ggml.pre {vocabulary.pre!r}: known are {sorted(PRE_TOKENIZERS)}"
        )
    if vocabulary.add_bos:
        raise UnsupportedVocabulary("tokenizer.ggml.add_bos_token is true: not reproduced")
    vocab = {text: token_id for token_id, text in enumerate(vocabulary.tokens)}
    if len(vocab) != len(vocabulary.tokens):
        raise UnsupportedVocabulary("the vocabulary holds the same token text twice")
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(vocabulary),
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[vocabulary.pre],
        # Byte-level post-processing only fixes offsets; no BOS/EOS is added (add_bos is false).
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [_merge_pair(merge) for merge in vocabulary.merges],
        },
    }
    special = {
        name: text
        for name, text in (
            ("bos_token", _token(vocabulary, vocabulary.bos_id)),
            ("eos_token", _token(vocabulary, vocabulary.eos_id)),
            ("unk_token", _token(vocabulary, vocabulary.unk_id)),
            ("pad_token", _token(vocabulary, vocabulary.pad_id)),
        )
        if text is not None
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    if vocabulary.context_length is not None:
        config["model_max_length"] = vocabulary.context_length
    if vocabulary.chat_template is not None:
        config["chat_template"] = vocabulary.chat_template
    return {
        "tokenizer.json": tokenizer,
        "tokenizer_config.json": config,
        "special_tokens_map.json": special,
    }


def write_tokenizer(vocabulary: GgufVocabulary, directory: Path) -> None:
    """Write :func:`tokenizer_files` into ``directory`` (created if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in tokenizer_files(vocabulary).items():
        (directory / name).write_text(json.dumps(content, ensure_ascii=False, indent=1) + "\n")


def read_gguf_vocabulary(path: Path) -> GgufVocabulary:
    """The tokenizer keys of the GGUF at ``path`` (needs the ``gguf`` package)."""
    from gguf import GGUFReader  # AIPerf's environment only

    fields = GGUFReader(str(path)).fields

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    architecture = value("general.architecture")
    return GgufVocabulary(
        model=value("tokenizer.ggml.model"),
        pre=value("tokenizer.ggml.pre") or "default",
        tokens=value("tokenizer.ggml.tokens"),
        token_types=value("tokenizer.ggml.token_type"),
        merges=value("tokenizer.ggml.merges") or [],
        bos_id=value("tokenizer.ggml.bos_token_id"),
        eos_id=value("tokenizer.ggml.eos_token_id"),
        unk_id=value("tokenizer.ggml.unknown_token_id"),
        pad_id=value("tokenizer.ggml.padding_token_id"),
        add_bos=bool(value("tokenizer.ggml.add_bos_token")),
        chat_template=value("tokenizer.chat_template"),
        context_length=value(f"{architecture}.context_length") if architecture else None,
    )


def _encode(directory: Path, texts: Sequence[str]) -> list[list[int]]:
    """``texts`` through the tokenizer in ``directory`` loaded the way AIPerf loads it."""
    from transformers import AutoTokenizer  # AIPerf's environment only

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.aiperf_tokenizer")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="write DIR from the GGUF's vocabulary")
    build.add_argument("gguf", type=Path)
    build.add_argument("directory", type=Path)
    encode = commands.add_parser("encode", help="JSON list of texts on stdin -> token ids")
    encode.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    if args.command == "build":
        write_tokenizer(read_gguf_vocabulary(args.gguf), args.directory)
        print(args.directory)
    else:
        json.dump(_encode(args.directory, json.load(sys.stdin)), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
