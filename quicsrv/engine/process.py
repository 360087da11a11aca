"""One engine worker process as the supervisor sees it: its start, its messages, its end.

:meth:`WorkerProcess.start` spawns ``python -m quicsrv.engine.worker`` and waits for its Ready
(or its end); :meth:`WorkerProcess.watch` delivers its step messages (or lets an event loop read
them) until it dies or hangs; :meth:`WorkerProcess.end` reaps it and says how it ended, as a
:class:`WorkerEnd`. What to do about an end is :mod:`.restarts`'s and the supervisor's business.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from .ipc import Ready, WorkerPhase
from .spool import phase_path
from .worker import EXIT_CANARY_FAILED, EXIT_ENGINE_FAILED, WorkerOptions

__all__ = ["WorkerEnd", "WorkerProcess"]

log = logging.getLogger("quicsrv.engine")

#: Signals of a fault in native code (a bad instruction, address or operand), as opposed to a
#: kill from outside (SIGKILL by the OOM killer or an operator, SIGTERM).
_FAULT_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})

_PHASE_WORDS = {
    WorkerPhase.LOADING: "while loading the model",
    WorkerPhase.CANARY: "in the start-up canary",
    WorkerPhase.IDLE: "between decode steps",
    WorkerPhase.DECODING: "inside llama_decode",
}


@dataclass(frozen=True, slots=True)
class WorkerEnd:
    """How a worker ended."""

    exitcode: int | None
    phase: WorkerPhase
    killed_for: str = ""  # why the supervisor killed it, if it did
    who: str = "engine worker"

    @property
    def signal(self) -> signal.Signals | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode)
        except ValueError:
            return None

    @property
    def kernel_fault(self) -> bool:
        """A fault while llama.cpp computed: the crash the extra buffers are known for."""
        return self.signal in _FAULT_SIGNALS and self.phase in (
            WorkerPhase.CANARY,
            WorkerPhase.DECODING,
        )

    def describe(self) -> str:
        if self.killed_for:
            how = f"killed by the supervisor: {self.killed_for}"
        elif self.signal is not None:
            how = f"died of {self.signal.name}"
        elif self.exitcode == EXIT_ENGINE_FAILED:
            how = "exited: the engine thread failed (traceback above)"
        elif self.exitcode == EXIT_CANARY_FAILED:
            how = "exited: the canary decoded wrongly"
        else:
            how = f"exited with status {self.exitcode}"
        return f"{how} {_PHASE_WORDS[self.phase]}"


#: Called with each message the worker sent after Ready, and whether an event loop read it.
Deliver = Callable[[object, bool], None]


@dataclass(eq=False)
class WorkerProcess:
    """One running worker."""

    incarnation: int
    process: subprocess.Popen[bytes]
    conn: Connection
    phase_file: Path
    cpu_extra_buffers: bool
    deliver: Deliver
    ready: Ready | None = None
    reader: asyncio.AbstractEventLoop | None = None
    """The event loop reading this worker's messages; None: the supervisor thread reads."""
    ended: threading.Event = field(default_factory=threading.Event)
    """Set by the reading loop when the worker's end of the socket closed."""

    @classmethod
    def start(
        cls,
        options: WorkerOptions,
        *,
        start_timeout_s: float,
        closing: Callable[[], bool],
        deliver: Deliver,
    ) -> WorkerProcess | WorkerEnd:
        """Spawn a worker and wait for its Ready: the running worker, or how it ended."""
        incarnation = options.incarnation
        extra_buffers = options.settings.cpu_extra_buffers
        phase_file = phase_path(options.spool_dir, incarnation)
        phase_file.write_bytes(bytes([WorkerPhase.LOADING]))
        ours, theirs = socket.socketpair()
        started = time.monotonic()
        with theirs:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "quicsrv.engine.worker",
                    "--fd",
                    str(theirs.fileno()),
                    "--phase-file",
                    str(phase_file),
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        # Theirs is closed here, so the worker's death reads as EOF on ours.
        conn = Connection(ours.detach())
        worker = cls(incarnation, process, conn, phase_file, extra_buffers, deliver)
        log.info(
            "engine worker %d starting (pid %d, cpu extra buffers %s)",
            incarnation,
            process.pid,
            "on" if extra_buffers else "off",
        )
        try:
            conn.send(options)
        except OSError:
            return worker.end()
        deadline = started + start_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or closing():
                worker.kill()
                return worker.end("closing" if closing() else "not ready in time")
            if not conn.poll(min(remaining, 1.0)):
                continue
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return worker.end()
            if isinstance(message, Ready):
                worker.ready = message
                log.info(
                    "engine worker %d ready (pid %d): model loaded in %.2fs, canary %.2fs, "
                    "cpu extra buffers %s",
                    incarnation,
                    message.pid,
                    message.load_s,
                    message.canary_s,
                    "on" if message.cpu_extra_buffers else "off (safe mode)",
                )
                return worker

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def end(self, killed_for: str = "") -> WorkerEnd:
        """Reap the worker (killed, or about to exit) and say how it ended."""
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.conn.close()
        try:
            phase = WorkerPhase(self.phase_file.read_bytes()[0])
            self.phase_file.unlink()
        except (OSError, IndexError, ValueError):
            phase = WorkerPhase.LOADING
        who = f"engine worker {self.incarnation} (pid {self.process.pid})"
        return WorkerEnd(self.process.returncode, phase, killed_for, who)

    def watch(
        self,
        *,
        stall_timeout_s: float,
        stalled_for: Callable[[], float | None],
        delivery_loop: Callable[[], asyncio.AbstractEventLoop | None],
        closing: Callable[[], bool],
    ) -> WorkerEnd:
        """Deliver the worker's messages (or let the event loop ``delivery_loop()`` read them)
        until the worker dies, or makes no step for ``stall_timeout_s`` while it holds work
        (``stalled_for()``: how long it has not, None when it holds none) and is killed."""
        tick = min(1.0, stall_timeout_s / 4)
        while True:
            if self.reader is None:
                self._hand_reading_to(delivery_loop(), closing())
            if self.reader is not None:
                if self.ended.wait(tick):
                    return self.end()
                if self.reader.is_closed():  # its selector went with it: read here again
                    self.reader = None
                    continue
                if closing() and self.process.poll() is not None:
                    return self.end()  # the loop is busy closing us: nobody reads the EOF
            elif self.conn.poll(tick):
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    return self.end()
                self.deliver(message, False)
                continue
            idle_for = stalled_for()
            if idle_for is not None and idle_for > stall_timeout_s:
                log.error(
                    "engine worker %d made no step in %.1fs while it held work; killing it",
                    self.incarnation,
                    idle_for,
                )
                self.kill()
                if self.reader is not None:
                    self.ended.wait(10)  # the loop reads what came before the EOF
                return self.end(f"no decode step in {idle_for:.1f}s (hung)")

    def take_over_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        """``loop`` (the caller's, running) reads from now on, if the loop that read the worker
        is gone (and its selector with it): nobody would read until the supervisor's next
        tick. The supervisor thread only reads while ``reader`` is None."""
        reader = self.reader
        if reader is not None and reader is not loop and reader.is_closed():
            self.reader = loop
            loop.call_soon(self._start_reading, loop)

    def _hand_reading_to(self, loop: asyncio.AbstractEventLoop | None, closing: bool) -> None:
        if loop is None or loop.is_closed() or closing:
            return
        self.reader = loop
        try:
            loop.call_soon_threadsafe(self._start_reading, loop)
        except RuntimeError:  # closed meanwhile
            self.reader = None

    # --- the event loop, once it reads the worker -----------------------------------------

    def _start_reading(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.reader is not loop or self.ended.is_set():
            return
        try:
            loop.add_reader(self.conn.fileno(), self._read_on_loop, self.conn.fileno())
        except (OSError, ValueError):  # the worker is gone already
            self.ended.set()

    def _read_on_loop(self, fd: int) -> None:
        # Steps are a few hundred bytes sent in one write: a readable socket holds whole ones.
        # One message per call: the selector calls again while more are buffered, and a
        # ``poll()`` to look first would build a selector of its own every time.
        try:
            message = self.conn.recv()
            self.deliver(message, True)
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(fd)
            self.ended.set()
