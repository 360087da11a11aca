"""The restart policy at work in a running engine: its state, the moves the supervisor thread
makes on it, what the other threads read, and a log line for each move.

:mod:`.restarts` decides (pure); a :class:`RestartKeeper` holds the one
:class:`~.restarts.RestartState` of a :class:`~.supervisor.WorkerEngine` behind a lock, so that
the event loop may ask whether work is taken (``failure``, ``retry_in_s``) while the supervisor
thread records a death or waits out a cool-down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .ipc import WorkerPhase
from .process import WorkerEnd
from .restarts import (
    Action,
    Breaker,
    RestartPolicy,
    RestartState,
    WorkerDeath,
    decide,
    half_open,
    proven,
    worker_ready,
)

__all__ = ["RestartKeeper"]

log = logging.getLogger("quicsrv.engine")


class RestartKeeper:
    """See the module docstring. ``budget``: the restart budget in words, for log lines."""

    def __init__(self, policy: RestartPolicy, *, extra_buffers: bool, budget: str) -> None:
        self._policy = policy
        self._budget = budget
        self._lock = threading.Lock()
        self._state = RestartState(extra_buffers=extra_buffers)
        self._gave_up: str | None = None  # why no worker could ever start
        self._crash_loop = ""  # what opened the breaker last

    # --- what any thread reads ----------------------------------------------------------

    @property
    def extra_buffers(self) -> bool:
        """Whether the next worker starts with llama.cpp's extra CPU buffers."""
        return self._state.extra_buffers

    @property
    def breaker(self) -> Breaker:
        return self._state.breaker

    @property
    def gave_up(self) -> str | None:
        """Why no worker could ever start (None: one did, or none was tried yet)."""
        return self._gave_up

    def retry_in_s(self) -> float | None:
        """While the breaker is open: how long until a worker is tried again."""
        state = self._state
        if state.breaker is not Breaker.OPEN or state.retry_at is None:
            return None
        return max(0.0, state.retry_at - time.monotonic())

    def failure(self) -> str | None:
        """Why no work is taken now (no worker could ever start, or the breaker is open);
        None while work is taken."""
        if self._gave_up is not None:
            return self._gave_up
        retry_in_s = self.retry_in_s()
        if retry_in_s is None:
            return None
        return (
            f"{self._crash_loop}; the breaker is open: a new worker is tried in "
            f"{retry_in_s:.1f}s (cool-down {self._state.cooldown_s:g}s)"
        )

    # --- the supervisor thread's moves --------------------------------------------------

    def worker_ready(self) -> None:
        with self._lock:
            self._state = worker_ready(self._state)

    def worker_died(self, end: WorkerEnd, *, before_ready: bool) -> Action:
        """Record a worker's end; what to do about it (safe mode is logged here)."""
        death = WorkerDeath(
            at=time.monotonic(),
            before_ready=before_ready,
            in_canary=end.phase is WorkerPhase.CANARY,
            kernel_fault=end.kernel_fault,
        )
        with self._lock:
            decision = decide(self._policy, self._state, death)
            self._state = decision.state
        if decision.action is Action.SAFE_MODE and before_ready:
            log.warning(
                "SAFE MODE: the start-up canary crashed the engine worker (%s) with "
                "llama.cpp's extra CPU buffers on (AMX / repacked weights, known to fault "
                "in batched matmul on some Xeons); restarting with use_extra_bufts=False. "
                'Set cpu_extra_buffers = "off" to skip the canary\'s retry.',
                end.describe(),
            )
        elif decision.action is Action.SAFE_MODE:
            log.warning(
                "SAFE MODE: the engine worker faulted inside llama_decode twice in a row with "
                "llama.cpp's extra CPU buffers on; restarting with use_extra_bufts=False"
            )
        return decision.action

    def give_up(self, reason: str) -> str:
        """No worker could start within the budget: why, in words (logged)."""
        self._gave_up = f"{self._budget}; last: {reason}"
        log.error("ENGINE FAILED: %s. No worker could start.", self._gave_up)
        return self._gave_up

    def opened(self, reason: str, *, after_half_open: bool) -> str:
        """The breaker opened for the death ``reason``: the crash loop, in words."""
        if after_half_open:
            self._crash_loop = f"the half-open breaker's worker died too: {reason}"
        else:
            self._crash_loop = f"{self._budget}; last: {reason}"
        return self._crash_loop

    @property
    def cooldown_s(self) -> float:
        return self._state.cooldown_s

    def cool_down(self, changed: threading.Condition, closing: Callable[[], bool]) -> bool:
        """Wait out the open breaker's cool-down on ``changed`` (notified when the engine
        closes), then half-open it; False when closing."""
        with changed:
            while not closing():
                retry_at = self._state.retry_at
                left = 0.0 if retry_at is None else retry_at - time.monotonic()
                if left <= 0:
                    break
                changed.wait(left)
            if closing():
                return False
        with self._lock:
            self._state = half_open(self._policy, self._state)
            cooldown_s = self._state.cooldown_s
        log.warning(
            "engine breaker HALF-OPEN after a %gs cool-down: starting one worker; %d decode "
            "steps close the breaker, its death opens it again for twice as long",
            cooldown_s,
            self._policy.probation_steps,
        )
        return True

    def stepped(self) -> None:
        """The worker made a decode step: a half-open breaker's probation goes on (or ends,
        the breaker closed)."""
        if self._state.breaker is not Breaker.HALF_OPEN:
            return
        with self._lock:
            self._state = proven(self._state)
            closed = self._state.breaker is Breaker.CLOSED
        if closed:
            log.warning(
                "engine breaker CLOSED: the half-open worker made %d decode steps; restarts "
                "count from zero again",
                self._policy.probation_steps,
            )
