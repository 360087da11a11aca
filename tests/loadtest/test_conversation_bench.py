"""``python -m loadtest.bench.conversation``: the script it sends, the prefix it measures, how it
reads a streamed answer and how it reports, without a model (the measuring is a benchmark).
Also the llama-server build's cache lookup, which must never build."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest

from loadtest.bench.conversation import _ask, _reused
from loadtest.bench.conversation_report import (
    LLAMA_SERVER,
    NO_BUILD,
    QUICSRV,
    RAW_COLD,
    RAW_INCREMENTAL,
    TurnResult,
    render,
)
from loadtest.bench.conversation_script import common_prefix, history, user_turns
from loadtest.bench.llama_server import llama_server_argv
from loadtest.bench.llama_server_build import find_llama_server
from loadtest.bench.servers import ServerSettings


def _words(text: str) -> int:
    return len(text.split())


def test_user_turns_are_long_enough_distinct_and_fixed():
    turns = user_turns(8, 150, _words)
    assert len(turns) == 8
    assert all(150 <= _words(t) <= 151 for t in turns)
    assert len(set(turns)) == 8
    assert turns == user_turns(8, 150, _words)


def test_history_resends_every_earlier_turn_with_its_answer():
    users = ["u1", "u2", "u3"]
    assert history(users, [], 0) == [{"role": "user", "content": "u1"}]
    assert history(users, ["a1", "a2"], 2) == [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
    ]
    with pytest.raises(ValueError, match="earlier answers"):
        history(users, ["a1"], 2)


def test_common_prefix():
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5, 6]) == 4
    assert common_prefix([1, 2, 9], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [1]) == 0


def _sse(*events: object) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    return ("".join(lines) + "data: [DONE]\n\n").encode()


def test_the_harness_times_the_first_content_and_reads_usage():
    body = _sse(
        {"choices": [{"delta": {"role": "assistant"}}]},  # no content: not a first token
        {"choices": [{"delta": {"content": "Hel"}}]},
        {"choices": [{"delta": {"content": "lo"}}]},
        {
            "choices": [],
            "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 30}},
        },
    )
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))

    async def ask() -> object:
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as http:
            return await _ask(http, {"model": "m"})

    reply = asyncio.run(ask())
    assert reply.text == "Hello"  # type: ignore[attr-defined]
    assert reply.ttft_s >= 0  # type: ignore[attr-defined]
    assert _reused(reply) == 30  # type: ignore[arg-type]


def test_llama_servers_own_account_of_reuse_is_read_too():
    from loadtest.bench.conversation import _Reply

    assert _reused(_Reply(0.1, "", {"prompt_tokens": 9}, {"cache_n": 7})) == 7
    assert _reused(_Reply(0.1, "", {"prompt_tokens": 9}, {})) is None


def _turns(system: str, ttfts: list[float], reused: int | None) -> list[TurnResult]:
    return [
        TurnResult(
            system=system,
            repeat=0,
            turn=i + 1,
            ttft_s=t,
            prompt_tokens=100 * (i + 1),
            reused_tokens=reused,
            reusable_tokens=100 * i,
        )
        for i, t in enumerate(ttfts)
    ]


def test_the_report_judges_the_last_turn():
    results = [
        *_turns(RAW_INCREMENTAL, [0.5, 0.6], 0),
        *_turns(RAW_COLD, [0.5, 1.0], 0),
        *_turns(QUICSRV, [0.6, 0.8], None),
        *_turns(LLAMA_SERVER, [0.5, 0.7], 100),
    ]
    text = render(results, turns=2, repeats=1)
    assert "| 2 | 200 | 100 | 600 | 200 | 1000 | 800 | – / 200 | 700 | 100 / 200 |" in text
    assert "| turn-2 TTFT quicsrv ≤ 1.5× raw incremental | 800 / 600 ms = 1.33× | yes |" in text
    assert "| turn-2 TTFT quicsrv ≤ llama-server's | 800 / 700 ms = 1.14× | **no** |" in text
    assert "| quicsrv reports reused prompt tokens | not reported | **no** |" in text


def test_without_a_build_llama_servers_rows_say_so():
    results = [*_turns(RAW_INCREMENTAL, [0.5], 0), *_turns(QUICSRV, [0.6], 0)]
    text = render(results, turns=1, repeats=1, llama_server_note=NO_BUILD)
    assert f"| turn-1 TTFT quicsrv ≤ llama-server's | {NO_BUILD} | – |" in text
    assert "| skipped | skipped |" in text


def test_finding_the_build_never_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("QUICSRV_LLAMA_SERVER_CACHE", str(tmp_path))
    assert find_llama_server("9.9.9") is None
    assert list(tmp_path.iterdir()) == []
    binary = tmp_path / "9.9.9" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    assert find_llama_server("9.9.9") is None  # not executable: a half-done copy
    os.chmod(binary, 0o755)
    assert find_llama_server("9.9.9") == binary


def test_llama_server_gets_quicsrvs_slots_and_threads():
    argv = llama_server_argv(Path("/b/llama-server"), ServerSettings(model_path=Path("/m.gguf")))
    pairs = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert pairs["--ctx-size"] == str(8 * 2048)
    assert pairs["--parallel"] == "8"
    assert pairs["--threads"] == pairs["--threads-batch"] == "2"
    assert "--no-kv-unified" in argv and "--cache-prompt" in argv
