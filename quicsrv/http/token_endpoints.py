"""The token endpoints: what ``POST /tokenize``, ``POST /detokenize`` and ``GET /props`` do,
on the engine's vocabulary (the router dispatches here, with the same API keys and body limit
as every other endpoint; :mod:`.token_api` reads the requests and shapes the bodies).

Nothing here starts a generation or waits for a slot: the vocabulary is the server process's
own (loaded ``vocab_only``), so these answer while every slot is busy. A long text is
tokenized off the event loop, as a long prompt is.
"""

from __future__ import annotations

import asyncio
from importlib import metadata

from ..engine import Engine
from ..sessions.generation import INLINE_PROMPT_CHARS
from . import token_api
from .messages import FullResponse, HttpRequest, json_response

__all__ = ["TokenEndpoints"]


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


class TokenEndpoints:
    """See the module docstring."""

    def __init__(self, *, engine: Engine, model_id: str) -> None:
        self._engine = engine
        self._model_id = model_id

    @property
    def max_detokenize_tokens(self) -> int:
        """The most ids one ``/detokenize`` takes: no sequence this model reads is longer."""
        return max(self._engine.context_per_sequence, self._engine.model_info.n_ctx_train or 0)

    async def tokenize(self, request: HttpRequest) -> FullResponse:
        """``POST /tokenize``: ``content``'s token ids (with ``with_pieces``, their pieces)."""
        ask = token_api.parse_tokenize(request.body, model_id=self._model_id)

        def run() -> dict[str, object]:
            tokens = self._engine.tokenize(
                ask.content, add_special=ask.add_special, parse_special=ask.parse_special
            )
            pieces = [self._engine.token_text(t) for t in tokens] if ask.with_pieces else None
            return token_api.tokenize_body(tokens, pieces)

        if len(ask.content) <= INLINE_PROMPT_CHARS:
            return json_response(200, run())
        return json_response(200, await asyncio.to_thread(run))

    async def detokenize(self, request: HttpRequest) -> FullResponse:
        """``POST /detokenize``: the text of ``tokens`` (a special token as its text; bytes that
        end inside a character as U+FFFD)."""
        ask = token_api.parse_detokenize(
            request.body,
            model_id=self._model_id,
            n_vocab=self._engine.model_info.n_vocab,
            max_tokens=self.max_detokenize_tokens,
        )

        def run() -> str:
            data = b"".join(self._engine.token_text(t) for t in ask.tokens)
            return data.decode("utf-8", "replace")

        if len(ask.tokens) <= INLINE_PROMPT_CHARS:
            return json_response(200, {"content": run()})
        return json_response(200, {"content": await asyncio.to_thread(run)})

    async def props(self) -> FullResponse:
        """``GET /props``: the model and the server's context, slots and defaults."""
        body = token_api.props_body(
            self._engine.model_info,
            model_id=self._model_id,
            n_ctx=self._engine.context_per_sequence,
            total_slots=self._engine.n_seq_max,
            build_info=(
                f"quicsrv {_version('quicsrv')}, llama-cpp-python {_version('llama-cpp-python')}"
            ),
        )
        return json_response(200, body)
