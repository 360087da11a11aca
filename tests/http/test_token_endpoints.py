"""The token endpoints through the router, without a model (a scripted engine whose tokens are
Unicode code points): their routes over every protocol, the keys they need, their answers'
shapes and every refusal's stable code. The real model's agreement with its own prompt lengths
is tests/http/test_tokens_e2e.py's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from quicsrv.http import token_api
from quicsrv.http.messages import FullResponse, HttpRequest
from quicsrv.http.router import Router
from tests.fakes import FakeEngine

from .routers import fake_router

KEY = "qs_test-key"


def _request(
    path: str,
    body: Any = b"",
    *,
    method: str = "POST",
    headers: dict[bytes, bytes] | None = None,
    protocol: str = "http/1.1",
) -> HttpRequest:
    return HttpRequest(
        method=method,
        path=path,
        headers=headers or {},
        body=body if isinstance(body, bytes) else json.dumps(body).encode(),
        connection="conn:1",
        arrived_at=0.0,
        protocol=protocol,
    )


async def _json(router: Router, request: HttpRequest) -> tuple[int, Any]:
    response = await router.handle(request)
    assert isinstance(response, FullResponse), response
    return response.status, json.loads(response.body)


@pytest.mark.parametrize("protocol", ["http/1.1", "h2", "h3"])
@pytest.mark.asyncio
async def test_tokenize_and_detokenize_answer_over_every_protocol(
    tmp_path: Path, protocol: str
) -> None:
    """Outside ``/v1/``, yet JSON over HTTP/3 too (not the native API's ERROR frame)."""
    router = fake_router(tmp_path)
    status, body = await _json(router, _request("/tokenize", {"content": "Hé!"}, protocol=protocol))
    assert (status, body) == (200, {"tokens": [ord("H"), ord("é"), ord("!")]})
    status, body = await _json(
        router, _request("/detokenize", {"tokens": body["tokens"]}, protocol=protocol)
    )
    assert (status, body) == (200, {"content": "Hé!"})
    status, props = await _json(router, _request("/props", method="GET", protocol=protocol))
    assert status == 200 and props["total_slots"] == 8
    assert props["default_generation_settings"]["n_ctx"] == 64


@pytest.mark.asyncio
async def test_with_pieces_gives_text_or_the_bytes_of_a_split_character(tmp_path: Path) -> None:
    router = fake_router(tmp_path)
    engine = router._sessions.engine
    assert isinstance(engine, FakeEngine)
    engine.pieces[0x41] = b"\xc3"  # half of "é": not valid UTF-8 alone
    status, body = await _json(
        router, _request("/tokenize", {"content": "aA", "with_pieces": True, "model": "fake"})
    )
    assert status == 200
    assert body == {"tokens": [{"id": 0x61, "piece": "a"}, {"id": 0x41, "piece": [0xC3]}]}


@pytest.mark.asyncio
async def test_props_and_models_say_the_context_and_the_model_s_facts(tmp_path: Path) -> None:
    router = fake_router(tmp_path)
    _, props = await _json(router, _request("/props", method="GET"))
    assert props["model_alias"] == "fake" and props["model_path"] == "fake.gguf"
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8
    assert props["build_info"].startswith("quicsrv ")
    _, models = await _json(router, _request("/v1/models", method="GET"))
    (entry,) = models["data"]
    assert entry["id"] == "fake" and entry["object"] == "model"
    assert entry["max_model_len"] == 64 == entry["meta"]["n_ctx"]
    assert entry["meta"]["n_vocab"] == 0x110000
    _, single = await _json(router, _request("/v1/models/fake", method="GET"))
    assert single == entry


@pytest.mark.asyncio
async def test_the_token_endpoints_need_a_key_when_keys_are_set(tmp_path: Path) -> None:
    router = fake_router(tmp_path, keys=(KEY,))
    for request in (
        _request("/tokenize", {"content": "x"}),
        _request("/detokenize", {"tokens": [120]}),
        _request("/props", method="GET"),
        _request("/v1/responses/input_tokens", {"input": "x"}),
    ):
        status, body = await _json(router, request)
        assert status == 401, request.path
    authorized = {b"authorization": f"Bearer {KEY}".encode()}
    status, body = await _json(router, _request("/tokenize", {"content": "x"}, headers=authorized))
    assert (status, body) == (200, {"tokens": [120]})


@pytest.mark.asyncio
async def test_input_tokens_counts_the_prompt_a_response_would_have(tmp_path: Path) -> None:
    """The fake template is ``<role>content``: one token per character, so the count is
    checkable by hand (the real template's agreement: the e2e test)."""
    router = fake_router(tmp_path)
    ask = {"model": "fake", "input": "Hi", "instructions": "Be", "max_output_tokens": 8}
    status, body = await _json(router, _request("/v1/responses/input_tokens", ask))
    assert status == 200
    assert body == {"object": "response.input_tokens", "input_tokens": len("<system>Be<user>Hi")}
    without_model = {k: v for k, v in ask.items() if k != "model"}
    assert await _json(router, _request("/v1/responses/input_tokens", without_model)) == (
        200,
        body,
    )


@pytest.mark.parametrize(
    ("path", "body", "method", "expected"),
    [
        ("/tokenize", {}, "POST", (400, "missing_required_parameter", "content")),
        ("/tokenize", {"content": 7}, "POST", (400, "invalid_value", "content")),
        (
            "/tokenize",
            {"content": "x", "with_pieces": 1},
            "POST",
            (400, "invalid_value", "with_pieces"),
        ),
        (
            "/tokenize",
            {"content": "x", "add_special": "yes"},
            "POST",
            (400, "invalid_value", "add_special"),
        ),
        ("/tokenize", {"prompt": "x"}, "POST", (400, "unknown_parameter", "prompt")),
        (
            "/tokenize",
            {"content": "x", "model": "gpt-4"},
            "POST",
            (404, "model_not_found", "model"),
        ),
        ("/tokenize", b"[1]", "POST", (400, "invalid_json", None)),
        ("/tokenize", b"", "GET", (405, "method_not_allowed", None)),
        ("/detokenize", {}, "POST", (400, "missing_required_parameter", "tokens")),
        ("/detokenize", {"tokens": "abc"}, "POST", (400, "invalid_value", "tokens")),
        ("/detokenize", {"tokens": [1, "2"]}, "POST", (400, "invalid_value", "tokens[1]")),
        ("/detokenize", {"tokens": [1, True]}, "POST", (400, "invalid_value", "tokens[1]")),
        ("/detokenize", {"tokens": [1, -1]}, "POST", (400, "invalid_token_id", "tokens[1]")),
        ("/detokenize", {"tokens": [0x110000]}, "POST", (400, "invalid_token_id", "tokens[0]")),
        ("/detokenize", {"tokens": [65] * 65}, "POST", (400, "too_many_tokens", "tokens")),
        ("/props", b"", "POST", (405, "method_not_allowed", None)),
        ("/v1/responses/input_tokens", {}, "POST", (400, "missing_required_parameter", "input")),
        ("/v1/responses/input_tokens", b"", "GET", (405, "method_not_allowed", None)),
        (
            "/v1/responses/input_tokens",
            {"input": "x" * 70, "max_output_tokens": 8},
            "POST",
            (413, "prompt_too_long", None),
        ),
    ],
)
@pytest.mark.asyncio
async def test_bad_input_gets_a_400_with_a_stable_code(
    tmp_path: Path, path: str, body: Any, method: str, expected: tuple[int, str, str | None]
) -> None:
    status, answer = await _json(fake_router(tmp_path), _request(path, body, method=method))
    error = answer["error"]
    assert (status, error["code"], error["param"]) == expected
    assert error["message"]


def test_a_piece_is_text_when_it_can_be_and_bytes_otherwise() -> None:
    assert token_api.piece_json("é".encode()) == "é"
    assert token_api.piece_json(b"\xe6\x9d") == [0xE6, 0x9D]
    assert token_api.piece_json(b"") == ""
