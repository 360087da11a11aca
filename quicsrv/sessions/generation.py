"""A GENERATE checked against this server's limits and turned into a generation spec.

A chat that continues a stored turn (the Responses API's ``previous_response_id``) is
rendered so that its prompt starts with that turn's own token ids, prompt and answer as the
engine saw them, not a re-tokenization of their text (which may split the answer otherwise):
the prefix cache then finds the cells the turn left, and the follow-up's time to first token
does not grow with the history. That holds only when the chat template is prefix-stable for
this conversation (rendering it with the answer and the new messages extends the old prompt's
text by the answer and more): checked on every request, and where it fails the whole chat is
rendered and tokenized afresh.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import quicsrv_proto
from quicsrv_proto import ChatMessage, ErrorCode, Truncation

from ..engine import Engine, InvalidSchema, SamplingParams
from .errors import RequestRejected
from .overflow import fit_history
from .spec import GenerationSpec

__all__ = [
    "INLINE_PROMPT_CHARS",
    "PreparedRequest",
    "PriorTurn",
    "build_request",
    "prepare_off_loop",
    "prompt_chars",
    "prompt_length",
]

log = logging.getLogger(__name__)

#: A prompt up to this size is tokenized on the event loop (tens of microseconds), a longer one
#: on a thread (tokenizing takes about half a microsecond per character).
INLINE_PROMPT_CHARS = 256
_MESSAGE_OVERHEAD_CHARS = 32  # what a chat template adds around each message, roughly


@dataclass(frozen=True, slots=True, kw_only=True)
class PriorTurn:
    """A stored turn that a chat continues: see the module docstring."""

    messages: tuple[ChatMessage, ...]
    """The messages its prompt was rendered from."""
    prompt_tokens: tuple[int, ...]
    generated: tuple[int, ...]
    answer: str
    """Its answer's text."""
    exact: bool
    """The answer's text is its tokens' text (False when a stop sequence cut it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedRequest:
    """A GENERATE made ready for the engine."""

    spec: GenerationSpec
    """What the generation is (its grammar compiled and checked)."""
    messages: tuple[ChatMessage, ...] | None
    """The chat as rendered into the prompt (its oldest turns dropped by ``truncation``);
    None for a plain prompt."""
    continued: bool
    """The prompt starts with the prior turn's own tokens (see the module docstring)."""


def prompt_chars(frame: quicsrv_proto.Generate) -> int:
    """About how many characters a GENERATE gives the tokenizer (a chat: its messages, each
    with its template overhead, so many empty messages do not pass for a short prompt)."""
    if frame.messages is not None:
        tools = len(frame.tools or "")
        return tools + sum(
            len(m.role) + len(m.content) + _MESSAGE_OVERHEAD_CHARS for m in frame.messages
        )
    return len(frame.prompt or "")


def prompt_length(engine: Engine, frame: quicsrv_proto.Generate) -> int:
    """How many tokens the prompt of ``frame`` is, rendered and tokenized as
    :func:`build_request` does for a new generation (a chat through the model's template); no
    limit is checked and nothing is dropped (``truncation`` is not applied)."""
    if frame.messages is not None:
        tools = None if frame.tools is None else _tools(frame.tools)
        return len(_chat_tokens(engine, frame.messages, tools))
    assert frame.prompt is not None  # proto guarantees exactly one of the two
    return len(engine.tokenize(frame.prompt, add_special=True))


def build_request(
    engine: Engine,
    frame: quicsrv_proto.Generate,
    *,
    max_tokens_limit: int,
    prior: PriorTurn | None = None,
) -> PreparedRequest:
    """Validate a GENERATE against this server's limits and tokenize its prompt (a chat that
    continues ``prior``: its messages start with the prior's and its answer)."""
    if frame.max_tokens > max_tokens_limit:
        raise RequestRejected(
            ErrorCode.INVALID_FIELD,
            f"GENERATE.max_tokens {frame.max_tokens} exceeds this server's limit "
            f"{max_tokens_limit}",
        )
    budget = engine.context_per_sequence - frame.max_tokens
    messages, continued = None, False
    if frame.messages is not None:
        messages = tuple(frame.messages)
        tools = None if frame.tools is None else _tools(frame.tools)
        tokens, continued = _chat_prompt(engine, messages, prior, tools)
        if len(tokens) > budget and frame.truncation is Truncation.AUTO:
            kept = fit_history(
                frame.messages,
                budget=budget,
                prompt_tokens=lambda messages: len(_chat_tokens(engine, messages, tools)),
                content_tokens=lambda m: len(engine.tokenize(m.content, add_special=False)),
            )
            if kept is not None:
                log.info(
                    "truncation auto: %d of %d messages kept to fit %d tokens",
                    len(kept),
                    len(frame.messages),
                    budget,
                )
                messages = kept
                tokens, continued = _chat_prompt(engine, kept, prior, tools)
    else:
        assert frame.prompt is not None  # proto guarantees exactly one of the two
        tokens = engine.tokenize(frame.prompt, add_special=True)
    if len(tokens) > budget:
        hint = (
            " even with its oldest turns dropped (truncation auto keeps the system messages "
            "and the newest turn)"
            if frame.truncation is Truncation.AUTO
            else "; truncation 'auto' drops a chat's oldest turns instead"
            if frame.messages is not None
            else ""
        )
        raise RequestRejected(
            ErrorCode.PROMPT_TOO_LONG,
            f"prompt of {len(tokens)} tokens + max_tokens {frame.max_tokens} does not fit the "
            f"context of {engine.context_per_sequence} tokens{hint}",
        )
    grammar = None
    if frame.json_schema is not None:
        try:
            grammar = engine.grammar_for(frame.json_schema)
        except InvalidSchema as exc:
            where = f" (at {exc.path})" if exc.path else ""
            raise RequestRejected(
                ErrorCode.INVALID_FIELD, f"GENERATE.json_schema: {exc}{where}"
            ) from None
    seed = frame.seed if frame.seed is not None else int.from_bytes(_random_seed(), "little")
    spec = GenerationSpec(
        prompt_tokens=tuple(tokens),
        max_tokens=frame.max_tokens,
        sampling=SamplingParams(
            temperature=frame.temperature,
            top_p=frame.top_p,
            top_k=frame.top_k,
            min_p=frame.min_p,
            repeat_penalty=frame.repeat_penalty,
            seed=seed,
        ),
        stop=frame.stop,
        ignore_eos=frame.ignore_eos,
        prefill_chunk=engine.prefill_chunk,
        grammar=grammar,
        logprobs=frame.logprobs,
        score_prompt=frame.score_prompt,
    )
    return PreparedRequest(spec=spec, messages=messages, continued=continued)


async def prepare_off_loop(
    prepare: Callable[..., PreparedRequest],
    frame: quicsrv_proto.Generate,
    prior: PriorTurn | None = None,
) -> PreparedRequest:
    """``prepare(frame, prior)`` (:func:`build_request` with the server's limits) on a thread,
    except for a short prompt: tokenizing one takes tens of microseconds, the trip to a thread
    and back a millisecond or more of the time to first token (measured on 2 busy cores). A long
    one would hold up every other stream."""
    if prompt_chars(frame) <= INLINE_PROMPT_CHARS and prior is None and not frame.json_schema:
        return prepare(frame)
    return await asyncio.to_thread(prepare, frame, prior)


def _chat_prompt(
    engine: Engine, messages: tuple[ChatMessage, ...], prior: PriorTurn | None, tools: _Tools
) -> tuple[list[int], bool]:
    """The chat's prompt tokens, and whether they continue ``prior``'s own (see the module
    docstring)."""
    if prior is not None and prior.exact:
        n = len(prior.messages)
        if messages[:n] == prior.messages and messages[n : n + 1] == (
            ChatMessage(role="assistant", content=prior.answer),
        ):
            before = _render(engine, prior.messages, tools)
            full = _render(engine, messages, tools)
            head = before + prior.answer
            if (
                full.startswith(head)
                and len(full) > len(head)
                and engine.tokenize(before, add_special=False) == list(prior.prompt_tokens)
            ):
                rest = engine.tokenize(full[len(head) :], add_special=False)
                return [*prior.prompt_tokens, *prior.generated, *rest], True
    return _chat_tokens(engine, messages, tools), False


#: The tool list a chat template renders (GENERATE's ``tools``, parsed), or None.
_Tools = list[dict[str, object]] | None


def _tools(text: str) -> list[dict[str, object]]:
    try:
        tools = json.loads(text)
    except ValueError:
        tools = None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestRejected(
            ErrorCode.INVALID_FIELD, "GENERATE.tools must be a JSON array of objects"
        )
    return tools


def _render(engine: Engine, messages: Sequence[ChatMessage], tools: _Tools) -> str:
    chat = [{"role": m.role, "content": m.content} for m in messages]
    # Without tools, the call every Engine has always taken (fakes included).
    return engine.render_chat(chat) if tools is None else engine.render_chat(chat, tools)


def _chat_tokens(engine: Engine, messages: Sequence[ChatMessage], tools: _Tools) -> list[int]:
    return engine.tokenize(_render(engine, messages, tools), add_special=False)


def _random_seed() -> bytes:
    return secrets.token_bytes(8)
