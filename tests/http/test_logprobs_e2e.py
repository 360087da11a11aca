"""End to end: log-probabilities through the real server and model, and across cuts.

Every kind of cut carries the same numbers, bit for bit, as the uninterrupted run: an SSE stream
resumed by ``Last-Event-ID``, and a native stream whose engine worker is killed mid-answer (the
session continues by exact replay; the tokens before the kill come from the token log).
"""

from __future__ import annotations

import math
import os
import signal
from typing import Any

import pytest

from quicsrv_client import Client, GenerationEnded, TokenReceived
from tests.helpers import running_server

from .helpers import cut_and_resume, openai_client, tcp_client

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

CHAT = [{"role": "user", "content": "Name three rivers of Europe."}]
SAMPLINGS = pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 5}], ids=["greedy", "seeded"]
)


def _check_entries(entries: list[dict[str, Any]], top: int, *, greedy: bool) -> None:
    """Each entry: a log-probability, ``top`` alternatives most likely first, the sampled token
    among them when it was the most likely (greedy)."""
    assert entries
    for entry in entries:
        assert entry["logprob"] <= 0.0 and bytes(entry["bytes"])
        alternatives = entry["top_logprobs"]
        assert len(alternatives) == top
        values = [a["logprob"] for a in alternatives]
        assert values == sorted(values, reverse=True) and math.fsum(map(math.exp, values)) <= 1.0
        assert entry["logprob"] <= values[0]
        if greedy:
            assert alternatives[0]["token"] == entry["token"]
            assert alternatives[0]["logprob"] == entry["logprob"]


def _stream_entries(events: list[Any]) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    for event in events:
        if event.data == "[DONE]" or not event.json.get("choices"):
            continue
        logprobs = event.json["choices"][0]["logprobs"]
        if logprobs is not None:
            entries += logprobs["content"]
    return entries


@SAMPLINGS
async def test_chat_logprobs_resumed_by_last_event_id_are_the_uninterrupted_ones(
    engine, certs, sampling
):
    async with running_server(engine, certs) as server:
        body = {
            "model": server.app.router.model_id,
            "messages": CHAT,
            "max_tokens": 32,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 3,
            **sampling,
        }
        async with tcp_client(server, certs) as tcp:
            cut = await cut_and_resume(tcp, "/v1/chat/completions", body, stop_after=10)
    whole = _stream_entries(cut.whole)
    _check_entries(whole, 3, greedy=sampling["temperature"] == 0)
    assert len(whole) == 32  # every token's, those without text of their own included
    assert _stream_entries(cut.before) + _stream_entries(cut.after) == whole


async def test_native_seeded_logprobs_survive_a_kill_9_of_the_worker(engine, certs):
    sampling = {"temperature": 0.9, "seed": 5}  # greedy ones are cut and resumed above

    async def run(kill_at: int | None) -> list[tuple[int, float | None, Any]]:
        got = []
        async for event in client.generate(
            "The lighthouse keeper opened the door and",
            max_tokens=24,
            ignore_eos=True,
            logprobs=4,
            **sampling,
        ):
            if isinstance(event, TokenReceived):
                got.append((event.token_id, event.logprob, event.top_logprobs))
                if event.index == kill_at:
                    os.kill(engine.worker_pid, signal.SIGKILL)
            elif isinstance(event, GenerationEnded):
                assert event.completion_tokens == 24
        return got

    async with (
        running_server(engine, certs) as server,
        Client("127.0.0.1", server.port, ca=certs.ca_cert, stall_timeout_s=None) as client,
    ):
        whole = await run(None)
        cut = await run(8)
    assert cut == whole
    for _token, logprob, top in whole:
        assert logprob is not None and len(top) == 4 and logprob <= top[0][1]


async def test_the_openai_sdk_reads_chat_completion_and_responses_logprobs(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        model = server.app.router.model_id
        chat = await client.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        text = await client.completions.create(
            model=model, prompt="One, two, three,", max_tokens=8, temperature=0, logprobs=2
        )
        response = await client.responses.create(
            model=model,
            input=CHAT[0]["content"],
            max_output_tokens=12,
            temperature=0,
            include=["message.output_text.logprobs"],
            top_logprobs=2,
        )
    content = chat.choices[0].logprobs.content
    _check_entries([c.model_dump() for c in content], 2, greedy=True)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert len(content) == chat.usage.completion_tokens

    legacy = text.choices[0].logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == text.usage.completion_tokens
    for logprob, top in zip(legacy.token_logprobs, legacy.top_logprobs, strict=True):
        assert len(top) == 2 and logprob == max(top.values())  # greedy: the likeliest
    assert "".join(legacy.tokens) == text.choices[0].text
    assert legacy.text_offset == sorted(legacy.text_offset)

    part = response.output[0].content[0]
    _check_entries([e.model_dump() for e in part.logprobs], 2, greedy=True)
    assert len(part.logprobs) == response.usage.output_tokens
    # The same prompt and settings: the same tokens and numbers as the chat completion.
    assert [e.model_dump() for e in part.logprobs] == [c.model_dump() for c in content]


async def test_echo_scores_the_prompt_as_the_generation_scored_its_own_tokens(engine, certs):
    prompt = "The three primary colours are"
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        model = server.app.router.model_id
        made = await client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        text = made.choices[0].text
        scored = await client.completions.create(
            model=model, prompt=prompt + text, max_tokens=1, temperature=0, logprobs=1, echo=True
        )
    generated = made.choices[0].logprobs
    echo = scored.choices[0]
    n_prompt = scored.usage.prompt_tokens
    assert echo.text.startswith(prompt + text)
    logprobs = echo.logprobs
    # Every prompt token, then the one sampled (an end token included: a scorer drops it).
    assert len(logprobs.tokens) == n_prompt + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert "".join(logprobs.tokens[:n_prompt]) == prompt + text
    assert logprobs.text_offset[:n_prompt] == [
        len("".join(logprobs.tokens[:i])) for i in range(n_prompt)
    ]
    # The answer's tokens, scored as a prompt (computed in one batch, not one by one): the
    # same tokens, and log-probabilities within float32 rounding of the kernels' sums.
    tail = slice(n_prompt - len(generated.tokens), n_prompt)
    assert logprobs.tokens[tail] == generated.tokens
    pairs = zip(logprobs.token_logprobs[tail], generated.token_logprobs, strict=True)
    for as_prompt, as_answer in pairs:
        assert as_prompt == pytest.approx(as_answer, abs=0.05)
    assert math.fsum(logprobs.token_logprobs[tail]) == pytest.approx(
        math.fsum(generated.token_logprobs), abs=0.2
    )


async def test_responses_logprobs_resumed_from_starting_after_are_the_uninterrupted_ones(
    engine, certs
):
    from .test_responses_e2e import _cut, _read

    sampling = {"temperature": 0.9, "seed": 7}

    params = dict(
        input=CHAT[0]["content"],
        max_output_tokens=24,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        extra_body={
            "ignore_eos": True,
            **({"seed": sampling["seed"]} if "seed" in sampling else {}),
        },
        temperature=sampling["temperature"],
    )
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        model = server.app.router.model_id
        whole = await _read(await client.responses.create(model=model, stream=True, **params))
        first, _ = await _cut(
            server, await client.responses.create(model=model, stream=True, **params), 10
        )
        rest = await _read(
            await client.responses.retrieve(
                first[0].response.id, stream=True, starting_after=first[-1].sequence_number
            )
        )

    def deltas(events: list[Any]) -> list[dict[str, Any]]:
        return [
            entry.model_dump()
            for e in events
            if e.type == "response.output_text.delta"
            for entry in e.logprobs
        ]

    assert deltas(first) + deltas(rest) == deltas(whole)
    assert len(deltas(whole)) == 24
    done = next(e for e in whole if e.type == "response.output_text.done")
    assert [entry.model_dump() for entry in done.logprobs] == deltas(whole)
    _check_entries(deltas(whole), 2, greedy=False)
