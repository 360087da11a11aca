"""Request mapping: what is accepted, what is refused, and with which OpenAI-style error."""

from __future__ import annotations

import json

import pytest

from quicsrv.http.errors import ApiError
from quicsrv.http.openai_api import DEFAULT_MAX_TOKENS, finish_reason, parse_completion
from quicsrv_proto import EndReason

MODEL = "m"


def _chat(**fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_completion(json.dumps(body).encode(), chat=True, model_id=MODEL)


def _text(**fields):
    body = {"model": MODEL, "prompt": "hi", **fields}
    return parse_completion(json.dumps(body).encode(), chat=False, model_id=MODEL)


def test_a_chat_request_maps_onto_a_generate():
    request = _chat(
        max_completion_tokens=12,
        temperature=0.7,
        top_p=0.9,
        seed=5,
        stop=["\n"],
        n=1,
        stream=True,
        stream_options={"include_usage": True},
        logit_bias={},
        user="u",
    )
    g = request.generate
    assert g.messages is not None and g.messages[0].role == "user"
    assert (g.max_tokens, g.temperature, g.top_p, g.seed, g.stop) == (12, 0.7, 0.9, 5, ("\n",))
    assert request.chat and request.stream and request.include_usage


def test_sampling_defaults_are_llama_servers_and_named_values_win():
    request = _text()
    assert request.generate.prompt == "hi"
    g = request.generate
    assert (g.temperature, g.top_p, g.top_k, g.min_p, g.repeat_penalty) == (
        0.8,
        0.95,
        40,
        0.05,
        1.0,
    )
    assert request.generate.max_tokens == DEFAULT_MAX_TOKENS
    assert not request.stream and not request.include_usage
    named = _text(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0).generate
    assert (named.temperature, named.top_p, named.top_k, named.min_p) == (1.0, 1.0, 0, 0.0)


def test_content_parts_and_the_developer_role():
    request = _chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    messages = request.generate.messages
    assert messages is not None
    assert [(m.role, m.content) for m in messages] == [("system", "be brief"), ("user", "ab")]


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"n": 2}, "n", "unsupported_value"),
        ({"logit_bias": {"50256": -100}}, "logit_bias", "unsupported_parameter"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
        ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"logprobs": 1}, "logprobs", "invalid_value"),
        ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "invalid_value"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"},
            "tool_choice",
            "invalid_value",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "invalid_value",
        ),
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ({"temperature": 3}, "temperature", "invalid_value"),
        ({"temperature": "hot"}, "temperature", "invalid_value"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_tokens": True}, "max_tokens", "invalid_value"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens", "invalid_value"),
        ({"seed": -1}, "seed", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"stop": [""]}, "stop", "invalid_value"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"messages": []}, "messages", "missing_required_parameter"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "unsupported_value",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "unsupported_value",
        ),
        ({"prompt": "x"}, "prompt", "unknown_parameter"),
    ],
)
def test_bad_chat_fields_get_400_naming_the_parameter(fields, param, code):
    with pytest.raises(ApiError) as caught:
        _chat(**fields)
    error = caught.value
    assert (error.status, error.param, error.code) == (400, param, code)
    body = json.loads(error.body())["error"]
    assert set(body) >= {"message", "type", "param", "code"}
    assert body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"prompt": ["a", "b"]}, "prompt", "unsupported_value"),
        ({"prompt": [1, 2, 3]}, "prompt", "unsupported_value"),
        ({"echo": True, "logprobs": 1, "stream": True}, "echo", "unsupported_value"),
        ({"logprobs": 21}, "logprobs", "invalid_value"),
        ({"logprobs": True}, "logprobs", "invalid_value"),
        ({"best_of": 3}, "best_of", "unsupported_parameter"),
        ({"messages": []}, "messages", "unknown_parameter"),
    ],
)
def test_bad_text_fields_get_400(fields, param, code):
    with pytest.raises(ApiError) as caught:
        _text(**fields)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)


@pytest.mark.parametrize("body", [b"", b"{", b"[1]", b'"x"', b"[" * 100_000])
def test_a_body_that_is_no_json_object(body):
    with pytest.raises(ApiError) as caught:
        parse_completion(body, chat=True, model_id=MODEL)
    assert (caught.value.status, caught.value.code) == (400, "invalid_json")


def test_another_model_is_404():
    with pytest.raises(ApiError) as caught:
        parse_completion(b'{"model": "gpt-4o", "prompt": "x"}', chat=False, model_id=MODEL)
    assert (caught.value.status, caught.value.code, caught.value.param) == (
        404,
        "model_not_found",
        "model",
    )


def test_finish_reasons():
    assert finish_reason(EndReason.EOS) == "stop"
    assert finish_reason(EndReason.STOP) == "stop"
    assert finish_reason(EndReason.LENGTH) == "length"
    assert finish_reason(EndReason.CANCELLED) == "cancelled"
