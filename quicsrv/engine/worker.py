"""The engine worker process: llama.cpp lives here, so its crash is not the server's.

Started by :class:`~quicsrv.engine.supervisor.WorkerEngine` as ``python -m quicsrv.engine.worker
--fd N --phase-file PATH``: a fresh interpreter (no fork of a threaded server, and unlike
``multiprocessing``'s spawn, no re-import of the caller's ``__main__``), talking over an inherited
socket wrapped in a ``multiprocessing`` Connection. Its first message is :class:`WorkerOptions`. It
loads the model, runs the start-up canary, says :class:`~.ipc.Ready`, then runs a
:class:`~.llama.LlamaEngine`: the main thread applies the server's commands, the engine thread
decodes and sends its :class:`~.ipc.Step` messages when :mod:`.coalescing` says they are due. Every
exit path is explicit: the server's pipe closing (EOF) or a ``Stop`` exits cleanly, a failed
engine thread exits with :data:`EXIT_ENGINE_FAILED`, and a native crash is a signal the
supervisor reads from the exit code.

Test-only fault switches (``QUICSRV_TEST_FAULT``, comma-separated), so the tests can provoke what
otherwise only a broken CPU or build does:

* ``canary-crash`` - SIGSEGV inside the canary's decode while CPU extra buffers are on;
* ``decode-crash:N`` - SIGSEGV at the N-th decode after Ready while extra buffers are on;
* ``hang:N`` - the first worker to get ready hangs at its N-th decode after Ready (on a CPU
  whose canary crashes, that is the safe-mode worker after it);
* ``decode-error:N`` - the first ready worker's N-th decode after Ready raises, as a failed
  ``llama_decode`` does;
* ``decode-abort:N`` - every worker aborts (SIGABRT) at its N-th decode after Ready: a crash loop;
  ``decode-abort:N:M``: only the workers before incarnation M do (the M-th one recovers);
* ``poison:TEXT`` - every worker aborts (SIGABRT, extra buffers on or off) at each decode while
  it holds a sequence whose prompt contains TEXT: one request that kills whoever runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import mmap
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..logs import log_handler
from ..spawn import die_with_parent
from ._api import (
    EngineError,
    FinishReason,
    PausedState,
    PrefillPlan,
    ResumePath,
    SamplingParams,
    SequenceHandle,
    SequenceRequest,
    TokenLogprobs,
)
from .coalescing import StepCoalescer
from .ipc import (
    Allow,
    Cancel,
    Command,
    Event,
    Pause,
    PrefixHeld,
    PromptScored,
    Ready,
    SequenceCommand,
    SequenceFinished,
    SequencePaused,
    SequencePlanned,
    SequenceResumed,
    Step,
    Stop,
    Submit,
    TokenGenerated,
    WorkerPhase,
)
from .llama import EngineObserver, EngineSettings, LlamaEngine
from .spool import out_path

__all__ = ["EXIT_CANARY_FAILED", "EXIT_ENGINE_FAILED", "WorkerOptions", "main", "run_worker"]

log = logging.getLogger("quicsrv.engine.worker")

EXIT_ENGINE_FAILED = 70  # the engine thread raised (e.g. llama_decode returned an error)
EXIT_CANARY_FAILED = 71  # the canary returned, but wrong (no tokens, or timed out)
FAULT_ENV = "QUICSRV_TEST_FAULT"
CANARY_TIMEOUT_S = 120.0
_CANARY_TEXT = "The quick brown fox jumps over the lazy dog, then runs back home again."


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOptions:
    settings: EngineSettings
    spool_dir: Path
    incarnation: int
    replaces_ready: bool
    """An earlier worker of this engine got ready (the one-shot test faults spare this one)."""
    token_coalesce_s: float
    """How long a token may wait to share a message with the next ones (:mod:`.coalescing`)."""
    log_level: int = logging.INFO
    log_format: str = "plain"  # or "json", as the server logs (quicsrv.logs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m quicsrv.engine.worker")
    parser.add_argument("--fd", type=int, required=True, help="the server's socket")
    parser.add_argument("--phase-file", type=Path, required=True, help="one byte, mmap'ed")
    args = parser.parse_args(argv)
    conn = Connection(args.fd)
    try:
        options: WorkerOptions = conn.recv()
    except (EOFError, OSError):
        os._exit(0)
    with open(args.phase_file, "r+b") as f:
        phase = _Phase(mmap.mmap(f.fileno(), 1))
    run_worker(conn, options, phase)


class _Phase:
    """The worker's :class:`WorkerPhase` in a shared page: still readable after its death."""

    def __init__(self, page: mmap.mmap) -> None:
        self._page = page

    @property
    def value(self) -> int:
        return self._page[0]

    @value.setter
    def value(self, phase: int) -> None:
        self._page[0] = phase


def run_worker(conn: Connection, options: WorkerOptions, phase: Any) -> None:
    """Serve the engine (``phase``: anything with a writable ``value``)."""
    if options.log_format == "json":
        logging.basicConfig(level=options.log_level, handlers=[log_handler("json")])
    else:
        logging.basicConfig(
            level=options.log_level,
            format=f"%(asctime)s engine-worker[{os.getpid()}] %(name)s %(message)s",
        )
    faulthandler.enable()  # a native crash prints the Python stack it happened under
    die_with_parent(signal.SIGKILL)  # no worker outlives its server
    faults = _Faults.from_env(options)
    worker = _Worker(conn, options, phase, faults)
    worker.serve()


class _Worker:
    def __init__(self, conn: Connection, options: WorkerOptions, phase: Any, faults: _Faults):
        self._conn = conn
        self._options = options
        self._phase = phase
        self._faults = faults
        # Held from taking the pending events until they are sent: messages leave in order.
        self._send_lock = threading.Lock()
        self._events_lock = threading.Lock()  # the engine thread reports; rarely the others
        self._events: list[Event] = []
        self._coalescer = StepCoalescer(options.token_coalesce_s)  # under the send lock
        # A paused sequence's KV blob (MBs) is written here, not on the decode thread.
        self._blob_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-blob")
        self._handles: dict[int, SequenceHandle] = {}
        self._poisoned: set[int] = set()  # keys of sequences the ``poison`` fault aborts on
        self._reporting = False  # steps are reported from Ready on (the canary's are not)
        self._engine: LlamaEngine | None = None

    def serve(self) -> None:
        settings = self._options.settings
        started = time.monotonic()
        self._phase.value = WorkerPhase.LOADING
        engine = self._engine = LlamaEngine(settings, _Observer(self))
        loaded = time.monotonic()
        log.info(
            "model loaded in %.2fs (cpu extra buffers %s)",
            loaded - started,
            "on" if settings.cpu_extra_buffers else "off",
        )
        self._phase.value = WorkerPhase.CANARY
        _canary(engine)
        canary_s = time.monotonic() - loaded
        self._phase.value = WorkerPhase.IDLE
        self._reporting = True
        self._send(
            Ready(
                os.getpid(),
                settings.cpu_extra_buffers,
                loaded - started,
                canary_s,
                engine.prefix_stats.enabled,
            )
        )
        while True:
            try:
                commands: list[Command] = self._conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the server is gone: nobody to generate for
            for command in commands:
                if isinstance(command, Stop):
                    engine.close()
                    self._blob_writer.shutdown(wait=True)
                    os._exit(0)
                self._apply(engine, command)

    def _apply(self, engine: LlamaEngine, command: SequenceCommand) -> None:
        if isinstance(command, Submit):
            request = _with_blob(command.request, command.kv_file)
            sink = _Sink(self, command.key)
            if self._faults.poisons(engine, request.prompt_tokens):
                self._poisoned.add(command.key)
            try:
                self._handles[command.key] = engine.submit(request, sink)
            except EngineError as exc:  # the server checked the same limits: a bug, not a peer
                log.error("sequence %d refused by the engine: %s", command.key, exc)
                self._report(SequenceFinished(command.key, FinishReason.FAILED, 0))
            return
        handle = self._handles.get(command.key)
        if handle is None:
            return  # it finished or paused meanwhile; the server learns that from the events
        if isinstance(command, Allow):
            handle.allow(command.n_tokens)
        elif isinstance(command, Pause):
            handle.pause(capture_kv=command.capture_kv)
        elif isinstance(command, Cancel):
            handle.cancel()

    # --- engine thread ------------------------------------------------------------------

    def _report(self, event: Event) -> None:
        with self._events_lock:
            self._events.append(event)

    def step_finished(self) -> None:
        self._hand_on(self._coalescer.step_finished)

    def call_finished(self) -> None:
        """What a call reported before the step's next calls: sent now if it must not wait
        (:meth:`.coalescing.StepCoalescer.call_finished`)."""
        self._hand_on(self._coalescer.call_finished)

    def _hand_on(self, coalesce: Callable[[Step], list[Step] | None]) -> None:
        """What was reported so far, as a step, to the coalescer; sent if it says so."""
        if not self._reporting:
            return
        with self._send_lock:
            due = coalesce(Step(self._take_events(), time.monotonic()))
            if due:
                self._send_locked(due)

    def planned(self, key: int, plan: PrefillPlan) -> None:
        self._report(SequencePlanned(key, plan))
        self.held(key)

    def held(self, key: int) -> None:
        """Report what the prefix cache holds (it changes when sequences come and go)."""
        if self._engine is not None and self._engine.prefix_stats.enabled:
            stats = self._engine.prefix_stats
            self._report(
                PrefixHeld(
                    key,
                    stats.resident_tokens,
                    stats.blob_bytes,
                    stats.disk_bytes,
                    stats.shelf_dropped,
                )
            )

    def paused(self, key: int, state: PausedState) -> None:
        self.forget(key)
        self.held(key)
        if state.kv_state is None:
            self._report(SequencePaused(key, state.generated, None))
        else:
            self._blob_writer.submit(self._pass_blob_on, key, state.generated, state.kv_state)

    def decode_started(self) -> None:
        self._phase.value = WorkerPhase.DECODING if self._reporting else WorkerPhase.CANARY
        self._faults.before_decode(canary=not self._reporting, poisoned=bool(self._poisoned))

    def decode_finished(self) -> None:
        self._phase.value = WorkerPhase.IDLE if self._reporting else WorkerPhase.CANARY

    def forget(self, key: int) -> None:
        self._handles.pop(key, None)
        self._poisoned.discard(key)

    # --- the blob writer's thread --------------------------------------------------------

    def _pass_blob_on(self, key: int, generated: tuple[int, ...], blob: bytes) -> None:
        path = out_path(self._options.spool_dir, self._options.incarnation, key, len(generated))
        kv_file: str | None = str(path)
        try:
            path.write_bytes(blob)
        except OSError as exc:  # the server rebuilds the cells by exact replay instead
            log.warning("cannot write KV blob %s: %s", path, exc)
            path.unlink(missing_ok=True)
            kv_file = None
        # Sent now, with whatever the current step reported so far: the engine may be idle.
        self._report(SequencePaused(key, generated, kv_file))
        self._send_pending()

    # --- any thread ---------------------------------------------------------------------

    def _send_pending(self) -> None:
        with self._send_lock:
            self._send_locked(self._coalescer.send_now(Step(self._take_events(), time.monotonic())))

    def _take_events(self) -> tuple[Event, ...]:
        with self._events_lock:
            events, self._events = self._events, []
        return tuple(events)

    def _send(self, message: object) -> None:
        with self._send_lock:
            self._send_locked(message)

    def _send_locked(self, message: object) -> None:
        try:
            self._conn.send(message)
        except (OSError, EOFError):
            os._exit(0)  # the server is gone


class _Observer(EngineObserver):
    def __init__(self, worker: _Worker) -> None:
        self._worker = worker

    def decode_started(self) -> None:
        self._worker.decode_started()

    def decode_finished(self) -> None:
        self._worker.decode_finished()

    def step_finished(self) -> None:
        self._worker.step_finished()

    def tokens_sampled(self) -> None:
        self._worker.call_finished()

    def engine_failed(self, error: BaseException) -> None:
        # The engine logged the traceback. Exit without reporting the sequences' FAILED ends:
        # the supervisor restarts the worker and they continue by exact replay.
        logging.shutdown()
        os._exit(EXIT_ENGINE_FAILED)


class _Sink:
    """One sequence's TokenSink inside the worker: events go to the current step's message."""

    def __init__(self, worker: _Worker, key: int) -> None:
        self._worker = worker
        self._key = key

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: TokenLogprobs | None
    ) -> None:
        self._worker._report(TokenGenerated(self._key, index, token_id, piece, logprobs))

    def prompt_scored(
        self, logprobs: tuple[TokenLogprobs, ...], ended: tuple[int, TokenLogprobs] | None
    ) -> None:
        self._worker._report(PromptScored(self._key, logprobs, ended))

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self._worker.forget(self._key)
        self._worker._report(SequenceFinished(self._key, reason, completion_tokens))
        self._worker.held(self._key)

    def sequence_paused(self, state: PausedState) -> None:
        self._worker.paused(self._key, state)

    def sequence_resumed(self, path: ResumePath) -> None:
        self._worker._report(SequenceResumed(self._key, path))

    def sequence_planned(self, plan: PrefillPlan) -> None:
        self._worker.planned(self._key, plan)


def _with_blob(request: SequenceRequest, kv_file: str | None) -> SequenceRequest:
    if kv_file is None or request.resume is None:
        return request
    path = Path(kv_file)
    try:
        blob = path.read_bytes()
    except OSError as exc:  # without its blob the sequence is rebuilt by exact replay
        log.warning("KV blob %s unreadable (%s); replaying instead", kv_file, exc)
        return request
    finally:
        path.unlink(missing_ok=True)
    return dataclasses.replace(request, resume=dataclasses.replace(request.resume, kv_state=blob))


class _CanarySink:
    def __init__(self, done: threading.Semaphore) -> None:
        self._done = done
        self.tokens = 0
        self.reason: FinishReason | None = None

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: TokenLogprobs | None
    ) -> None:
        self.tokens += 1

    def prompt_scored(
        self, logprobs: tuple[TokenLogprobs, ...], ended: tuple[int, TokenLogprobs] | None
    ) -> None:
        pass

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self.reason = reason
        self._done.release()

    def sequence_paused(self, state: PausedState) -> None:
        self._done.release()

    def sequence_resumed(self, path: ResumePath) -> None:
        pass

    def sequence_planned(self, plan: PrefillPlan) -> None:
        pass


def _canary(engine: LlamaEngine) -> None:
    """Decode what crashes a broken build at once: a multi-token prompt, then a batch of several
    sequences in one ``llama_decode``. A crash here kills the process before Ready."""
    prompt = tuple(engine.tokenize(_CANARY_TEXT, add_special=True))
    chunk = max(2, len(prompt) // 2)  # at least two multi-token prefill batches per sequence
    count = min(4, engine.settings.n_seq_max)
    done = threading.Semaphore(0)
    sinks = [_CanarySink(done) for _ in range(count)]
    for sink in sinks:
        request = SequenceRequest(
            prompt_tokens=prompt,
            max_tokens=4,
            sampling=SamplingParams(),
            ignore_eos=True,
            prefill_chunk=chunk,
            # In chunks, even alone: several multi-token batches per sequence.
            prefill_plan=PrefillPlan.plain(len(prompt), chunk),
        )
        engine.submit(request, sink)
    deadline = time.monotonic() + CANARY_TIMEOUT_S
    for _ in sinks:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            log.error("canary: no result within %.0fs", CANARY_TIMEOUT_S)
            os._exit(EXIT_CANARY_FAILED)
    if any(s.reason is not FinishReason.LENGTH or s.tokens != 4 for s in sinks):
        log.error("canary: sequences ended %s", [(s.reason, s.tokens) for s in sinks])
        os._exit(EXIT_CANARY_FAILED)


class _Faults:
    """The test-only switches of the module docstring, bound to this worker."""

    def __init__(
        self,
        *,
        canary_crash: bool = False,
        crash_at: int = 0,
        hang_at: int = 0,
        error_at: int = 0,
        abort_at: int = 0,
        poison: bytes = b"",
    ) -> None:
        self._canary_crash = canary_crash
        self._crash_at = crash_at
        self._hang_at = hang_at
        self._error_at = error_at
        self._abort_at = abort_at
        self._poison = poison
        self._decodes = 0  # since Ready

    @classmethod
    def from_env(cls, options: WorkerOptions) -> _Faults:
        spec = os.environ.get(FAULT_ENV, "")
        if not spec:
            return cls()
        canary_crash, crash_at, hang_at, error_at, abort_at = False, 0, 0, 0, 0
        poison = b""
        for item in spec.split(","):
            name, _, count = item.strip().partition(":")
            if name == "canary-crash":
                canary_crash = True
            elif name == "decode-crash":
                crash_at = int(count)
            elif name == "hang":
                hang_at = int(count)
            elif name == "decode-error":
                error_at = int(count)
            elif name == "decode-abort":
                at, _, until = count.partition(":")
                if not until or options.incarnation < int(until):
                    abort_at = int(at)
            elif name == "poison":
                poison = count.encode()
            else:
                raise ValueError(f"{FAULT_ENV}: unknown fault {name!r}")
        extra_buffers = options.settings.cpu_extra_buffers
        log.warning("test faults armed: %s (cpu extra buffers %s)", spec, extra_buffers)
        if not extra_buffers:  # the crashes model a kernel that only the extra buffers use
            canary_crash, crash_at = False, 0
        if options.replaces_ready:
            hang_at, error_at = 0, 0
        return cls(
            canary_crash=canary_crash,
            crash_at=crash_at,
            hang_at=hang_at,
            error_at=error_at,
            abort_at=abort_at,
            poison=poison,
        )

    def poisons(self, engine: LlamaEngine, prompt_tokens: tuple[int, ...]) -> bool:
        """Whether a prompt holds the ``poison`` fault's text."""
        if not self._poison:
            return False
        return self._poison in b"".join(engine.piece(t) for t in prompt_tokens)

    def before_decode(self, *, canary: bool, poisoned: bool = False) -> None:
        if canary:
            if self._canary_crash:
                os.kill(os.getpid(), signal.SIGSEGV)
            return
        self._decodes += 1
        if self._decodes == self._crash_at:
            os.kill(os.getpid(), signal.SIGSEGV)
        if self._decodes == self._abort_at:
            os.abort()
        if poisoned:
            log.warning("test fault: a poisoned sequence is in the batch")
            os.abort()
        if self._decodes == self._hang_at:
            log.warning("test fault: hanging in decode")
            threading.Event().wait()
        if self._decodes == self._error_at:
            raise RuntimeError("test fault: llama_decode failed")


if __name__ == "__main__":
    main()
