"""End to end: the real model through the real server over real QUIC on loopback."""

from __future__ import annotations

import asyncio
import struct

import cbor2
import llama_cpp
import pytest

import quicsrv_proto
from quicsrv_client import Client, GenerationEnded, ServerError, TokenReceived
from quicsrv_proto import ErrorCode
from tests.helpers import llama_extra_buffers, raw_connection, running_server

PROMPT = "The capital of France is"

pytestmark = [pytest.mark.model, pytest.mark.asyncio]


def _reference_greedy(model_path, prompt: str, n: int, engine) -> list[int]:
    """llama-cpp-python's own generate, with the engine's weights layout and attention kernel."""
    with llama_extra_buffers(engine.cpu_extra_buffers):
        llm = llama_cpp.Llama(
            str(model_path),
            n_ctx=2048,
            n_batch=512,
            n_threads=2,
            flash_attn=engine.settings.flash_attn,
            verbose=False,
        )
    tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    out: list[int] = []
    for token in llm.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0):
        out.append(token)
        if len(out) == n:
            break
    llm.close()
    return out


async def test_greedy_matches_llama_cpp_python(engine, certs, model_path):
    expected = _reference_greedy(model_path, PROMPT, 40, engine)
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            result = await c.generate_text(PROMPT, max_tokens=40, ignore_eos=True)
    assert list(result.token_ids) == expected
    assert result.end.reason is quicsrv_proto.EndReason.LENGTH
    assert result.end.completion_tokens == 40


async def test_seeded_sampling_is_reproducible(engine, certs):
    params = dict(max_tokens=32, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            first = await c.generate_text(PROMPT, **params)
            second = await c.generate_text(PROMPT, **params)
            other = await c.generate_text(PROMPT, **{**params, "seed": 99})
    assert first.token_ids == second.token_ids
    assert first.text == second.text
    assert len(first.token_ids) == 32
    assert other.token_ids != first.token_ids


async def test_chat_messages_use_the_template(engine, certs):
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            result = await c.generate_text(
                messages=[{"role": "user", "content": "Say hello."}], max_tokens=16
            )
    # The rendered ChatML template is far longer than the bare message.
    assert result.end.prompt_tokens > 10
    assert result.text.strip()


async def test_four_concurrent_generations_interleave(engine, certs):
    arrivals: list[int] = []

    async def run(c: Client, which: int) -> int:
        count = 0
        async for event in c.generate(PROMPT, max_tokens=24, ignore_eos=True):
            if isinstance(event, TokenReceived):
                arrivals.append(which)
                count += 1
        return count

    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            counts = await asyncio.gather(*(run(c, i) for i in range(4)))
    assert counts == [24] * 4
    # Interleaved: every stream receives a token before any other stream has finished.
    last = {i: max(k for k, w in enumerate(arrivals) if w == i) for i in range(4)}
    first = {i: arrivals.index(i) for i in range(4)}
    assert max(first.values()) < min(last.values())


async def test_stop_sequence_is_not_emitted(engine, certs):
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            full = await c.generate_text(PROMPT, max_tokens=30, ignore_eos=True)
            assert "." in full.text
            stopped = await c.generate_text(PROMPT, max_tokens=30, stop=(".",), ignore_eos=True)
    assert stopped.end.reason is quicsrv_proto.EndReason.STOP
    assert stopped.text == full.text[: full.text.index(".")]


async def test_cancel_by_breaking_out_frees_the_engine(model_path, certs, cpu_extra_buffers):
    from quicsrv.engine.llama import LlamaEngine
    from quicsrv.settings import engine_settings_for

    # One slot and one queue place: the next request can only run once the first is freed.
    solo = LlamaEngine(
        engine_settings_for(
            model_path, n_seq_max=1, max_queued=1, cpu_extra_buffers=cpu_extra_buffers
        )
    )
    try:
        async with running_server(solo, certs) as server:
            async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
                events = c.generate(PROMPT, max_tokens=1500, ignore_eos=True)
                async for event in events:
                    if isinstance(event, TokenReceived) and event.index == 2:
                        break
                await events.aclose()
                after = await c.generate_text(PROMPT, max_tokens=8, ignore_eos=True)
            assert len(after.token_ids) == 8
            # Connection close cancels too.
            async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c2:
                async for event in c2.generate(PROMPT, max_tokens=1500, ignore_eos=True):
                    if isinstance(event, TokenReceived) and event.index == 2:
                        break
            async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c3:
                again = await c3.generate_text(PROMPT, max_tokens=8, ignore_eos=True)
            assert len(again.token_ids) == 8
        # Neither long generation ran anywhere near its 1,500 tokens.
        assert solo.tokens_generated_total < 200
    finally:
        solo.close()


def _frame_bytes(frame_type: int, payload: object, *, magic=b"LLM\x00", version=1) -> bytes:
    body = cbor2.dumps(payload)
    return struct.pack(">4sBIB", magic, version, len(body), frame_type) + body


BAD_REQUESTS = [
    (
        "malformed_cbor",
        "POST",
        "/v1/generate",
        struct.pack(">4sBIB", b"LLM\x00", 1, 2, 1) + b"\xff\xff",
        ErrorCode.MALFORMED_PAYLOAD,
        400,
    ),
    (
        "bad_magic",
        "POST",
        "/v1/generate",
        _frame_bytes(1, {"prompt": "x", "max_tokens": 4}, magic=b"XYZ\x00"),
        ErrorCode.BAD_MAGIC,
        400,
    ),
    (
        "bad_version",
        "POST",
        "/v1/generate",
        _frame_bytes(1, {"prompt": "x", "max_tokens": 4}, version=9),
        ErrorCode.UNSUPPORTED_VERSION,
        400,
    ),
    (
        "unknown_type",
        "POST",
        "/v1/generate",
        _frame_bytes(77, {}),
        ErrorCode.UNKNOWN_FRAME_TYPE,
        400,
    ),
    (
        "oversized",
        "POST",
        "/v1/generate",
        struct.pack(">4sBIB", b"LLM\x00", 1, 50_000_000, 1),
        ErrorCode.FRAME_TOO_LARGE,
        413,
    ),
    (
        "max_tokens_zero",
        "POST",
        "/v1/generate",
        _frame_bytes(1, {"prompt": "x", "max_tokens": 0}),
        ErrorCode.INVALID_FIELD,
        400,
    ),
    (
        "max_tokens_over_limit",
        "POST",
        "/v1/generate",
        _frame_bytes(1, {"prompt": "x", "max_tokens": 5000}),
        ErrorCode.INVALID_FIELD,
        400,
    ),
    (
        "negative_temperature",
        "POST",
        "/v1/generate",
        _frame_bytes(1, {"prompt": "x", "max_tokens": 4, "temperature": -1.0}),
        ErrorCode.INVALID_FIELD,
        400,
    ),
    (
        "unknown_key",
        "POST",
        "/v1/generate",
        _frame_bytes(1, {"prompt": "x", "max_tokens": 4, "colour": "red"}),
        ErrorCode.UNKNOWN_FIELD,
        400,
    ),
    (
        "missing_field",
        "POST",
        "/v1/generate",
        _frame_bytes(1, {"prompt": "x"}),
        ErrorCode.MISSING_FIELD,
        400,
    ),
    (
        "prompt_too_long",
        "POST",
        "/v1/generate",
        _frame_bytes(1, {"prompt": "word " * 3000, "max_tokens": 16}),
        ErrorCode.PROMPT_TOO_LONG,
        413,
    ),
    (
        "wrong_frame",
        "POST",
        "/v1/generate",
        _frame_bytes(2, {"index": 0, "id": 1, "text": "a"}),
        ErrorCode.UNEXPECTED_FRAME,
        400,
    ),
    (
        "truncated",
        "POST",
        "/v1/generate",
        _frame_bytes(1, {"prompt": "x", "max_tokens": 4})[:-2],
        ErrorCode.TRUNCATED_FRAME,
        400,
    ),
    # (Other /v1/ paths belong to the HTTP API, whose errors are JSON: tests/http.)
    ("wrong_path", "POST", "/nope", b"", ErrorCode.NOT_FOUND, 404),
    ("wrong_method", "GET", "/v1/generate", b"", ErrorCode.METHOD_NOT_ALLOWED, 405),
]


async def test_every_bad_input_gets_its_code_and_the_connection_goes_on(engine, certs):
    good = quicsrv_proto.encode_frame(
        quicsrv_proto.Generate(prompt=PROMPT, max_tokens=4, ignore_eos=True)
    )
    async with running_server(engine, certs) as server:
        async with raw_connection(server.port, certs.ca_cert) as conn:
            # A generation in flight on the same connection while the bad requests arrive.
            in_flight = asyncio.ensure_future(
                conn.request(
                    "POST",
                    "/v1/generate",
                    quicsrv_proto.encode_frame(
                        quicsrv_proto.Generate(prompt=PROMPT, max_tokens=48, ignore_eos=True)
                    ),
                )
            )
            for name, method, path, body, code, status in BAD_REQUESTS:
                response = await conn.request(method, path, body)
                frames = response.frames
                assert response.status == status, name
                assert len(frames) == 1 and isinstance(frames[0], quicsrv_proto.Error), name
                assert frames[0].code == code, (name, frames[0])
                assert frames[0].message, name
                after = await conn.request("POST", "/v1/generate", good)
                assert after.status == 200, name
                assert isinstance(after.frames[-1], quicsrv_proto.End), name
            long_run = await in_flight
    tokens = [f for f in long_run.frames if isinstance(f, quicsrv_proto.Token)]
    assert [t.index for t in tokens] == list(range(48))


async def test_client_raises_server_error_with_code(engine, certs):
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            with pytest.raises(ServerError) as info:
                await c.generate_text("word " * 3000, max_tokens=16)
            assert info.value.code == ErrorCode.PROMPT_TOO_LONG
            ok = await c.generate_text(PROMPT, max_tokens=4, ignore_eos=True)
    assert len(ok.token_ids) == 4


async def test_shutdown_ends_open_streams_with_reason_shutdown(engine, certs):
    seen: list[object] = []
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            async for event in c.generate(PROMPT, max_tokens=1000, ignore_eos=True):
                seen.append(event)
                if isinstance(event, TokenReceived) and event.index == 3:
                    shutting_down = asyncio.ensure_future(server.shutdown(5.0))
        await shutting_down
    end = seen[-1]
    assert isinstance(end, GenerationEnded)
    assert end.reason is quicsrv_proto.EndReason.SHUTDOWN


async def test_utf8_characters_are_never_split(engine, certs):
    texts: list[str] = []
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            # Emoji in the prompt make the model go on with emoji: 4-byte characters that
            # SmolLM2's vocabulary spells with byte tokens.
            async with c.stream(
                "List ten emoji: 🍎 🍌 🍇", max_tokens=48, ignore_eos=True
            ) as generation:
                async for event in generation:
                    if isinstance(event, TokenReceived):
                        texts.append(event.text)
                    elif isinstance(event, GenerationEnded):
                        texts.append(event.text)
    # A token holding only part of a character carries no text; the character arrives whole
    # with the token that completes it. Without such a token this test would prove nothing.
    assert "" in texts[:-1], "the prompt must produce a character split across tokens"
    assert "\ufffd" not in "".join(texts)


async def test_long_prompts_are_tokenized_and_chat_rendered_off_the_event_loop(
    engine, certs, monkeypatch
):
    import threading

    loop_thread = threading.current_thread()
    seen: list[tuple[str, threading.Thread]] = []
    tokenize, render_chat = engine.tokenize, engine.render_chat

    def recording_tokenize(text, *, add_special):
        seen.append(("tokenize", threading.current_thread()))
        return tokenize(text, add_special=add_special)

    def recording_render_chat(messages):
        seen.append(("render_chat", threading.current_thread()))
        return render_chat(messages)

    monkeypatch.setattr(engine, "tokenize", recording_tokenize)
    monkeypatch.setattr(engine, "render_chat", recording_render_chat)
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as c:
            # Past INLINE_PROMPT_CHARS: a short prompt is tokenized on the loop, at once.
            long_text = "Tell me about the sea. " * 12
            await c.generate_text(long_text, max_tokens=2)
            await c.generate_text(messages=[{"role": "user", "content": long_text}], max_tokens=2)
            off_loop = list(seen)
            await c.generate_text(PROMPT, max_tokens=2)
    assert {name for name, _ in off_loop} == {"tokenize", "render_chat"}
    assert all(thread is not loop_thread for _, thread in off_loop)
    assert seen[len(off_loop) :] == [("tokenize", loop_thread)]


async def test_the_client_delays_its_acknowledgements_after_the_handshake(engine, certs):
    # The knob is aioquic's private ``_ack_delay``: this fails loudly if aioquic renames it.
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert, ack_delay_s=0.02) as c:
            result = await c.generate_text(PROMPT, max_tokens=4, ignore_eos=True)
            assert c._protocol is not None
            assert c._protocol._quic._ack_delay == 0.02
    assert len(result.token_ids) == 4
