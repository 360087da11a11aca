"""Anthropic's Messages API endpoints: what ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` do, on the sessions, and the resume of a Messages stream
(the router dispatches here; :mod:`.anthropic_api` reads the requests and shapes the bodies,
:mod:`.anthropic_stream` encodes a stream).

A message is a session, as a chat completion is. Streamed, each event's id is a signed cursor
(:mod:`.cursor`, with ``FLAG_MESSAGES``), so that ``GET /v1/streams/{session}`` with that id in
``Last-Event-ID`` continues the stream after it, on any process, and ``DELETE`` stops the
generation: the streams' one resume route, which reads the cursor and hands an Anthropic one
here. Both go through the session manager's checks: the record exists and has not expired, and
the API key that made it is the one asking.
"""

from __future__ import annotations

import functools

from quicsrv_proto.http3 import SESSION_HEADER

from ..apikeys import ClientId
from ..sessions.manager import SessionManager
from . import anthropic_api
from .anthropic_api import MessageShape
from .anthropic_stream import MessageEncoder
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
from .sse import collect_answer

__all__ = ["AnthropicEndpoints"]


class AnthropicEndpoints:
    """See the module docstring. ``keepalive``: Anthropic's ``ping`` event, written while a
    stream is quiet (None: never)."""

    def __init__(
        self, *, sessions: SessionManager, model_id: str, keepalive: KeepAlive | None
    ) -> None:
        self._sessions = sessions
        self._model_id = model_id
        self._keepalive = keepalive

    async def create(self, request: HttpRequest, who: ClientId) -> Response:
        """``POST /v1/messages``: Anthropic's events (``stream: true``), else one ``message``
        body once the generation has ended."""
        anthropic_api.check_version(request.headers)
        create = anthropic_api.parse_create(
            request.body,
            model_id=self._model_id,
            native_tools=self._sessions.engine.model_info.tool_call_format,
        )
        api = create.api()
        session = await self._sessions.open_generation(
            create.generate,
            client=who.name,
            owner=who.key_id or "",
            arrived_at=request.arrived_at,
            quota=who.quota,
            api=lambda _: api,
        )
        shape = MessageShape.of(session.record, self._model_id)
        matched = functools.partial(self._sessions.matched_stop, session.record)
        if create.stream:
            encoder = MessageEncoder(
                shape, mac_key=self._sessions.keys.current, stop_sequence=matched
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
        body = anthropic_api.message_body(shape, answer.text, answer.end, matched())
        return json_response(200, body, ((SESSION_HEADER, session.session_id.hex().encode()),))

    async def count_tokens(self, request: HttpRequest) -> FullResponse:
        """``POST /v1/messages/count_tokens``: the prompt's length in tokens, rendered as
        ``POST /v1/messages`` renders the same fields (the tool prompt included)."""
        anthropic_api.check_version(request.headers)
        frame = anthropic_api.parse_count(
            request.body,
            model_id=self._model_id,
            native_tools=self._sessions.engine.model_info.tool_call_format,
        )
        count = await self._sessions.count_prompt_tokens(frame)
        return json_response(200, {"input_tokens": count})

    async def resume(self, who: ClientId, cursor: Cursor) -> SessionStream:
        """The events of a Messages stream after the one ``cursor`` names (see the module
        docstring): rendered again from the first token, those after it sent."""
        session = await self._sessions.reattach(cursor.session_id, 0, key_id=who.key_id)
        record = session.record
        if not anthropic_api.is_message(record):  # a genuine cursor names a message
            raise ApiError(404, "no such stream", code="unknown_session")
        encoder = MessageEncoder(
            MessageShape.of(record, self._model_id),
            mac_key=self._sessions.keys.current,
            after=cursor.index,
            stop_sequence=functools.partial(self._sessions.matched_stop, record),
        )
        return event_stream(
            session,
            0,
            encoder.encode_all,
            client=who.name,
            fresh=False,
            keepalive=self._keepalive,
        )
