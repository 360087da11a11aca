"""The token endpoints' requests and bodies, in llama-server's shapes: ``POST /tokenize``,
``POST /detokenize``, ``GET /props``, and the model facts on ``/v1/models`` entries
(llama-server's ``meta``, vLLM's ``max_model_len``). Pure: bytes and facts in, checked values
and dicts out (:mod:`.token_endpoints` acts on them).

llama-server is the reference (``tools/server/README.md`` and ``server-context.cpp`` of the
llama.cpp that llama-cpp-python 0.3.36 vendors): the same field names and defaults, a piece as
a string when its bytes are valid UTF-8 and as a list of byte values otherwise. Where it is
lenient this server is not: an unknown field, a wrong type, an id outside the vocabulary are a
400 with a stable code (llama-server ignores the first, and aborts or answers 500 on the last).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quicsrv_proto.frames import MAX_PROMPT_CHARS

from ..engine import ModelInfo
from . import openai_api
from .errors import ApiError

__all__ = [
    "TOKENIZE_FIELDS",
    "DetokenizeRequest",
    "TokenizeRequest",
    "model_facts",
    "parse_detokenize",
    "parse_tokenize",
    "piece_json",
    "props_body",
    "tokenize_body",
]

#: The fields ``POST /tokenize`` takes, with llama-server's defaults (``model`` is accepted
#: when it names the served model: OpenAI-style clients send it everywhere).
TOKENIZE_FIELDS: dict[str, bool] = {
    "add_special": False,
    "parse_special": True,
    "with_pieces": False,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizeRequest:
    """A checked ``POST /tokenize``."""

    content: str
    """The text to tokenize."""
    add_special: bool
    """Put BOS in front where the model wants one (llama-server's default: no)."""
    parse_special: bool
    """A special token's text is that token (default), else plain text."""
    with_pieces: bool
    """Answer ``{"id", "piece"}`` objects instead of bare ids."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DetokenizeRequest:
    """A checked ``POST /detokenize``."""

    tokens: tuple[int, ...]
    """Token ids, each inside the vocabulary."""


def _invalid(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def _object(body: bytes, fields: set[str], model_id: str) -> dict[str, Any]:
    """The JSON object of a body whose keys are all in ``fields`` (or ``model``, naming the
    served model)."""
    request = openai_api.json_object(body)
    for key in request:
        if key not in fields and key != "model":
            raise _invalid(
                f"{key[:100]}: unknown field (this endpoint takes {', '.join(sorted(fields))})",
                key[:100],
                "unknown_parameter",
            )
    if "model" in request:
        openai_api.check_model(request, model_id)
    return request


def parse_tokenize(body: bytes, *, model_id: str) -> TokenizeRequest:
    """Check a ``POST /tokenize`` body; raises :class:`ApiError` (400; 404 for another
    model)."""
    request = _object(body, {"content", *TOKENIZE_FIELDS}, model_id)
    content = request.get("content")
    if content is None:
        raise _invalid(
            "content is required (the text to tokenize)", "content", "missing_required_parameter"
        )
    if not isinstance(content, str):
        # llama-server also takes arrays mixing text and ids; this server tokenizes text only.
        raise _invalid("content must be a string", "content")
    if len(content) > MAX_PROMPT_CHARS:
        raise _invalid(f"content must be at most {MAX_PROMPT_CHARS} characters", "content")
    flags = {
        name: openai_api.optional(request, name, bool, default)
        for name, default in TOKENIZE_FIELDS.items()
    }
    return TokenizeRequest(content=content, **flags)


def parse_detokenize(
    body: bytes, *, model_id: str, n_vocab: int, max_tokens: int
) -> DetokenizeRequest:
    """Check a ``POST /detokenize`` body: ``tokens``, at most ``max_tokens`` ids, each in
    ``[0, n_vocab)``; raises :class:`ApiError` (400; 404 for another model)."""
    request = _object(body, {"tokens"}, model_id)
    tokens = request.get("tokens")
    if tokens is None:
        raise _invalid(
            "tokens is required (an array of token ids)", "tokens", "missing_required_parameter"
        )
    if not isinstance(tokens, list):
        raise _invalid("tokens must be an array of token ids", "tokens")
    if len(tokens) > max_tokens:
        raise _invalid(
            f"tokens holds {len(tokens)} ids; at most {max_tokens} are detokenized at once",
            "tokens",
            "too_many_tokens",
        )
    for i, token in enumerate(tokens):
        if type(token) is not int:  # bool is an int in Python: true is no token id
            raise _invalid(f"tokens[{i}] must be an integer token id", f"tokens[{i}]")
        if not 0 <= token < n_vocab:
            raise _invalid(
                f"tokens[{i}] = {token} is not a token id of this model (0 to {n_vocab - 1})",
                f"tokens[{i}]",
                "invalid_token_id",
            )
    return DetokenizeRequest(tokens=tuple(tokens))


def piece_json(piece: bytes) -> str | list[int]:
    """A token's piece as llama-server shows it: the text when the bytes are valid UTF-8,
    else the byte values (a piece may hold part of a character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def tokenize_body(tokens: list[int], pieces: list[bytes] | None) -> dict[str, Any]:
    """``POST /tokenize``'s answer: the ids, or with ``pieces`` ``{"id", "piece"}`` objects."""
    if pieces is None:
        return {"tokens": tokens}
    return {
        "tokens": [
            {"id": token, "piece": piece_json(piece)}
            for token, piece in zip(tokens, pieces, strict=True)
        ]
    }


def model_facts(info: ModelInfo, *, n_ctx: int) -> dict[str, Any]:
    """The fields a ``/v1/models`` entry carries besides OpenAI's: llama-server's ``meta``
    and vLLM's ``max_model_len``, both the context one sequence gets here (``n_ctx``)."""
    return {
        "max_model_len": n_ctx,
        "meta": {
            "vocab_type": info.vocab_type,
            "n_vocab": info.n_vocab,
            "n_ctx": n_ctx,
            "n_ctx_train": info.n_ctx_train,
            "n_embd": info.n_embd,
            "n_params": info.n_params,
            "size": info.size_bytes,
        },
    }


def props_body(
    info: ModelInfo, *, model_id: str, n_ctx: int, total_slots: int, build_info: str
) -> dict[str, Any]:
    """``GET /props``: llama-server's fields that are true here. ``n_ctx`` is the context of
    one sequence (llama-server's per-slot ``n_ctx``), ``params`` the sampling a request that
    names none gets, ``model_path`` the file's name only."""
    return {
        "default_generation_settings": {
            "n_ctx": n_ctx,
            "params": {
                **openai_api.DEFAULT_SAMPLING,
                "max_tokens": openai_api.DEFAULT_MAX_TOKENS,
                "n_predict": openai_api.DEFAULT_MAX_TOKENS,
            },
        },
        "total_slots": total_slots,
        "model_alias": model_id,
        "model_path": info.file_name,
        "modalities": {"vision": False, "audio": False},
        "chat_template": info.chat_template or "",
        "bos_token": info.bos_token,
        "eos_token": info.eos_token,
        "build_info": build_info,
    }
