"""The objects the Responses API answers with are whole (every field of Open Responses'
``ResponseResource`` and OpenAI's ``Response``, in every event), and one field policy holds on
every endpoint: a value that changes nothing is accepted, any other unsupported one refused
naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

import quicsrv_proto
from quicsrv.http.errors import ApiError
from quicsrv.http.openai_api import DEFAULT_MAX_TOKENS, completion_body, parse_completion
from quicsrv.http.responses_api import ResponseView, parse_create, response_object
from quicsrv.http.responses_stream import ResponseEncoder
from quicsrv_proto import EndReason

MODEL = "m"
SESSION = bytes(range(16))
ENDED_AT = 1_700_000_123
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}

NUMBER = (int, float)
NONE = type(None)
#: Open Responses' ResponseResource: each required field and the JSON types it may hold.
RESOURCE: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "object": (str,),
    "created_at": (int,),
    "completed_at": (int, NONE),
    "status": (str,),
    "incomplete_details": (dict, NONE),
    "model": (str,),
    "previous_response_id": (str, NONE),
    "instructions": (str, NONE),
    "output": (list,),
    "error": (dict, NONE),
    "tools": (list,),
    "tool_choice": (str, dict),
    "truncation": (str,),
    "parallel_tool_calls": (bool,),
    "text": (dict,),
    "top_p": NUMBER,
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "top_logprobs": (int,),
    "temperature": NUMBER,
    "reasoning": (dict, NONE),
    "usage": (dict, NONE),
    "max_output_tokens": (int, NONE),
    "max_tool_calls": (int, NONE),
    "store": (bool,),
    "background": (bool,),
    "service_tier": (str,),
    "metadata": (dict,),
    "safety_identifier": (str, NONE),
    "prompt_cache_key": (str, NONE),
}


def check_resource(response: dict[str, Any]) -> None:
    """Every field of a ResponseResource is there, with a type the schema allows."""
    for name, types in RESOURCE.items():
        assert name in response, name
        value = response[name]
        assert isinstance(value, types) and not (bool in types) ^ isinstance(value, bool), (
            name,
            value,
        )
    usage = response["usage"]
    if usage is not None:
        assert set(usage["input_tokens_details"]) == {"cached_tokens", "cache_write_tokens"}
        assert set(usage["output_tokens_details"]) == {"reasoning_tokens"}
    for tool in response["tools"]:
        assert set(tool) == {"type", "name", "description", "parameters", "strict"}


def _create(**fields: Any) -> Any:
    body = {"model": MODEL, "input": "hi", **fields}
    return parse_create(json.dumps(body).encode(), model_id=MODEL)


def _view(fields: dict[str, Any]) -> ResponseView:
    return ResponseView(
        session_id=SESSION,
        created_at=1_700_000_000,
        fields=fields,
        text="",
        input_tokens=0,
        cached_tokens=0,
        output_tokens=0,
        end=None,
    )


def _stream(fields: dict[str, Any], texts: list[str], reason: EndReason) -> list[dict[str, Any]]:
    """The events of a whole stream, as JSON."""
    encoder = ResponseEncoder(_view(fields), text_before="", ended_at=lambda: ENDED_AT)
    frames: list[quicsrv_proto.Frame] = [
        quicsrv_proto.Checkpoint(session_id=SESSION, index=-1, snapshot_hash=b"h" * 32),
        *(quicsrv_proto.Token(index=i, token_id=i, text=t) for i, t in enumerate(texts)),
        quicsrv_proto.End(reason=reason, prompt_tokens=5, completion_tokens=len(texts)),
    ]
    data = encoder.encode_all(frames).decode()
    return [
        json.loads(line.removeprefix("data: "))
        for block in data.split("\n\n")[:-1]
        for line in block.split("\n")
        if line.startswith("data: ")
    ]


@pytest.mark.parametrize("reason", [EndReason.EOS, EndReason.LENGTH, EndReason.CANCELLED])
def test_every_event_of_a_message_carries_the_whole_response(reason: EndReason) -> None:
    fields = _create(
        metadata={"k": "v"}, safety_identifier="u1", prompt_cache_key="chat-7", temperature=0.5
    ).fields
    events = _stream(fields, ["Hel", "lo"], reason)
    carrying = [e["response"] for e in events if "response" in e]
    assert len(carrying) == 3  # created, in_progress, and the final one
    for response in carrying:
        check_resource(response)
        assert (response["safety_identifier"], response["prompt_cache_key"]) == ("u1", "chat-7")
        assert (response["temperature"], response["metadata"]) == (0.5, {"k": "v"})
        assert response["max_output_tokens"] == DEFAULT_MAX_TOKENS  # the limit that applied
        assert (response["tools"], response["tool_choice"]) == ([], "auto")
    final = carrying[-1]
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}
    # completed_at: only once completed, and then from the record, never the clock.
    assert [r["completed_at"] for r in carrying[:2]] == [None, None]
    assert final["completed_at"] == (ENDED_AT if reason is EndReason.EOS else None)


def test_every_event_of_a_call_echoes_the_requests_tools_and_tool_choice() -> None:
    choice = {"type": "function", "name": "get_weather"}
    fields = _create(
        tools=[WEATHER, {**WEATHER, "name": "other", "strict": False}], tool_choice=choice
    ).fields
    events = _stream(fields, ['{"city"', ': "Oslo"}'], EndReason.EOS)
    carrying = [e["response"] for e in events if "response" in e]
    echoed = [
        {**WEATHER, "strict": True},  # not said: true, as every argument follows the schema
        {**WEATHER, "name": "other", "strict": False},
    ]
    for response in carrying:
        check_resource(response)
        assert response["tools"] == echoed
        assert response["tool_choice"] == choice
    assert carrying[-1]["output"][0]["name"] == "get_weather"


def test_a_function_tool_without_description_or_parameters_echoes_nulls() -> None:
    fields = _create(tools=[{"type": "function", "name": "now"}], tool_choice="required").fields
    assert fields["tools"] == [
        {"type": "function", "name": "now", "description": None, "parameters": None, "strict": True}
    ]


def test_a_record_from_before_these_fields_still_answers_whole() -> None:
    """Records stored by an earlier version hold fewer fields: the defaults fill them in."""
    old = {"model": MODEL, "instructions": None, "max_output_tokens": None, "metadata": {}}
    response = response_object(_view(old), announced=True)
    check_resource(response)
    assert (response["tools"], response["tool_choice"], response["parallel_tool_calls"]) == (
        [],
        "auto",
        True,
    )


# --- one policy for fields -----------------------------------------------------------------


def _chat(**fields: Any) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_completion(json.dumps(body).encode(), chat=True, model_id=MODEL)


def _text(**fields: Any) -> Any:
    body = {"model": MODEL, "prompt": "hi", **fields}
    return parse_completion(json.dumps(body).encode(), chat=False, model_id=MODEL)


#: Fields whose value changes nothing in the answer, at such values, on every endpoint.
EVERYWHERE: list[dict[str, Any]] = [
    {"user": "u-1"},
    {"safety_identifier": "hash-of-user"},
    {"prompt_cache_key": "any string at all"},
    {"prompt_cache_retention": "24h"},
    {"service_tier": "auto"},
    {"service_tier": "default"},
    {"service_tier": None},
    {"metadata": {}},
    {"metadata": {"team": "a"}},
    {"presence_penalty": 0},
    {"frequency_penalty": 0.0},
]
CHAT_ONLY: list[dict[str, Any]] = [
    {"store": True},
    {"store": False},
    {"top_logprobs": 0},
    {"logprobs": False},
    {"modalities": ["text"]},
    {"audio": None},
    {"prediction": None},
    {"web_search_options": None},
    {"reasoning_effort": "none"},
    {"verbosity": "medium"},
    {"parallel_tool_calls": True},
    {"n": 1},
    {"logit_bias": {}},
    {"cache_prompt": True},
]
RESPONSES_ONLY: list[dict[str, Any]] = [
    {"context_management": None},
    {"reasoning": {"effort": None, "summary": None}},
    {"reasoning": {"effort": "none"}},
    {"include": ["reasoning.encrypted_content"]},
    {"top_logprobs": 0},
    {"max_tool_calls": None},
    {"stream_options": {"include_obfuscation": False}},
    {"conversation": None},
    {"parallel_tool_calls": False},
]


@pytest.mark.parametrize("fields", EVERYWHERE + CHAT_ONLY)
def test_neutral_fields_are_accepted_on_chat(fields: dict[str, Any]) -> None:
    _chat(**fields)


@pytest.mark.parametrize(
    "fields", EVERYWHERE + [{"store": True}, {"n": 1}, {"echo": False}, {"cache_prompt": True}]
)
def test_neutral_fields_are_accepted_on_completions(fields: dict[str, Any]) -> None:
    _text(**fields)


@pytest.mark.parametrize("fields", EVERYWHERE + RESPONSES_ONLY)
def test_neutral_fields_are_accepted_on_responses(fields: dict[str, Any]) -> None:
    _create(**fields)


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"service_tier": "flex"}, "service_tier", "unsupported_parameter"),
        ({"service_tier": "priority"}, "service_tier", "unsupported_parameter"),
        ({"prompt_cache_key": 5}, "prompt_cache_key", "invalid_value"),
        ({"safety_identifier": ["x"]}, "safety_identifier", "invalid_value"),
        ({"prompt_cache_retention": "forever"}, "prompt_cache_retention", "unsupported_parameter"),
        ({"presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
        ({"metadata": {"k": 1}}, "metadata", "invalid_value"),
    ],
)
@pytest.mark.parametrize("endpoint", [_chat, _text, _create])
def test_a_value_that_would_change_the_answer_is_refused_everywhere(
    endpoint: Any, fields: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(ApiError) as caught:
        endpoint(**fields)
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"context_management": [{"type": "compaction"}]}, "context_management"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"max_tool_calls": 2}, "max_tool_calls"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
    ],
)
def test_responses_refuse_what_would_change_the_answer(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _create(**fields)
    assert (caught.value.param, caught.value.code) == (param, "unsupported_parameter")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": "yes"}, "store"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"verbosity": "low"}, "verbosity"),
        ({"cache_prompt": False}, "cache_prompt"),
    ],
)
def test_chat_refuses_what_would_change_the_answer(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _chat(**fields)
    assert (caught.value.param, caught.value.code) == (param, "unsupported_parameter")


# --- keys inside messages ------------------------------------------------------------------


def test_an_assistant_items_phase_is_accepted_and_changes_nothing() -> None:
    history = [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "content": "hello", "phase": "final_answer"},
        {"type": "message", "role": "user", "content": "again"},
    ]
    plain = [{k: v for k, v in item.items() if k != "phase"} for item in history]
    assert _create(input=history).generate == _create(input=plain).generate


@pytest.mark.parametrize(
    ("item", "param", "code"),
    [
        ({"role": "user", "content": "x", "mood": "happy"}, "input[0].mood", "unknown_parameter"),
        (
            {"role": "assistant", "content": "x", "phase": "draft"},
            "input[0].phase",
            "unsupported_value",
        ),
    ],
)
def test_an_items_other_keys_are_refused_by_name(
    item: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(ApiError) as caught:
        _create(input=[item])
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, code)


def test_a_chat_messages_keys_are_named_and_echoed_nulls_accepted() -> None:
    echoed = {
        "role": "assistant",
        "content": "a",
        "refusal": None,
        "annotations": [],
        "audio": None,
    }
    _chat(messages=[{"role": "user", "content": "q"}, echoed, {"role": "user", "content": "q"}])
    with pytest.raises(ApiError) as caught:
        _chat(messages=[{"role": "user", "content": "q", "mood": 1}])
    assert (caught.value.param, caught.value.code) == ("messages[0].mood", "unknown_parameter")
    with pytest.raises(ApiError) as caught:
        _chat(messages=[{"role": "assistant", "content": "q", "refusal": "no"}])
    assert caught.value.param == "messages[0].refusal"


@pytest.mark.parametrize("tools", [False, True])
def test_a_chat_completion_message_has_refusal_null(tools: bool) -> None:
    request = _chat(
        **(
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}
            if tools
            else {}
        )
    )
    end = quicsrv_proto.End(reason=EndReason.EOS, prompt_tokens=1, completion_tokens=1)
    body = completion_body(
        session_id=SESSION,
        chat=True,
        model=MODEL,
        created=0,
        text="{}" if tools else "hello",
        end=end,
        tools=request.tools,
    )
    message = body["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None
