"""kill -9 the server mid-generation, start it again, resume: the text continues exactly, and so
do the tokens' log-probabilities."""

from __future__ import annotations

import asyncio
import signal

import pytest

from quicsrv_client import Client, GenerationEnded, ResumePosition, TokenReceived
from tests.helpers import server_process

pytestmark = [pytest.mark.model, pytest.mark.asyncio, pytest.mark.slow]

PROMPT = "The three most important inventions of the last century are"
PARAMS = dict(max_tokens=64, temperature=0.7, top_k=40, seed=5, ignore_eos=True, logprobs=3)


async def test_resume_after_kill_9_and_restart_continues_exactly(certs, tmp_path, model_path):
    ids: list[int] = []
    text: list[str] = []
    scores: list[object] = []
    async with server_process(certs, tmp_path) as (process, port):
        client = Client("127.0.0.1", port, ca=certs.ca_cert)
        await client.connect()
        generation = client.generate(PROMPT, **PARAMS)
        async for event in generation:
            if isinstance(event, TokenReceived):
                ids.append(event.token_id)
                text.append(event.text)
                scores.append((event.logprob, event.top_logprobs))
                if len(ids) == 27:
                    break
        process.send_signal(signal.SIGKILL)  # mid-generation: nothing gets to shut down
        await asyncio.to_thread(process.wait, 30)
        position = generation.position
        await client.close()
    assert isinstance(position, ResumePosition) and position.last_index == 26

    async with server_process(certs, tmp_path) as (_process, port):
        async with Client("127.0.0.1", port, ca=certs.ca_cert) as c:
            resumed = c.resume_from(position)
            async for event in resumed:
                if isinstance(event, TokenReceived):
                    ids.append(event.token_id)
                    text.append(event.text)
                    scores.append((event.logprob, event.top_logprobs))
                elif isinstance(event, GenerationEnded):
                    text.append(event.text)
            reference = [event async for event in c.generate(PROMPT, **PARAMS)]
    tokens = [event for event in reference if isinstance(event, TokenReceived)]
    assert resumed.resume_path == "replay"  # the KV blob died with the process
    assert ids == [event.token_id for event in tokens]
    assert "".join(text) == "".join(
        event.text for event in reference if isinstance(event, TokenReceived | GenerationEnded)
    )
    assert scores == [(event.logprob, event.top_logprobs) for event in tokens]
    assert all(logprob is not None and len(top) == 3 for logprob, top in scores)
