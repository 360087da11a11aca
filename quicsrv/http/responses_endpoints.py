"""The Responses API's endpoints: what ``POST /v1/responses`` and ``/v1/responses/{id}`` do,
on the sessions (the router dispatches here; :mod:`.responses_api` shapes the bodies and the
events, :mod:`.responses_stream` encodes a stream).

A response is a session whose record keeps, in ``SessionRecord.api``, the request's fields and
(unless ``store: false``) the conversation its prompt was rendered from, so that
``previous_response_id`` can continue it on any process. Reading, continuing, cancelling and
deleting go through the session manager's checks: the record exists and has not expired, and
the API key that made it is the one asking.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import urllib.parse
from typing import Any

import quicsrv_proto
from quicsrv_proto import ChatMessage, EndReason
from quicsrv_proto.frames import MAX_MESSAGES
from quicsrv_proto.http3 import SESSION_HEADER

from ..apikeys import ClientId
from ..sessions.generation import PreparedRequest, PriorTurn, prepare_off_loop
from ..sessions.lifecycle import SessionState
from ..sessions.manager import SessionManager
from ..sessions.record import SessionRecord
from . import logprobs, openai_api, responses_api, tool_format
from .errors import ApiError
from .messages import (
    FullResponse,
    HttpRequest,
    KeepAlive,
    Response,
    event_stream,
    json_response,
)
from .responses_api import ResponseView
from .responses_stream import ResponseEncoder
from .responses_tools import ToolAnswerEncoder, generic, response_object
from .sse import collect_answer

__all__ = ["ResponsesEndpoints", "streamed"]


class ResponsesEndpoints:
    """See the module docstring."""

    def __init__(
        self,
        *,
        sessions: SessionManager,
        model_id: str,
        keepalive: KeepAlive | None,
    ) -> None:
        self._sessions = sessions
        self._model_id = model_id
        self._keepalive = keepalive

    def _native_tools(self) -> str | None:
        """The chat template's own tool-call format (None: tools the generic way)."""
        return self._sessions.engine.model_info.tool_call_format

    async def create(self, request: HttpRequest, who: ClientId) -> Response:
        """``POST /v1/responses``."""
        create = responses_api.parse_create(
            request.body, model_id=self._model_id, native_tools=self._native_tools()
        )
        generate, prior = create.generate, None
        if create.previous_response_id is not None:
            generate, prior = await self._continue(create, who)
        # The system message (instructions, the tool prompt) is not part of the conversation.
        system = create.instructions is not None or tool_format.stored(create.fields)
        conversation_from = 1 if system else 0

        def api(prepared: PreparedRequest) -> dict[str, Any]:
            kept = prepared.messages if create.store and prepared.messages else ()
            return {
                "kind": responses_api.KIND,
                "fields": create.fields,
                "messages": [[m.role, m.content] for m in kept],
                "from": conversation_from,
            }

        session = await self._sessions.open_generation(
            generate,
            client=who.name,
            owner=who.key_id or "",
            arrived_at=request.arrived_at,
            quota=who.quota,
            prior=prior,
            api=api,
            unattended=create.background,
        )
        headers = ((SESSION_HEADER, session.session_id.hex().encode()),)
        if create.stream:
            view = ResponseView.of(session.record, "")
            ended_at = functools.partial(responses_api.ended_at, session.record)
            encoder: ResponseEncoder | ToolAnswerEncoder = (
                ToolAnswerEncoder(view, ended_at=ended_at)
                if generic(view)
                else ResponseEncoder(
                    view, text_before="", ended_at=ended_at, **self._scoring(session.record)
                )
            )
            return event_stream(
                session,
                0,
                encoder.encode_all,
                client=who.name,
                fresh=True,
                keepalive=self._keepalive,
            )
        if create.background:
            view = ResponseView.of(session.record, "", queued=session.state is SessionState.QUEUED)
            return json_response(200, response_object(view), headers)
        answer = await collect_answer(session, who.name)
        view = ResponseView.of(session.record, answer.text, piece=self._sessions.piece)
        return json_response(200, response_object(view), headers)

    async def input_tokens(self, request: HttpRequest, who: ClientId) -> FullResponse:
        """``POST /v1/responses/input_tokens``: how many tokens the prompt of the same body
        sent to ``POST /v1/responses`` would be, by the same path: the same checks, the
        continuation of ``previous_response_id``, the chat template, the tool prompt and
        ``truncation``. Nothing starts and nothing is stored; a prompt that would not fit the
        context gets the refusal the response would. ``model`` may be left out (OpenAI's
        endpoint makes it optional): the served one."""
        body = openai_api.json_object(request.body)
        body.setdefault("model", self._model_id)
        create = responses_api.parse_create(
            json.dumps(body).encode(), model_id=self._model_id, native_tools=self._native_tools()
        )
        generate, prior = create.generate, None
        if create.previous_response_id is not None:
            generate, prior = await self._continue(create, who)
        prepared = await prepare_off_loop(self._sessions.prepare, generate, prior)
        count = len(prepared.spec.prompt_tokens)
        return json_response(200, {"object": "response.input_tokens", "input_tokens": count})

    async def _continue(
        self, create: responses_api.CreateRequest, who: ClientId
    ) -> tuple[quicsrv_proto.Generate, PriorTurn]:
        """The GENERATE of a request that continues ``previous_response_id``: its
        instructions, the previous response's conversation and answer, then its input."""
        assert create.previous_response_id is not None
        param = "previous_response_id"
        previous = await self._stored_response(
            responses_api.from_response_id(create.previous_response_id, param), who, param
        )
        if previous.end is None:
            raise ApiError(
                400,
                f"Previous response with id '{create.previous_response_id}' is still in "
                "progress: wait for it to end, or cancel it",
                code="previous_response_in_progress",
                param=param,
            )
        api = previous.api or {}
        stored = tuple(ChatMessage(role=r, content=c) for r, c in api.get("messages", ()))
        answer = self._sessions.text_of(previous)
        calls = ResponseView.of(previous, "").calls
        single = len(calls) == 1
        if single:  # the conversation shows the call, as a template without tools can
            answer = tool_format.calls_text([(calls[0], answer)])
        given = create.generate.messages or ()
        messages = (
            *given[: len(given) - len(create.input)],  # the instructions, if any
            *stored[int(api.get("from", 0)) :],
            ChatMessage(role="assistant", content=answer),
            *create.input,
        )
        if len(messages) > MAX_MESSAGES:
            raise ApiError(
                400,
                f"the conversation has {len(messages)} messages, more than {MAX_MESSAGES}: "
                "start a new one from a summary",
                code="invalid_value",
                param=param,
            )
        prior = PriorTurn(
            messages=stored,
            prompt_tokens=previous.spec.prompt_tokens,
            generated=tuple(previous.generated),
            answer=answer,
            # One function's stored tokens are its arguments only: rendered afresh.
            exact=previous.end.reason is not EndReason.STOP and not single,
        )
        return dataclasses.replace(create.generate, messages=messages), prior

    async def _stored_response(
        self, session_id: bytes, who: ClientId, param: str | None = None, *, stored: bool = True
    ) -> SessionRecord:
        """A response's record, if this key made it and (``stored``) it was stored: 404
        otherwise, as for an id that never existed."""
        record = await self._sessions.lookup(session_id, key_id=who.key_id)
        api = record.api or {}
        if not responses_api.is_response(record) or (
            stored and not api.get("fields", {}).get("store", True)
        ):
            raise ApiError(
                404,
                f"Response with id '{responses_api.response_id(session_id)}' not found.",
                code="not_found",
                param=param,
            )
        return record

    async def retrieve(self, who: ClientId, session_id: bytes) -> FullResponse:
        """``GET /v1/responses/{id}``: the response object."""
        record = await self._stored_response(session_id, who)
        live = self._sessions.live(session_id)
        queued = live is not None and live.state is SessionState.QUEUED
        view = ResponseView.of(
            record, self._sessions.text_of(record), queued=queued, piece=self._sessions.piece
        )
        return json_response(200, response_object(view))

    async def resume(
        self, request: HttpRequest, who: ClientId, session_id: bytes, query: str
    ) -> Response:
        """``GET /v1/responses/{id}?stream=true`` (see :func:`streamed`): its events after
        the number ``starting_after`` (or ``Last-Event-ID``) gives."""
        params = urllib.parse.parse_qs(query)
        after = _starting_after(params, request.headers.get(b"last-event-id"))
        # Checked as a message's index, the lowest a response's events give: a function call's
        # (one event fewer before its deltas) is only known from the record.
        lowest = responses_api.first_token_after(after)
        session = await self._sessions.reattach(session_id, lowest, key_id=who.key_id)
        record = session.record
        if not responses_api.is_response(record):
            raise ApiError(404, "no such response", code="not_found")
        view = ResponseView.of(record, "")
        ended_at = functools.partial(responses_api.ended_at, record)
        encoder: ResponseEncoder | ToolAnswerEncoder
        if generic(view):
            # Its events are numbered as they come: all rendered again, those after sent.
            from_index, encoder = 0, ToolAnswerEncoder(view, after=after, ended_at=ended_at)
        else:
            call = bool(view.calls)
            # Past the last token (the closing events): only the END is left to send.
            from_index = min(
                responses_api.first_token_after(after, call=call), len(record.generated)
            )
            encoder = ResponseEncoder(
                view,
                text_before=self._sessions.text_of(record, upto=from_index),
                after=after,
                ended_at=ended_at,
                **self._scoring(record),
            )
        return event_stream(
            session,
            from_index,
            encoder.encode_all,
            client=who.name,
            fresh=False,
            keepalive=self._keepalive,
        )

    def _scoring(self, record: SessionRecord) -> dict[str, Any]:
        """A stream encoder's arguments for the tokens' log-probabilities, where the record
        keeps them."""
        if record.logprobs is None:
            return {}
        piece = self._sessions.piece
        return {
            "piece": piece,
            "logprobs_of": functools.partial(logprobs.recorded, record, piece),
        }

    async def cancel(self, who: ClientId, session_id: bytes) -> FullResponse:
        """``POST /v1/responses/{id}/cancel``: the final object, with usage."""
        await self._stored_response(session_id, who, stored=False)
        await self._sessions.cancel(session_id, key_id=who.key_id)
        record = await self._sessions.lookup(session_id, key_id=who.key_id)
        view = ResponseView.of(record, self._sessions.text_of(record), piece=self._sessions.piece)
        return json_response(200, response_object(view))

    async def delete(self, who: ClientId, session_id: bytes) -> FullResponse:
        """``DELETE /v1/responses/{id}``."""
        await self._stored_response(session_id, who, stored=False)
        await self._sessions.delete(session_id, key_id=who.key_id)
        return json_response(200, responses_api.deleted_body(session_id))


def streamed(query: str) -> bool:
    """Whether a ``GET /v1/responses/{id}`` with ``query`` asks for the response's events
    (``stream=true``: :meth:`ResponsesEndpoints.resume`) rather than its object."""
    return _flag(urllib.parse.parse_qs(query), "stream")


def _flag(params: dict[str, list[str]], name: str) -> bool:
    values = params.get(name, [])
    if not values or values[0] in ("false", "0", ""):
        return False
    if values[0] in ("true", "1"):
        return True
    raise ApiError(400, f"{name} must be true or false", code="invalid_value", param=name)


def _starting_after(params: dict[str, list[str]], last_event_id: bytes | None) -> int:
    """The ``starting_after`` of a streamed GET (or the ``Last-Event-ID`` an EventSource sends,
    which names the same number); -1: from the first event."""
    values = params.get("starting_after", [])
    text = values[0] if values else (last_event_id or b"").decode("latin-1").strip()
    if not text:
        return -1
    if not text.isdigit() or len(text) > 10:
        raise ApiError(
            400,
            "starting_after must be a sequence number (an integer, 0 or more)",
            code="invalid_value",
            param="starting_after",
        )
    return int(text)
