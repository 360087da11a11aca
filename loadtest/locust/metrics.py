"""Turning read phases into Locust request events, and the token-order check per generation.

Locust aggregates "requests" by (type, name) with percentiles; every measurement here is one:

=============  ======================  ==================================================
type           name                    response time
=============  ======================  ==================================================
``connect``    ``handshake``           QUIC + TLS handshake
``generate``   ``ttft``                request sent -> first TOKEN
``generate``   ``inter-token``         gap between consecutive TOKENs of one read phase
``generate``   ``generation (SCEN)``   request sent -> END, per scenario (pauses included)
``resume``     ``resume (PATH)``       RESUME sent on a new connection -> first TOKEN/END,
                                       by the server's resume path (kv-restore, replay..)
``check``      ``token order``         0; a failure if any index was lost/repeated/reordered
``error``      ``SLUG (CODE)`` / exc   0; an unexpected error, by wire code or class
``bad``        ``KIND``                request -> its ERROR; a failure if the code is wrong
=============  ======================  ==================================================
"""

from __future__ import annotations

from typing import Any

from loadtest.locust.driver import Segment
from loadtest.locust.ledger import LedgerVerdict, RunTally, TokenLedger
from quicsrv_client import GenerationEnded, ProtocolError, ServerError, TokenReceived

__all__ = ["GenerationCheck", "Reporter", "TokenOrderError", "UnexpectedReply", "error_name"]


class TokenOrderError(Exception):
    """A generation's tokens were not each index exactly once, in order."""


class UnexpectedReply(Exception):
    """A malformed or over-limit request did not get the error code it must get."""


def error_name(exc: BaseException) -> str:
    """How an error is counted: by wire code where the wire gave one, else by class."""
    if isinstance(exc, ServerError):
        return f"{exc.slug} ({exc.code})"
    if isinstance(exc, ProtocolError):
        return f"protocol {exc.error_code.slug} ({int(exc.error_code)})"
    return type(exc).__name__


class Reporter:
    """Fires Locust request events and keeps the run's tally (greenlet side only)."""

    def __init__(self, events: Any, tally: RunTally) -> None:
        self._events = events
        self.tally = tally

    def measure(
        self,
        kind: str,
        name: str,
        seconds: float,
        *,
        length: int = 0,
        exception: BaseException | None = None,
    ) -> None:
        self._events.request.fire(
            request_type=kind,
            name=name,
            response_time=seconds * 1000.0,
            response_length=length,
            exception=exception,
            context={},
        )

    def unexpected(self, exc: BaseException) -> None:
        """An error nothing in the scenario asked for: a failure, counted by code."""
        name = error_name(exc)
        self.tally.unexpected_errors[name] += 1
        self.measure("error", name, 0.0, exception=exc)

    def expected(self, kind: str, seconds: float, got: BaseException | None, want: str) -> None:
        """A bad request's reply: ``want`` is the error name it must have produced."""
        if got is not None and error_name(got) == want:
            self.tally.expected_errors_ok[kind] += 1
            self.measure("bad", kind, seconds)
            return
        self.tally.expected_errors_wrong[kind] += 1
        what = "no error" if got is None else f"{error_name(got)}: {got}"
        self.measure("bad", kind, seconds, exception=UnexpectedReply(f"wanted {want}, got {what}"))


class GenerationCheck:
    """One generation followed over its read phases: metrics per phase, the verdict at the end.

    A phase is ``"start"`` (the request), ``"continue"`` (the same stream after the reader
    paused) or ``"resume"`` (a RESUME on a new connection).
    """

    def __init__(self, reporter: Reporter, scenario: str) -> None:
        self.reporter = reporter
        self.scenario = scenario
        self.ledger = TokenLedger()
        self.started_s: float | None = None
        self.end_s: float | None = None
        self.completion_tokens: int | None = None
        self.failed = False

    def phase(self, segment: Segment, kind: str) -> bool:
        """Account for one phase; True while the generation goes on (no END, no error)."""
        report = self.reporter
        if kind == "start":
            self.started_s = segment.started_s
        if kind == "resume" and segment.error is None:
            first = next((t for t, e in segment.events if _is_payload(e)), None)
            if first is not None:
                path = segment.resume_path or "unknown"
                report.tally.resume_paths[path] += 1
                report.measure("resume", f"resume ({path})", first - segment.started_s)
        tokens = segment.tokens()
        if kind == "start" and tokens:
            report.measure("generate", "ttft", tokens[0][0] - segment.started_s)
        for (before, _), (after, _) in zip(tokens, tokens[1:], strict=False):
            report.measure("generate", "inter-token", after - before)
        for _, token in tokens:
            self.ledger.add(token.index)
        if segment.error is not None:
            self.failed = True
            report.unexpected(segment.error)
            self._verdict()
            return False
        end = segment.end
        if end is not None:
            self.end_s = segment.events[-1][0]
            self.completion_tokens = end.completion_tokens
            if self.started_s is not None:
                report.measure(
                    "generate",
                    f"generation ({self.scenario})",
                    self.end_s - self.started_s,
                    length=end.completion_tokens,
                )
            self._verdict()
            return False
        position = segment.position
        if position is not None and position.last_index != self.ledger.last_index:
            self.failed = True
            report.unexpected(
                TokenOrderError(
                    f"client position says last index {position.last_index}, "
                    f"the ledger {self.ledger.last_index}"
                )
            )
            return False
        return True

    def abandon(self, exc: BaseException) -> None:
        """The generation stopped for a reason outside the client (e.g. a bridge timeout)."""
        self.failed = True
        self.reporter.unexpected(exc)
        self._verdict()

    def _verdict(self) -> LedgerVerdict:
        verdict = self.ledger.verdict(self.completion_tokens)
        self.reporter.tally.record(verdict)
        if verdict.complete or not verdict.ok:
            self.reporter.measure(
                "check",
                "token order",
                0.0,
                length=verdict.received,
                exception=None if verdict.ok else TokenOrderError(verdict.describe()),
            )
        return verdict


def _is_payload(event: object) -> bool:
    return isinstance(event, TokenReceived | GenerationEnded)
