"""Locust load test for quicsrv: many users, resumes under load, nothing lost.

    .venv/bin/locust -f loadtest/locust/locustfile.py --host quic://127.0.0.1:4433 \\
        --headless -u 8 -r 2 -t 60s --csv out/run --html out/run.html

Each simulated user drives the real client library (:mod:`client`) with a weighted mix:

* ``plain`` (6): one generation read as fast as it comes;
* ``slow_reader`` (2): stops reading after a few tokens (its receive window stops growing, so
  the server pauses the generation), waits, then drains to the end on the same stream;
* ``drop_and_resume`` (2): drops the connection mid-stream (1-3 times, anywhere from right
  after the first CHECKPOINT to the last token) and resumes on a new connection;
* ``bad_request`` (1): a malformed or over-limit request that must get its own error code
  (raw bytes on a connection of its own, or through the user's main connection, which then
  goes on serving the user's real generations).

Every generation is checked: each token index exactly once, in order, across all its
streams, up to END's count (see :mod:`loadtest.locust.ledger`); a lost, repeated or
reordered token is a ``check / token order`` failure. Metrics are Locust request events (see
:mod:`loadtest.locust.metrics`). How gevent and asyncio meet: :mod:`loadtest.locust.bridge`.

Options (flag, or the environment variable in brackets): ``--quic-ca`` [LOCUST_QUIC_CA],
``--quic-summary`` (JSON tally written at exit), ``--quic-max-tokens-limit``,
``--quic-loops``, ``--quic-slow-window``, ``--quic-slow-pause``, ``--quic-no-cover``,
``--quic-phase-timeout``; the target comes from ``--host`` [LOCUST_HOST].
"""

from __future__ import annotations

import random
import secrets
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Locust monkey-patches (gevent) on import; everything asyncio runs on bridge threads.
import gevent
from locust import between, task

# `locust -f loadtest/locust/locustfile.py` puts loadtest/locust/ on sys.path; the helpers are
# imported as the `loadtest` package, so the repository root must be there too.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadtest.locust.bridge import BridgeTimeout  # noqa: E402
from loadtest.locust.driver import send_raw  # noqa: E402
from loadtest.locust.metrics import GenerationCheck, UnexpectedReply  # noqa: E402
from loadtest.locust.raw import RAW_BAD_REQUESTS, RawBadRequest  # noqa: E402
from loadtest.locust.user import (  # noqa: E402
    CLOSE_TIMEOUT_S,
    MAIN_WINDOW_BYTES,
    PROMPTS,
    QuicUser,
    StopAt,
)
from quicsrv_client import Client, ClientError, Generation, ResumePosition, ServerError  # noqa: E402

#: A slow reader's generation must outrun its window plus the server's max_tokens_ahead (64)
#: for the server to pause it: ~45 tokens fit in 2 KiB, so 160 tokens do.
SLOW_READER_TOKENS = 160
#: Long enough to exceed the server's context per sequence (2048 by default).
TOO_LONG_PROMPT = "word " * 5000


class QuicsrvUser(QuicUser):
    """One client of the server: plain, slow, dropped-and-resumed and bad requests."""

    wait_time = between(0.1, 0.5)

    def on_start(self) -> None:
        super().on_start()
        self.finished: ResumePosition | None = None
        """A finished generation's position: material for forged resumes."""
        if self.options.cover:
            # Every scenario once (plain first: the bad resumes need a finished session).
            rest: list[Callable[[], None]] = [
                self.slow_reader,
                self.drop_and_resume,
                lambda: self.bad_request(every_kind=True),
            ]
            random.shuffle(rest)
            for scenario in [self.plain, *rest]:
                scenario()

    # --- scenarios ----------------------------------------------------------------------------

    @task(6)
    def plain(self) -> None:
        """One generation, read as fast as it comes."""
        self.report.tally.scenarios["plain"] += 1
        client = self.connection("main", MAIN_WINDOW_BYTES)
        if client is None:
            return
        check = GenerationCheck(self.report, "plain")
        generation = client.generate(random.choice(PROMPTS), **_params(random.randint(24, 64)))
        segment = self.read_phase(check, generation)
        if segment is not None:
            check.phase(segment, "start")
            if segment.end is not None:
                self.finished = segment.position
        self.done_with("main", segment)

    @task(2)
    def slow_reader(self) -> None:
        """Stop reading after a few tokens, pause (the server pauses too), then drain."""
        self.report.tally.scenarios["slow_reader"] += 1
        client = self.connection("slow", self.options.slow_window_bytes)
        if client is None:
            return
        check = GenerationCheck(self.report, "slow reader")
        generation = client.generate(random.choice(PROMPTS), **_params(SLOW_READER_TOKENS))
        segment = self.read_phase(check, generation, StopAt(random.randint(1, 12)))
        if segment is None or not check.phase(segment, "start"):
            self.done_with("slow", segment)
            return
        # The behaviour under test, not synchronisation: the application stops reading.
        gevent.sleep(self.options.slow_pause_s * random.uniform(0.5, 1.5))
        segment = self.read_phase(check, generation)
        if segment is not None:
            check.phase(segment, "continue")
        self.done_with("slow", segment)

    @task(2)
    def drop_and_resume(self) -> None:
        """Drop the connection mid-stream 1-3 times, resuming each time on a new one."""
        self.report.tally.scenarios["drop_and_resume"] += 1
        max_tokens = random.randint(32, 96)
        cuts = sorted(random.sample(range(-1, max_tokens - 1), k=random.choice((1, 1, 2, 3))))
        client = self.fresh_connection()
        if client is None:
            return
        check = GenerationCheck(self.report, "drop+resume")
        generation = client.generate(random.choice(PROMPTS), **_params(max_tokens))
        kind = "start"
        for cut in [*cuts, None]:
            segment = self.read_phase(check, generation, None if cut is None else StopAt(cut))
            if segment is None or not check.phase(segment, kind):
                self.back_off(segment)
                break
            position = segment.position
            self.await_(self.connections.close(client, generation), CLOSE_TIMEOUT_S)  # the drop
            if position is None:
                check.abandon(UnexpectedReply("no resume position after CHECKPOINT"))
                return
            client = self.fresh_connection()
            if client is None:
                return
            generation = client.resume_from(position)
            kind = "resume"
        self.await_(self.connections.close(client), CLOSE_TIMEOUT_S)

    @task(1)
    def bad_request(self, every_kind: bool = False) -> None:
        """A malformed or over-limit request: it must get its own error code."""
        self.report.tally.scenarios["bad_request"] += 1
        kinds: list[Callable[[], None]] = [
            *(lambda r=r: self._raw_bad(r) for r in RAW_BAD_REQUESTS),
            self._over_limit,
            self._prompt_too_long,
            self._unknown_session,
            self._forged_hash,
            self._index_beyond_snapshot,
        ]
        for bad in kinds if every_kind else [random.choice(kinds)]:
            bad()

    # --- bad requests -----------------------------------------------------------------------

    def _raw_bad(self, request: RawBadRequest) -> None:
        want = f"{request.code.slug} ({int(request.code)})"
        try:
            reply, seconds = self.await_(
                send_raw(self.target, request, self.options.phase_timeout_s)
            )
        except (BridgeTimeout, ClientError, OSError, ConnectionError) as exc:
            self.report.expected(request.name, 0.0, exc, want)
            return
        frame = reply.error()
        got: BaseException
        if frame is not None and reply.status == request.status:
            got = ServerError(frame.code, frame.message, http_status=reply.status)
        else:
            got = UnexpectedReply(f"HTTP {reply.status}, body {bytes(reply.body[:64])!r}")
        self.report.expected(request.name, seconds, got, want)

    def _expect(self, kind: str, want: str, make: Callable[[Client], Generation]) -> None:
        """Run a client request on the main connection that must fail with ``want``."""
        client = self.connection("main", MAIN_WINDOW_BYTES)
        if client is None:
            return
        check = GenerationCheck(self.report, kind)
        segment = self.read_phase(check, make(client))
        if segment is None:
            self.done_with("main", segment)
            return
        self.report.expected(kind, segment.ended_s - segment.started_s, segment.error, want)
        if segment.error is None:
            check.phase(segment, "start")  # it generated after all: still check its tokens
        self.done_with("main", segment)

    def _over_limit(self) -> None:
        limit = self.options.max_tokens_limit
        self._expect(
            "max_tokens_over_limit",
            "invalid_field (8)",
            lambda c: c.generate("Hello", max_tokens=limit + 1),
        )

    def _prompt_too_long(self) -> None:
        self._expect(
            "prompt_too_long",
            "prompt_too_long (20)",
            lambda c: c.generate(TOO_LONG_PROMPT, max_tokens=16),
        )

    def _unknown_session(self) -> None:
        self._expect(
            "unknown_session",
            "unknown_session (40)",
            lambda c: c.resume(secrets.token_hex(16), 0, secrets.token_bytes(32)),
        )

    def _forged_hash(self) -> None:
        done = self.finished
        if done is None:
            return self._unknown_session()
        forged = bytes(b ^ 0x5A for b in done.snapshot_hash)
        self._expect(
            "forged_hash",
            "hash_mismatch (42)",
            lambda c: c.resume(
                done.session_id, done.last_index, forged, checkpoint_index=done.checkpoint_index
            ),
        )

    def _index_beyond_snapshot(self) -> None:
        done = self.finished
        if done is None:
            return self._unknown_session()
        self._expect(
            "index_beyond_snapshot",
            "index_beyond_snapshot (43)",
            lambda c: c.resume(
                done.session_id,
                done.last_index + 1000,
                done.snapshot_hash,
                checkpoint_index=done.checkpoint_index,
            ),
        )


def _params(max_tokens: int) -> dict[str, Any]:
    """Half greedy, half seeded sampling; always exactly ``max_tokens`` tokens."""
    params: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True}
    if random.random() < 0.5:
        params.update(temperature=0.8, top_k=40, top_p=0.95, seed=random.randrange(1 << 32))
    return params
