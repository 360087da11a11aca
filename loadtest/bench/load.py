"""Concurrent streams against a running server, timed at the client as tokens arrive.

Two drivers with one shape: quicsrv over QUIC (the project's own :class:`client.Client`, every
stream multiplexed on one connection) and an OpenAI-style server over SSE / HTTP/1.1 (httpx, one
TCP connection per stream, as browsers and the ``openai`` package do). Each stream has the same
deadline; a stream that misses it keeps what it received and is marked ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import cast

import httpx

from loadtest.bench.stats import PROMPTS, StreamResult
from quicsrv_client import Client, ClientError, Event, GenerationEnded, TokenReceived

__all__ = ["run_quicsrv_load", "run_sse_load"]


def _prompt(i: int) -> str:
    return PROMPTS[i % len(PROMPTS)]


async def run_quicsrv_load(
    port: int,
    ca: Path,
    *,
    streams: int,
    max_tokens: int,
    timeout_s: float,
    ack_delay_s: float | None = None,
) -> tuple[float, list[StreamResult]]:
    """``streams`` concurrent greedy generations on one QUIC connection; (start time, results).
    ``ack_delay_s``: the client's acknowledgement delay (None: the client's default)."""
    options = {} if ack_delay_s is None else {"ack_delay_s": ack_delay_s}
    async with Client("127.0.0.1", port, ca=ca, **options) as client:
        deadline = asyncio.get_running_loop().time() + timeout_s
        started = time.perf_counter()
        results = await asyncio.gather(
            *(_quic_stream(client, _prompt(i), max_tokens, deadline) for i in range(streams))
        )
    return started, list(results)


async def _quic_stream(
    client: Client, prompt: str, max_tokens: int, deadline: float
) -> StreamResult:
    result = StreamResult(expected_tokens=max_tokens, started_s=time.perf_counter())
    events = cast(
        AsyncGenerator[Event, None],
        client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    try:
        async with asyncio.timeout_at(deadline), contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, TokenReceived):
                    result.token_times_s.append(time.perf_counter())
                elif isinstance(event, GenerationEnded):
                    result.finish = str(event.reason)
    except TimeoutError:
        result.finish = "timeout"
    except ClientError as exc:
        result.finish = f"error: {type(exc).__name__}"
    return result


async def run_sse_load(
    port: int,
    *,
    streams: int,
    max_tokens: int,
    timeout_s: float,
    suppressed_tokens: Sequence[int],
) -> tuple[float, list[StreamResult]]:
    """``streams`` concurrent streamed ``/v1/completions`` requests; (start time, results).

    ``suppressed_tokens`` get a logit bias of -100: the OpenAI API has no ``ignore_eos``, so the
    end-of-generation tokens are made unpickable instead, and every stream owes ``max_tokens``.
    """
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    timeout = httpx.Timeout(timeout_s)
    bias = {str(token): -100.0 for token in suppressed_tokens}
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=timeout
    ) as http:
        deadline = asyncio.get_running_loop().time() + timeout_s
        started = time.perf_counter()
        results = await asyncio.gather(
            *(_sse_stream(http, _prompt(i), max_tokens, bias, deadline) for i in range(streams))
        )
    return started, list(results)


async def _sse_stream(
    http: httpx.AsyncClient,
    prompt: str,
    max_tokens: int,
    bias: dict[str, float],
    deadline: float,
) -> StreamResult:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "repeat_penalty": 1.0,  # llama-cpp-python defaults to 1.1; quicsrv's greedy uses none
        "logit_bias": bias,
        "stream": True,
    }
    result = StreamResult(expected_tokens=max_tokens, started_s=time.perf_counter())
    try:
        async with (
            asyncio.timeout_at(deadline),
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            if response.status_code != 200:
                result.finish = f"http {response.status_code}"
                return result
            result.finish = "eof without [DONE]"
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators and ": ping" comments
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    if result.finish == "eof without [DONE]":
                        # [DONE] with no finish_reason: the server cut the stream short.
                        result.finish = "interrupted"
                    break
                choice = json.loads(data)["choices"][0]
                if choice.get("finish_reason") is not None:
                    result.finish = str(choice["finish_reason"])
                else:
                    # One chunk per token (llama-cpp-python merges tokens only to complete a
                    # multi-byte character, which undercounts, never overcounts).
                    result.token_times_s.append(time.perf_counter())
    except TimeoutError:
        result.finish = "timeout"
    except httpx.HTTPError as exc:
        result.finish = f"error: {type(exc).__name__}"
    return result
