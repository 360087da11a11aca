"""What one benchmark stream and one load level measured, and how they are summarised."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["PROMPTS", "LoadResult", "StreamResult", "percentile", "summarise"]

# Shared with loadtest/bench/determinism.py; stream i of a load gets PROMPTS[i % 16].
PROMPTS = [
    "The history of the printing press",
    "Write a recipe for tomato soup.",
    "Explain how a bicycle gear works.",
    "List five uses for a paperclip:",
    "Once upon a time in a small village,",
    "The main causes of the French Revolution were",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "The rules of chess are simple:",
    "A letter to my future self:",
    "Why is the ocean salty?",
    "The best way to learn a language is",
    "In 1969, the first humans",
    "How do vaccines work?",
    "The three laws of thermodynamics",
    "A haiku about autumn leaves:",
]


@dataclass(slots=True, kw_only=True)
class StreamResult:
    """One generation as the client saw it."""

    expected_tokens: int
    """The ``max_tokens`` asked for (EOS is ignored, so every token is owed)."""
    started_s: float
    """``time.perf_counter()`` when the request was sent."""
    token_times_s: list[float] = field(default_factory=list)
    """``time.perf_counter()`` at each token's arrival."""
    finish: str = "none"
    """Why it ended: the server's reason (``length``), ``interrupted``, ``timeout``, ``error``."""

    @property
    def delivered(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] - self.started_s if self.token_times_s else None

    @property
    def gaps_s(self) -> list[float]:
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    """One server under one load: ``streams`` concurrent generations of ``max_tokens`` each."""

    target: str
    streams: int
    max_tokens: int
    wall_s: float
    """From sending the first request to the last token received."""
    delivered_tokens: int
    expected_tokens: int
    tokens_per_s: float
    """Aggregate delivered tokens per second over ``wall_s``."""
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    gap_p50_s: float | None
    """Inter-token gap at each stream's client, pooled over all streams."""
    gap_p99_s: float | None
    gap_max_s: float | None
    delivered_min: int
    delivered_mean: float
    delivered_max: int
    complete_streams: int
    """Streams that received every one of their ``max_tokens`` tokens."""
    finishes: dict[str, int]
    others_cpu_share: float
    """CPU used by other processes during the run, as a share of the whole machine."""
    loadavg_1m: float
    """The machine's 1-minute load average when the load ended."""
    server_cpu_s: float | None = None
    """CPU of quicsrv's server process alone (not its engine worker) during the load."""
    round: int = -1
    """Which round of the run it belongs to: the raw loop ran in the same round, right before
    or after it, for a ratio that machine drift cannot skew (-1: no raw run beside it)."""

    @property
    def server_cpu_us_per_token(self) -> float | None:
        if self.server_cpu_s is None or not self.delivered_tokens:
            return None
        return 1e6 * self.server_cpu_s / self.delivered_tokens

    @property
    def lost_tokens(self) -> int:
        return self.expected_tokens - self.delivered_tokens


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (an observed value, never an interpolation); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


def summarise(
    target: str,
    max_tokens: int,
    started_s: float,
    streams: Sequence[StreamResult],
    others_cpu_share: float,
) -> LoadResult:
    """Reduce one load's streams to its row in the table."""
    ends = [s.token_times_s[-1] for s in streams if s.token_times_s]
    wall_s = (max(ends) - started_s) if ends else 0.0
    delivered = [s.delivered for s in streams]
    ttfts = [t for s in streams if (t := s.ttft_s) is not None]
    gaps = [g for s in streams for g in s.gaps_s]
    total = sum(delivered)
    return LoadResult(
        target=target,
        streams=len(streams),
        max_tokens=max_tokens,
        wall_s=wall_s,
        delivered_tokens=total,
        expected_tokens=max_tokens * len(streams),
        tokens_per_s=total / wall_s if wall_s > 0 else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        gap_p50_s=percentile(gaps, 50),
        gap_p99_s=percentile(gaps, 99),
        gap_max_s=max(gaps) if gaps else None,
        delivered_min=min(delivered),
        delivered_mean=total / len(delivered),
        delivered_max=max(delivered),
        complete_streams=sum(1 for n in delivered if n >= max_tokens),
        finishes=dict(Counter(s.finish for s in streams)),
        others_cpu_share=others_cpu_share,
        loadavg_1m=os.getloadavg()[0],
    )
