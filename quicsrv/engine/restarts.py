"""What the supervisor does when an engine worker dies: a pure restart policy with a breaker.

No process, thread or clock here: :func:`decide` takes the policy, the state so far and the
facts of one death (its time included) and returns a :class:`Decision`, the action and the next
state; :func:`half_open` and :func:`proven` are the breaker's other two moves. The supervisor
(:mod:`.supervisor`) holds one :class:`RestartState` and only carries decisions out. The table::

    breaker    the death                               action      breaker after
    CLOSED     before Ready, canary or kernel fault,   SAFE_MODE   CLOSED (extra buffers off)
               extra buffers on, auto
    CLOSED     a 2nd kernel fault in a row, as above   SAFE_MODE   CLOSED (extra buffers off),
                                                                   unless over budget: below
    CLOSED     within the budget                       RESTART     CLOSED
    CLOSED     over budget, no worker ever ready       GIVE_UP     CLOSED (a start failure)
    CLOSED     over budget, a worker was ready once    OPEN        OPEN until now + cool-down
    HALF_OPEN  any                                     OPEN        OPEN until now + 2 x cool-down
                                                                   (capped)

The budget: more than ``max_restarts`` restarts within ``window_s`` is a crash loop. An open
breaker refuses new work; at ``retry_at`` it half-opens (one worker is started, work is taken
again), and a half-open worker that makes ``probation_steps`` decode steps closes it: the
restart history and the cool-down start over. Safe mode (``auto_safe_mode``: the configuration
says ``cpu_extra_buffers = "auto"``) switches llama.cpp's extra CPU buffers off for good; a
death in the canary is the canary doing its job, so that restart is not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum, IntEnum

__all__ = [
    "Action",
    "Breaker",
    "Decision",
    "RestartPolicy",
    "RestartState",
    "WorkerDeath",
    "decide",
    "half_open",
    "proven",
    "worker_ready",
]


class Breaker(IntEnum):
    """The circuit breaker's state; the value is the ``quicsrv_engine_breaker_state`` gauge."""

    CLOSED = 0
    """Workers are restarted within the budget; work is taken."""
    OPEN = 1
    """A crash loop: no worker, new work refused until ``retry_at``."""
    HALF_OPEN = 2
    """One worker on probation after a cool-down; work is taken."""


class Action(Enum):
    RESTART = "restart"
    """Start another worker now."""
    SAFE_MODE = "safe-mode"
    """Start another worker now, without llama.cpp's extra CPU buffers (from now on)."""
    OPEN = "open"
    """A crash loop: end what runs, refuse new work, half-open at the state's ``retry_at``."""
    GIVE_UP = "give-up"
    """No worker ever got ready and the budget is spent: the engine cannot start."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartPolicy:
    max_restarts: int
    window_s: float
    """More than ``max_restarts`` restarts within this window is a crash loop."""
    cooldown_s: float
    """How long the breaker stays open after a crash loop, before its first half-open try."""
    max_cooldown_s: float
    """The cool-down doubles after each failed half-open try, up to this."""
    probation_steps: int
    """Decode steps a half-open worker makes before the breaker closes."""
    auto_safe_mode: bool
    """``cpu_extra_buffers = "auto"``: a canary crash or repeated kernel faults turn them off."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerDeath:
    """The facts of one worker's end that the policy reads."""

    at: float
    """When (``time.monotonic()``)."""
    before_ready: bool
    """It never said Ready (died loading, in the canary, or was not ready in time)."""
    in_canary: bool
    """It died inside the start-up canary."""
    kernel_fault: bool
    """A fault signal while llama.cpp computed (the canary or ``llama_decode``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartState:
    extra_buffers: bool
    """Whether the next worker starts with llama.cpp's extra CPU buffers."""
    breaker: Breaker = Breaker.CLOSED
    restarts: tuple[float, ...] = ()
    """When the counted restarts happened, the oldest first (only those in the window)."""
    kernel_faults_in_a_row: int = 0
    ever_ready: bool = False
    """A worker said Ready once: a crash loop from now on opens the breaker, never gives up."""
    cooldown_s: float = 0.0
    """The cool-down the breaker last opened for (0: none since it last closed)."""
    retry_at: float | None = None
    """OPEN: when the half-open try starts."""
    probation_left: int = 0
    """HALF_OPEN: decode steps the worker still has to make."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    action: Action
    state: RestartState


def decide(policy: RestartPolicy, state: RestartState, death: WorkerDeath) -> Decision:
    """What to do about ``death``; see the module docstring's table."""
    safe_mode = False
    faults = state.kernel_faults_in_a_row + 1 if death.kernel_fault else 0
    if state.extra_buffers and policy.auto_safe_mode:
        canary = death.before_ready and (death.in_canary or death.kernel_fault)
        safe_mode = canary or faults >= 2
    state = dataclasses.replace(
        state,
        extra_buffers=state.extra_buffers and not safe_mode,
        kernel_faults_in_a_row=0 if safe_mode else faults,
    )
    if state.breaker is Breaker.HALF_OPEN:
        return _open(policy, state, death.at, min(policy.max_cooldown_s, 2 * state.cooldown_s))
    if safe_mode and death.before_ready:
        return Decision(action=Action.SAFE_MODE, state=state)  # the canary did its job
    recent = tuple(t for t in state.restarts if t >= death.at - policy.window_s)
    if len(recent) >= policy.max_restarts:
        if not state.ever_ready:
            return Decision(action=Action.GIVE_UP, state=dataclasses.replace(state, restarts=()))
        return _open(policy, state, death.at, policy.cooldown_s)
    state = dataclasses.replace(state, restarts=(*recent, death.at))
    return Decision(action=Action.SAFE_MODE if safe_mode else Action.RESTART, state=state)


def half_open(policy: RestartPolicy, state: RestartState) -> RestartState:
    """The cool-down is over: one worker is tried (the caller waited until ``retry_at``)."""
    if state.breaker is not Breaker.OPEN:
        raise ValueError(f"only an open breaker half-opens, not a {state.breaker.name} one")
    return dataclasses.replace(
        state, breaker=Breaker.HALF_OPEN, retry_at=None, probation_left=policy.probation_steps
    )


def worker_ready(state: RestartState) -> RestartState:
    """A worker said Ready: from now on a crash loop opens the breaker instead of giving up."""
    return dataclasses.replace(state, ever_ready=True)


def proven(state: RestartState, steps: int = 1) -> RestartState:
    """A worker made ``steps`` decode steps: a half-open breaker closes once its probation is
    over (the restart history and the cool-down start over); otherwise nothing changes."""
    if state.breaker is not Breaker.HALF_OPEN:
        return state
    left = state.probation_left - steps
    if left > 0:
        return dataclasses.replace(state, probation_left=left)
    return dataclasses.replace(
        state, breaker=Breaker.CLOSED, restarts=(), cooldown_s=0.0, probation_left=0
    )


def _open(policy: RestartPolicy, state: RestartState, now: float, cooldown_s: float) -> Decision:
    cooldown_s = max(cooldown_s, min(policy.cooldown_s, policy.max_cooldown_s))
    opened = dataclasses.replace(
        state,
        breaker=Breaker.OPEN,
        restarts=(),
        cooldown_s=cooldown_s,
        retry_at=now + cooldown_s,
        probation_left=0,
    )
    return Decision(action=Action.OPEN, state=opened)
