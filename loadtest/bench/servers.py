"""Model servers as child processes: started, awaited until they say they listen, stopped.

Readiness is the server's own "listening" line, read from its output as it arrives; the output
is drained into a log file for the whole run so the child never blocks on a full pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quicsrv.settings import engine_settings_for
from quicsrv.spawn import ServerDidNotStart, spawn_server_async

if TYPE_CHECKING:
    from quicsrv.engine.llama import EngineSettings

__all__ = [
    "Child",
    "ServerSettings",
    "llama_cpp_reference_server",
    "llama_cpp_server",
    "quicsrv_server",
]

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0

_UVICORN_READY = re.compile(r"Uvicorn running on https?://\S+:(\d+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class Child:
    """A started server: the port it announced and its process id (for CPU accounting)."""

    port: int
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    """What both servers get, so that they are compared on equal terms."""

    model_path: Path
    n_threads: int = 2
    context_per_sequence: int = 2048
    n_batch: int = 512
    parallel: int = 8
    flash_attn: bool = True
    """Set explicitly everywhere: llama.cpp's "auto" may turn it on, which changes the speed."""
    kv_unified: bool = False
    """Raw loop only: quicsrv keeps it off (a sequence's output would depend on the batch)."""
    cpu_extra_buffers: bool = True
    """llama.cpp's extra CPU weight buffers (AMX); quicsrv's canary decides (``probe``)."""

    def engine_settings(self, **changes: Any) -> EngineSettings:
        """The engine settings these make, with ``changes`` (the in-process rows)."""
        return engine_settings_for(
            self.model_path,
            n_seq_max=self.parallel,
            context_per_sequence=self.context_per_sequence,
            n_batch=self.n_batch,
            n_threads=self.n_threads,
            flash_attn=self.flash_attn,
            kv_unified=self.kv_unified,
            cpu_extra_buffers=self.cpu_extra_buffers,
            **changes,
        )


async def _drain(
    stream: asyncio.StreamReader,
    log: Path,
    pattern: re.Pattern[str],
    announced: asyncio.Future[int],
) -> None:
    """Copy ``stream`` to ``log`` until EOF; the first ``pattern`` match resolves the port."""
    with log.open("w") as out:
        async for raw in stream:
            line = raw.decode("utf-8", "replace")
            out.write(line)
            out.flush()
            if not announced.done() and (match := pattern.search(line)):
                announced.set_result(int(match.group(1)))


@contextlib.asynccontextmanager
async def _child(
    argv: Sequence[str], log: Path, ready: re.Pattern[str], cwd: Path | None = None
) -> AsyncIterator[Child]:
    """Run ``argv``; yield it once it announces its port; SIGTERM (then SIGKILL) on the way out."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert process.stdout is not None
    announced: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    drain = asyncio.create_task(_drain(process.stdout, log, ready, announced))
    exited = asyncio.create_task(process.wait())
    try:
        done, _ = await asyncio.wait(
            {announced, exited}, timeout=STARTUP_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
        )
        if announced not in done:
            why = f"exited with {process.returncode}" if exited in done else "did not start"
            raise RuntimeError(f"{argv[0]} {why} within {STARTUP_TIMEOUT_S:.0f}s; see {log}")
        yield Child(port=announced.result(), pid=process.pid)
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(exited), STOP_TIMEOUT_S)
            except TimeoutError:
                process.kill()
        await exited
        await drain


@contextlib.asynccontextmanager
async def quicsrv_server(
    settings: ServerSettings,
    cert: Path,
    key: Path,
    log: Path,
    *,
    prefill_chunk: int | None = None,
    tree: Path | None = None,
    per_client_caps: bool = False,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Child]:
    """``quicsrv serve`` on 127.0.0.1 with an ephemeral UDP port; with ``tree``, the quicsrv of
    that checkout (``python -m`` imports from the working directory first). Without
    ``per_client_caps`` the one client of a load run may take every slot and queue place.
    ``env``: more ``QUICSRV_*`` settings, over these."""
    args = [
        "--host=127.0.0.1",
        "--port=0",
        f"--model={settings.model_path}",
        f"--cert={cert}",
        f"--key={key}",
        f"--parallel={settings.parallel}",
        f"--ctx={settings.context_per_sequence}",
        f"--threads={settings.n_threads}",
    ]
    # Variables, not flags: an older checkout (``tree``) ignores the keys it does not know.
    variables = {
        "QUICSRV_FLASH_ATTN": str(settings.flash_attn).lower(),
        "QUICSRV_CPU_EXTRA_BUFFERS": "on" if settings.cpu_extra_buffers else "off",
    }
    if not per_client_caps:
        # A load run puts every stream on one connection, which is one client: let it have
        # every slot and queue place, as the engine-only rows do.
        variables["QUICSRV_MAX_ACTIVE_PER_CLIENT"] = str(settings.parallel)
        variables["QUICSRV_MAX_QUEUED_PER_CLIENT"] = "1000000"
    if prefill_chunk is not None:
        variables["QUICSRV_PREFILL_CHUNK_TOKENS"] = str(prefill_chunk)
    # A data dir of its own beside its log: one server process per data dir (it is locked),
    # and two servers of one checkout must not share sessions.
    variables["QUICSRV_DATA_DIR"] = str(log.resolve().with_name(f"{log.stem}-data"))
    variables.update(env or {})
    log.unlink(missing_ok=True)
    started = spawn_server_async(
        args,
        env=variables,
        cwd=tree,
        log=log,
        start_timeout_s=STARTUP_TIMEOUT_S,
        stop_timeout_s=STOP_TIMEOUT_S,
    )
    try:
        async with started as server:
            yield Child(port=server.port, pid=server.process.pid)
    except ServerDidNotStart as exc:
        raise RuntimeError(
            f"quicsrv did not start within {STARTUP_TIMEOUT_S:.0f}s; see {log}"
        ) from exc


def llama_cpp_server_argv(settings: ServerSettings, *, interrupt_requests: bool) -> list[str]:
    """``python -m llama_cpp.server`` with the same model, threads, batch and context.

    It decodes one sequence at a time (no ``n_seq_max``), so its context is one sequence's
    budget. ``logits_all`` is turned off (quicsrv computes only the logits it samples) and
    ``verbose`` too (no timing print per request): its best settings, not its defaults.
    """
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(settings.model_path),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--n_ctx",
        str(settings.context_per_sequence),
        "--n_batch",
        str(settings.n_batch),
        "--n_ubatch",
        str(settings.n_batch),
        "--n_threads",
        str(settings.n_threads),
        "--n_threads_batch",
        str(settings.n_threads),
        "--flash_attn",
        str(settings.flash_attn),
        "--logits_all",
        "False",
        "--verbose",
        "False",
        "--interrupt_requests",
        str(interrupt_requests),
    ]


@contextlib.asynccontextmanager
async def llama_cpp_server(
    settings: ServerSettings, log: Path, *, interrupt_requests: bool
) -> AsyncIterator[Child]:
    """llama-cpp-python's OpenAI-compatible server on 127.0.0.1, on an ephemeral TCP port."""
    argv = llama_cpp_server_argv(settings, interrupt_requests=interrupt_requests)
    async with _child(argv, log, _UVICORN_READY) as child:
        yield child


def llama_cpp_reference_argv(settings: ServerSettings) -> list[str]:
    """:mod:`loadtest.bench.llama_cpp_reference` (llama-cpp-python's ``Llama`` with OpenAI's
    echo log-probabilities) with the same model, threads, batch, context and kernels."""
    return [
        sys.executable,
        "-m",
        "loadtest.bench.llama_cpp_reference",
        f"--model={settings.model_path}",
        "--port=0",
        f"--ctx={settings.context_per_sequence}",
        f"--batch={settings.n_batch}",
        f"--threads={settings.n_threads}",
        "--flash-attn" if settings.flash_attn else "--no-flash-attn",
        f"--extra-buffers={'on' if settings.cpu_extra_buffers else 'off'}",
    ]


@contextlib.asynccontextmanager
async def llama_cpp_reference_server(settings: ServerSettings, log: Path) -> AsyncIterator[Child]:
    """The reference on 127.0.0.1, plain HTTP, an ephemeral port (see its module)."""
    from loadtest.bench.llama_cpp_reference import READY_PATTERN

    argv = llama_cpp_reference_argv(settings)
    async with _child(argv, log, re.compile(READY_PATTERN)) as child:
        yield child
