"""Paused-session census: every user parks one generation and never reads it again.

    .venv/bin/python -m loadtest.locust.smoke --locustfile loadtest/locust/parked.py \\
        --no-require-scenarios -u 100 -r 5 -t 120s --server-arg=--max-tokens-ahead=8 \\
        --locust-arg=--quic-slow-window=512 --out loadtest/results/locust-parked

Each user opens a connection with a small receive window, starts a long generation, reads two
tokens and stops reading, holding the stream open until the run ends. Once the server has run
``max_tokens_ahead`` tokens past what the reader acknowledged, it pauses the generation: the
sequence leaves the batch, its KV cells are captured (memory up to the KV budget, then disk)
and its slot goes to the next user. The smoke harness samples the server's RSS and its
store-usage log lines (live sessions, KV blobs in memory and on disk), which give the number
of paused sessions held and the memory each costs. Use this file on its own (``-f``), not next
to ``locustfile.py``.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from locust import constant, task

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # see locustfile.py

from loadtest.locust.metrics import GenerationCheck  # noqa: E402
from loadtest.locust.user import PROMPTS, QuicUser, StopAt  # noqa: E402
from quicsrv_client import Generation, ServerError  # noqa: E402
from quicsrv_proto import ErrorCode  # noqa: E402

#: Far more than the window plus max_tokens_ahead, so that the generation pauses rather than ends.
PARKED_TOKENS = 1024


class ParkedReader(QuicUser):
    """Starts one generation, reads two tokens, then holds the stream without reading."""

    wait_time = constant(1.0)

    def on_start(self) -> None:
        super().on_start()
        self.parked: Generation | None = None

    @task
    def park(self) -> None:
        if self.parked is not None:
            return  # keep holding it; wait_time paces this idle loop
        client = self.connection("parked", self.options.slow_window_bytes)
        if client is None:
            return
        check = GenerationCheck(self.report, "parked")
        generation = client.generate(
            random.choice(PROMPTS), max_tokens=PARKED_TOKENS, ignore_eos=True
        )
        segment = self.read_phase(check, generation, StopAt(1))
        if segment is None:
            self.done_with("parked", segment)
            return
        error = segment.error
        if isinstance(error, ServerError) and error.code == ErrorCode.OVERLOADED:
            # Admission is full for now: the server said so, with a retry hint. Try again.
            self.report.measure("park", "overloaded, retried", 0.0)
            self.back_off(segment)
            return
        if not check.phase(segment, "start"):
            self.done_with("parked", segment)
            return
        self.parked = generation
        self.report.tally.parked += 1
        self.report.measure("park", "parked", segment.ended_s - segment.started_s)
