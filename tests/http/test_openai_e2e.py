"""End to end: the OpenAI API through the real server, the real model, real clients.

The official ``openai`` SDK and httpx over TCP (HTTP/1.1, HTTP/2), niquests over HTTP/3. Texts
are compared between two runs on this machine, never against fixed strings.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from quicsrv.apikeys import hash_key, new_key
from quicsrv.http.cursor import decode_cursor, encode_cursor
from tests.helpers import running_server, session_settings

from .helpers import (
    base_url,
    cut_and_resume,
    events_text,
    h3_session,
    h3_stream,
    openai_client,
    tcp_client,
    tcp_stream,
)

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


async def _model(server) -> str:
    return server.app.router.model_id


async def test_the_openai_sdk_streams_and_not_over_tcp(engine, certs):
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        models = await client.models.list()
        model = models.data[0].id
        assert [m.id for m in models.data] == [await _model(server)]
        params = dict(model=model, messages=CHAT, max_tokens=24, temperature=0)
        raw = await client.chat.completions.with_raw_response.create(**params)
        assert raw.headers["alt-svc"] == f'h3=":{server.port}"; ma=86400'
        whole = raw.parse()
        stream = await client.chat.completions.create(
            **params, stream=True, stream_options={"include_usage": True}
        )
        parts, finish, usage, ids = [], None, None, set()
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        completion = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=16, temperature=0
        )
        text_stream = await client.completions.create(
            model=model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True
        )
        streamed_text = "".join([c.choices[0].text async for c in text_stream if c.choices])
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert "".join(parts) == choice.message.content  # greedy: streamed or not, the same text
    assert finish == choice.finish_reason and finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert completion.object == "text_completion" and completion.choices[0].text
    assert streamed_text == completion.choices[0].text
    assert completion.usage.completion_tokens <= 16


async def test_niquests_over_http3_gets_what_tcp_gets(engine, certs):
    body = {"model": "", "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stream": True}
    async with running_server(engine, certs) as server:
        body["model"] = await _model(server)
        url = base_url(server) + "/v1/completions"
        async with tcp_client(server, certs, http2=True) as tcp:
            over_h2, tcp_events = await tcp_stream(tcp, "POST", url, json=body)
        async with h3_session(certs) as h3:
            models = await h3.get(base_url(server) + "/v1/models")
            response, h3_events = await h3_stream(h3, "POST", url, json=body)
            whole = await h3.post(url, json={**body, "stream": False})
            health = await h3.get(base_url(server) + "/healthz")
    assert over_h2.http_version == "HTTP/2"
    assert models.http_version == 30 and models.json()["data"][0]["id"] == body["model"]
    assert response.http_version == 30 and response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert h3_events[-1].data == "[DONE]"
    assert events_text(h3_events) == events_text(tcp_events) == whole.json()["choices"][0]["text"]
    assert health.status_code == 200 and health.text == "ok\n"


async def test_niquests_finds_http3_by_alt_svc(engine, certs):
    async with running_server(engine, certs) as server:
        url = base_url(server) + "/v1/models"
        async with h3_session(certs, h3_only=False) as session:
            first = await session.get(url)
            second = await session.get(url)
    assert first.http_version in (11, 20)  # a client that knew nothing started over TCP
    assert first.headers["alt-svc"] == f'h3=":{server.port}"; ma=86400'
    assert second.http_version == 30


@pytest.mark.parametrize(
    ("sampling", "http2"),
    [({"temperature": 0}, False), ({"temperature": 0.9, "top_p": 0.95, "seed": 7}, True)],
    ids=["greedy-http1.1", "seeded-http2"],
)
async def test_a_cut_stream_resumed_by_last_event_id_is_the_uninterrupted_text(
    engine, certs, sampling, http2
):
    async with running_server(engine, certs) as server:
        body = {
            "model": await _model(server),
            "messages": CHAT,
            "max_tokens": 48,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **sampling,
        }
        async with tcp_client(server, certs, http2=http2) as tcp:
            # Resumed over TCP again on this client, and over HTTP/3: the same cursor, the
            # same tail.
            cut = await cut_and_resume(tcp, "/v1/chat/completions", body, stop_after=12)
        reference, before, after_tcp = cut.whole, cut.before, cut.after
        async with h3_session(certs) as h3:
            url = f"{base_url(server)}/v1/streams/{cut.session}?last_event_id={cut.last_id}"
            _, after_h3 = await h3_stream(h3, "GET", url)
    assert events_text(reference) == events_text(before) + events_text(after_tcp)
    assert after_h3 == after_tcp  # ids included: the same events, whatever carried them

    # The same finish and usage, but for what the prefix cache held when each run started.
    def finish_and_usage(events: list[Any]) -> list[Any]:
        ends = [(e.json["choices"], e.json["usage"]) for e in events[-3:-1]]
        for _, usage in ends:
            if usage:
                usage["prompt_tokens_details"]["cached_tokens"] = 0
        return ends

    assert finish_and_usage(reference) == finish_and_usage(after_tcp)
    assert reference[-1].data == after_tcp[-1].data == "[DONE]"
    assert reference[-2].json["usage"]["completion_tokens"] == 48


async def test_a_disconnect_pauses_and_delete_stops(engine, certs, tmp_path):
    # A small allowance, so the abandoned generation pauses long before max_tokens.
    settings = session_settings(tmp_path, max_tokens_ahead=8)
    async with running_server(engine, certs, sessions=settings) as server:
        body = {
            "model": await _model(server),
            "prompt": PROMPT,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }
        async with tcp_client(server, certs) as tcp:
            response, before = await tcp_stream(
                tcp, "POST", "/v1/completions", json=body, stop_after=4
            )
            session_id = response.headers["quicsrv-session"]
            session = server.sessions.live(bytes.fromhex(session_id))
            if session is not None:
                await asyncio.wait_for(session.idle.wait(), timeout=60)
            record = server.sessions.store.get(bytes.fromhex(session_id))
            assert record is not None and record.end is None  # paused, not ended
            assert len(record.generated) < 400
            last_id = [e.id for e in before if e.id is not None][-1]
            # Read on a while, then stop it from elsewhere: the stream ends "cancelled".
            resumed = tcp.stream(
                "GET", f"/v1/streams/{session_id}", headers={"last-event-id": last_id}
            )
            lines: list[str] = []
            async with resumed as stream:
                async for line in stream.aiter_lines():
                    lines.append(line)
                    if sum(x.startswith("id: ") for x in lines) == 3:
                        async with tcp_client(server, certs) as other:
                            stopped = await other.delete(f"/v1/streams/{session_id}")
            again = await tcp.delete(f"/v1/streams/{session_id}")
            unknown = await tcp.delete(f"/v1/streams/{'ab' * 16}")
    finish = [json.loads(x[6:]) for x in lines if x.startswith("data: {")][-1]
    assert finish["choices"][0]["finish_reason"] == "cancelled"
    assert lines[-2:] == ["data: [DONE]", ""]
    assert stopped.status_code == 200 and stopped.json()["status"] == "cancelled"
    assert again.json()["status"] == "cancelled"  # stopping twice changes nothing
    assert again.json()["completion_tokens"] == stopped.json()["completion_tokens"] < 400
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_session"


async def test_bad_input_gets_openai_errors_and_the_connection_goes_on(engine, certs):
    async with running_server(engine, certs, max_request_bytes=4096) as server:
        model = await _model(server)
        ok = {"model": model, "prompt": "Hi", "max_tokens": 2}
        cases = [
            ("POST", "/v1/completions", b"{not json", 400, "invalid_json"),
            ("POST", "/v1/completions", json.dumps({**ok, "n": 2}), 400, "unsupported_value"),
            ("POST", "/v1/completions", json.dumps({**ok, "logit_bias": {"1": 5}}), 400, None),
            ("POST", "/v1/completions", json.dumps({**ok, "bogus": 1}), 400, "unknown_parameter"),
            ("POST", "/v1/completions", json.dumps({**ok, "model": "gpt-4"}), 404, None),
            ("POST", "/v1/completions", json.dumps({**ok, "max_tokens": 10**6}), 400, None),
            ("POST", "/v1/completions", json.dumps({**ok, "prompt": "x" * 5000}), 413, None),
            ("GET", "/v1/completions", b"", 405, "method_not_allowed"),
            ("GET", "/v1/nope", b"", 404, "unknown_endpoint"),
            ("GET", f"/v1/streams/{'cd' * 16}", b"", 400, "missing_last_event_id"),
        ]
        async with tcp_client(server, certs) as tcp, h3_session(certs) as h3:
            for method, path, content, status, code in cases:
                for label, response in [
                    ("tcp", await tcp.request(method, path, content=content)),
                    ("h3", await h3.request(method, base_url(server) + path, data=content)),
                ]:
                    assert response.status_code == status, (label, path, content)
                    error = response.json()["error"]
                    assert set(error) >= {"message", "type", "param", "code"}
                    assert code is None or error["code"] == code, (label, error)
            final = await tcp.post("/v1/completions", json=ok)
            final_h3 = await h3.post(base_url(server) + "/v1/completions", json=ok)
        async with openai_client(server, certs) as client:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model=model, messages=CHAT, n=2, max_tokens=2)
    assert final.status_code == 200 and final_h3.status_code == 200
    assert caught.value.code == "unsupported_value"
    assert caught.value.param == "n"


async def test_forged_and_foreign_cursors_are_refused(engine, certs):
    async with running_server(engine, certs) as server:
        body = {
            "model": await _model(server),
            "prompt": PROMPT,
            "max_tokens": 4,
            "stream": True,
        }
        async with tcp_client(server, certs) as tcp:
            first, first_events = await tcp_stream(tcp, "POST", "/v1/completions", json=body)
            second, _ = await tcp_stream(tcp, "POST", "/v1/completions", json=body)
            cursor = first_events[1].id
            assert cursor is not None
            keys = server.sessions.keys.verifying_keys(0)
            decoded = decode_cursor(cursor, keys)
            forged = encode_cursor(b"x" * 32, decoded.session_id, decoded.index, decoded.flags)
            responses = {
                "forged": await tcp.get(
                    f"/v1/streams/{first.headers['quicsrv-session']}",
                    headers={"last-event-id": forged},
                ),
                "foreign": await tcp.get(
                    f"/v1/streams/{second.headers['quicsrv-session']}",
                    headers={"last-event-id": cursor},
                ),
                "garbage": await tcp.get(
                    f"/v1/streams/{first.headers['quicsrv-session']}",
                    headers={"last-event-id": "garbage"},
                ),
            }
            genuine, tail = await tcp_stream(
                tcp,
                "GET",
                f"/v1/streams/{first.headers['quicsrv-session']}",
                headers={"last-event-id": cursor},
            )
    for name, response in responses.items():
        assert response.status_code == 403, name
        assert response.json()["error"]["code"] == "invalid_cursor", name
    assert genuine.status_code == 200
    assert events_text(first_events) == events_text(first_events[:2]) + events_text(tail)


async def test_api_keys_guard_the_http_api(engine, certs, tmp_path):
    alice, bob = new_key(), new_key()
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"{hash_key(alice)} alice\n{hash_key(bob)} bob\n")
    async with running_server(engine, certs, api_keys_file=keys_file) as server:
        model = await _model(server)
        async with openai_client(server, certs, api_key="wrong") as client:
            with pytest.raises(openai.AuthenticationError) as caught:
                await client.models.list()
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
        async with tcp_client(server, certs, authorization=f"Bearer {alice}") as as_alice:
            started, events = await tcp_stream(as_alice, "POST", "/v1/completions", json=body)
        path = f"/v1/streams/{started.headers['quicsrv-session']}"
        cursor = events[0].id
        assert cursor is not None
        async with tcp_client(server, certs, authorization=f"Bearer {bob}") as as_bob:
            resumed_by_bob = await as_bob.get(path, headers={"last-event-id": cursor})
            stopped_by_bob = await as_bob.delete(path)
        async with tcp_client(server, certs) as anonymous:
            no_key = await anonymous.get(path, headers={"last-event-id": cursor})
            health = await anonymous.get("/healthz")
            metrics = await anonymous.get("/metrics")
    assert caught.value.status_code == 401
    assert no_key.status_code == 401 and no_key.headers["www-authenticate"].startswith("Bearer")
    assert no_key.json()["error"]["type"] == "authentication_error"
    for response in (resumed_by_bob, stopped_by_bob):
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "session_key_mismatch"
    assert health.status_code == 200  # operators' endpoints keep their own rules
    assert metrics.status_code == 401


async def test_a_completion_in_early_data_is_too_early(engine, certs):
    from aioquic.asyncio import connect
    from aioquic.h3.connection import H3_ALPN
    from aioquic.quic.configuration import QuicConfiguration

    from tests.quicsrv.test_zero_rtt_e2e import _RecordingProtocol, _ticket_for

    async with running_server(engine, certs) as server:
        configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN)
        configuration.load_verify_locations(str(certs.ca_cert))
        configuration.server_name = "localhost"
        configuration.session_ticket = await _ticket_for(server.port, certs.ca_cert)
        body = {"model": await _model(server), "prompt": PROMPT, "max_tokens": 4}
        async with connect(
            "127.0.0.1",
            server.port,
            configuration=configuration,
            create_protocol=_RecordingProtocol,
            wait_connected=False,
        ) as raw:
            assert isinstance(raw, _RecordingProtocol)
            stream_id = raw._quic.get_next_available_stream_id()
            raw.h3.send_headers(
                stream_id,
                [
                    (b":method", b"POST"),
                    (b":scheme", b"https"),
                    (b":authority", b"localhost"),
                    (b":path", b"/v1/completions"),
                ],
            )
            raw.h3.send_data(stream_id, json.dumps(body).encode(), end_stream=True)
            raw.transmit()  # the first flight: Initial + 0-RTT carrying the whole request
            await asyncio.wait_for(raw.done.wait(), 30)
            assert raw._quic.tls.early_data_accepted
    assert raw.status == 425
    assert json.loads(bytes(raw.body))["error"]["code"] == "too_early"
    assert len(server.sessions.store) == 0  # no compute was started


async def test_a_chat_over_the_context_is_refused_or_truncated_when_asked(engine, certs):
    # max_tokens takes most of the context, so a modest history is already over the budget.
    max_tokens = engine.context_per_sequence - 400
    history = [{"role": "system", "content": "You answer in one short sentence."}]
    for i in range(12):
        history.append({"role": "user", "content": f"Tell me fact number {i} about lighthouses."})
        history.append({"role": "assistant", "content": f"Fact {i}: " + "a tall tower. " * 8})
    history.append({"role": "user", "content": "Which fact was the most surprising?"})
    async with running_server(engine, certs) as server, openai_client(server, certs) as client:
        params = dict(model=await _model(server), messages=history, max_tokens=max_tokens)
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(**params)
        assert refused.value.status_code == 413
        assert "truncation" in str(refused.value.message)
        stream = await client.chat.completions.create(
            **params, stream=True, extra_body={"truncation": "auto"}
        )
        async for chunk in stream:  # it started: the history was cut to fit; enough
            assert chunk.id.startswith("chatcmpl-")
            break
        await stream.close()


async def test_the_next_turn_reports_cached_tokens_and_another_key_never_reuses_them(
    engine, certs, tmp_path
):
    alice, bob = new_key(), new_key()
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{hash_key(alice)} alice\n{hash_key(bob)} bob\n")
    notes = (
        "Notes for the night shift at the lighthouse: the lamp is lit at dusk, the lens is "
        "cleaned at dawn, the logbook records every ship that passes, the fog horn sounds "
        "every thirty seconds in fog, and the keeper checks the oil twice a night. "
    )
    first = [
        {"role": "system", "content": notes * 2},
        {"role": "user", "content": "When is the lens cleaned?"},
    ]
    async with running_server(engine, certs, api_keys_file=keys_file) as server:
        model = await _model(server)
        params = dict(model=model, max_tokens=16, temperature=0)
        async with openai_client(server, certs, api_key=alice) as as_alice:
            answer = await as_alice.chat.completions.create(messages=first, **params)
            second = [
                *first,
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": "And the oil?"},
            ]
            turn = await as_alice.chat.completions.create(messages=second, **params)
        async with openai_client(server, certs, api_key=bob) as as_bob:
            foreign = await as_bob.chat.completions.create(messages=second, **params)
    cached = turn.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < turn.usage.prompt_tokens  # the first turn's cells, not the new text
    # Bob's identical request finds nothing of Alice's: his time to first token cannot tell
    # him what she asked.
    assert foreign.usage.prompt_tokens_details.cached_tokens == 0
    assert foreign.usage.prompt_tokens == turn.usage.prompt_tokens
