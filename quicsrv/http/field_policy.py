"""Which request fields the OpenAI-style APIs accept, and at which values: the one policy.

Every field a request names is one of three kinds (the README's "Fields: one policy"):

- **honoured**: the endpoint reads it and acts on it (``temperature``, ``stop``, ``tools``...);
  its own parser checks the value;
- **neutral**: quicsrv cannot honour it, but the value given changes nothing in the answer: a
  null, an empty list or object, the default (``n: 1``, ``service_tier: "auto"``), or a field
  that only labels, routes or accounts for the request (``user``, ``safety_identifier``,
  ``prompt_cache_key``, ``metadata``). Accepted, on every endpoint that defines the field;
- anything else is refused with a 400 naming the field in ``param``: a value that would change
  the output (``unsupported_parameter``: a setting silently ignored would be a lie) or a field
  the API does not define (``unknown_parameter``).

The tables below are the policy; :meth:`FieldPolicy.check` applies one of them. Anthropic's
Messages API (``MESSAGES``, ``COUNT_TOKENS``) follows the same three kinds with its own fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ApiError

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "COUNT_TOKENS",
    "MESSAGES",
    "RESPONSES",
    "FieldPolicy",
    "check_metadata",
    "refuse_unless_neutral",
]

#: OpenAI's bounds on ``metadata``.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

Neutral = tuple[object, ...] | Callable[[object], bool]
"""The values of a field that change nothing (null always does): listed, or a test."""


def _is_text(value: object) -> bool:
    return isinstance(value, str)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _no_reasoning(value: object) -> bool:
    """``reasoning`` that asks for none: {}, OpenAI's own echo ``{"effort": null, "summary":
    null}``, or ``effort: "none"`` (the model reasons in no hidden tokens either way)."""
    if not isinstance(value, dict) or set(value) - {"effort", "summary", "generate_summary"}:
        return False
    return value.get("effort") in (None, "none") and all(
        value.get(k) is None for k in ("summary", "generate_summary")
    )


def _text_only(value: object) -> bool:
    return value == ["text"]


#: Neutral on every endpoint: fields that only label, route or account for a request, or that
#: name how a hosted service would run it (its tier, how long it keeps a cached prefix).
_EVERYWHERE: dict[str, Neutral] = {
    "user": _is_text,
    "safety_identifier": _is_text,
    "prompt_cache_key": _is_text,  # which cache a prefix goes to: quicsrv's finds it anyway
    "prompt_cache_retention": ("in_memory", "in-memory", "24h"),
    "service_tier": ("auto", "default"),
    "metadata": lambda value: True,  # checked by check_metadata
}
#: Sampling settings the engine does not have, at their neutral value.
_SAMPLING: dict[str, Neutral] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
}
_COMPLETION_COMMON: dict[str, Neutral] = {
    **_EVERYWHERE,
    **_SAMPLING,
    "n": (1,),
    "logit_bias": ({},),
    # Stored chat completions cannot be listed here; storing changes nothing in the answer.
    "store": _is_bool,
    # llama-server's: true is what quicsrv's prefix cache always does; false (compute the
    # whole prompt again) is not a setting here, and a reused prefix may change the answer.
    "cache_prompt": (True,),
}


@dataclass(frozen=True, slots=True)
class FieldPolicy:
    """One endpoint's fields: those its parser honours, and the neutral values of the rest."""

    honoured: frozenset[str]
    neutral: Mapping[str, Neutral]

    def check(self, request: dict[str, Any]) -> None:
        """Refuse an unknown field, or a neutral one at a value that changes the output; check
        the neutral fields' types (400 naming the field)."""
        unknown = sorted(set(request) - self.honoured - set(self.neutral))
        if unknown:
            raise ApiError(
                400,
                f"Unrecognized request argument supplied: {unknown[0]}",
                code="unknown_parameter",
                param=unknown[0],
            )
        for name in ("user", "safety_identifier", "prompt_cache_key"):
            if request.get(name) is not None and not isinstance(request[name], str):
                raise ApiError(400, f"{name} must be a string", code="invalid_value", param=name)
        if "metadata" in self.neutral:
            check_metadata(request.get("metadata"))
        refuse_unless_neutral(request, self.neutral)


#: quicsrv's sampling and scheduling extensions, with llama-server's names where it has them
#: (``top_k``, ``min_p``, ``repeat_penalty``, ``ignore_eos``), honoured on every generating
#: endpoint (Anthropic's ``top_k`` is its own field of the same meaning).
_EXTENSIONS = frozenset({"seed", "top_k", "min_p", "repeat_penalty", "ignore_eos", "deadline_ms"})

CHAT = FieldPolicy(
    honoured=frozenset(
        {
            "model",
            "messages",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "stop",
            "stream",
            "stream_options",
            "response_format",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "truncation",
            "logprobs",
            "top_logprobs",
        }
    )
    | _EXTENSIONS,
    neutral={
        **_COMPLETION_COMMON,
        "functions": ([],),
        "function_call": ("none",),
        "modalities": _text_only,
        "audio": (),
        "prediction": (),
        "web_search_options": (),
        "reasoning_effort": ("none",),
        "verbosity": ("medium",),
    },
)
COMPLETIONS = FieldPolicy(
    honoured=frozenset(
        {
            "model",
            "prompt",
            "max_tokens",
            "temperature",
            "top_p",
            "stop",
            "stream",
            "stream_options",
            "logprobs",
            "echo",
        }
    )
    | _EXTENSIONS,
    neutral={**_COMPLETION_COMMON, "suffix": (), "best_of": (1,)},
)
RESPONSES = FieldPolicy(
    honoured=frozenset(
        {
            "model",
            "input",
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "stream",
            "background",
            "store",
            "previous_response_id",
            "truncation",
            "text",
            "tools",
            "tool_choice",
            "include",  # checked by its parser
            "top_logprobs",
        }
    )
    | _EXTENSIONS,
    neutral={
        **_EVERYWHERE,
        **_SAMPLING,  # Open Responses defines both penalties on the request
        "parallel_tool_calls": _is_bool,
        "reasoning": _no_reasoning,
        "max_tool_calls": (),
        "stream_options": ({}, {"include_obfuscation": False}),
        "prompt": (),
        "conversation": (),
        "context_management": (),
    },
)


def _no_thinking(value: object) -> bool:
    """Anthropic's ``thinking`` that makes no thinking blocks: ``disabled``, or ``adaptive``
    (the model decides whether to think; this one never does)."""
    return (
        isinstance(value, dict)
        and set(value) <= {"type", "display"}
        and value.get("type") in ("disabled", "adaptive")
    )


def _ephemeral(value: object) -> bool:
    """Anthropic's ``cache_control``: where to cache a prefix (quicsrv's cache keeps them
    all)."""
    return (
        isinstance(value, dict)
        and value.get("type") == "ephemeral"
        and set(value) <= {"type", "ttl"}
        and value.get("ttl", "5m") in ("5m", "1h")
    )


#: Anthropic's fields that change nothing here, on both of its endpoints: the reasoning a model
#: without it never does, a cache breakpoint, where or how fast to run it; the features this
#: server has none of (code execution containers, MCP servers, context editing, structured
#: output and effort settings, cache diagnostics) only when absent or null.
_ANTHROPIC: dict[str, Neutral] = {
    "thinking": _no_thinking,
    "cache_control": _ephemeral,
    "speed": ("standard",),
    "output_config": ({},),
    "context_management": (),
    "mcp_servers": ([],),
    "container": (),
    "diagnostics": (),
}
MESSAGES = FieldPolicy(
    honoured=frozenset(
        {
            "model",
            "messages",
            "system",
            "max_tokens",
            "temperature",
            "top_p",
            "stop_sequences",
            "stream",
            "metadata",  # checked by its parser: Anthropic's holds user_id only
            "tools",
            "tool_choice",
            "truncation",
        }
    )
    | _EXTENSIONS,
    neutral={
        **_ANTHROPIC,
        "service_tier": ("auto", "standard_only"),
        "inference_geo": _is_text,
    },
)
COUNT_TOKENS = FieldPolicy(
    honoured=frozenset({"model", "messages", "system", "tools", "tool_choice"}),
    neutral=_ANTHROPIC,
)


def refuse_unless_neutral(request: dict[str, Any], neutral: Mapping[str, Neutral]) -> None:
    """Each field of ``neutral`` present in ``request`` holds null or one of its neutral
    values (a setting this server cannot honour is refused, never silently ignored)."""
    for name, allowed in neutral.items():
        if name not in request:
            continue
        value = request[name]
        if value is None:
            continue
        if callable(allowed):
            if allowed(value):
                continue
        # bool is an int in Python: True must not pass for 1.
        elif any(type(value) is type(a) and value == a for a in allowed):
            continue
        if name == "n" and isinstance(value, int) and not isinstance(value, bool) and value > 1:
            raise ApiError(400, "only n=1 is supported", code="unsupported_value", param="n")
        raise ApiError(
            400,
            f"{name}={json.dumps(value)[:60]} is not supported by this server",
            code="unsupported_parameter",
            param=name,
        )


def check_metadata(value: object) -> dict[str, str]:
    """OpenAI's ``metadata``: at most 16 string pairs, keys up to 64 characters, values up to
    512 (400 ``metadata`` otherwise); {} for null."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise _bad_metadata(f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs")
    for key, text in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise _bad_metadata(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters")
        if not isinstance(text, str) or len(text) > MAX_METADATA_VALUE_CHARS:
            raise _bad_metadata(
                f"metadata values are strings of at most {MAX_METADATA_VALUE_CHARS} characters"
            )
    return dict(value)


def _bad_metadata(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param="metadata")
