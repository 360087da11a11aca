"""How long each resume waits for its first token, and what the server was doing meanwhile.

Issue 46 saw three resumes through a lossy link get no token for about 70 s on a loaded machine,
then be served together; it did not reproduce. A soak that records, for every resume, the wait
from its request to its first token and the server's queue and slot state (``/metrics``: slots
in use and in all, requests and resumes in line, live sessions by lifecycle state, the engine's
health) at that first token, and every :data:`WATCH_EVERY_S` while it waits, tells a rerun that
hits such a stall what held it: no slot (``active == slots``, resumes in line), the engine (a
worker restarting, ``engine_up`` 0), or neither (the flow of that one stream).

:class:`ResumeWatch` does the timing and the scrapes; :func:`server_state` picks what is kept
from a scrape (pure, tested without a server).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["WATCH_EVERY_S", "ResumeWait", "ResumeWatch", "server_state", "summary"]

#: While a resume has no token yet, the server's state is taken this often (and at its first
#: token): often enough to see a stall of tens of seconds from inside, rarely enough that the
#: scrapes cost a loaded machine nothing to speak of.
WATCH_EVERY_S = 5.0

_KEPT = (
    "quicsrv_generations_active",
    "quicsrv_generations_slots",
    "quicsrv_generations_queued",
    "quicsrv_resumes_queued",
    "quicsrv_sessions_paused",
    "quicsrv_engine_up",
    "quicsrv_engine_worker_restarts_total",
    "quicsrv_connections_open",
)
_BY_STATE = 'quicsrv_sessions_by_state{state="'


def server_state(values: Mapping[str, float]) -> dict[str, float]:
    """What is kept of a ``/metrics`` scrape (``name{labels}`` to value): the slots, the lines,
    the engine, and the live sessions by state (as ``state:<name>``)."""
    kept = {name.removeprefix("quicsrv_"): values[name] for name in _KEPT if name in values}
    for name, value in values.items():
        if name.startswith(_BY_STATE) and value:
            kept["state:" + name[len(_BY_STATE) : -2]] = value
    return kept


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeWait:
    """One resume: how long its first token took, and the server's state then and meanwhile."""

    kind: str
    """Which soak generation resumed (``cut-resume``, ``sse-cut-resume`` over TCP or HTTP/3)."""
    session: str
    first_token_s: float | None
    """From the resume's request to its first token (None: none came, the resume ended)."""
    at_first_token: dict[str, float]
    """The server's state (:func:`server_state`) at the first token."""
    while_waiting: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    """Every :data:`WATCH_EVERY_S` of the wait: seconds into it, and the server's state."""

    def describe(self) -> str:
        state = self.at_first_token
        states = ", ".join(f"{k[6:]} {v:g}" for k, v in sorted(state.items()) if k[:6] == "state:")
        waited = "no token" if self.first_token_s is None else f"{self.first_token_s:.2f} s"
        return (
            f"{self.kind} {self.session[:8]}: first token after {waited}; then slots "
            f"{state.get('generations_active', 0):g}/{state.get('generations_slots', 0):g}, "
            f"in line {state.get('generations_queued', 0):g} (resumes "
            f"{state.get('resumes_queued', 0):g}), engine up {state.get('engine_up', 0):g}, "
            f"sessions: {states or 'none'}; {len(self.while_waiting)} looks while waiting"
        )


class ResumeWatch:
    """Times one resume from its creation (make it just before the request) to
    :meth:`first_token`, taking the server's state with ``scrape`` meanwhile and then;
    :meth:`finish` gives the record."""

    def __init__(
        self,
        kind: str,
        session: str,
        scrape: Callable[[], Awaitable[Mapping[str, float]]],
        every_s: float = WATCH_EVERY_S,
    ) -> None:
        self._kind = kind
        self._session = session
        self._scrape = scrape
        self._every_s = every_s
        self._started = time.monotonic()
        self._first: float | None = None
        self._at_first: asyncio.Task[Mapping[str, float]] | None = None
        self._looks: list[tuple[float, dict[str, float]]] = []
        self._watching = asyncio.ensure_future(self._watch())

    def first_token(self) -> None:
        """The resume's first token arrived (later calls do nothing)."""
        if self._first is not None:
            return
        self._first = time.monotonic()
        self._watching.cancel()
        self._at_first = asyncio.ensure_future(self._scrape())

    async def finish(self) -> ResumeWait:
        self._watching.cancel()
        at_first: Mapping[str, float] = {}
        if self._at_first is not None:
            try:
                at_first = await self._at_first
            except Exception:  # a scrape that failed records nothing, the soak goes on
                at_first = {}
        return ResumeWait(
            kind=self._kind,
            session=self._session,
            first_token_s=None if self._first is None else self._first - self._started,
            at_first_token=server_state(at_first),
            while_waiting=self._looks,
        )

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)  # a periodic look, not synchronisation
            with_scrape = time.monotonic()
            try:
                values = await self._scrape()
            except Exception:
                continue
            self._looks.append((with_scrape - self._started, server_state(values)))


def summary(waits: list[ResumeWait]) -> str:
    """A round's resumes in one line: how many, the median and slowest first token, and the
    slowest one's server state."""
    timed = [w for w in waits if w.first_token_s is not None]
    if not timed:
        return f"{len(waits)} resumes, none timed"
    slowest = max(timed, key=lambda w: w.first_token_s or 0.0)
    median = statistics.median(w.first_token_s or 0.0 for w in timed)
    return f"{len(waits)} resumes, first token median {median:.2f} s; slowest: {slowest.describe()}"
