"""Leaks: do open descriptors, threads, spool files, KV files and memory come back after many
generations with cuts, resumes and cancels?

One ``quicsrv serve`` process (and its engine worker, its child) runs rounds of generations,
each round the same mix (:class:`Kind`), several lanes at once: read to the end over native
frames; cut (the connection dropped mid-generation) and resumed to the end on a new connection;
stopped by ``DELETE /v1/streams/{id}`` (at once after a stream reset; at once after a cut,
racing a pause that captures the KV cells; after a cut, once the pause landed); an SSE stream
over TCP cut and resumed by its last event id (over TCP or over HTTP/3); an SSE stream stopped
by a DELETE while it is read. After every round the server is let come to rest
(:func:`at_rest`: no generation, no live session, no TCP connection, no blob in transit, polled
with a deadline, never slept on), and its census (:class:`Census`) is taken: open fds and
threads of the server and of the worker, spool files, KV files, RSS.

The first round warms up (thread pools, caches, the model's pages) and gives the baseline: from
then on every count must come back to exactly the baseline's, and each process's RSS may grow by
at most :data:`RSS_GROWTH_BOUND_MIB` between the second round and the last. Threads are told
apart by name (both processes run with a ``sitecustomize`` that names their Python threads for
the kernel); the event loop's default executor's are counted apart (:data:`POOL_THREAD`).

What is retained by design, and so not counted: session *records* stay on disk and in memory
until their TTL (``session_ttl_s``) for a late resume; they are reported (``sessions``), and a
finished session holds no open descriptor and no KV file. The soak's server keeps them
``--session-ttl-s`` (120 s), so that a long soak's RSS measures what is not retained by design.
The server keeps no KV blob in memory here (``kv_memory_budget_bytes = 0``), so every pause
writes a KV file and every resume or stop must remove it; a cut generation is resumed once its
pause has landed (its KV file exists), so each resume restores the cells and passes a blob
through the worker's spool.

    python -m loadtest.bench.soak --rounds 20 --per-round 30
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import json
import os
import re
import ssl
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import cbor2
import httpx

from loadtest.bench.machine import CpuMeter
from loadtest.bench.resume_watch import ResumeWait, ResumeWatch, summary
from quicsrv.devcerts import DevCertPaths, ensure_dev_certs
from quicsrv.spawn import spawn_server_async
from quicsrv_client import Client, GenerationEnded, SessionStarted, TokenReceived

__all__ = [
    "POOL_MAX_THREADS",
    "POOL_THREAD",
    "RSS_GROWTH_BOUND_MIB",
    "Census",
    "Kind",
    "ProcessCensus",
    "RoundResult",
    "ServerUnderTest",
    "SoakSettings",
    "at_rest",
    "main",
    "metrics",
    "process_census",
    "rss_growth_mib",
    "run_round",
    "settle",
    "soak",
    "soak_server",
    "thread_namer",
]

#: How much each process's RSS may grow between the second round and the last.
RSS_GROWTH_BOUND_MIB = 32.0
PROMPT = "Write a long story about a lighthouse keeper and the sea."
MODEL_SERVER_ENV = {
    # Every paused blob goes to a KV file (none kept in memory): the files are what is counted.
    "QUICSRV_KV_MEMORY_BUDGET_BYTES": "0",
    # A small allowance: a cut reader's generation stops a few tokens on and pauses, long
    # before max_tokens (the allowance grows to at most 8 times this: 32 tokens).
    "QUICSRV_MAX_TOKENS_AHEAD": "4",
}
#: How long a request may take on 2 busy shared cores before it counts as lost (a neighbour's
#: test suite can slow llama.cpp's two threads tenfold).
_PATIENCE_S = 300.0
#: The event loop's default executor (``asyncio.to_thread``) names its threads
#: ``asyncio_N``. It starts one more whenever a job comes while all of its threads are busy, up
#: to concurrent.futures' default bound, and keeps them: how many depends on how the jobs
#: happened to overlap, is bounded, and is no leak. Those past its first (N >= 1; the first
#: lives from start-up, and native threads llama.cpp starts from it inherit its name) are
#: counted apart (shown as ``+N``) and checked against the bound only; every other thread,
#: by name, must come back exactly.
POOL_THREAD = re.compile(r"asyncio_[1-9]\d*")
POOL_MAX_THREADS = min(32, (os.cpu_count() or 1) + 4) - 1
#: Run in the server and its worker (``sitecustomize`` on their ``PYTHONPATH``): each Python
#: thread gives the kernel its name (Python does so itself from 3.14), so a census tells the
#: threads apart. Measuring instrument only: it changes no behaviour.
_NAME_THREADS = """\
import ctypes
import threading

_prctl = ctypes.CDLL(None, use_errno=True).prctl
_PR_SET_NAME = 15
_bootstrap_inner = threading.Thread._bootstrap_inner


def _named_bootstrap_inner(self):
    try:
        _prctl(_PR_SET_NAME, self.name.encode()[:15], 0, 0, 0)
    except Exception:
        pass
    _bootstrap_inner(self)


threading.Thread._bootstrap_inner = _named_bootstrap_inner
"""
_ID = re.compile(r"[0-9a-f]{32}")
_INODE = re.compile(r"^(socket|pipe):\[\d+\]$")
_TCP_LISTEN = "0A"


class Kind(enum.StrEnum):
    """One generation of a round; a round cycles through them in this order."""

    COMPLETE = "complete"
    """Native frames, read to the end."""
    CUT_RESUME = "cut-resume"
    """Native: the connection dropped after a few tokens; once paused, resumed to the end."""
    CANCEL = "cancel"
    """Native, stopped by a DELETE after a few tokens, in turn: at once after a stream reset
    (the connection stays; the pause captures no KV cells); at once after a connection cut
    (racing a pause that captures them); after a cut, once the pause landed (its KV file must
    go with the session)."""
    SSE_CUT_RESUME = "sse-cut-resume"
    """SSE over TCP, dropped after a few events; resumed by Last-Event-ID over TCP or HTTP/3,
    in turn."""
    SSE_CANCEL = "sse-cancel"
    """SSE over TCP, stopped by a DELETE while it is read: it ends ``cancelled``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SoakSettings:
    max_tokens: int = 48
    """Well above ``cut_after`` plus the allowance's bound (32 tokens past the acknowledged
    ones), so a cut generation pauses before its end, as a rule: a client whose reader lags
    has acknowledged tokens the reader never took, and then it may finish (and is not paused)."""
    cut_after: int = 3
    """Tokens (events) read before a cut, a reset or a DELETE."""
    lanes: int = 3
    """Generations at once."""
    settle_timeout_s: float = 300.0
    """How long a round may take to come to rest, or a cut session to pause (polled; a deadline
    for a failure, not a measurement: 2 shared cores can be slow)."""


_DEFAULTS = SoakSettings()


# --- the census ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessCensus:
    """One process: what its descriptors point at, its threads, its resident memory."""

    pid: int
    fds: tuple[str, ...]
    """``readlink`` of every open descriptor, sockets and pipes without their inode, session
    ids as ``<id>``; sorted."""
    threads: tuple[str, ...]
    """Its threads' names (``/proc/PID/task/*/comm``: the Python name, cut to 15 bytes, in a
    process started by :func:`soak_server`; the process name for the main and native
    threads), sorted."""
    rss_kib: int

    @property
    def rss_mib(self) -> float:
        return self.rss_kib / 1024

    @property
    def fixed_threads(self) -> tuple[str, ...]:
        """Every thread but the event loop's default executor's past its first
        (:data:`POOL_THREAD`)."""
        return tuple(t for t in self.threads if not POOL_THREAD.fullmatch(t))

    @property
    def pool_threads(self) -> int:
        """Threads of the event loop's default executor past its first."""
        return len(self.threads) - len(self.fixed_threads)


def process_census(pid: int) -> ProcessCensus:
    """``pid``'s descriptors, threads and RSS from ``/proc``."""
    fds = []
    for name in _listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        fds.append(_ID.sub("<id>", _INODE.sub(r"\1", target)))
    threads = []
    for task in _listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            threads.append(Path(f"/proc/{pid}/task/{task}/comm").read_text().strip())
    return ProcessCensus(pid, tuple(sorted(fds)), tuple(sorted(threads)), _rss_kib(pid))


@dataclass(frozen=True, slots=True)
class Census:
    """The server, its worker, the worker's spool and the server's KV files, at one moment."""

    server: ProcessCensus
    worker: ProcessCensus
    spool: tuple[str, ...]
    """Files in the worker's spool directory (``phase-N`` while it lives; KV blobs in transit)."""
    kv: tuple[str, ...]
    """Files in ``<data_dir>/kv`` (paused sessions' KV blobs), session ids as ``<id>``."""
    sessions: int
    """Session records on disk (kept until their TTL by design: reported, not compared)."""

    def counts(self) -> dict[str, int]:
        """What must come back to the baseline exactly (threads: but the loop's default
        executor's, which :meth:`differences` checks against its bound)."""
        return {
            "server_fds": len(self.server.fds),
            "server_threads": len(self.server.fixed_threads),
            "worker_fds": len(self.worker.fds),
            "worker_threads": len(self.worker.fixed_threads),
            "spool_files": len(self.spool),
            "kv_files": len(self.kv),
        }

    def pool_threads(self) -> dict[str, int]:
        """The event loops' default executors' threads, per process (reported, bounded)."""
        return {"server": self.server.pool_threads, "worker": self.worker.pool_threads}

    def differences(self, baseline: Census) -> list[str]:
        """What differs from ``baseline``, item by item (empty: nothing)."""
        pairs = [
            ("server fds", self.server.fds, baseline.server.fds),
            ("server threads", self.server.fixed_threads, baseline.server.fixed_threads),
            ("worker fds", self.worker.fds, baseline.worker.fds),
            ("worker threads", self.worker.fixed_threads, baseline.worker.fixed_threads),
            ("spool files", self.spool, baseline.spool),
            ("kv files", self.kv, baseline.kv),
        ]
        lines = []
        for what, now, then in pairs:
            more = Counter(now) - Counter(then)
            fewer = Counter(then) - Counter(now)
            if more or fewer:
                lines.append(
                    f"{what}: {len(then)} -> {len(now)}"
                    + "".join(f"; +{n} {item}" for item, n in sorted(more.items()))
                    + "".join(f"; -{n} {item}" for item, n in sorted(fewer.items()))
                )
        for who, pooled in self.pool_threads().items():
            if pooled > POOL_MAX_THREADS:
                lines.append(f"{who} default executor threads: {pooled} > {POOL_MAX_THREADS}")
        return lines

    def describe(self) -> str:
        return (
            f"server fds {len(self.server.fds)} threads {len(self.server.fixed_threads)}"
            f"+{self.server.pool_threads} rss {self.server.rss_mib:.1f} MiB | worker fds "
            f"{len(self.worker.fds)} threads {len(self.worker.fixed_threads)}"
            f"+{self.worker.pool_threads} rss {self.worker.rss_mib:.1f} MiB | "
            f"spool {len(self.spool)} kv {len(self.kv)} | sessions kept {self.sessions}"
        )


@dataclass(frozen=True, slots=True)
class ServerUnderTest:
    """A running ``quicsrv serve`` seen from outside: where to reach it and what to count."""

    pid: int
    port: int
    data_dir: Path
    certs: DevCertPaths
    worker_pid: int
    spool_dir: Path
    model_id: str = ""
    """What ``/v1/models`` lists (the OpenAI API's requests must name it)."""

    @classmethod
    def find(cls, pid: int, port: int, data_dir: Path, certs: DevCertPaths) -> ServerUnderTest:
        """The server ``pid``'s engine worker is its one child; the worker's spool directory
        is where its ``--phase-file`` lies."""
        children = {
            child
            for task in _listdir(f"/proc/{pid}/task")
            for child in _read(f"/proc/{pid}/task/{task}/children").split()
        }
        if len(children) != 1:
            raise RuntimeError(f"the server {pid} has children {sorted(children)}, not one worker")
        worker = int(children.pop())
        argv = _read(f"/proc/{worker}/cmdline").split("\0")
        phase_file = Path(argv[argv.index("--phase-file") + 1])
        return cls(pid, port, data_dir, certs, worker, phase_file.parent)

    def census(self) -> Census:
        kv_dir = self.data_dir / "kv"
        return Census(
            server=process_census(self.pid),
            worker=process_census(self.worker_pid),
            spool=tuple(sorted(_listdir(str(self.spool_dir)))),
            kv=tuple(sorted(_ID.sub("<id>", name) for name in _listdir(str(kv_dir)))),
            sessions=sum(name.endswith(".meta") for name in _listdir(str(self.sessions_dir))),
        )

    @property
    def sessions_dir(self) -> Path:
        return self.data_dir / "sessions"

    def tcp_connections(self) -> int:
        """The server's TCP sockets that are not listening (connections, open or closing)."""
        inodes = {
            int(target[8:-1])
            for name in _listdir(f"/proc/{self.pid}/fd")
            if (target := _readlink(f"/proc/{self.pid}/fd/{name}")).startswith("socket:[")
        }
        count = 0
        for table in ("tcp", "tcp6"):
            for line in _read(f"/proc/{self.pid}/net/{table}").splitlines()[1:]:
                fields = line.split()
                if int(fields[9]) in inodes and fields[3] != _TCP_LISTEN:
                    count += 1
        return count

    def client(self) -> Client:
        return Client("127.0.0.1", self.port, ca=self.certs.ca_cert)

    def http(self) -> httpx.AsyncClient:
        """A client of the HTTP API over TCP (HTTP/1.1): each a connection of its own."""
        return httpx.AsyncClient(
            base_url=f"https://localhost:{self.port}",
            verify=ssl.create_default_context(cafile=str(self.certs.ca_cert)),
            timeout=_PATIENCE_S,
        )


async def metrics(client: Client) -> dict[str, float]:
    """The server's ``/metrics``, ``name{labels}`` to value."""
    response = await client.get("/metrics", timeout_s=_PATIENCE_S)
    if response.status != 200:
        raise RuntimeError(f"/metrics answered {response.status}")
    values = {}
    for line in response.body.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def at_rest(server: ServerUnderTest, client: Client) -> bool:
    """Whether the server is at rest: no generation running or queued, no live session, no
    KV blob in memory or in transit through the spool, its KV files those its store counts,
    no TCP connection (closed ones included, until the server closed its end)."""
    now = await metrics(client)
    idle = all(
        now.get(name, 0.0) == 0.0
        for name in (
            "quicsrv_generations_active",
            "quicsrv_generations_queued",
            "quicsrv_sessions_live",
            'quicsrv_kv_store_blobs{where="memory"}',
        )
    )
    spool = _listdir(str(server.spool_dir))
    kv_files = _listdir(str(server.data_dir / "kv"))
    return (
        idle
        and all(name.startswith("phase-") for name in spool)
        and len(kv_files) == now.get('quicsrv_kv_store_blobs{where="disk"}', -1.0)
        and server.tcp_connections() == 0
    )


async def settle(
    server: ServerUnderTest, deadline_s: float, baseline: Census | None = None
) -> tuple[Census, float]:
    """Poll until the server is :func:`at_rest` and (given a ``baseline``) its counts are the
    baseline's, or the deadline passes; the census then, and how long it took."""
    started = time.monotonic()
    census = None
    # A connection of its own each time: one kept across a long round would idle out. QUIC
    # connections hold no descriptor in the server (one UDP socket carries them all).
    async with server.client() as client:
        while time.monotonic() - started < deadline_s:
            if await at_rest(server, client):
                census = server.census()
                if baseline is None or census.counts() == baseline.counts():
                    break
            await asyncio.sleep(0.05)  # polling observable state, not waiting for it
    if census is None:
        census = server.census()
    return census, time.monotonic() - started


# --- the generations -------------------------------------------------------------------------


@dataclass
class Tally:
    """What a round's generations did (each must end as planned, or it raises)."""

    kinds: Counter[str] = field(default_factory=Counter)
    resume_paths: Counter[str] = field(default_factory=Counter)
    tokens: int = 0
    resumes: list[ResumeWait] = field(default_factory=list)
    """Each resume's wait for its first token and the server's state then (issue 46)."""


def _scraper(server: ServerUnderTest) -> Callable[[], Awaitable[dict[str, float]]]:
    """A ``/metrics`` scrape of ``server`` on a connection of its own (a resume's watch)."""

    async def scrape() -> dict[str, float]:
        async with server.client() as client:
            return await metrics(client)

    return scrape


async def _complete(server: ServerUnderTest, settings: SoakSettings, tally: Tally, _: int) -> None:
    async with server.client() as client:
        result = await client.generate_text(PROMPT, max_tokens=settings.max_tokens, ignore_eos=True)
    _expect(len(result.token_ids) == settings.max_tokens, f"{len(result.token_ids)} tokens")
    tally.tokens += len(result.token_ids)


async def _cut_resume(
    server: ServerUnderTest, settings: SoakSettings, tally: Tally, _: int
) -> None:
    client = server.client()
    await client.connect()
    generation = client.generate(PROMPT, max_tokens=settings.max_tokens, ignore_eos=True)
    got = 0
    async for event in generation:
        if isinstance(event, TokenReceived):
            got += 1
            if got >= settings.cut_after and generation.position is not None:
                break
    position = generation.position
    await client.aclose()  # the cut: the connection goes, nobody reads
    _expect(position is not None, "no position to resume from")
    assert position is not None
    await _paused(server, position.session_id, settings.settle_timeout_s)
    watch = ResumeWatch(Kind.CUT_RESUME.value, position.session_id, _scraper(server))
    async with server.client() as client:
        async for event in client.resume_from(position):
            if isinstance(event, SessionStarted) and event.resume_path:
                tally.resume_paths[event.resume_path] += 1
            elif isinstance(event, TokenReceived):
                watch.first_token()
                got = event.index + 1
            elif isinstance(event, GenerationEnded):
                _expect(event.completion_tokens == settings.max_tokens, f"{event}")
    tally.resumes.append(await watch.finish())
    tally.tokens += got


async def _cancel(server: ServerUnderTest, settings: SoakSettings, tally: Tally, i: int) -> None:
    client = server.client()
    await client.connect()
    async with client.stream(PROMPT, max_tokens=settings.max_tokens, ignore_eos=True) as generation:
        async for event in generation:
            if isinstance(event, TokenReceived) and event.index + 1 >= settings.cut_after:
                break
        session_id = generation.session_id
        variant = _variant(i, 3)
        if variant > 0:
            await client.aclose()  # the cut: a pause that captures the KV cells
    _expect(session_id is not None, "no session id")
    assert session_id is not None
    if variant == 2:
        await _paused(server, session_id, settings.settle_timeout_s)
    async with server.http() as http:
        stopped = await http.delete(f"/v1/streams/{session_id}")
    await client.aclose()
    _expect(stopped.status_code == 200, f"DELETE answered {stopped.status_code}")
    _expect(stopped.json()["status"] == "cancelled", f"DELETE answered {stopped.json()}")
    tally.tokens += stopped.json()["completion_tokens"]


async def _sse_cut_resume(
    server: ServerUnderTest, settings: SoakSettings, tally: Tally, i: int
) -> None:
    body = _completion_body(server, settings)
    async with server.http() as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            session_id = response.headers["quicsrv-session"]
            ids = []
            async for line in response.aiter_lines():
                if line.startswith("id: "):
                    ids.append(line[4:])
                    if len(ids) >= settings.cut_after:
                        break  # leaving the block unread closes the connection: a cut
    await _paused(server, session_id, settings.settle_timeout_s)
    if _variant(i, 2):
        # The answer comes whole: its wait is to the whole answer, not to the first token.
        kind = f"{Kind.SSE_CUT_RESUME.value} h3 (whole answer)"
        watch = ResumeWatch(kind, session_id, _scraper(server))
        async with server.client() as client:  # the same cursor over HTTP/3
            answer = await client.get(
                f"/v1/streams/{session_id}?last_event_id={ids[-1]}", timeout_s=_PATIENCE_S
            )
        watch.first_token()
        _expect(answer.status == 200, f"resume over HTTP/3 answered {answer.status}")
        lines = answer.body.decode().splitlines()
    else:
        watch = ResumeWatch(f"{Kind.SSE_CUT_RESUME.value} tcp", session_id, _scraper(server))
        async with server.http() as http:
            resumed = http.stream(
                "GET", f"/v1/streams/{session_id}", headers={"last-event-id": ids[-1]}
            )
            async with resumed as response:
                _expect(response.status_code == 200, f"resume answered {response.status_code}")
                lines = []
                async for line in response.aiter_lines():
                    if line.startswith("id: "):
                        watch.first_token()
                    lines.append(line)
    tally.resumes.append(await watch.finish())
    _expect("data: [DONE]" in lines, "the resumed stream did not end with [DONE]")
    tally.tokens += len(ids) + sum(line.startswith("id: ") for line in lines)


async def _sse_cancel(
    server: ServerUnderTest, settings: SoakSettings, tally: Tally, _: int
) -> None:
    body = _completion_body(server, settings)
    lines = []
    async with server.http() as http:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            session_id = response.headers["quicsrv-session"]
            stopped = None
            async for line in response.aiter_lines():
                lines.append(line)
                ids = sum(x.startswith("id: ") for x in lines)
                if stopped is None and ids >= settings.cut_after:
                    stopped = await http.delete(f"/v1/streams/{session_id}")  # another connection
    _expect(stopped is not None and stopped.status_code == 200, f"DELETE answered {stopped}")
    finishes = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines if "finish" in x]
    _expect(finishes[-1:] == ["cancelled"], f"the stream ended {finishes[-1:]}")
    _expect(lines[-2:] == ["data: [DONE]", ""], "the stream did not end with [DONE]")
    tally.tokens += sum(x.startswith("id: ") for x in lines)


_DRIVERS: dict[Kind, Callable[[ServerUnderTest, SoakSettings, Tally, int], Awaitable[None]]] = {
    Kind.COMPLETE: _complete,
    Kind.CUT_RESUME: _cut_resume,
    Kind.CANCEL: _cancel,
    Kind.SSE_CUT_RESUME: _sse_cut_resume,
    Kind.SSE_CANCEL: _sse_cancel,
}


def _completion_body(server: ServerUnderTest, settings: SoakSettings) -> dict[str, Any]:
    return {
        "model": server.model_id,
        "prompt": PROMPT,
        "max_tokens": settings.max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


async def _paused(server: ServerUnderTest, session_id: str, deadline_s: float) -> None:
    """Poll until the session's pause landed (its KV file is written) or it ended."""
    kv_file = server.data_dir / "kv" / f"{session_id}.kv"
    meta = server.sessions_dir / f"{session_id}.meta"
    started = time.monotonic()
    while not kv_file.exists() and not _ended(meta):
        if time.monotonic() - started > deadline_s:
            raise RuntimeError(f"session {session_id} neither paused nor ended in {deadline_s} s")
        await asyncio.sleep(0.01)  # polling observable state, not waiting for it


def _ended(meta: Path) -> bool:
    try:
        return "end" in cbor2.loads(meta.read_bytes())
    except (OSError, ValueError, cbor2.CBORDecodeError):
        return False


def _variant(i: int, variants: int) -> int:
    """Which of its kind's ``variants`` generation ``i`` of a round is: the next one each time
    the kinds come round."""
    return (i // len(Kind)) % variants


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"a generation did not go as planned: {what}")


async def run_round(server: ServerUnderTest, settings: SoakSettings, count: int) -> Tally:
    """``count`` generations, the kinds in turn, ``settings.lanes`` at a time."""
    tally = Tally()
    lanes = asyncio.Semaphore(settings.lanes)
    kinds = list(Kind)

    async def one(i: int) -> None:
        kind = kinds[i % len(kinds)]
        async with lanes:
            await _DRIVERS[kind](server, settings, tally, i)
        tally.kinds[kind] += 1

    async with asyncio.TaskGroup() as group:
        for i in range(count):
            group.create_task(one(i))
    return tally


# --- the soak --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RoundResult:
    round: int
    census: Census
    settle_s: float
    run_s: float
    others_cpu: float
    """Other processes' share of the machine while the round ran (0: none, 1: every core)."""
    tokens: int
    kinds: dict[str, int]
    resume_paths: dict[str, int]
    differences: list[str]
    resume_waits: list[ResumeWait] = field(default_factory=list)
    """Each resume's wait for its first token, and the server's state then and meanwhile."""

    def line(self) -> str:
        paths = ", ".join(f"{p} {n}" for p, n in sorted(self.resume_paths.items())) or "none"
        verdict = "baseline" if self.round == 1 else ("same" if not self.differences else "DIFF")
        return (
            f"round {self.round}: {self.census.describe()} | {self.tokens} tokens in "
            f"{self.run_s:.1f} s (others' CPU {self.others_cpu:.0%}), resumes: {paths}; at rest "
            f"in {self.settle_s:.2f} s: {verdict}\n    {summary(self.resume_waits)}"
        )


def thread_namer(directory: Path) -> str:
    """Write the ``sitecustomize`` that names Python threads for the kernel into
    ``directory``; the ``PYTHONPATH`` that makes a Python process run it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(_NAME_THREADS)
    return os.pathsep.join([str(directory), *filter(None, [os.environ.get("PYTHONPATH")])])


@contextlib.asynccontextmanager
async def soak_server(
    work: Path,
    certs: DevCertPaths,
    *,
    model_path: Path | None = None,
    env: dict[str, str] | None = None,
) -> AsyncIterator[ServerUnderTest]:
    """``quicsrv serve`` with a data dir of its own under ``work`` and the soak's settings
    (``env``: more ``QUICSRV_*`` over them); stopped by SIGTERM at the end."""
    data_dir = work / "data"
    args = ["--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir)]
    args += ["--cert", str(certs.server_cert), "--key", str(certs.server_key)]
    if model_path is not None:
        args += ["--model", str(model_path)]
    env = {**MODEL_SERVER_ENV, "PYTHONPATH": thread_namer(work / "instrument"), **(env or {})}
    async with spawn_server_async(args, env=env, log=work / "server.log") as spawned:
        server = ServerUnderTest.find(spawned.process.pid, spawned.port, data_dir, certs)
        async with server.client() as client:
            models = json.loads((await client.get("/v1/models", timeout_s=_PATIENCE_S)).body)
        yield dataclasses.replace(server, model_id=models["data"][0]["id"])


async def soak(
    server: ServerUnderTest,
    settings: SoakSettings,
    rounds: int,
    per_round: int,
    report: Callable[[RoundResult], None] = lambda _: None,
) -> list[RoundResult]:
    """Run ``rounds`` rounds; round 1's census is the baseline of the others."""
    results: list[RoundResult] = []
    baseline: Census | None = None
    for number in range(1, rounds + 1):
        started = time.monotonic()
        others = CpuMeter([os.getpid(), server.pid])
        tally = await run_round(server, settings, per_round)
        run_s = time.monotonic() - started
        others_cpu = others.stop()
        census, settle_s = await settle(server, settings.settle_timeout_s, baseline)
        differences = [] if baseline is None else census.differences(baseline)
        baseline = baseline or census
        result = RoundResult(
            round=number,
            census=census,
            settle_s=settle_s,
            run_s=run_s,
            others_cpu=others_cpu,
            tokens=tally.tokens,
            kinds=dict(tally.kinds),
            resume_paths=dict(tally.resume_paths),
            differences=differences,
            resume_waits=tally.resumes,
        )
        report(result)
        results.append(result)
    return results


def rss_growth_mib(results: list[RoundResult]) -> dict[str, float]:
    """Each process's RSS growth from the second round to the last (MiB)."""
    second, last = results[1].census, results[-1].census
    return {
        "server": last.server.rss_mib - second.server.rss_mib,
        "worker": last.worker.rss_mib - second.worker.rss_mib,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.soak",
        description="fds, threads, spool and KV files, RSS of the server and its worker, round "
        "after round of generations with cuts, resumes and cancels",
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=30)
    parser.add_argument("--lanes", type=int, default=_DEFAULTS.lanes)
    parser.add_argument("--max-tokens", type=int, default=_DEFAULTS.max_tokens)
    parser.add_argument(
        "--session-ttl-s",
        type=float,
        default=120.0,
        help="the server's session_ttl_s: ended sessions' records go after it (swept every 5 s), "
        "so what a long soak keeps is bounded and its RSS can level off",
    )
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    parser.add_argument(
        "--work",
        type=Path,
        help="keep the server's data dir and log here (default: a temporary one)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (a warm-up, the second round, the last)")
    settings = SoakSettings(lanes=args.lanes, max_tokens=args.max_tokens)

    async def run(work: Path) -> list[RoundResult]:
        certs = ensure_dev_certs(work / "certs")
        retention = {
            "QUICSRV_SESSION_TTL_S": str(args.session_ttl_s),
            "QUICSRV_SESSION_SWEEP_INTERVAL_S": "5",
        }
        async with soak_server(work, certs, env=retention) as server:
            print(
                f"server pid {server.pid}, worker pid {server.worker_pid}, spool "
                f"{server.spool_dir}, {args.rounds} rounds of {args.per_round}",
                flush=True,
            )
            results = await soak(
                server,
                settings,
                args.rounds,
                args.per_round,
                lambda r: print(
                    r.line() + "".join(f"\n    {d}" for d in r.differences), flush=True
                ),
            )
        return results

    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(run(args.work))
    else:
        with tempfile.TemporaryDirectory(prefix="quicsrv-soak-") as tmp:
            results = asyncio.run(run(Path(tmp)))
    growth = rss_growth_mib(results)
    leaked = [r.round for r in results if r.differences]
    grew = [who for who, mib in growth.items() if mib > RSS_GROWTH_BOUND_MIB]
    print(
        f"RSS growth round 2 -> {len(results)}: server {growth['server']:+.1f} MiB, worker "
        f"{growth['worker']:+.1f} MiB (bound {RSS_GROWTH_BOUND_MIB:g} MiB each); counts back to "
        f"the baseline after {len(results) - 1 - len(leaked)}/{len(results) - 1} rounds"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out / f"soak-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "argv": sys.argv[1:] if argv is None else argv,
                "settings": asdict(settings),
                "rss_growth_bound_mib": RSS_GROWTH_BOUND_MIB,
                "rss_growth_mib": growth,
                "rounds": [
                    {
                        **asdict(r),
                        "counts": r.census.counts(),
                        "pool_threads": r.census.pool_threads(),
                    }
                    for r in results
                ],
            }
        )
    )
    print(f"wrote {out}")
    return 1 if leaked or grew else 0


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _rss_kib(pid: int) -> int:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
