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
  KV blobs of resumed sequences to the spool directory on the way (:mod:`.outbox`);
* the callers' ``submit``/``cancel``/``pause``/``allow`` (on the event loop) only append to that
  outbox.

When a worker dies, every sequence it held is reported *paused without KV cells*; the sessions
then resume them through their ordinary path (exact replay, or KV restore for a session whose
blob was saved at an earlier pause), so a client sees a delay and nothing else. Two pure
policies decide what else a death means:

* :mod:`.suspects` attributes it to the generations in the batch: one that keeps killing the
  worker (``poison_strikes`` deaths in a row, the last with no other suspect) ends alone with
  :attr:`FinishReason.POISONED` (``engine_unavailable``) and is refused from then on, while its
  neighbours resume; generations that died together too often resume one at a time to find it
  (the others' submits wait here meanwhile, never in the worker). The watch at run time, what
  it holds back and the log line of each conviction: :mod:`.quarantine`;
* :mod:`.restarts` decides restart, safe mode, give up or the breaker: more than
  ``max_restarts`` per ``restart_window_s`` opens it (every sequence finishes FAILED, new work
  is refused with :class:`EngineUnavailable` and a retry hint), after ``breaker_cooldown_s``
  one worker is tried (half-open) and ``breaker_probation_steps`` decode steps close it again;
  its death doubles the cool-down. Giving up is left for a worker that never got ready once.
  Its state at run time, and the log line of each move: :mod:`.breaker`.

The start-up canary (see :mod:`.worker`) decides the safe mode: with ``cpu_extra_buffers=auto``
a worker that dies in the canary (or of a fault signal before it is ready) with the extra
buffers on is restarted without them, and so is one that dies of a fault signal inside
``llama_decode`` twice in a row. One worker's start, messages and end: :mod:`.process`; the
directory KV blobs pass through: :mod:`.spool`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ..config import CpuExtraBuffers
from ..logs import current_log_format
from ._api import (
    CannotReplay,
    EngineError,
    EngineHealth,
    EngineUnavailable,
    FinishReason,
    PausedState,
    SequenceRequest,
    StepListener,
    TokenSink,
)
from .breaker import RestartKeeper
from .ipc import (
    Allow,
    Cancel,
    Command,
    Pause,
    PrefixHeld,
    PromptScored,
    Ready,
    SequenceFinished,
    SequencePaused,
    SequencePlanned,
    SequenceResumed,
    Step,
    Stop,
    Submit,
    TokenGenerated,
)
from .llama import EngineSettings, ModelFacts
from .outbox import Outbox
from .prefix_cache import PrefixStats
from .process import WorkerEnd, WorkerProcess
from .quarantine import Quarantine
from .request_checks import check_admission, check_request
from .restarts import Action, Breaker, RestartPolicy
from .sampling import GrammarViolation, check_replay
from .spool import Spool, take
from .vocab import Vocabulary
from .worker import WorkerOptions

__all__ = ["SupervisorSettings", "WorkerEngine", "probe_cpu_extra_buffers"]

log = logging.getLogger("quicsrv.engine")

_ADMISSION_UNLIMITED = 1 << 30  # the worker's own limit: the server process admits
_NONE_ALLOWED = -(1 << 62)  # a handle's allowance before the session gave one


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
    """More than ``max_restarts`` restarts within this window is a crash loop: the breaker
    opens."""
    breaker_cooldown_s: float
    """An open breaker tries a worker again after this long (doubling after each failed try)."""
    breaker_max_cooldown_s: float
    breaker_probation_steps: int
    """Decode steps a half-open breaker's worker makes before the breaker closes."""
    poison_strikes: int
    """Worker deaths in a row that convict a generation, the last with no other suspect."""
    token_coalesce_s: float
    """How long a generated token may wait in the worker for the next ones (``.coalescing``)."""
    spool_dir: Path | None = None
    """Where KV blobs pass between the processes; None: a fresh directory in /dev/shm."""

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(
            max_restarts=self.max_restarts,
            window_s=self.restart_window_s,
            cooldown_s=self.breaker_cooldown_s,
            max_cooldown_s=self.breaker_max_cooldown_s,
            probation_steps=self.breaker_probation_steps,
            auto_safe_mode=self.cpu_extra_buffers is CpuExtraBuffers.AUTO,
        )


@dataclass(eq=False)
class _RemoteSequence:
    """A sequence the worker runs, as the server sees it: a SequenceHandle."""

    key: int
    who: int  # the generation across its resumes: its sink's id (the PoisonWatch's name)
    engine: WorkerEngine
    sink: TokenSink
    history: list[int]  # every token of the sequence: the resumed ones, then what it generated
    admitted: bool = True
    cancelled: bool = False
    allowed: int = _NONE_ALLOWED
    held: Submit | None = None
    """Its Submit, while the poison watch holds it back (see .quarantine)."""

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
        self.vocabulary = Vocabulary.load(settings.model_path, settings.chat_template)
        self._spool = Spool(supervision.spool_dir)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._sequences: dict[int, _RemoteSequence] = {}
        self._outbox = Outbox()
        self._link: WorkerProcess | None = None
        self._keys = itertools.count()
        self._incarnations = itertools.count()
        self._admitted = 0
        self._closing = False
        self._progress_at = time.monotonic()
        self._restarts = RestartKeeper(
            supervision.restart_policy(),
            extra_buffers=supervision.cpu_extra_buffers is not CpuExtraBuffers.OFF,
            budget=f"{supervision.max_restarts} worker restarts within "
            f"{supervision.restart_window_s:g}s",
        )
        self._quarantine: Quarantine[_RemoteSequence] = Quarantine(supervision.poison_strikes)
        self._delivery_loop: asyncio.AbstractEventLoop | None = None
        self._first_ready = threading.Event()
        self.restarts = 0
        self.worker_deaths = 0
        self.breaker_opens = 0
        self.poisoned_generations = 0  # generations convicted of killing the worker, failed alone
        self.deaths: deque[str] = deque(maxlen=100)  # why workers ended, oldest first
        self.tokens_generated_total = 0
        self.on_step: StepListener | None = None
        self.last_ready: Ready | None = None
        self.prefix_stats = PrefixStats(enabled=settings.prefix_cache)
        """The worker's prefix cache, from its SequencePlanned events (metrics)."""
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
            raise EngineUnavailable(f"the engine worker could not start: {self._restarts.gave_up}")
        self._sender.start()

    # --- the Engine protocol (the rest comes from ModelFacts) -----------------------------

    def submit(self, request: SequenceRequest, sink: TokenSink) -> _RemoteSequence:
        """Queue a sequence for the worker; raises PromptTooLong, Overloaded or
        EngineUnavailable at once. While a worker restarts, it waits in the outbox."""
        check_request(self.settings, request)
        resume = request.resume
        if request.grammar is not None and resume is not None and resume.generated:
            # Here, not in the worker: llama.cpp aborts the process on a forbidden token.
            try:
                check_replay(self.vocabulary.handle, request.grammar, resume.generated)
            except GrammarViolation as exc:
                raise CannotReplay(f"the recorded tokens do not fit the grammar: {exc}") from None
        who = id(sink)
        with self._lock:
            self._refuse_if_down()
            if self._closing:
                raise EngineError("the engine is shutting down")
            if self._quarantine.convicted(who, sink):
                raise EngineUnavailable(
                    "this generation kept killing the engine worker; it is not run again"
                )
            check_admission(self.settings, self._admitted)
            self._admitted += 1
            key = next(self._keys)
            sequence = _RemoteSequence(
                key, who, self, sink, list(resume.generated) if resume is not None else []
            )
            self._sequences[key] = sequence
            if resume is not None and resume.kv_state is not None:
                self._outbox.attach(key, resume.kv_state)
                request = dataclasses.replace(
                    request, resume=dataclasses.replace(resume, kv_state=None)
                )
            if self._quarantine.arrived(sequence):
                self._send_locked(sequence, Submit(key, request))
            else:
                sequence.held = Submit(key, request)
                self._send_released_locked()
        return sequence

    def deliver_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the worker's messages on ``loop`` from now on (the supervisor thread hands
        over at its next wake-up)."""
        self._delivery_loop = loop
        link = self._link
        if link is not None:
            link.take_over_reading(loop)

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
            self._quarantine.clear()
        for sequence in leftovers:
            sequence.sink.sequence_finished(FinishReason.SHUTDOWN, len(sequence.history))
        self._spool.remove()
        self.vocabulary.close()

    def health(self) -> EngineHealth:
        return EngineHealth(
            failure=self.failure,
            restarting=self._link is None,
            restarts=self.restarts,
            breaker=self.breaker,
            worker_deaths=self.worker_deaths,
            breaker_opens=self.breaker_opens,
            poisoned_generations=self.poisoned_generations,
            prefix_cache=dataclasses.replace(self.prefix_stats),
            cpu_extra_buffers=self.cpu_extra_buffers,
            threads=self.settings.n_threads,
            worker_pid=self.worker_pid,
        )

    # --- what tests and stats read ------------------------------------------------------

    @property
    def worker_pid(self) -> int | None:
        link = self._link
        return link.process.pid if link is not None else None

    @property
    def cpu_extra_buffers(self) -> bool:
        """Whether the running worker uses llama.cpp's extra CPU buffers (False: safe mode)."""
        return self._restarts.extra_buffers

    @property
    def reading_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that reads the running worker's messages (None: the supervisor)."""
        link = self._link
        return link.reader if link is not None else None

    @property
    def breaker(self) -> Breaker:
        """Closed (restarts within the budget), open (a crash loop: new work refused until a
        cool-down ends) or half-open (one worker on probation, work taken)."""
        return self._restarts.breaker

    @property
    def retry_in_s(self) -> float | None:
        """While the breaker is open: how long until a worker is tried again."""
        return self._restarts.retry_in_s()

    @property
    def failure(self) -> str | None:
        """Why no work is taken now (no worker could ever start, or the breaker is open);
        None while work is taken."""
        return self._restarts.failure()

    # --- handles' commands (any thread) -------------------------------------------------

    def _post(self, sequence: _RemoteSequence, command: Command, *, release: bool) -> None:
        with self._lock:
            if release:
                # Like the in-process engine: a cancelled or pausing sequence gives its place
                # back at once, so the next request is queued rather than refused.
                self._release(sequence)
            if self._sequences.get(sequence.key) is not sequence:
                return  # already ended, or handed back by a dead worker
            if sequence.held is None:
                self._outbox.append(command)
                self._changed.notify_all()
                return
            if isinstance(command, Allow):
                return  # sent with its Submit, once released
            # A held sequence never reached a worker: it stops here, as it was.
            del self._sequences[sequence.key]
            sequence.held = None
            blob = self._outbox.detach(sequence.key)
            self._quarantine.withdraw(sequence.who, finished=isinstance(command, Cancel))
            self._send_released_locked()
        if isinstance(command, Cancel):
            sequence.sink.sequence_finished(FinishReason.CANCELLED, len(sequence.history))
        else:
            sequence.sink.sequence_paused(
                PausedState(generated=tuple(sequence.history), kv_state=blob)
            )

    def _send_locked(self, sequence: _RemoteSequence, submit: Submit) -> None:
        if not any(s.held is None for s in self._sequences.values() if s is not sequence):
            self._progress_at = time.monotonic()  # the stall clock starts with the work
        self._outbox.append(submit)
        if sequence.allowed != _NONE_ALLOWED:  # allowances given while it was held
            self._outbox.append(Allow(sequence.key, sequence.allowed))
        self._changed.notify_all()

    def _send_released_locked(self) -> None:
        """Send what the poison watch releases (a trial, or the held ones after it)."""
        for sequence in self._quarantine.release():
            if sequence.held is not None:
                submit, sequence.held = sequence.held, None
                self._send_locked(sequence, submit)

    def _release(self, sequence: _RemoteSequence) -> None:
        """With the lock held."""
        if sequence.admitted:
            sequence.admitted = False
            self._admitted -= 1

    def _refuse_if_down(self) -> None:
        """With the lock held: raise EngineUnavailable while no work is taken."""
        failure = self.failure
        if failure is not None:
            raise EngineUnavailable(f"the engine failed: {failure}", self.retry_in_s)

    # --- the sender thread --------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            with self._changed:
                while not (self._outbox and (self._link is not None or self._closing)):
                    self._changed.wait()
                outgoing = self._outbox.take()
                link = self._link
            if link is None:
                return  # closing while no worker runs
            commands = outgoing.written(self._spool, link.incarnation)
            try:
                link.conn.send(commands)
            except (OSError, EOFError, ValueError):
                pass  # the worker died: the supervisor hands its sequences back for a resume
            if any(isinstance(c, Stop) for c in commands):
                return

    # --- the supervisor thread ----------------------------------------------------------

    def _supervise(self) -> None:
        link = self._bring_up()
        with self._lock:
            self._link = link
        self._first_ready.set()
        while link is not None:
            end = link.watch(
                stall_timeout_s=self.supervision.stall_timeout_s,
                stalled_for=self._stalled_for,
                delivery_loop=lambda: self._delivery_loop,
                closing=lambda: self._closing,
            )
            if self._closing:
                return
            link = self._replace(link, end)

    def _bring_up(self) -> WorkerProcess | None:
        """Start workers until one is ready, waiting out an open breaker's cool-down first;
        None once closing, or when no worker could ever start (``failure`` says why)."""
        while not self._closing:
            if self._restarts.breaker is Breaker.OPEN and not self._restarts.cool_down(
                self._changed, lambda: self._closing
            ):
                return None
            outcome = self._spawn()
            if isinstance(outcome, WorkerProcess):
                ready = self.last_ready = outcome.ready
                if ready is not None:  # a new worker's cache starts empty (off for SWA models)
                    self.prefix_stats.enabled = ready.prefix_cache
                    self.prefix_stats.resident_tokens = self.prefix_stats.blob_bytes = 0
                self._restarts.worker_ready()
                return outcome
            if self._closing:
                return None
            reason = f"{outcome.who} {outcome.describe()} before it was ready"
            self.deaths.append(reason)
            self.worker_deaths += 1
            log.error("%s", reason)
            half_open_before = self._restarts.breaker is Breaker.HALF_OPEN
            action = self._restarts.worker_died(outcome, before_ready=True)
            if action is Action.GIVE_UP:
                self._restarts.give_up(reason)
                return None
            if action is Action.OPEN:
                self._open(reason, [], after_half_open=half_open_before)
        return None

    def _spawn(self) -> WorkerProcess | WorkerEnd:
        settings = dataclasses.replace(
            self.settings,
            cpu_extra_buffers=self._restarts.extra_buffers,
            max_queued=_ADMISSION_UNLIMITED,
        )
        options = WorkerOptions(
            settings=settings,
            spool_dir=self._spool.path,
            incarnation=next(self._incarnations),
            replaces_ready=self.last_ready is not None,
            token_coalesce_s=self.supervision.token_coalesce_s,
            log_level=logging.getLogger().getEffectiveLevel(),
            log_format=current_log_format(),
        )
        return WorkerProcess.start(
            options,
            start_timeout_s=self.supervision.start_timeout_s,
            closing=lambda: self._closing,
            deliver=self._on_message,
        )

    def _stalled_for(self) -> float | None:
        with self._lock:
            if all(s.held is not None for s in self._sequences.values()):
                return None  # the worker holds no work: nothing to wait for
            return time.monotonic() - self._progress_at

    def _on_message(self, message: object, on_loop: bool) -> None:
        self._progress_at = time.monotonic()
        if isinstance(message, list):  # after Ready, every message is the steps that are due
            for step in message:
                self._deliver(step, on_loop=on_loop)

    def _deliver(self, step: Step, *, on_loop: bool = False) -> None:
        stepped: list[int] = []
        for event in step.events:
            with self._lock:
                sequence = self._sequences.get(event.key)
                if sequence is not None:
                    self._note_locked(sequence, event)
            if isinstance(event, SequencePaused):
                if on_loop and event.kv_file is not None:
                    # Reading MBs of KV blob is no work for the event loop. Nothing of this
                    # sequence follows its pause, so the delivery may come later.
                    asyncio.get_running_loop().run_in_executor(
                        None, _deliver_pause, sequence, event
                    )
                else:
                    _deliver_pause(sequence, event)
            elif isinstance(event, PrefixHeld):
                stats = self.prefix_stats
                stats.resident_tokens, stats.blob_bytes = event.resident_tokens, event.blob_bytes
                stats.disk_bytes, stats.shelf_dropped = event.disk_bytes, event.shelf_dropped
            elif sequence is None:
                continue
            elif isinstance(event, TokenGenerated):
                sequence.history.append(event.token_id)
                self.tokens_generated_total += 1
                stepped.append(event.key)
                sequence.sink.token_generated(
                    event.index, event.token_id, event.piece, event.logprobs
                )
            elif isinstance(event, PromptScored):
                sequence.sink.prompt_scored(event.logprobs, event.ended)
            elif isinstance(event, SequenceFinished):
                sequence.sink.sequence_finished(event.reason, event.completion_tokens)
            elif isinstance(event, SequenceResumed):
                sequence.sink.sequence_resumed(event.path)
            elif isinstance(event, SequencePlanned):
                self.prefix_stats.count(reused=event.plan.reused, n_prompt=event.plan.length)
                sequence.sink.sequence_planned(event.plan)
        if stepped:
            self._restarts.stepped()
        if stepped and self.on_step is not None:
            self.on_step(stepped, step.finished_at)

    def _note_locked(self, sequence: _RemoteSequence, event: object) -> None:
        """What an event of a sequence the worker holds tells the bookkeeping (lock held)."""
        if isinstance(event, SequenceFinished | SequencePaused):
            del self._sequences[sequence.key]
            self._release(sequence)
            if isinstance(event, SequenceFinished):
                self._quarantine.finished(sequence.who)
            else:
                self._quarantine.left(sequence.who)
            self._send_released_locked()
        elif isinstance(event, TokenGenerated):
            if self._quarantine.progressed(sequence.who, len(sequence.history) + 1):
                self._send_released_locked()  # past where the worker died: cleared

    def _replace(self, link: WorkerProcess, end: WorkerEnd) -> WorkerProcess | None:
        """A running worker ended: fail a generation it convicts, hand the others back, then
        start another (after a cool-down, if this was a crash loop)."""
        reason = f"{end.who} {end.describe()}"
        self.deaths.append(reason)
        self.worker_deaths += 1
        half_open_before = self._restarts.breaker is Breaker.HALF_OPEN
        action = self._restarts.worker_died(end, before_ready=False)
        with self._lock:
            self._link = None
            victims = [s for s in self._sequences.values() if s.held is None]
            for sequence in victims:
                del self._sequences[sequence.key]
                self._release(sequence)
            self._outbox.worker_died(held=self._sequences)
        self._spool.discard(link.incarnation)  # blobs the dead worker never passed on
        if action is Action.OPEN:
            self._open(reason, victims, after_half_open=half_open_before)
        else:
            with self._lock:
                guilty = self._quarantine.worker_died(victims)
                self._send_released_locked()  # a held generation's trial may start now
            self.poisoned_generations += len(guilty)
            others = [s for s in victims if s not in guilty]
            log.error(
                "%s; %d generation(s) continue from their tokens after a restart",
                reason,
                len(others),
            )
            for sequence in guilty:
                sequence.sink.sequence_finished(FinishReason.POISONED, len(sequence.history))
            self._hand_back(others)
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

    def _open(self, reason: str, victims: list[_RemoteSequence], *, after_half_open: bool) -> None:
        """A crash loop: the breaker is open; every sequence (``victims``, the dead worker's,
        and those waiting) ends FAILED and new work is refused until the cool-down ends."""
        crash_loop = self._restarts.opened(reason, after_half_open=after_half_open)
        with self._lock:
            victims = victims + list(self._sequences.values())
            self._sequences.clear()
            self._quarantine.clear()
            self._outbox.clear()
            for sequence in victims:
                self._release(sequence)
                sequence.held = None
                self._quarantine.finished(sequence.who)
            self.breaker_opens += 1
            self._changed.notify_all()
        log.error(
            "ENGINE BREAKER OPEN: %s. %d generation(s) end with engine_unavailable (their "
            "sessions stay resumable); new requests are refused for %gs, then one worker is "
            "tried (half-open).",
            crash_loop,
            len(victims),
            self._restarts.cooldown_s,
        )
        for sequence in victims:
            ending = FinishReason.CANCELLED if sequence.cancelled else FinishReason.FAILED
            sequence.sink.sequence_finished(ending, len(sequence.history))


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
    kv = take(event.kv_file)
    if sequence is not None:
        sequence.sink.sequence_paused(PausedState(generated=event.generated, kv_state=kv))
