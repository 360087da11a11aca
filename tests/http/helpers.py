"""Helpers for the HTTP API's end-to-end tests: clients over TCP and HTTP/3, SSE parsing."""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import niquests
import openai

from quicsrv.devcerts import DevCertPaths
from quicsrv.transport import RunningServer


@dataclass(frozen=True)
class SseEvent:
    id: str | None
    data: str
    event: str | None = None
    """The ``event:`` line's name (Anthropic's and the Responses API's events have one)."""

    @property
    def json(self) -> Any:
        return json.loads(self.data)


def parse_sse(lines: list[str]) -> list[SseEvent]:
    """Events from ``text/event-stream`` lines (WHATWG HTML §9.2.6, the parts used here)."""
    events: list[SseEvent] = []
    event_id: str | None = None
    name: str | None = None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                events.append(SseEvent(event_id, "\n".join(data), name))
            event_id, name, data = None, None, []
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])
    return events


def chunk_text(event: SseEvent) -> str:
    """The text an OpenAI chunk adds (chat ``delta.content`` or completion ``text``)."""
    if event.data == "[DONE]":
        return ""
    chunk = event.json
    if not chunk.get("choices"):
        return ""
    choice = chunk["choices"][0]
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    return str(choice.get("text") or "")


def events_text(events: list[SseEvent]) -> str:
    return "".join(chunk_text(e) for e in events)


def base_url(server: RunningServer) -> str:
    return f"https://localhost:{server.port}"


def tls_context(certs: DevCertPaths) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(certs.ca_cert))


@contextlib.asynccontextmanager
async def tcp_client(
    server: RunningServer, certs: DevCertPaths, *, http2: bool = False, **headers: str
) -> AsyncIterator[httpx.AsyncClient]:
    """httpx over TCP (HTTP/1.1, or HTTP/2 when asked), verifying the dev CA."""
    async with httpx.AsyncClient(
        base_url=base_url(server),
        verify=tls_context(certs),
        http2=http2,
        headers=headers,
        timeout=120,
    ) as client:
        yield client


@contextlib.asynccontextmanager
async def anthropic_client(
    server: RunningServer, certs: DevCertPaths, api_key: str = "unused"
) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """Anthropic's official SDK, over TCP, trusting the dev CA (it sends ``x-api-key``)."""
    client = anthropic.AsyncAnthropic(
        base_url=base_url(server),
        api_key=api_key,
        http_client=anthropic.DefaultAsyncHttpxClient(verify=tls_context(certs)),
        max_retries=0,
        timeout=120,
    )
    try:
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def openai_client(
    server: RunningServer, certs: DevCertPaths, api_key: str = "unused"
) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official SDK, over TCP, trusting the dev CA."""
    http_client = openai.DefaultAsyncHttpxClient(verify=tls_context(certs))
    client = openai.AsyncOpenAI(
        base_url=base_url(server) + "/v1",
        api_key=api_key,
        http_client=http_client,
        max_retries=0,
        timeout=120,
    )
    try:
        yield client
    finally:
        await client.close()


class H3Client:
    """A niquests session that trusts the dev CA on every request (niquests' HTTP/3 path reads
    ``verify`` per request, not from the session)."""

    def __init__(self, session: niquests.AsyncSession, ca: str) -> None:
        self._session = session
        self._ca = ca

    async def request(self, method: str, url: str, **kwargs: Any) -> niquests.Response:
        return await self._session.request(method, url, verify=self._ca, **kwargs)

    async def get(self, url: str, **kwargs: Any) -> niquests.Response:
        return await self.request("GET", url, **kwargs)

    async def post(self, url: str, **kwargs: Any) -> niquests.Response:
        return await self.request("POST", url, **kwargs)


@contextlib.asynccontextmanager
async def h3_session(certs: DevCertPaths, *, h3_only: bool = True) -> AsyncIterator[H3Client]:
    """niquests speaking HTTP/3 only (no TCP fallback, so a pass proves QUIC carried it)."""
    async with niquests.AsyncSession(disable_http1=h3_only, disable_http2=h3_only) as session:
        yield H3Client(session, str(certs.ca_cert))


async def h3_stream(
    session: H3Client, method: str, url: str, **kwargs: Any
) -> tuple[niquests.AsyncResponse, list[SseEvent]]:
    """A whole SSE response over HTTP/3."""
    response = await session.request(method, url, stream=True, **kwargs)
    assert isinstance(response, niquests.AsyncResponse)
    lines = [line async for line in response.iter_lines()]
    text = [line.decode() if isinstance(line, bytes) else line for line in lines]
    return response, parse_sse([*text, ""])


@dataclass(frozen=True)
class CutStream:
    """An SSE request run whole, then again and cut, then resumed by its Last-Event-ID."""

    whole: list[SseEvent]
    before: list[SseEvent]
    """The events the cut stream delivered."""
    after: list[SseEvent]
    """The events the resume delivered."""
    session: str
    last_id: str
    """The last event id before the cut: the cursor the resume sent."""


async def cut_and_resume(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    *,
    stop_after: int,
    resume_on: httpx.AsyncClient | None = None,
) -> CutStream:
    """``body`` posted to ``path`` once whole, once cut after ``stop_after`` events with an id,
    and that cut stream resumed with ``GET /v1/streams/{session}`` (on ``resume_on``: another
    server, say; else on ``client``)."""
    _, whole = await tcp_stream(client, "POST", path, json=body)
    cut, before = await tcp_stream(client, "POST", path, json=body, stop_after=stop_after)
    session = cut.headers["quicsrv-session"]
    last_id = [e.id for e in before if e.id is not None][-1]
    _, after = await tcp_stream(
        resume_on or client, "GET", f"/v1/streams/{session}", headers={"last-event-id": last_id}
    )
    return CutStream(whole=whole, before=before, after=after, session=session, last_id=last_id)


async def tcp_stream(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    stop_after: int | None = None,
    **kwargs: Any,
) -> tuple[httpx.Response, list[SseEvent]]:
    """An SSE response over TCP; with ``stop_after``, the connection is dropped after that
    many events that carry an id (the cut a client sees when its network goes)."""
    events: list[SseEvent] = []
    lines: list[str] = []
    async with client.stream(method, url, **kwargs) as response:
        async for line in response.aiter_lines():
            lines.append(line)
            if line == "":
                events = parse_sse(lines)
                if stop_after is not None and sum(e.id is not None for e in events) >= stop_after:
                    break
        else:
            events = parse_sse([*lines, ""])
    return response, events
