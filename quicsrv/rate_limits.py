"""Rate limits: requests and generated tokens per minute, per API key (or per source address on
an open server).

Each limited client has two GCRA buckets (the generic cell rate algorithm, the leaky bucket as
a meter: one "theoretical arrival time" per bucket, no timer, no queue). A bucket of ``limit``
per minute lets ``limit`` through at once, then one every ``60 / limit`` s.

The policy, decided once here:

- a **new generation** (the endpoints that start compute: the router's ``STARTS_COMPUTE``) is
  admitted only while its client has a request left in the minute *and* at least one
  generated token left; otherwise it is refused at once, ``429 rate_limit_exceeded`` (35) with
  ``retry-after``: the time until both buckets have room again. Refused requests cost nothing.
  Refusing rather than queueing is what OpenAI does, and a refused client keeps no server
  resource while it waits;
- a **running generation is never cut**: its tokens are charged to its client as they are
  recorded, past the budget if need be. The debt then delays the client's next start (``tpm``
  is an average over time, not a cap on one answer). Resumes and reads are never limited:
  they continue what was admitted;
- the headers OpenAI sends (``x-ratelimit-limit-requests``, ``-remaining-requests``,
  ``-reset-requests``, the same for ``-tokens``) go with every answer of a generating endpoint
  of a limited client, refusals included; ``reset`` is the time until the bucket is full
  again, written as OpenAI writes it (``1s``, ``6m0s``, ``120ms``).

Limits come from the server's configuration (``rate_limit_requests_per_minute``,
``rate_limit_tokens_per_minute``: 0 is none) and, per key, from the keys file (``rpm=N``,
``tpm=N``). The buckets live in this process: with ``--workers N`` each process keeps its own,
so a client gets up to N times its limits across the node. At most :data:`MAX_CLIENTS` buckets
are kept: past that, the full ones (which are the same as none) are dropped, then the oldest.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "MAX_CLIENTS",
    "Gcra",
    "Quota",
    "RateLimited",
    "RateLimiter",
    "RateLimits",
    "RateState",
    "address_key",
    "openai_duration",
]

PERIOD_S = 60.0
MAX_CLIENTS = 65_536
_EPSILON_S = 1e-9  # float noise in the time arithmetic, never a policy


@dataclass(frozen=True, slots=True, kw_only=True)
class RateLimits:
    """A client's limits; 0: none of that kind."""

    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    """Generated tokens (prompt tokens are not counted)."""

    def __post_init__(self) -> None:
        if self.requests_per_minute < 0 or self.tokens_per_minute < 0:
            raise ValueError("rate limits must be 0 (none) or more")

    @property
    def limited(self) -> bool:
        return self.requests_per_minute > 0 or self.tokens_per_minute > 0


@dataclass(frozen=True, slots=True)
class Quota:
    """Whose budget a request spends, and its limits."""

    key: str
    """The API key id (``key:...``), or ``addr:<address>`` on an open server."""
    limits: RateLimits


class RateLimited(Exception):
    """A new generation refused by its client's rate limit (``rate_limit_exceeded``)."""

    def __init__(self, message: str, *, limit: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.message = message
        self.limit = limit
        """Which limit: ``requests`` or ``tokens`` (OpenAI's error ``type`` says the same)."""
        self.retry_after_s = retry_after_s


def address_key(address: str) -> str:
    """The rate-limit key of a peer's IP address on an open server: IPv4 (an IPv4-mapped IPv6
    address too) per address, IPv6 per /64 (one host usually holds a whole /64)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"addr:{address}"
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return f"addr:{ip.ipv4_mapped}"
        return f"addr:{ipaddress.IPv6Network((ip, 64), strict=False)}"
    return f"addr:{ip}"


def openai_duration(seconds: float) -> str:
    """A duration as OpenAI's ``x-ratelimit-reset-*`` headers write it (Go's style): ``0s``,
    ``120ms``, ``8.64s``, ``6m0s``, ``1h2m3s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.2f}".rstrip("0").rstrip(".") + "s"
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{text}"
    if minutes >= 1:
        return f"{int(minutes)}m{text}"
    return text


class Gcra:
    """One bucket of ``limit`` per :data:`PERIOD_S`; pure: every call is given ``now``."""

    __slots__ = ("interval_s", "limit", "tat")

    def __init__(self, limit: int, now: float) -> None:
        self.limit = limit
        self.interval_s = PERIOD_S / limit
        """What one unit costs in time (the emission interval)."""
        self.tat = now
        """The theoretical arrival time: the bucket is full at or after it."""

    def retry_after_s(self, now: float, cost: int = 1) -> float:
        """How long until ``cost`` units fit (0: now)."""
        return max(0.0, max(self.tat, now) + cost * self.interval_s - PERIOD_S - now)

    def fits(self, now: float, cost: int = 1) -> bool:
        return self.retry_after_s(now, cost) <= _EPSILON_S

    def take(self, now: float, cost: int) -> None:
        """Spend ``cost`` units, whether or not they fit (a debt delays what comes next)."""
        self.tat = max(self.tat, now) + cost * self.interval_s

    def remaining(self, now: float) -> int:
        """Units that fit now."""
        room = PERIOD_S - max(0.0, self.tat - now) + _EPSILON_S
        return max(0, min(self.limit, math.floor(room / self.interval_s)))

    def reset_s(self, now: float) -> float:
        """How long until the bucket is full again."""
        return max(0.0, self.tat - now)

    def relimit(self, limit: int, now: float) -> None:
        """A new limit (the keys file changed): what was spent stays spent, counted in units
        (a raised limit has room at once)."""
        if limit != self.limit:
            spent = max(0.0, self.tat - now) / self.interval_s
            self.limit = limit
            self.interval_s = PERIOD_S / limit
            self.tat = now + spent * self.interval_s


@dataclass(frozen=True, slots=True, kw_only=True)
class RateState:
    """A client's buckets at one moment, as the ``x-ratelimit-*`` headers say it."""

    limit_requests: int
    remaining_requests: int
    reset_requests_s: float
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_s: float

    def headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """OpenAI's rate-limit headers, for the limits that are set."""
        out: list[tuple[bytes, bytes]] = []
        for kind, limit, remaining, reset_s in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s),
        ):
            if limit > 0:
                out += [
                    (f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()),
                    (f"x-ratelimit-remaining-{kind}".encode(), str(remaining).encode()),
                    (f"x-ratelimit-reset-{kind}".encode(), openai_duration(reset_s).encode()),
                ]
        return tuple(out)


class _Buckets:
    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests: Gcra | None = None
        self.tokens: Gcra | None = None

    def fit(self, limits: RateLimits, now: float) -> None:
        """Match the buckets to ``limits`` (made full where new, dropped where unset)."""
        self.requests = _fitted(self.requests, limits.requests_per_minute, now)
        self.tokens = _fitted(self.tokens, limits.tokens_per_minute, now)

    def full(self, now: float) -> bool:
        return all(b is None or b.tat <= now for b in (self.requests, self.tokens))


def _fitted(bucket: Gcra | None, limit: int, now: float) -> Gcra | None:
    if limit <= 0:
        return None
    if bucket is None:
        return Gcra(limit, now)
    bucket.relimit(limit, now)
    return bucket


class RateLimiter:
    """Every limited client's buckets (see the module docstring). On one event loop;
    ``clock``: monotonic seconds."""

    def __init__(
        self, *, clock: Callable[[], float] = time.monotonic, max_clients: int = MAX_CLIENTS
    ) -> None:
        self._clock = clock
        self._max_clients = max_clients
        self._clients: dict[str, _Buckets] = {}
        self.refusals: Counter[str] = Counter()
        """New generations refused, by limit (``requests``, ``tokens``)."""

    def __len__(self) -> int:
        return len(self._clients)

    def admit(self, quota: Quota) -> None:
        """Spend one request of ``quota``'s, or raise :class:`RateLimited` (nothing spent)."""
        limits = quota.limits
        if not limits.limited:
            return
        now = self._clock()
        buckets = self._buckets(quota.key, limits, now)
        waits = []
        if buckets.requests is not None and not buckets.requests.fits(now):
            waits.append(("requests", buckets.requests.retry_after_s(now), buckets.requests))
        if buckets.tokens is not None and not buckets.tokens.fits(now):
            waits.append(("tokens", buckets.tokens.retry_after_s(now), buckets.tokens))
        if waits:
            limit, _, bucket = max(waits, key=lambda w: w[1])
            retry_after_s = max(w[1] for w in waits)
            self.refusals[limit] += 1
            per = "requests per min (RPM)" if limit == "requests" else "tokens per min (TPM)"
            raise RateLimited(
                f"Rate limit reached for {quota.key} on {per}: Limit {bucket.limit}, "
                f"Remaining {bucket.remaining(now)}. Please try again in "
                f"{openai_duration(retry_after_s)}.",
                limit=limit,
                retry_after_s=retry_after_s,
            )
        if buckets.requests is not None:
            buckets.requests.take(now, 1)

    def charge_tokens(self, key: str, tokens: int = 1) -> None:
        """``tokens`` generated for ``key``'s client: spent, past its budget if need be (a
        running generation is never cut). A client with no token bucket here pays nothing."""
        buckets = self._clients.get(key)
        if buckets is not None and buckets.tokens is not None:
            buckets.tokens.take(self._clock(), tokens)

    def state(self, quota: Quota) -> RateState | None:
        """``quota``'s buckets now (None: it has no limits)."""
        limits = quota.limits
        if not limits.limited:
            return None
        now = self._clock()
        buckets = self._buckets(quota.key, limits, now)
        requests, tokens = buckets.requests, buckets.tokens
        return RateState(
            limit_requests=limits.requests_per_minute,
            remaining_requests=requests.remaining(now) if requests else 0,
            reset_requests_s=requests.reset_s(now) if requests else 0.0,
            limit_tokens=limits.tokens_per_minute,
            remaining_tokens=tokens.remaining(now) if tokens else 0,
            reset_tokens_s=tokens.reset_s(now) if tokens else 0.0,
        )

    def _buckets(self, key: str, limits: RateLimits, now: float) -> _Buckets:
        buckets = self._clients.get(key)
        if buckets is None:
            if len(self._clients) >= self._max_clients:
                self._make_room(now)
            buckets = self._clients[key] = _Buckets()
        buckets.fit(limits, now)
        return buckets

    def _make_room(self, now: float) -> None:
        """Drop the full buckets (the same as none); if that is not a tenth of the table, the
        oldest too (forgiving what they spent), so that sweeps stay rare."""
        for key in [k for k, b in self._clients.items() if b.full(now)]:
            del self._clients[key]
        target = self._max_clients * 9 // 10
        while len(self._clients) > target:
            del self._clients[next(iter(self._clients))]
