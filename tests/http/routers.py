"""The router over a fake engine, as the unit tests of its endpoints build it (no model, no
sockets)."""

from __future__ import annotations

from pathlib import Path

from quicsrv.apikeys import ApiKeys
from quicsrv.http.messages import FullResponse
from quicsrv.http.operator import PlainRoutes
from quicsrv.http.router import Router
from quicsrv.sessions.manager import SessionManager
from quicsrv.settings import session_settings_for
from tests.fakes import FakeEngine

LIMIT = 4096
"""The routers' request body limit."""


class _NoPlainRoutes(PlainRoutes):
    def handle(self, method: object, path: object, headers: object) -> FullResponse:
        raise AssertionError("no operator endpoint is asked for here")


def fake_router(tmp_path: Path, *, keys: tuple[str, ...] = (), accepting: bool = True) -> Router:
    sessions = SessionManager(FakeEngine(), session_settings_for(tmp_path, max_tokens_limit=64))
    sessions.accepting = accepting
    return Router(
        sessions=sessions,
        api_keys=ApiKeys(keys),
        plain=_NoPlainRoutes(
            metrics=sessions.metrics, readiness=lambda: None, authorize_metrics=lambda _: True
        ),
        metrics=sessions.metrics,
        model_id="fake",
        max_body_bytes=LIMIT,
    )
