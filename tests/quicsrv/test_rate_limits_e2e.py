"""Rate limits end to end: the real model and server, each API's own refusal.

The limiter's clock stands still here (no bucket refills during a test, so nothing depends
on how fast the machine is); the refill itself is tested in tests/test_rate_limits.py.
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest

from quicsrv.apikeys import hash_key, new_key
from quicsrv.rate_limits import RateLimiter
from quicsrv.sessions.manager import SessionManager
from quicsrv_client import Client, ServerError
from quicsrv_proto import ErrorCode
from tests.helpers import running_server, session_settings
from tests.http.helpers import anthropic_client, openai_client, tcp_client

pytestmark = [pytest.mark.model, pytest.mark.asyncio]


def _still() -> float:
    return 1000.0


async def test_each_api_refuses_a_spent_key_in_its_own_shape_and_never_cuts_a_generation(
    engine, certs, tmp_path: Path
):
    alice, bob = new_key(), new_key()
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{hash_key(alice)} alice rpm=2\n{hash_key(bob)} bob tpm=4\n")
    sessions = SessionManager(engine, session_settings(tmp_path), rates=RateLimiter(clock=_still))
    async with running_server(
        engine, certs, sessions=sessions, api_keys_file=keys_file, metrics_public=True
    ) as server:
        model = server.app.router.model_id
        ca = certs.ca_cert
        # alice: two requests a minute, over the native protocol; the third is refused.
        async with Client("127.0.0.1", server.port, ca=ca, api_key=alice) as c:
            for _ in range(2):
                await c.generate_text("Hi", max_tokens=2, ignore_eos=True)
            with pytest.raises(ServerError) as native:
                await c.generate_text("Hi", max_tokens=2)
        assert native.value.code == ErrorCode.RATE_LIMIT_EXCEEDED
        assert native.value.http_status == 429
        assert native.value.retry_after_s == pytest.approx(30.0)
        # ...and in OpenAI's shape, with OpenAI's headers, through its SDK...
        async with openai_client(server, certs, api_key=alice) as oai:
            with pytest.raises(openai.RateLimitError) as refused:
                await oai.completions.create(model=model, prompt="Hi", max_tokens=2)
        error = refused.value
        assert error.code == "rate_limit_exceeded" and error.type == "requests"
        headers = error.response.headers
        assert headers["retry-after"] == "30"
        assert headers["x-ratelimit-limit-requests"] == "2"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"] == "1m0s"
        assert "x-ratelimit-limit-tokens" not in headers  # alice has no token limit
        # ...and in Anthropic's, through its SDK.
        async with anthropic_client(server, certs, api_key=alice) as claude:
            with pytest.raises(anthropic.RateLimitError) as refused_too:
                await claude.messages.create(
                    model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]
                )
        assert refused_too.value.status_code == 429
        assert refused_too.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]

        # bob: 4 generated tokens a minute. One generation of 12 runs to its end (a limit
        # never cuts one); the debt then refuses the next, as a token limit.
        async with tcp_client(server, certs, authorization=f"Bearer {bob}") as http:
            body = {"model": model, "prompt": "Hi", "max_tokens": 12, "ignore_eos": True}
            answered = await http.post("/v1/completions", json=body)
            assert answered.status_code == 200
            assert answered.json()["usage"]["completion_tokens"] == 12
            assert answered.headers["x-ratelimit-limit-tokens"] == "4"
            refused_bob = await http.post("/v1/completions", json=body)
            assert refused_bob.status_code == 429
            assert refused_bob.json()["error"]["type"] == "tokens"
            assert refused_bob.headers["x-ratelimit-remaining-tokens"] == "0"
            # The 8 tokens of debt and one more, at 15 s each.
            assert refused_bob.headers["retry-after"] == "135"
            assert refused_bob.headers["x-ratelimit-reset-tokens"] == "3m0s"
            # Reads are not limited: the models list, the metrics.
            assert (await http.get("/v1/models")).status_code == 200
            metrics = (await http.get("/metrics")).text
    assert 'quicsrv_rate_limited_total{limit="requests"} 3.0' in metrics
    assert 'quicsrv_rate_limited_total{limit="tokens"} 1.0' in metrics
    assert 'quicsrv_requests_total{code="rate_limit_exceeded",endpoint="completions"} 2.0' in (
        metrics
    )
    assert server.app.refusals == {ErrorCode.RATE_LIMIT_EXCEEDED: 4}


async def test_an_open_servers_budget_is_per_address_not_per_connection(engine, certs, tmp_path):
    sessions = SessionManager(engine, session_settings(tmp_path), rates=RateLimiter(clock=_still))
    async with running_server(
        engine, certs, sessions=sessions, rate_limit_requests_per_minute=1
    ) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as first:
            await first.generate_text("Hi", max_tokens=1)
        # A new connection from the same address is no new budget (its fair share is new).
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert) as second:
            with pytest.raises(ServerError) as refused:
                await second.generate_text("Hi", max_tokens=1)
    assert refused.value.code == ErrorCode.RATE_LIMIT_EXCEEDED
    assert list(server.sessions.rates.refusals.items()) == [("requests", 1)]
