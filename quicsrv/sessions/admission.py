"""Who gets the engine's sequence slots next: fair shares per client, resumes first.

Every engine sequence runs under a :class:`Slot` from the :class:`FairGate`, which hands out
at most ``slots`` at once (the engine's ``n_seq_max``), so the engine's own first-come queue
never decides the order. A client is its API key, or its connection when the server has no
keys. Waiting requests are served round-robin across clients, the client running the fewest
sequences first (a client's 50th request does not run before another client's 1st), and a
session coming back (a resume, or a paused sequence whose reader caught up) goes before every
new request: it already holds a reader.

Caps: a client runs at most ``max_active_per_client`` sequences and queues at most
``max_queued_per_client`` new requests (``client_limit``, 429); the whole queue holds at most
``max_queued`` new requests (``overloaded``, 503). Resumes are never refused here: each is one
session's only reader, and sessions are bounded by the session store. Refusals carry a
``retry_after_s`` estimated from the queue ahead and the mean time a slot is held.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from quicsrv_proto import ErrorCode

from .errors import RequestRejected

__all__ = ["AdmissionLimits", "FairGate", "Place", "Slot"]

_INITIAL_HOLD_S = 2.0
_HOLD_SMOOTHING = 0.2  # weight of the newest slot hold in the running mean
_MIN_RETRY_S = 0.1
_MAX_RETRY_S = 600.0
#: Distinct (code, client) refusal counters kept; past that they add up under OTHER_CLIENTS (on
#: an open server every connection is a client, so the peers would decide the size).
MAX_REFUSAL_KEYS = 1024
OTHER_CLIENTS = "(others)"


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionLimits:
    slots: int
    """Engine sequences at once (the engine's ``n_seq_max``)."""
    max_queued: int
    """New requests waiting, all clients together."""
    max_active_per_client: int
    max_queued_per_client: int

    def __post_init__(self) -> None:
        if min(self.slots, self.max_active_per_client, self.max_queued_per_client) < 1:
            raise ValueError("admission limits must be at least 1 (max_queued at least 0)")
        if self.max_queued < 0:
            raise ValueError("max_queued must be at least 0")


class Slot:
    """The right to run one engine sequence; :meth:`release` gives it back (once)."""

    __slots__ = ("_gate", "client", "granted_at", "released")

    def __init__(self, gate: FairGate, client: str, granted_at: float) -> None:
        self._gate = gate
        self.client = client
        self.granted_at = granted_at
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate._release(self)


class Place:
    """A place in the gate's line (:meth:`FairGate.queue`): :meth:`wait` for its slot, or
    :meth:`leave` the line. Exactly one of the two takes it."""

    __slots__ = ("_gate", "_taken", "_waiter")

    def __init__(self, gate: FairGate, waiter: _Waiter) -> None:
        self._gate = gate
        self._waiter = waiter
        self._taken = False  # wait() handed the slot on: it is its taker's to release

    @property
    def client(self) -> str:
        return self._waiter.client

    def take(self) -> Slot | None:
        """The slot, if it is there already (then the taker's to release), else None."""
        future = self._waiter.future
        if self._taken or not future.done() or future.cancelled():
            return None
        self._taken = True
        return future.result()

    async def wait(self, timeout_s: float | None = None) -> Slot:
        """The slot, once it is this place's turn. Raises RequestRejected
        ``deadline_exceeded`` when ``timeout_s`` passes first (the place is given up);
        cancelling the caller gives the place (or its slot) back."""
        waiter = self._waiter
        try:
            async with asyncio.timeout(timeout_s):
                slot = await asyncio.shield(waiter.future)
        except TimeoutError:
            if self._gate._withdraw(waiter):
                self._gate._count_refusal(ErrorCode.DEADLINE_EXCEEDED, waiter.client)
                raise RequestRejected(
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"could not start within {timeout_s:.3f} s: {self._gate.queued} requests "
                    f"waiting, {self._gate.active} running",
                ) from None
            slot = waiter.future.result()  # granted just as the deadline passed: use it
        except asyncio.CancelledError:
            self.leave()
            raise
        self._taken = True
        return slot

    def leave(self) -> None:
        """Give the place up: out of the line, or its slot back if it was granted (and not
        taken by :meth:`wait`)."""
        waiter = self._waiter
        if self._taken or self._gate._withdraw(waiter) or waiter.future.cancelled():
            return
        waiter.future.result().release()


@dataclass(eq=False)
class _Waiter:
    client: str
    resume: bool
    future: asyncio.Future[Slot] = field(repr=False)


def _granted(slot: Slot) -> asyncio.Future[Slot]:
    future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
    future.set_result(slot)
    return future


class FairGate:
    """See the module docstring. Runs on one event loop; nothing here blocks."""

    def __init__(
        self, limits: AdmissionLimits, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._active: Counter[str] = Counter()
        self._active_total = 0
        # Per class (resumes, new requests): each client's waiters in order, and the clients
        # in round-robin order (a client moves to the back when one of its waiters is served).
        self._waiting: dict[bool, dict[str, deque[_Waiter]]] = {True: {}, False: {}}
        self._queued_new = 0
        self._mean_hold_s = _INITIAL_HOLD_S
        self.refusals: Counter[tuple[ErrorCode, str]] = Counter()
        """Refusals by (code, client): ``client_limit`` (per-client), ``overloaded``
        (server-wide), ``deadline_exceeded``; for logs and metrics (:meth:`refusals_by_code`)."""
        self.granted = 0
        self._observers: list[asyncio.Future[None]] = []

    # --- what others read ---------------------------------------------------------------

    @property
    def active(self) -> int:
        return self._active_total

    @property
    def queued(self) -> int:
        """Waiters of both kinds."""
        return sum(len(q) for by_client in self._waiting.values() for q in by_client.values())

    @property
    def queued_new(self) -> int:
        """New requests waiting (returning sessions not counted)."""
        return self._queued_new

    def refusals_by_code(self) -> Counter[ErrorCode]:
        """How many requests the gate refused, per error code, all clients together."""
        totals: Counter[ErrorCode] = Counter()
        for (code, _client), n in self.refusals.items():
            totals[code] += n
        return totals

    def active_for(self, client: str) -> int:
        return self._active[client]

    def queued_for(self, client: str) -> int:
        return sum(len(by_client.get(client, ())) for by_client in self._waiting.values())

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Until ``predicate()`` holds, checked after every change of the gate (tests, stats)."""
        while not predicate():
            observer = asyncio.get_running_loop().create_future()
            self._observers.append(observer)
            await observer

    def _changed(self) -> None:
        observers, self._observers = self._observers, []
        for observer in observers:
            if not observer.done():
                observer.set_result(None)

    # --- acquiring ----------------------------------------------------------------------

    async def acquire(
        self, client: str, *, resume: bool = False, timeout_s: float | None = None
    ) -> Slot:
        """A slot for ``client``: at once, or after waiting its fair turn (:meth:`queue`, then
        :meth:`Place.wait`). Cancelling the caller gives the place (or slot) back."""
        return await self.queue(client, resume=resume).wait(timeout_s)

    def queue(self, client: str, *, resume: bool = False) -> Place:
        """A place in line for ``client``: granted at once when a slot is free for it, else
        queued. Raises RequestRejected at once, ``client_limit`` or ``overloaded`` (new
        requests only), when the queue is full: those answers need no wait."""
        # After every dispatch either no slot is free or no waiter may take one, so a client
        # that may run now passes nobody who could.
        if self._can_run(client):
            return Place(self, _Waiter(client, resume, _granted(self._grant(client))))
        if not resume:
            self._check_room(client)
        waiter = _Waiter(client, resume, asyncio.get_running_loop().create_future())
        self._waiting[resume].setdefault(client, deque()).append(waiter)
        if not resume:
            self._queued_new += 1
        self._dispatch()
        self._changed()
        return Place(self, waiter)

    def retry_after_s(self, ahead: int, servers: int) -> float:
        """Seconds until ``ahead`` queued requests have each run once on ``servers`` slots."""
        rounds = math.ceil((ahead + 1) / max(1, servers))
        return round(min(_MAX_RETRY_S, max(_MIN_RETRY_S, rounds * self._mean_hold_s)), 3)

    # --- internals ----------------------------------------------------------------------

    def _count_refusal(self, code: ErrorCode, client: str) -> None:
        key = (code, client)
        if key not in self.refusals and len(self.refusals) >= MAX_REFUSAL_KEYS:
            key = (code, OTHER_CLIENTS)
        self.refusals[key] += 1

    def _check_room(self, client: str) -> None:
        limits = self.limits
        mine = len(self._waiting[False].get(client, ()))
        if mine >= limits.max_queued_per_client:
            self._count_refusal(ErrorCode.CLIENT_LIMIT, client)
            raise RequestRejected(
                ErrorCode.CLIENT_LIMIT,
                f"this client already has {self._active[client]} generations running and "
                f"{mine} waiting (limits {limits.max_active_per_client} and "
                f"{limits.max_queued_per_client})",
                self.retry_after_s(mine, limits.max_active_per_client),
            )
        if self._queued_new >= limits.max_queued:
            self._count_refusal(ErrorCode.OVERLOADED, client)
            raise RequestRejected(
                ErrorCode.OVERLOADED,
                f"{self._active_total} generations running and {self._queued_new} waiting "
                f"(server limits {limits.slots} and {limits.max_queued})",
                self.retry_after_s(self._queued_new, limits.slots),
            )

    def _can_run(self, client: str) -> bool:
        return (
            self._active_total < self.limits.slots
            and self._active[client] < self.limits.max_active_per_client
        )

    def _grant(self, client: str) -> Slot:
        self._active[client] += 1
        self._active_total += 1
        self.granted += 1
        self._changed()
        return Slot(self, client, self._clock())

    def _release(self, slot: Slot) -> None:
        held = self._clock() - slot.granted_at
        self._mean_hold_s += _HOLD_SMOOTHING * (held - self._mean_hold_s)
        self._active[slot.client] -= 1
        if self._active[slot.client] <= 0:
            del self._active[slot.client]
        self._active_total -= 1
        self._dispatch()
        self._changed()

    def _dispatch(self) -> None:
        """Hand free slots to waiters: resumes first, round-robin over clients in each class."""
        while self._active_total < self.limits.slots:
            waiter = self._next_waiter(True) or self._next_waiter(False)
            if waiter is None:
                return
            waiter.future.set_result(self._grant(waiter.client))

    def _next_waiter(self, resume: bool) -> _Waiter | None:
        """The first waiter of the client running the fewest sequences (round-robin order
        among equals): a hog's queued requests never go before another client's first."""
        by_client = self._waiting[resume]
        cap = self.limits.max_active_per_client
        eligible = [c for c in by_client if self._active[c] < cap]
        if not eligible:
            return None
        client = min(eligible, key=self._active.__getitem__)  # min keeps the first of equals
        queue = by_client[client]
        waiter = queue.popleft()
        del by_client[client]  # back of the round-robin order, if it still waits
        if queue:
            by_client[client] = queue
        if not resume:
            self._queued_new -= 1
        return waiter

    def _withdraw(self, waiter: _Waiter) -> bool:
        """Take a waiter out of its queue; False if it was served already."""
        queue = self._waiting[waiter.resume].get(waiter.client)
        if queue is None or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del self._waiting[waiter.resume][waiter.client]
        if not waiter.resume:
            self._queued_new -= 1
        waiter.future.cancel()
        self._changed()
        return True
