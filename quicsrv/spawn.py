"""Start ``quicsrv serve`` as a process and wait until it listens: the one way tests, benchmarks
and the demo do it.

The server prints ``quicsrv listening on HOST:PORT (...)`` once every socket is bound (with
``--port 0`` that line is the only way to learn the port), so nothing sleeps: the caller gets
the process and its port when that line arrives, or an error with the log's tail when the
process exits first. A thread keeps reading the server's output (to a log file and to an
optional callback) so the pipe never fills. Leaving the context sends SIGTERM (a graceful
shutdown) and waits, then kills the server's whole process group.

The other side of a start: a process quicsrv starts (a ``--workers`` server, an engine worker)
calls :func:`die_with_parent` first, so that not even a kill -9 of its parent leaves it running.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "LISTENING",
    "ServerDidNotStart",
    "SpawnedServer",
    "die_with_parent",
    "spawn_server",
    "spawn_server_async",
]

LISTENING = re.compile(r"listening on \S+:(\d+)")


class ServerDidNotStart(RuntimeError):
    """The process exited, or never said it listens, within the time allowed."""


@dataclass(eq=False)
class SpawnedServer:
    process: subprocess.Popen[str]
    port: int
    log: Path | None
    """Everything the server wrote (stdout and stderr), when a log file was asked for."""
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    """The last lines it wrote, for error messages."""


@contextlib.contextmanager
def spawn_server(
    args: Sequence[str],
    *,
    prefix: Sequence[str] = (),
    log: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    start_timeout_s: float = 600.0,
    stop_timeout_s: float = 30.0,
) -> Iterator[SpawnedServer]:
    """``quicsrv serve ARGS`` (under ``prefix``, e.g. ``ip netns exec NS``) until the block
    ends. ``on_line`` sees every line the server writes, on the reading thread; ``cwd`` is
    where ``python -m`` imports quicsrv from first (another checkout, for a comparison). The
    block may stop the process itself (another signal, to check its exit status)."""
    command = [*prefix, sys.executable, "-m", "quicsrv.cli", "serve", *args]
    # Opened first, not on the reading thread: a log that cannot be opened is an error here,
    # not a thread that dies and a start waited for until its timeout.
    sink = open(log, "a") if log is not None else None  # noqa: SIM115 - closed by read()
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        # Its own process group: whatever it starts (``--workers`` processes, engine workers)
        # can be killed with it, so that none outlives the block holding the output pipe.
        start_new_session=True,
    )
    lines: deque[str] = deque(maxlen=200)
    listening = threading.Event()
    found: list[int] = []

    def read() -> None:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                lines.append(line)
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                if on_line is not None:
                    on_line(line)
                if not found and (match := LISTENING.search(line)):
                    found.append(int(match.group(1)))
                    listening.set()
        finally:
            if sink is not None:
                sink.close()
            listening.set()  # the process ended: wake the waiter

    reader = threading.Thread(target=read, name="quicsrv-output", daemon=True)
    reader.start()
    try:
        if not listening.wait(start_timeout_s) or not found:
            tail = "".join(list(lines)[-20:])
            raise ServerDidNotStart(f"quicsrv serve did not start ({command!r}):\n{tail}")
        yield SpawnedServer(process=process, port=found[0], log=log, lines=lines)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(process.pid)
                process.wait()
        reader.join(stop_timeout_s)
        if reader.is_alive():
            # A descendant still holds the pipe open (the server died and left it behind):
            # kill the group, or the read below never ends, nor the close, which waits for it.
            _kill_group(process.pid)
            reader.join(stop_timeout_s)
        if process.stdout is not None and not reader.is_alive():
            process.stdout.close()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.asynccontextmanager
async def spawn_server_async(
    args: Sequence[str], **options: object
) -> AsyncIterator[SpawnedServer]:
    """:func:`spawn_server` for a coroutine: the waits run on a thread, not on the loop."""
    manager = spawn_server(args, **options)  # type: ignore[arg-type]
    server = await asyncio.to_thread(manager.__enter__)
    try:
        yield server
    finally:
        await asyncio.to_thread(manager.__exit__, None, None, None)


def die_with_parent(signum: signal.Signals) -> None:
    """Ask Linux to send this process ``signum`` when its parent dies, a kill -9 included
    (``PR_SET_PDEATHSIG``: strictly, when the parent's *thread* that started it ends); nothing
    on other systems."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
    except OSError:
        pass
