"""End to end: the token endpoints through the real server and model agree with the prompt
lengths the server itself uses (``usage`` of a completion and of a response), round trip, and
answer over HTTP/3 as over TCP. One server, generations of one token: a few seconds."""

from __future__ import annotations

import pytest

from tests.helpers import running_server

from .helpers import base_url, h3_session, openai_client, tcp_client

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

PROMPT = "The lighthouse keeper counted 12 ships, then 3 more."
#: Non-ASCII, an emoji (bytes split across tokens), a run of spaces, a special token's text.
ODD = "Ünïcödé 東京 😀  tabs\tand <|im_end|> end"
CHAT = [{"role": "user", "content": "Name a colour."}]


async def test_the_token_endpoints_agree_with_the_server_s_own_prompt_lengths(engine, certs):
    async with running_server(engine, certs) as server:
        model = server.app.router.model_id
        async with tcp_client(server, certs) as http, openai_client(server, certs) as client:

            async def post(path: str, body: dict) -> dict:
                response = await http.post(path, json=body)
                assert response.status_code == 200, response.text
                return response.json()

            prompt_ids = (await post("/tokenize", {"content": PROMPT, "add_special": True}))[
                "tokens"
            ]
            completion = await client.completions.create(
                model=model, prompt=PROMPT, max_tokens=1, temperature=0
            )
            instructions = "Answer in one word."
            counted = await client.responses.input_tokens.count(
                model=model, instructions=instructions, input=CHAT
            )
            first = await client.responses.create(
                model=model, instructions=instructions, input=CHAT, max_output_tokens=1
            )
            counted_next = await client.responses.input_tokens.count(
                model=model, input="Another?", previous_response_id=first.id
            )
            second = await client.responses.create(
                model=model, input="Another?", previous_response_id=first.id, max_output_tokens=1
            )
            odd = await post("/tokenize", {"content": ODD, "with_pieces": True})
            odd_ids = [t["id"] for t in odd["tokens"]]
            back = await post("/detokenize", {"tokens": odd_ids})
            plain = await post("/tokenize", {"content": ODD, "parse_special": False})
            props = (await http.get("/props")).json()
            (entry,) = (await http.get("/v1/models")).json()["data"]
        async with h3_session(certs) as h3:
            over_h3 = await h3.post(base_url(server) + "/tokenize", json={"content": PROMPT})
    assert completion.usage.prompt_tokens == len(prompt_ids)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == first.usage.input_tokens > len(CHAT[0]["content"].split())
    assert counted_next.input_tokens == second.usage.input_tokens > first.usage.input_tokens
    # The pieces are the text's bytes in order; a piece that splits a character is bytes.
    pieces = [
        p.encode() if isinstance(p, str) else bytes(p) for p in (t["piece"] for t in odd["tokens"])
    ]
    assert b"".join(pieces) == ODD.encode()
    assert any(isinstance(t["piece"], list) for t in odd["tokens"])  # the emoji's bytes
    assert back == {"content": ODD}
    eos = props["eos_token"]
    assert eos in ODD and [t["piece"] for t in odd["tokens"]].count(eos) == 1
    assert len(plain["tokens"]) > len(odd_ids)  # <|im_end|> as plain text: several tokens
    assert over_h3.http_version == 30 and over_h3.json()["tokens"] == prompt_ids
    n_ctx = engine.context_per_sequence
    assert props["default_generation_settings"]["n_ctx"] == n_ctx == entry["max_model_len"]
    assert props["total_slots"] == engine.n_seq_max and props["model_alias"] == model
    meta = entry["meta"]
    assert meta["n_vocab"] > max(odd_ids) and meta["n_ctx"] == n_ctx
    assert meta["n_ctx_train"] >= n_ctx and meta["n_params"] > 0 and meta["size"] > 0
