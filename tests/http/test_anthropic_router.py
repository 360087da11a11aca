"""The router's part of Anthropic's Messages API, without a model (a scripted engine): its
routes, its credential header, its error shape on its paths and only there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from quicsrv.http.messages import FullResponse, HttpRequest
from tests.fakes import FakeEngine

from .routers import LIMIT, fake_router

pytestmark = pytest.mark.asyncio

KEY = "qs_test-key"
ASK = {"model": "fake", "messages": [{"role": "user", "content": "Hi"}]}


def _request(
    path: str,
    body: Any = b"",
    *,
    method: str = "POST",
    headers: dict[bytes, bytes] | None = None,
    early_data: bool = False,
) -> HttpRequest:
    return HttpRequest(
        method=method,
        path=path,
        headers=headers or {},
        body=body if isinstance(body, bytes) else json.dumps(body).encode(),
        connection="conn:1",
        arrived_at=0.0,
        early_data=early_data,
        protocol="http/1.1",
    )


def _anthropic(response: object) -> tuple[int, str, str]:
    """(status, error type, stable code) of an Anthropic-shaped refusal."""
    assert isinstance(response, FullResponse), response
    body = json.loads(response.body)
    assert body["type"] == "error" and set(body["error"]) == {"type", "message", "details"}
    return response.status, body["error"]["type"], body["error"]["details"]["error_code"]


@pytest.mark.parametrize(
    ("path", "method", "body", "headers", "expected"),
    [
        ("/v1/messages", "GET", b"", {}, (405, "invalid_request_error", "method_not_allowed")),
        ("/v1/messages/batches", "POST", ASK, {}, (404, "not_found_error", "unknown_endpoint")),
        (
            "/v1/messages",
            "POST",
            ASK,
            {},
            (400, "invalid_request_error", "missing_required_parameter"),
        ),
        ("/v1/messages", "POST", b"[", {}, (400, "invalid_request_error", "invalid_json")),
        (
            "/v1/messages/count_tokens",
            "POST",
            {**ASK, "model": "claude"},
            {},
            (404, "not_found_error", "model_not_found"),
        ),
        (
            "/v1/messages",
            "POST",
            {**ASK, "max_tokens": 4},
            {b"anthropic-version": b"2022-01-01"},
            (400, "invalid_request_error", "unsupported_version"),
        ),
        (
            "/v1/streams/" + "ab" * 16,
            "GET",
            b"",
            {b"anthropic-version": b"2023-06-01"},
            (400, "invalid_request_error", "missing_last_event_id"),
        ),
    ],
)
async def test_refusals_on_anthropic_s_paths_take_its_shape(
    tmp_path: Path,
    path: str,
    method: str,
    body: Any,
    headers: dict[bytes, bytes],
    expected: tuple[int, str, str],
) -> None:
    response = await fake_router(tmp_path).handle(
        _request(path, body, method=method, headers=headers)
    )
    assert _anthropic(response) == expected


async def test_a_body_past_the_limit_is_request_too_large_in_anthropic_s_shape(
    tmp_path: Path,
) -> None:
    router = fake_router(tmp_path)
    assert _anthropic(router.too_large(_request("/v1/messages"))) == (
        413,
        "request_too_large",
        "request_too_large",
    )
    big = _request("/v1/messages", {**ASK, "system": "x" * LIMIT})
    assert _anthropic(await router.handle(big))[0] == 413
    # Elsewhere, OpenAI's shape as before.
    openai = router.too_large(_request("/v1/chat/completions"))
    assert json.loads(openai.body)["error"]["code"] == "request_too_large"


async def test_x_api_key_is_a_bearer_key_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    router = fake_router(tmp_path, keys=(KEY,))
    count = "/v1/messages/count_tokens"
    missing = await router.handle(_request(count, ASK))
    wrong = await router.handle(_request(count, ASK, headers={b"x-api-key": b"qs_wrong"}))
    right = await router.handle(_request(count, ASK, headers={b"x-api-key": KEY.encode()}))
    bearer = await router.handle(
        _request(count, ASK, headers={b"authorization": f"Bearer {KEY}".encode()})
    )
    models = await router.handle(
        _request("/v1/models", method="GET", headers={b"x-api-key": KEY.encode()})
    )
    assert _anthropic(missing) == _anthropic(wrong)[:2] + ("unauthorized",)
    assert _anthropic(wrong) == (401, "authentication_error", "unauthorized")
    assert isinstance(wrong, FullResponse) and dict(wrong.headers)[b"www-authenticate"]
    assert isinstance(right, FullResponse) and isinstance(bearer, FullResponse)
    assert right.status == bearer.status == 200 and right.body == bearer.body
    assert isinstance(models, FullResponse) and models.status == 200


async def test_count_tokens_is_the_rendered_prompt_s_length(tmp_path: Path) -> None:
    router = fake_router(tmp_path)
    body = {**ASK, "system": "Be brief."}
    response = await router.handle(_request("/v1/messages/count_tokens", body))
    assert isinstance(response, FullResponse) and response.status == 200
    # The scripted engine's template and tokenizer: one token per character.
    expected = len(
        FakeEngine().render_chat(
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ]
        )
    )
    assert json.loads(response.body) == {"input_tokens": expected}


async def test_a_message_in_early_data_is_too_early_and_counting_is_not(tmp_path: Path) -> None:
    router = fake_router(tmp_path)
    early = await router.handle(_request("/v1/messages", {**ASK, "max_tokens": 4}, early_data=True))
    counted = await router.handle(_request("/v1/messages/count_tokens", ASK, early_data=True))
    assert _anthropic(early) == (425, "invalid_request_error", "too_early")
    assert isinstance(counted, FullResponse) and counted.status == 200
