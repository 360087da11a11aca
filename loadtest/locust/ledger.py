"""The load test's own bookkeeping: every token index once and in order, and the run's tally.

Pure Python (no gevent, no asyncio), so the checks can be unit-tested anywhere. The client
already refuses a TOKEN whose index is not the last one + 1; this ledger checks the same promise
independently, across all the streams (first request and resumes) that made up one generation,
and against the END frame's count.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LedgerVerdict", "RunTally", "TokenLedger"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerVerdict:
    """What one generation's token indices looked like."""

    received: int
    """Tokens received, over every stream of the generation."""
    lost: int
    """Indices below the expected count that never arrived."""
    duplicated: int
    """Arrivals of an index that had already arrived."""
    out_of_order: int
    """Arrivals whose index was not greater than the one before."""
    complete: bool
    """The generation reached END (an incomplete one is checked as a prefix)."""

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.out_of_order == 0

    def describe(self) -> str:
        return (
            f"{self.received} received, {self.lost} lost, {self.duplicated} duplicated, "
            f"{self.out_of_order} out of order"
        )


@dataclass(slots=True)
class TokenLedger:
    """Every token index one generation delivered, in arrival order, across resumes."""

    seen: list[int] = field(default_factory=list)

    @property
    def last_index(self) -> int:
        """The last index received (-1: none), what a resume must continue after."""
        return self.seen[-1] if self.seen else -1

    def add(self, index: int) -> None:
        self.seen.append(index)

    def verdict(self, completion_tokens: int | None) -> LedgerVerdict:
        """Check the arrivals; ``completion_tokens`` is END's count, None if END never came.

        Complete: exactly ``0 .. completion_tokens - 1``, each once, ascending. Incomplete: the
        same for the prefix that arrived (the missing tail is not "lost": it was never due).
        """
        seen = self.seen
        duplicated = len(seen) - len(set(seen))
        out_of_order = sum(1 for a, b in zip(seen, seen[1:], strict=False) if b <= a)
        expected = completion_tokens if completion_tokens is not None else max(seen, default=-1) + 1
        distinct = set(seen)
        lost = sum(1 for i in range(expected) if i not in distinct)
        # Indices past END's count (or negative ones) are as wrong as repeats.
        out_of_order += sum(1 for i in distinct if i < 0 or i >= max(expected, 0))
        return LedgerVerdict(
            received=len(seen),
            lost=lost,
            duplicated=duplicated,
            out_of_order=out_of_order,
            complete=completion_tokens is not None,
        )


@dataclass(slots=True)
class RunTally:
    """Counts over a whole Locust run, written as JSON when Locust quits."""

    generations_checked: int = 0
    tokens_checked: int = 0
    lost_tokens: int = 0
    duplicated_tokens: int = 0
    out_of_order_tokens: int = 0
    order_failures: int = 0
    incomplete_generations: int = 0
    scenarios: Counter[str] = field(default_factory=Counter)
    resume_paths: Counter[str] = field(default_factory=Counter)
    expected_errors_ok: Counter[str] = field(default_factory=Counter)
    expected_errors_wrong: Counter[str] = field(default_factory=Counter)
    unexpected_errors: Counter[str] = field(default_factory=Counter)
    parked: int = 0

    def record(self, verdict: LedgerVerdict) -> None:
        if verdict.complete:
            self.generations_checked += 1
        else:
            self.incomplete_generations += 1
        self.tokens_checked += verdict.received
        self.lost_tokens += verdict.lost
        self.duplicated_tokens += verdict.duplicated
        self.out_of_order_tokens += verdict.out_of_order
        if not verdict.ok:
            self.order_failures += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "generations_checked": self.generations_checked,
            "tokens_checked": self.tokens_checked,
            "lost_tokens": self.lost_tokens,
            "duplicated_tokens": self.duplicated_tokens,
            "out_of_order_tokens": self.out_of_order_tokens,
            "order_failures": self.order_failures,
            "incomplete_generations": self.incomplete_generations,
            "scenarios": dict(self.scenarios),
            "resume_paths": dict(self.resume_paths),
            "expected_errors_ok": dict(self.expected_errors_ok),
            "expected_errors_wrong": dict(self.expected_errors_wrong),
            "unexpected_errors": dict(self.unexpected_errors),
            "parked": self.parked,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_dict(), indent=2, sort_keys=True) + "\n")
