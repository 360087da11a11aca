"""The engine as the server sees it: llama.cpp in a supervised worker process.

:class:`WorkerEngine` implements the :class:`~._api.Engine` protocol in the server process with
the model's vocabulary only (tokenizing, pieces, chat template: no weights, no compute kernels).
Decoding happens in a worker process (:mod:`.worker`), so a native crash, an OOM kill or a failed
``llama_decode`` costs a restart, not the server.

Two threads of its own, neither of them the event loop's, and its callers:

* the **supervisor** starts workers and watches them: a worker that exits, is killed, or makes
  no step progress for ``stall_timeout_s`` while it holds work is replaced. Once the server
  names its event loop (:meth:`WorkerEngine.deliver_on`), that loop reads the worker's step
  messages itself and calls the sinks there: a step's tokens then reach the sessions with one
  wake-up of the loop, not a wake-up of this thread plus a cross-thread hand-off. Without a
  running loop (before one is named, after it closed) this thread reads and delivers;
* the **sender** sends the commands gathered since its last send as one message, and writes the
  KV blobs of resumed sequences to the spool directory on the way;
* the callers' ``submit``/``cancel``/``pause``/``allow`` (on the event loop) only append to that
  outbox.

When a worker dies, every sequence it held is reported *paused without KV cells*; the sessions
then resume them through their ordinary path (exact replay, or KV restore for a session whose
blob was saved at an earlier pause), so a client sees a delay and nothing else. Restarts are
bounded (``max_restarts`` per ``restart_window_s``); past that the engine fails: its sequences
finish with :attr:`FinishReason.FAILED` and new work is refused with :class:`EngineUnavailable`.

The start-up canary (see :mod:`.worker`) decides the safe mode: with ``cpu_extra_buffers=auto``
a worker that dies in the canary (or of a fault signal before it is ready) with the extra
buffers on is restarted without them, and so is one that dies of a fault signal inside
``llama_decode`` twice in a row.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

from ..logs import current_log_format
from ._api import (
    CpuExtraBuffers,
    EngineError,
    EngineUnavailable,
    FinishReason,
    PausedState,
    SequenceRequest,
    TokenSink,
)
from .ipc import (
    Allow,
    Cancel,
    Command,
    Pause,
    Ready,
    SequenceFinished,
    SequencePaused,
    SequenceResumed,
    Step,
    Stop,
    Submit,
    TokenGenerated,
    WorkerPhase,
)
from .llama import EngineSettings, ModelFacts, check_admission, check_request
from .vocab import Vocabulary
from .worker import EXIT_CANARY_FAILED, EXIT_ENGINE_FAILED, WorkerOptions

__all__ = ["SupervisorSettings", "WorkerEngine", "probe_cpu_extra_buffers"]

log = logging.getLogger("quicsrv.engine")

#: Signals of a fault in native code (a bad instruction, address or operand), as opposed to a
#: kill from outside (SIGKILL by the OOM killer or an operator, SIGTERM).
_FAULT_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})
_ADMISSION_UNLIMITED = 1 << 30  # the worker's own limit: the server process admits


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorSettings:
    """Derived from :class:`quicsrv.config.ServerConfig` (``supervisor_settings()``)."""

    cpu_extra_buffers: CpuExtraBuffers
    start_timeout_s: float
    """Model load plus canary; a worker not ready by then is killed and counts as a crash."""
    stall_timeout_s: float
    """No decode step for this long while the worker holds work: it hangs, and is replaced."""
    max_restarts: int
    restart_window_s: float
    """More than ``max_restarts`` restarts within this window is a crash loop: give up."""
    token_coalesce_s: float
    """How long a generated token may wait in the worker for the next ones (``.coalescing``)."""
    spool_dir: Path | None = None
    """Where KV blobs pass between the processes; None: a fresh directory in /dev/shm."""


_PHASE_WORDS = {
    WorkerPhase.LOADING: "while loading the model",
    WorkerPhase.CANARY: "in the start-up canary",
    WorkerPhase.IDLE: "between decode steps",
    WorkerPhase.DECODING: "inside llama_decode",
}


@dataclass(frozen=True, slots=True)
class _Death:
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


@dataclass(eq=False)
class _Link:
    """One running worker."""

    incarnation: int
    process: subprocess.Popen[bytes]
    conn: Connection
    phase_file: Path
    cpu_extra_buffers: bool
    reader: asyncio.AbstractEventLoop | None = None
    """The event loop reading this worker's messages; None: the supervisor thread reads."""
    ended: threading.Event = field(default_factory=threading.Event)
    """Set by the reading loop when the worker's end of the socket closed."""

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def death(self, killed_for: str = "") -> _Death:
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
        return _Death(self.process.returncode, phase, killed_for, who)


@dataclass(eq=False)
class _RemoteSequence:
    """A sequence the worker runs, as the server sees it: a SequenceHandle."""

    key: int
    engine: WorkerEngine
    sink: TokenSink
    history: list[int]  # every token of the sequence: the resumed ones, then what it generated
    admitted: bool = True
    cancelled: bool = False
    allowed: int = -(1 << 62)  # none sent yet

    def cancel(self) -> None:
        self.cancelled = True
        self.engine._post(self, Cancel(self.key), release=True)

    def pause(self, *, capture_kv: bool = True) -> None:
        self.engine._post(self, Pause(self.key, capture_kv), release=True)

    def allow(self, n_tokens: int) -> None:
        # Called on every ACK; the session moves the allowance in steps, so only a change is
        # worth a message (each wakes the worker's command thread mid-decode).
        if n_tokens != self.allowed:
            self.allowed = n_tokens
            self.engine._post(self, Allow(self.key, n_tokens), release=False)


class WorkerEngine(ModelFacts):
    """See the module docstring."""

    def __init__(self, settings: EngineSettings, supervision: SupervisorSettings) -> None:
        self.settings = settings
        self.supervision = supervision
        self.vocabulary = Vocabulary.load(settings.model_path)
        self._spool = Path(tempfile.mkdtemp(prefix="quicsrv-kv-", dir=_spool_parent(supervision)))
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._sequences: dict[int, _RemoteSequence] = {}
        self._outbox: list[Command] = []
        self._blobs: dict[int, bytes] = {}  # KV blobs of queued Submits, written by the sender
        self._link: _Link | None = None
        self._keys = itertools.count()
        self._incarnations = itertools.count()
        self._admitted = 0
        self._closing = False
        self._failure: str | None = None
        self._progress_at = time.monotonic()
        self._restart_times: deque[float] = deque()
        self._kernel_faults_in_a_row = 0
        self._delivery_loop: asyncio.AbstractEventLoop | None = None
        self._extra_buffers = supervision.cpu_extra_buffers is not CpuExtraBuffers.OFF
        self._first_ready = threading.Event()
        self.restarts = 0
        self.deaths: deque[str] = deque(maxlen=100)  # why workers ended, oldest first
        self.tokens_generated_total = 0
        self.on_step: Callable[[list[int], float], None] | None = None
        """Told, once per decode step that sampled tokens, whose sequences got one and when the
        step ended (``time.monotonic()``; metrics)."""
        self.last_ready: Ready | None = None
        # Workers are started from the supervisor thread only: Linux's parent-death signal
        # (the worker's safety net) fires when the *thread* that started it exits.
        self._supervisor = threading.Thread(
            target=self._supervise, name="engine-supervisor", daemon=True
        )
        self._sender = threading.Thread(target=self._send_loop, name="engine-sender", daemon=True)
        self._supervisor.start()
        self._first_ready.wait()
        if self._link is None:
            self.close()
            raise EngineUnavailable(f"the engine worker could not start: {self._failure}")
        self._sender.start()

    # --- the Engine protocol (the rest comes from ModelFacts) -----------------------------

    def submit(self, request: SequenceRequest, sink: TokenSink) -> _RemoteSequence:
        """Queue a sequence for the worker; raises PromptTooLong, Overloaded or
        EngineUnavailable at once. While a worker restarts, it waits in the outbox."""
        check_request(self.settings, request)
        resume = request.resume
        with self._lock:
            if self._failure is not None:
                raise EngineUnavailable(f"the engine failed: {self._failure}")
            if self._closing:
                raise EngineError("the engine is shutting down")
            check_admission(self.settings, self._admitted)
            self._admitted += 1
            key = next(self._keys)
            sequence = _RemoteSequence(
                key, self, sink, list(resume.generated) if resume is not None else []
            )
            if not self._sequences:
                self._progress_at = time.monotonic()  # the stall clock starts with the work
            self._sequences[key] = sequence
            if resume is not None and resume.kv_state is not None:
                self._blobs[key] = resume.kv_state
                request = dataclasses.replace(
                    request, resume=dataclasses.replace(resume, kv_state=None)
                )
            self._outbox.append(Submit(key, request))
            self._changed.notify_all()
        return sequence

    def deliver_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the worker's messages on ``loop`` from now on (the supervisor thread hands
        over at its next wake-up)."""
        self._delivery_loop = loop
        link = self._link
        reader = link.reader if link is not None else None
        if link is not None and reader is not None and reader is not loop and reader.is_closed():
            # The loop that read the worker is gone (and its selector with it): nobody reads
            # until the supervisor thread's next tick, so the new loop takes over now. This is
            # the new loop's thread; the supervisor only reads when ``reader`` is None.
            link.reader = loop
            loop.call_soon(self._start_reading, link, loop)

    def close(self) -> None:
        """Stop the worker; sequences still running finish with SHUTDOWN."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._outbox.append(Stop())
            self._changed.notify_all()
            link = self._link
        if self._sender.is_alive():
            self._sender.join(timeout=10)
        if link is not None:
            try:
                link.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                link.kill()
        if self._supervisor.is_alive() and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=30)
        with self._lock:
            leftovers = list(self._sequences.values())
            self._sequences.clear()
        for sequence in leftovers:
            sequence.sink.sequence_finished(FinishReason.SHUTDOWN, len(sequence.history))
        shutil.rmtree(self._spool, ignore_errors=True)
        self.vocabulary.close()

    # --- what tests and stats read ------------------------------------------------------

    @property
    def worker_pid(self) -> int | None:
        link = self._link
        return link.process.pid if link is not None else None

    @property
    def cpu_extra_buffers(self) -> bool:
        """Whether the running worker uses llama.cpp's extra CPU buffers (False: safe mode)."""
        return self._extra_buffers

    @property
    def reading_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that reads the running worker's messages (None: the supervisor)."""
        link = self._link
        return link.reader if link is not None else None

    @property
    def failure(self) -> str | None:
        return self._failure

    # --- handles' commands (any thread) -------------------------------------------------

    def _post(self, sequence: _RemoteSequence, command: Command, *, release: bool) -> None:
        with self._lock:
            if release:
                # Like the in-process engine: a cancelled or pausing sequence gives its place
                # back at once, so the next request is queued rather than refused.
                self._release(sequence)
            if self._sequences.get(sequence.key) is not sequence:
                return  # already ended, or handed back by a dead worker
            self._outbox.append(command)
            self._changed.notify_all()

    def _release(self, sequence: _RemoteSequence) -> None:
        """With the lock held."""
        if sequence.admitted:
            sequence.admitted = False
            self._admitted -= 1

    # --- the sender thread --------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._changed:
                while not (self._outbox and (self._link is not None or self._closing)):
                    self._changed.wait()
                batch, self._outbox = self._outbox, []
                blobs = {
                    c.key: self._blobs.pop(c.key)
                    for c in batch
                    if isinstance(c, Submit) and c.key in self._blobs
                }
                link = self._link
            if link is None:
                return  # closing while no worker runs
            commands = [self._with_blob_file(c, blobs, link) for c in _latest_allowances(batch)]
            try:
                link.conn.send(commands)
            except (OSError, EOFError, ValueError):
                pass  # the worker died: the supervisor hands its sequences back for a resume
            if any(isinstance(c, Stop) for c in commands):
                return

    def _with_blob_file(self, command: Command, blobs: dict[int, bytes], link: _Link) -> Command:
        if not isinstance(command, Submit) or command.key not in blobs:
            return command
        path = self._spool / f"in-{link.incarnation}-{command.key}.kv"
        try:
            path.write_bytes(blobs[command.key])
        except OSError as exc:  # the worker then rebuilds the cells by exact replay
            log.warning("could not spool a KV blob (%s); the sequence will replay", exc)
            return command
        return dataclasses.replace(command, kv_file=str(path))

    # --- the supervisor thread ----------------------------------------------------------

    def _supervise(self) -> None:
        link = self._bring_up()
        with self._lock:
            self._link = link
        self._first_ready.set()
        while link is not None:
            death = self._watch(link)
            if self._closing:
                return
            link = self._replace(link, death)

    def _bring_up(self) -> _Link | None:
        """Start workers until one is ready; None once the restart budget is spent."""
        while not self._closing:
            outcome = self._spawn()
            if isinstance(outcome, _Link):
                return outcome
            reason = f"{outcome.who} {outcome.describe()} before it was ready"
            self.deaths.append(reason)
            log.error("%s", reason)
            if (
                self._extra_buffers
                and self.supervision.cpu_extra_buffers is CpuExtraBuffers.AUTO
                and (outcome.phase is WorkerPhase.CANARY or outcome.kernel_fault)
            ):
                self._extra_buffers = False
                log.warning(
                    "SAFE MODE: the start-up canary crashed the engine worker (%s) with "
                    "llama.cpp's extra CPU buffers on (AMX / repacked weights, known to fault "
                    "in batched matmul on some Xeons); restarting with use_extra_bufts=False. "
                    'Set cpu_extra_buffers = "off" to skip the canary\'s retry.',
                    outcome.describe(),
                )
                continue
            if not self._may_restart():
                self._fail(reason)
                return None
        return None

    def _spawn(self) -> _Link | _Death:
        incarnation = next(self._incarnations)
        settings = dataclasses.replace(
            self.settings,
            cpu_extra_buffers=self._extra_buffers,
            max_queued=_ADMISSION_UNLIMITED,
        )
        options = WorkerOptions(
            settings=settings,
            spool_dir=self._spool,
            incarnation=incarnation,
            token_coalesce_s=self.supervision.token_coalesce_s,
            log_level=logging.getLogger().getEffectiveLevel(),
            log_format=current_log_format(),
        )
        phase_file = self._spool / f"phase-{incarnation}"
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
        link = _Link(incarnation, process, conn, phase_file, self._extra_buffers)
        log.info(
            "engine worker %d starting (pid %d, cpu extra buffers %s)",
            incarnation,
            process.pid,
            "on" if self._extra_buffers else "off",
        )
        try:
            conn.send(options)
        except OSError:
            return link.death()
        deadline = started + self.supervision.start_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closing:
                link.kill()
                return link.death("closing" if self._closing else "not ready in time")
            if not conn.poll(min(remaining, 1.0)):
                continue
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return link.death()
            if isinstance(message, Ready):
                self.last_ready = message
                log.info(
                    "engine worker %d ready (pid %d): model loaded in %.2fs, canary %.2fs, "
                    "cpu extra buffers %s",
                    incarnation,
                    message.pid,
                    message.load_s,
                    message.canary_s,
                    "on" if message.cpu_extra_buffers else "off (safe mode)",
                )
                return link

    def _watch(self, link: _Link) -> _Death:
        """Deliver the worker's events (or let the event loop do it) until the worker dies,
        or hangs and is killed."""
        stall = self.supervision.stall_timeout_s
        tick = min(1.0, stall / 4)
        conn = link.conn
        while True:
            if link.reader is None:
                self._hand_reading_to_loop(link)
            if link.reader is not None:
                if link.ended.wait(tick):
                    return link.death()
                if link.reader.is_closed():  # its selector went with it: read here again
                    link.reader = None
                    continue
                if self._closing and link.process.poll() is not None:
                    return link.death()  # the loop is busy closing us: nobody reads the EOF
            elif conn.poll(tick):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    return link.death()
                self._progress_at = time.monotonic()
                self._deliver_steps(message)
                continue
            with self._lock:
                busy = bool(self._sequences)
                idle_for = time.monotonic() - self._progress_at
            if busy and idle_for > stall:
                log.error(
                    "engine worker %d made no step in %.1fs while it held work; killing it",
                    link.incarnation,
                    idle_for,
                )
                link.kill()
                if link.reader is not None:
                    link.ended.wait(10)  # the loop reads what came before the EOF
                return link.death(f"no decode step in {idle_for:.1f}s (hung)")

    def _hand_reading_to_loop(self, link: _Link) -> None:
        loop = self._delivery_loop
        if loop is None or loop.is_closed() or self._closing:
            return
        link.reader = loop
        try:
            loop.call_soon_threadsafe(self._start_reading, link, loop)
        except RuntimeError:  # closed meanwhile
            link.reader = None

    # --- the event loop, once it reads the worker -----------------------------------------

    def _start_reading(self, link: _Link, loop: asyncio.AbstractEventLoop) -> None:
        if link.reader is not loop or link.ended.is_set():
            return
        try:
            loop.add_reader(link.conn.fileno(), self._read_on_loop, link, link.conn.fileno())
        except (OSError, ValueError):  # the worker is gone already
            link.ended.set()

    def _read_on_loop(self, link: _Link, fd: int) -> None:
        # Steps are a few hundred bytes sent in one write: a readable socket holds whole ones.
        # One message per call: the selector calls again while more are buffered, and a
        # ``poll()`` to look first would build a selector of its own every time.
        try:
            message = link.conn.recv()
            self._progress_at = time.monotonic()
            self._deliver_steps(message, on_loop=True)
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(fd)
            link.ended.set()

    def _deliver_steps(self, message: object, *, on_loop: bool = False) -> None:
        if isinstance(message, list):  # after Ready, every message is the steps that are due
            for step in message:
                self._deliver(step, on_loop=on_loop)

    def _deliver(self, step: Step, *, on_loop: bool = False) -> None:
        stepped: list[int] = []
        for event in step.events:
            with self._lock:
                sequence = self._sequences.get(event.key)
                if sequence is not None and isinstance(event, SequenceFinished | SequencePaused):
                    del self._sequences[event.key]
                    self._release(sequence)
            if isinstance(event, SequencePaused):
                if on_loop and event.kv_file is not None:
                    # Reading MBs of KV blob is no work for the event loop. Nothing of this
                    # sequence follows its pause, so the delivery may come later.
                    asyncio.get_running_loop().run_in_executor(
                        None, _deliver_pause, sequence, event
                    )
                else:
                    _deliver_pause(sequence, event)
            elif sequence is None:
                continue
            elif isinstance(event, TokenGenerated):
                sequence.history.append(event.token_id)
                self.tokens_generated_total += 1
                stepped.append(event.key)
                sequence.sink.token_generated(event.index, event.token_id, event.piece)
            elif isinstance(event, SequenceFinished):
                sequence.sink.sequence_finished(event.reason, event.completion_tokens)
            elif isinstance(event, SequenceResumed):
                sequence.sink.sequence_resumed(event.path)
        if stepped and self.on_step is not None:
            self.on_step(stepped, step.finished_at)

    def _replace(self, link: _Link, death: _Death) -> _Link | None:
        """A running worker ended: hand its sequences back, then start another."""
        reason = f"{death.who} {death.describe()}"
        self.deaths.append(reason)
        with self._lock:
            self._link = None
            victims = list(self._sequences.values())
            self._sequences.clear()
            self._outbox.clear()
            self._blobs.clear()
            for sequence in victims:
                self._release(sequence)
        log.error(
            "%s; %d generation(s) continue from their tokens after a restart", reason, len(victims)
        )
        for prefix in ("in", "out"):  # blobs the dead worker never passed on
            for orphan in self._spool.glob(f"{prefix}-{link.incarnation}-*.kv"):
                orphan.unlink(missing_ok=True)
        self._hand_back(victims)
        if death.kernel_fault and self._extra_buffers:
            self._kernel_faults_in_a_row += 1
        else:
            self._kernel_faults_in_a_row = 0
        if (
            self._kernel_faults_in_a_row >= 2
            and self.supervision.cpu_extra_buffers is CpuExtraBuffers.AUTO
        ):
            self._extra_buffers = False
            log.warning(
                "SAFE MODE: the engine worker faulted inside llama_decode twice in a row with "
                "llama.cpp's extra CPU buffers on; restarting with use_extra_bufts=False"
            )
        if not self._may_restart():
            self._fail(reason)
            return None
        started = time.monotonic()
        new = self._bring_up()
        if new is None:
            return None
        with self._lock:
            self._link = new
            self._progress_at = time.monotonic()
            self._changed.notify_all()
        self.restarts += 1
        log.info("engine worker replaced in %.2fs", time.monotonic() - started)
        return new

    def _hand_back(self, sequences: list[_RemoteSequence]) -> None:
        """Tell the sinks of a dead worker's sequences: paused without KV (they will resume),
        or finished, for those that were cancelled anyway."""
        for sequence in sequences:
            if sequence.cancelled:
                sequence.sink.sequence_finished(FinishReason.CANCELLED, len(sequence.history))
            else:
                state = PausedState(generated=tuple(sequence.history), kv_state=None)
                sequence.sink.sequence_paused(state)

    def _may_restart(self) -> bool:
        now = time.monotonic()
        window = self.supervision.restart_window_s
        while self._restart_times and self._restart_times[0] < now - window:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.supervision.max_restarts:
            return False
        self._restart_times.append(now)
        return True

    def _fail(self, reason: str) -> None:
        """Crash loop: give up; every sequence ends FAILED, new work is refused."""
        with self._lock:
            self._failure = (
                f"{self.supervision.max_restarts} worker restarts within "
                f"{self.supervision.restart_window_s:.0f}s; last: {reason}"
            )
            victims = list(self._sequences.values())
            self._sequences.clear()
            self._outbox.clear()
            for sequence in victims:
                self._release(sequence)
            self._changed.notify_all()
        log.error(
            "ENGINE FAILED: %s. Generations end with engine_unavailable (their sessions stay "
            "resumable); new requests are refused until the server restarts.",
            self._failure,
        )
        for sequence in victims:
            ending = FinishReason.CANCELLED if sequence.cancelled else FinishReason.FAILED
            sequence.sink.sequence_finished(ending, len(sequence.history))


def _latest_allowances(batch: list[Command]) -> list[Command]:
    """Drop every allowance that a later one for the same sequence replaces: a message holds
    at most one per sequence, however many ACKs arrived since the last send."""
    seen: set[int] = set()
    kept: list[Command] = []
    for command in reversed(batch):
        if isinstance(command, Allow):
            if command.key in seen:
                continue
            seen.add(command.key)
        kept.append(command)
    kept.reverse()
    return kept


def probe_cpu_extra_buffers(settings: EngineSettings, supervision: SupervisorSettings) -> bool:
    """Whether llama.cpp's extra CPU buffers survive the canary on this machine.

    A worker process takes the risk, so that a tool that then runs llama.cpp in its own process
    (a benchmark, a unit test) can choose the safe setting without crashing first.
    """
    engine = WorkerEngine(settings, supervision)
    try:
        return engine.cpu_extra_buffers
    finally:
        engine.close()


def _deliver_pause(sequence: _RemoteSequence | None, event: SequencePaused) -> None:
    kv = _take_blob(event.kv_file)
    if sequence is not None:
        sequence.sink.sequence_paused(PausedState(generated=event.generated, kv_state=kv))


def _take_blob(kv_file: str | None) -> bytes | None:
    if kv_file is None:
        return None
    path = Path(kv_file)
    try:
        return path.read_bytes()
    except OSError as exc:  # the session then resumes by exact replay
        log.warning("KV blob %s unreadable: %s", kv_file, exc)
        return None
    finally:
        path.unlink(missing_ok=True)


def _spool_parent(supervision: SupervisorSettings) -> str | None:
    if supervision.spool_dir is not None:
        supervision.spool_dir.mkdir(parents=True, exist_ok=True)
        return str(supervision.spool_dir)
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and _writable(shm) else None


def _writable(directory: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False
