"""The chat page in real headless Chromium (Debian's package, driven by Playwright with the
system browser), through the real server and model: a conversation, a connection dropped
mid-stream by the server's test fault switch (over TCP, and with QUIC forced), a reload during
a generation. Each test leaves a screenshot under ``test-artifacts/browser/``.

Texts are compared with the same request made through the API on this machine (greedy), never
with fixed strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import expect

from quicsrv.apikeys import hash_key, new_key
from quicsrv.devcerts import DevCertPaths, spki_hash
from quicsrv.sessions.manager import SessionManager
from quicsrv.transport import RunningServer
from quicsrv_proto import EndReason
from tests.helpers import running_server, session_settings
from tests.redis_server import redis_server

from ..http.helpers import tls_context

pytestmark = [pytest.mark.model, pytest.mark.asyncio, pytest.mark.slow]

# Debian's launcher script is a shell wrapper; Playwright runs the binary itself.
CHROMIUM = Path("/usr/lib/chromium/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"
WAIT_MS = 120_000  # bounds a broken test; nothing waits for it to pass
QUESTION = "Tell me a story about a lighthouse keeper and a storm."

if not CHROMIUM.exists() or shutil.which("chromium") is None:  # CI installs it (.ci/run)
    pytest.skip("Debian's chromium is not installed (make system-deps)", allow_module_level=True)


@contextlib.asynccontextmanager
async def _chromium(
    server: RunningServer, certs: DevCertPaths, profile: Path, *, quic: bool, ready: bool = True
) -> AsyncIterator[Any]:
    """A headless Chromium page on the server's chat page (``ready``: once it shows the
    model); ``quic``: HTTP/3 from the first request (else TCP first, and HTTP/3 once
    ``alt-svc`` has told it)."""
    from playwright.async_api import async_playwright

    args = [
        "--no-sandbox",  # root
        f"--ignore-certificate-errors-spki-list={spki_hash(certs.server_cert)}",
        # Chromium tries ::1 first for localhost; the test server listens on 127.0.0.1.
        "--host-resolver-rules=MAP localhost 127.0.0.1",
    ]
    if quic:
        args.append(f"--origin-to-force-quic-on=localhost:{server.port}")
    async with async_playwright() as playwright:
        context = await playwright.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=args
        )
        try:
            page = context.pages[0] if context.pages else await context.new_page()
            # The page runs under its own CSP (nothing here evaluates strings in it): any
            # violation it reports fails the test.
            violations: list[str] = []
            page.on(
                "console",
                lambda message: (
                    violations.append(message.text)
                    if "Content Security Policy" in message.text
                    else None
                ),
            )
            await page.goto(f"https://localhost:{server.port}/")
            if ready:
                await expect(page.locator("#model")).not_to_have_text("…", timeout=WAIT_MS)
            yield page
            assert violations == []
        finally:
            await context.close()


async def _screenshot(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


async def _ask(page: Any, text: str, *, max_tokens: int) -> None:
    """Type a message with greedy sampling and send it (not waiting for the answer)."""
    await page.fill("#temperature", "0")
    await page.fill("#max-tokens", str(max_tokens))
    await page.fill("#prompt", text)
    await page.click("#send")


async def _until_status(page: Any, status: str) -> None:
    await expect(page.locator("#status")).to_have_text(status, timeout=WAIT_MS)


async def _reference(
    server: RunningServer, certs: DevCertPaths, inputs: list[str], max_tokens: int
) -> list[str]:
    """The same conversation through the API (a chain of greedy responses): the texts."""
    texts, previous = [], None
    async with httpx.AsyncClient(
        base_url=f"https://localhost:{server.port}", verify=tls_context(certs), timeout=120
    ) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for text in inputs:
            body: dict[str, Any] = {
                "model": model,
                "input": text,
                "temperature": 0,
                "max_output_tokens": max_tokens,
            }
            if previous is not None:
                body["previous_response_id"] = previous
            answer = (await http.post("/v1/responses", json=body)).json()
            previous = answer["id"]
            texts.append("".join(part["text"] for part in answer["output"][0]["content"]))
    return texts


def _h3_requests(server: RunningServer) -> float:
    value = server.app.metrics.registry.get_sample_value(
        "quicsrv_requests_by_protocol_total", {"protocol": "h3"}
    )
    return value or 0.0


async def test_a_two_turn_conversation(engine, certs, tmp_path):
    inputs = [QUESTION, "Give the keeper a name."]
    async with running_server(engine, certs) as server:
        expected = await _reference(server, certs, inputs, 24)
        async with _chromium(server, certs, tmp_path / "profile", quic=False) as page:
            model = await page.text_content("#model")
            outputs, protocols = [], []
            for text in inputs:
                await _ask(page, text, max_tokens=24)
                await _until_status(page, "done")
                outputs.append(await page.text_content("#output"))
                protocols.append(await page.text_content("#protocol"))
            user_messages = await page.locator(".message.user").all_text_contents()
            stats = await page.locator(".stats").all_text_contents()
            await _screenshot(page, "two-turn-conversation")
    assert model == server.app.router.model_id
    assert outputs == expected
    assert user_messages == inputs
    assert all(p in ("h2", "h3") for p in protocols)
    assert all("tokens" in s and p in s for s, p in zip(stats, protocols, strict=True))


async def test_a_connection_dropped_mid_stream_resumes_with_nothing_lost(engine, certs, tmp_path):
    async with running_server(engine, certs) as server:
        [expected] = await _reference(server, certs, [QUESTION], 48)
        async with _chromium(server, certs, tmp_path / "profile", quic=False) as page:
            server.app.router.faults.cut_next(after_writes=6)
            await _ask(page, QUESTION, max_tokens=48)
            await _until_status(page, "done")
            output = await page.text_content("#output")
            reconnects = await page.get_attribute("#status", "data-reconnects")
            await _screenshot(page, "dropped-connection-tcp")
    assert server.app.router.faults.cuts_made == 1
    assert reconnects is not None and int(reconnects) >= 1
    assert output == expected


async def test_with_quic_forced_a_dropped_connection_resumes_over_http3(engine, certs, tmp_path):
    async with running_server(engine, certs) as server:
        [expected] = await _reference(server, certs, [QUESTION], 48)
        h3_before = _h3_requests(server)
        async with _chromium(server, certs, tmp_path / "profile", quic=True) as page:
            server.app.router.faults.cut_next(after_writes=6)
            await _ask(page, QUESTION, max_tokens=48)
            await _until_status(page, "done")
            output = await page.text_content("#output")
            protocol = await page.text_content("#protocol")
            reconnects = await page.get_attribute("#status", "data-reconnects")
            await _screenshot(page, "dropped-connection-h3")
        h3_requests = _h3_requests(server) - h3_before
    assert protocol == "h3"
    # The page, its files, the model list, the answer and its resume all came over HTTP/3.
    assert h3_requests >= 6
    assert server.app.router.faults.cuts_made == 1
    assert reconnects is not None and int(reconnects) >= 1
    assert output == expected


async def test_a_reload_during_a_generation_finds_it_and_keeps_its_cells(engine, certs, tmp_path):
    def kv_restores(server: RunningServer) -> float:
        value = server.app.metrics.registry.get_sample_value(
            "quicsrv_resumes_total", {"path": "kv_restore"}
        )
        return value or 0.0

    async with running_server(engine, certs) as server:
        [expected] = await _reference(server, certs, [QUESTION], 400)
        restores_before = kv_restores(server)
        async with _chromium(server, certs, tmp_path / "profile", quic=True) as page:
            await _ask(page, QUESTION, max_tokens=400)
            # Reloaded once some of the answer is on the page: the fetch is cancelled.
            await expect(page.locator("#output")).to_have_text(
                re.compile(r".{20}", re.DOTALL), timeout=WAIT_MS
            )
            await page.reload()
            await _until_status(page, "done")
            output = await page.text_content("#output")
            turns = await page.locator(".turn").count()
            await _screenshot(page, "reload-mid-generation")
    assert turns == 1 and output == expected
    # The cancelled fetch was a cut: the paused sequence's cells were kept and restored.
    assert kv_restores(server) > restores_before


async def test_with_an_api_key_the_page_asks_for_it_and_stop_cancels_on_the_server(
    engine, certs, tmp_path
):
    key = new_key()
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{hash_key(key)} browser\n")
    async with running_server(engine, certs, api_keys_file=keys_file) as server:
        async with _chromium(server, certs, tmp_path / "profile", quic=False, ready=False) as page:
            await expect(page.locator("#key-row")).to_be_visible(timeout=WAIT_MS)
            await page.fill("#api-key", key)
            await page.click("#save-key")
            await expect(page.locator("#model")).to_have_text(
                server.app.router.model_id, timeout=WAIT_MS
            )
            await expect(page.locator("#key-row")).to_be_hidden()
            await _ask(page, QUESTION, max_tokens=400)
            await expect(page.locator("#output")).to_have_text(
                re.compile(r".{20}", re.DOTALL), timeout=WAIT_MS
            )
            await page.click("#stop")
            await _until_status(page, "done")
            stats = await page.text_content(".stats")
            await _screenshot(page, "api-key-and-stop")
        records = list(server.sessions.store)
    assert stats is not None and "cancelled" in stats
    [record] = records
    assert record.end is not None and record.end.reason is EndReason.CANCELLED
    assert 0 < record.end.completion_tokens < 400


async def test_the_page_rides_out_a_store_outage_and_finishes_the_answer(engine, certs, tmp_path):
    """Redis (with its append-only file) killed while the page streams, started again once the
    page is reconnecting: the answer finishes, the same as uninterrupted."""
    with redis_server(append_only=True) as redis:
        sessions = SessionManager(engine, session_settings(tmp_path, store_url=redis.url))
        async with running_server(engine, certs, sessions=sessions, store=redis.url) as server:
            [expected] = await _reference(server, certs, [QUESTION], 200)
            async with _chromium(server, certs, tmp_path / "profile", quic=True) as page:
                await _ask(page, QUESTION, max_tokens=200)
                await expect(page.locator("#output")).to_have_text(
                    re.compile(r".{20}", re.DOTALL), timeout=WAIT_MS
                )
                await asyncio.to_thread(redis.stop)  # SIGKILL
                # The stream ended with store_unavailable (or a resume was refused with 503).
                await expect(page.locator("#status")).to_have_attribute(
                    "data-reconnects", re.compile(r"[1-9]"), timeout=WAIT_MS
                )
                await asyncio.to_thread(redis.restart)
                await _until_status(page, "done")
                output = await page.text_content("#output")
                await _screenshot(page, "store-outage")
    assert output == expected
