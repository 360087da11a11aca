"""OpenAI's chat and text completions endpoints: what ``POST /v1/chat/completions``,
``POST /v1/completions``, ``GET /v1/models`` (and ``/v1/models/{id}``) and
``GET``/``DELETE /v1/streams/{session}`` do, on the sessions (the router dispatches here;
:mod:`.openai_api` reads the requests and shapes the bodies, :mod:`.sse` encodes a stream).

A completion is a session. Streamed, each of its events has a signed cursor as its id
(:mod:`.cursor`), so that ``GET /v1/streams/{session}`` with that id in ``Last-Event-ID`` (or
``?last_event_id=``) continues the stream after it, on any process, and ``DELETE`` stops the
generation. Both go through the session manager's checks: the record exists and has not
expired, and the API key that made it is the one asking.
"""

from __future__ import annotations

import time
from typing import Any

import quicsrv_proto
from quicsrv_proto.http3 import SESSION_HEADER

from ..apikeys import ClientId
from ..sessions.manager import SessionManager
from ..sessions.record import SessionRecord
from . import logprobs, openai_api, token_api
from .cursor import Cursor
from .errors import ApiError
from .messages import (
    FullResponse,
    HttpRequest,
    KeepAlive,
    Response,
    SessionStream,
    event_stream,
    json_response,
)
from .sse import SseEncoder, StreamShape, collect_answer
from .tool_answers import answer_format
from .tool_calls import ToolChoice
from .tool_format import ToolFormat

__all__ = ["CompletionsEndpoints"]


class CompletionsEndpoints:
    """See the module docstring."""

    def __init__(
        self, *, sessions: SessionManager, model_id: str, keepalive: KeepAlive | None
    ) -> None:
        self._sessions = sessions
        self._model_id = model_id
        self._keepalive = keepalive
        self._created = int(time.time())

    async def models(self) -> FullResponse:
        """``GET /v1/models``: the one model this server runs (its entry with the facts
        llama-server's and vLLM's clients read: :func:`.token_api.model_facts`)."""
        body = openai_api.models_body(self._model_id, self._created)
        body["data"] = [{**entry, **self._facts()} for entry in body["data"]]
        return json_response(200, body)

    def _facts(self) -> dict[str, Any]:
        engine = self._sessions.engine
        return token_api.model_facts(engine.model_info, n_ctx=engine.context_per_sequence)

    async def model(self, model_id: str) -> FullResponse:
        """``GET /v1/models/{id}``: the model object, or 404 for a model this server does not
        run."""
        if model_id != self._model_id:
            raise ApiError(
                404,
                f"The model `{model_id[:200]}` does not exist; this server serves "
                f"`{self._model_id}`",
                code="model_not_found",
                param="model",
            )
        entry = openai_api.model_object(self._model_id, self._created)
        return json_response(200, {**entry, **self._facts()})

    async def create(self, request: HttpRequest, who: ClientId, *, chat: bool) -> Response:
        """``POST /v1/chat/completions`` (``chat``) or ``POST /v1/completions``: a stream of
        events (``stream: true``), else one body once the generation has ended."""
        completion = openai_api.parse_completion(
            request.body,
            chat=chat,
            model_id=self._model_id,
            native_tools=self._sessions.engine.model_info.tool_call_format,
        )
        tools = completion.tools
        tool_answer = tools.answer if isinstance(tools, ToolFormat) else None
        call = tools if isinstance(tools, ToolChoice) else None
        # A resumed stream renders the answer the same way: the record says how.
        api: dict[str, Any] | None = None
        if tool_answer is not None:
            api = {"kind": "chat", "answer": tool_answer}
        elif call is not None:
            api = {"kind": "chat", "tools": call.stored()}
        session = await self._sessions.open_generation(
            completion.generate,
            client=who.name,
            owner=who.key_id or "",
            arrived_at=request.arrived_at,
            quota=who.quota,
            api=None if api is None else lambda _: api,
        )
        shape = StreamShape(
            session_id=session.session_id,
            chat=chat,
            include_usage=completion.include_usage,
            model=self._model_id,
            created=int(session.record.created_at_s),
            tools=call,
            tool_answer=tool_answer,
            echo=(completion.generate.prompt or "") if completion.echo else "",
        )
        scored = completion.generate.logprobs is not None
        if completion.stream:
            encoder = SseEncoder(
                shape,
                mac_key=self._sessions.keys.current,
                piece=self._sessions.piece if scored else None,
            )
            return event_stream(
                session,
                0,
                encoder.encode_all,
                client=who.name,
                fresh=True,
                keepalive=self._keepalive,
            )
        answer = await collect_answer(session, who.name)
        body = openai_api.completion_body(
            session_id=shape.session_id,
            chat=chat,
            model=shape.model,
            created=shape.created,
            text=shape.echo + answer.text,
            end=answer.end,
            tools=tools,
            logprobs=self._logprobs(session.record, answer.scored, chat=chat) if scored else None,
        )
        return json_response(200, body, ((SESSION_HEADER, session.session_id.hex().encode()),))

    async def resume(self, who: ClientId, cursor: Cursor) -> SessionStream:
        """``GET /v1/streams/{session}``: the stream's events after the one ``cursor`` (its
        ``Last-Event-ID``, read by :func:`~.cursor.read_cursor`) names."""
        session_id = cursor.session_id
        session = await self._sessions.reattach(session_id, cursor.index + 1, key_id=who.key_id)
        record = session.record
        names = (record.api or {}).get("tools")
        tool_answer = answer_format(record.api)
        shape = StreamShape(
            session_id=session_id,
            chat=cursor.chat,
            include_usage=cursor.include_usage,
            model=self._model_id,
            created=int(record.created_at_s),
            tools=None if names is None else ToolChoice.from_stored(names),
            tool_answer=tool_answer,
        )
        # Past the last token (the finishing or usage event): only the END is left to send.
        from_index = min(cursor.index + 1, len(record.generated))
        scored = record.logprobs is not None
        # Tool calls' deltas, and text completions' text_offset, depend on the text before.
        before = names or tool_answer or (scored and not cursor.chat)
        encoder = SseEncoder(
            shape,
            mac_key=self._sessions.keys.current,
            after=cursor.index,
            text_before=self._sessions.text_of(record, upto=from_index) if before else "",
            piece=self._sessions.piece if scored else None,
        )
        return event_stream(
            session,
            from_index,
            encoder.encode_all,
            client=who.name,
            fresh=False,
            keepalive=self._keepalive,
        )

    def _logprobs(
        self, record: SessionRecord, tokens: tuple[quicsrv_proto.Token, ...], *, chat: bool
    ) -> dict[str, Any]:
        """A ``stream: false`` answer's ``logprobs``, in its endpoint's shape: a text
        completion's with ``echo`` starts with the prompt's tokens (the first with none, as
        nothing predicts it), and ends with the end-of-generation token where that was the
        first one sampled (so that a scorer that drops the last entry, the sampled token, gets
        every prompt token's)."""
        piece = self._sessions.piece
        if chat:
            return logprobs.chat_logprobs(tokens, piece)
        body = logprobs.CompletionLogprobs(piece)
        if record.prompt_logprobs is not None:
            prompt = record.spec.prompt_tokens
            body.add(prompt[0], None, None)
            for token_id, scores in zip(prompt[1:], record.prompt_logprobs, strict=True):
                body.add_scored(token_id, scores)
        for token in tokens:
            body.add_token(token)
        if record.ended_by is not None:
            body.add_scored(*record.ended_by)
        return body.body()

    async def stop(self, who: ClientId, session_id: bytes) -> FullResponse:
        """``DELETE /v1/streams/{session}``: stop the generation; its end, as a stream object."""
        end = await self._sessions.cancel(session_id, key_id=who.key_id)
        body = {
            "id": session_id.hex(),
            "object": "stream",
            "status": "cancelled"
            if end.reason is quicsrv_proto.EndReason.CANCELLED
            else "finished",
            "finish_reason": openai_api.finish_reason(end.reason),
            "completion_tokens": end.completion_tokens,
        }
        return json_response(200, body)
