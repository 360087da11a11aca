"""A restart loses nothing: SIGTERM hands every generation over (paused, KV cells saved, streams
told END(shutdown)), a new ``quicsrv serve`` on the same port and data dir takes over as soon as
the old one lets go, and clients come back by themselves to exactly an uninterrupted run's
tokens. Real processes, the real model, real QUIC on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from quicsrv.spawn import spawn_server_async
from quicsrv_client import (
    Client,
    GenerationEnded,
    Reconnected,
    ReconnectPolicy,
    SessionStarted,
    TokenReceived,
)
from quicsrv_proto import EndReason
from tests.helpers import running_server, server_process
from tests.http.helpers import tls_context

pytestmark = [pytest.mark.model, pytest.mark.asyncio, pytest.mark.slow]

PROMPT = "The three most important inventions of the last century are"
GREEDY = dict(max_tokens=96, ignore_eos=True)
SEEDED = dict(max_tokens=96, temperature=0.8, top_k=40, seed=7, ignore_eos=True)
CUT_AT = 20  # tokens received when the old server gets SIGTERM


async def _restart(
    stack: contextlib.AsyncExitStack,
    process: subprocess.Popen[str],
    certs,
    data_dir: Path,
    port: int,
) -> asyncio.Task[tuple[subprocess.Popen[str], int]]:
    """SIGTERM the old server and at once start the new one on the same port and data dir
    (it loads its model while it waits for the data dir's lock)."""
    process.send_signal(signal.SIGTERM)
    return asyncio.ensure_future(stack.enter_async_context(server_process(certs, data_dir, port)))


async def test_a_restart_is_ridden_out_exactly_with_the_kv_cells_restored(certs, tmp_path):
    data_dir = tmp_path / "data"
    ids: list[int] = []
    events: list[object] = []
    policy = ReconnectPolicy(initial_delay_s=0.05, max_delay_s=1.0, max_attempts=40)
    async with contextlib.AsyncExitStack() as stack:
        process, port = await stack.enter_async_context(server_process(certs, data_dir))
        async with Client("127.0.0.1", port, ca=certs.ca_cert) as c:
            reference = await c.generate_text(PROMPT, **GREEDY)
        restarted = None
        async with Client(
            "127.0.0.1",
            port,
            ca=certs.ca_cert,
            reconnect=policy,
            ticket_cache=tmp_path / "tickets.json",
        ) as c:
            async for event in c.generate(PROMPT, **GREEDY):
                events.append(event)
                if isinstance(event, TokenReceived):
                    ids.append(event.token_id)
                    if len(ids) == CUT_AT:
                        restarted = await _restart(stack, process, certs, data_dir, port)
        assert restarted is not None
        _new_process, new_port = await restarted
        assert new_port == port
    assert ids == list(reference.token_ids)  # every token exactly once, none lost
    reconnects = [e for e in events if isinstance(e, Reconnected)]
    assert reconnects and "shutting down" in reconnects[0].error
    resumed = [e for e in events if isinstance(e, SessionStarted) and e.resume_path]
    # The old server saved the cells the new one restored: no replay of the whole text.
    assert resumed[-1].resume_path == "kv-restore"
    assert any(e.early_data for e in reconnects)  # the ticket survived the restart: 0-RTT
    end = events[-1]
    assert isinstance(end, GenerationEnded) and end.reason is EndReason.LENGTH


async def test_the_cli_rides_out_a_restart_and_exits_0_only_when_the_generation_ended(
    certs, tmp_path
):
    data_dir = tmp_path / "data"
    args = ["generate", PROMPT, "--json", "--ticket-cache", "", "--ca", str(certs.ca_cert)]
    sampling = ["--max-tokens", "96", "--temperature", "0.8", "--top-k", "40", "--seed", "7"]
    sampling += ["--ignore-eos"]
    async with contextlib.AsyncExitStack() as stack:
        process, port = await stack.enter_async_context(server_process(certs, data_dir))
        async with Client("127.0.0.1", port, ca=certs.ca_cert) as c:
            reference = await c.generate_text(PROMPT, **SEEDED)
        where = ["--host", "127.0.0.1", "--port", str(port)]
        cli = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "quicsrv_client.cli",
            *args,
            *sampling,
            *where,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert cli.stdout is not None
        lines: list[dict[str, object]] = []
        restarted = None
        while line := await cli.stdout.readline():
            lines.append(json.loads(line))
            tokens = sum(1 for item in lines if item["type"] == "token")
            if tokens == CUT_AT and restarted is None:
                restarted = await _restart(stack, process, certs, data_dir, port)
        status = await cli.wait()
        assert restarted is not None
        await restarted
        # Auto-resume off: the stream ends with END(shutdown), which is no end.
        process, _ = restarted.result()
        cut = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "quicsrv_client.cli",
            *args,
            *sampling,
            *where,
            "--no-auto-resume",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert cut.stdout is not None and cut.stderr is not None
        seen = 0
        second = None
        while line := await cut.stdout.readline():
            if json.loads(line)["type"] == "token":
                seen += 1
                if seen == 5 and second is None:
                    second = await _restart(stack, process, certs, data_dir, port)
        cut_status = await cut.wait()
        cut_err = (await cut.stderr.read()).decode()
        assert second is not None
        await second
    assert status == 0
    tokens = [item["id"] for item in lines if item["type"] == "token"]
    assert tokens == list(reference.token_ids)
    assert any(item["type"] == "reconnect" for item in lines)
    resumed = [item for item in lines if item["type"] == "session" and "resume_path" in item]
    assert resumed and resumed[-1]["resume_path"] == "kv-restore"
    assert lines[-1]["type"] == "end" and lines[-1]["reason"] == "length"
    assert cut_status == 4
    assert "quicsrv-client resume --session" in cut_err


async def test_an_sse_stream_resumes_across_a_restart_by_last_event_id(certs, tmp_path):
    data_dir = tmp_path / "data"
    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 96,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with contextlib.AsyncExitStack() as stack:
        process, port = await stack.enter_async_context(server_process(certs, data_dir))
        base = f"https://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, verify=tls_context(certs), timeout=60) as http:
            reference = await http.post("/v1/chat/completions", json={**body, "stream": False})
            expected = reference.json()["choices"][0]["message"]["content"]
            texts: list[str] = []
            last_id = None
            shutdown_error = None
            restarted = None
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                session = response.headers["quicsrv-session"]
                current_id = None
                async for line in response.aiter_lines():
                    if line.startswith("id: "):
                        current_id = line[4:]
                    elif line.startswith("data: {"):
                        data = json.loads(line[6:])
                        if "error" in data:
                            shutdown_error = data["error"]
                            continue
                        texts.append(data["choices"][0]["delta"].get("content") or "")
                        last_id = current_id
                        if len(texts) == CUT_AT and restarted is None:
                            restarted = await _restart(stack, process, certs, data_dir, port)
        assert restarted is not None and shutdown_error is not None
        assert shutdown_error["code"] == "shutting_down"
        await restarted
        async with httpx.AsyncClient(base_url=base, verify=tls_context(certs), timeout=60) as http:
            headers = {"last-event-id": last_id}
            async with http.stream("GET", f"/v1/streams/{session}", headers=headers) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        data = json.loads(line[6:])
                        choice = data["choices"][0] if data.get("choices") else None
                        if choice is not None:
                            texts.append(choice["delta"].get("content") or "")
    assert "".join(texts) == expected


async def test_a_second_server_on_a_data_dir_in_use_says_so_in_one_line(certs, tmp_path):
    data_dir = tmp_path / "data"
    async with server_process(certs, data_dir) as (process, _port):
        second = await asyncio.to_thread(
            subprocess.run,
            [
                sys.executable,
                "-m",
                "quicsrv.cli",
                "serve",
                *("--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir)),
                *("--cert", str(certs.server_cert), "--key", str(certs.server_key)),
            ],
            env={**os.environ, "QUICSRV_DATA_DIR_WAIT_S": "0.5"},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert second.returncode == 2
    [line] = [ln for ln in second.stderr.splitlines() if "cannot serve" in ln]
    assert f"in use by another quicsrv (pid {process.pid})" in line
    assert "Traceback" not in second.stderr


async def test_an_idle_client_reconnects_for_its_next_request(engine, certs):
    async with running_server(engine, certs) as server:
        async with Client("127.0.0.1", server.port, ca=certs.ca_cert, idle_timeout_s=0.5) as c:
            first = await c.generate_text(PROMPT, max_tokens=4, ignore_eos=True)
            # The connection idles out: nothing keeps an idle connection alive.
            await c._protocol.wait_closed()  # type: ignore[union-attr]
            second = await c.generate_text(PROMPT, max_tokens=4, ignore_eos=True)
    assert first.token_ids == second.token_ids
    assert c.stats.connections == 2


async def test_idle_tls_connections_do_not_stop_the_hand_over(engine, certs):
    """Idle TCP connections keep hypercorn's graceful shutdown waiting past the grace period;
    the listener is then cancelled, and the rest of the hand-over must still run."""
    context = ssl.create_default_context(cafile=str(certs.ca_cert))

    def idle_connections(port: int) -> list[ssl.SSLSocket]:
        return [
            context.wrap_socket(
                socket.create_connection(("127.0.0.1", port)), server_hostname="localhost"
            )
            for _ in range(3)
        ]

    async with running_server(engine, certs) as server:
        idle = await asyncio.to_thread(idle_connections, server.port)
        try:
            await server.shutdown(0.2)  # raised from the cancelled listener before
        finally:
            for connection in idle:
                connection.close()
        assert (server.app.config.data_dir / "tickets.cbor").exists()  # the last step ran


async def test_a_sigterm_with_idle_tls_clients_exits_0_without_a_traceback(certs, tmp_path):
    context = ssl.create_default_context(cafile=str(certs.ca_cert))
    log = tmp_path / "server.log"
    args = ["--host", "127.0.0.1", "--port", "0", "--data-dir", str(tmp_path / "data")]
    args += ["--cert", str(certs.server_cert), "--key", str(certs.server_key)]
    async with spawn_server_async(args, log=log) as server:
        idle = await asyncio.to_thread(
            lambda: [
                context.wrap_socket(
                    socket.create_connection(("127.0.0.1", server.port)),
                    server_hostname="localhost",
                )
                for _ in range(3)
            ]
        )
        try:
            server.process.send_signal(signal.SIGTERM)
            status = await asyncio.to_thread(server.process.wait, 60)
        finally:
            for connection in idle:
                connection.close()
    assert status == 0
    text = log.read_text()
    assert "shutdown: " in text and "stopped" in text
    assert "Traceback" not in text
