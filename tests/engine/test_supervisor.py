"""The supervisor's pure parts: how a worker's end is read, and what a send carries."""

from __future__ import annotations

import signal

from quicsrv.engine import SamplingParams, SequenceRequest
from quicsrv.engine.ipc import Allow, Cancel, Pause, Submit, WorkerPhase
from quicsrv.engine.outbox import _latest_allowances
from quicsrv.engine.process import WorkerEnd
from quicsrv.engine.worker import EXIT_ENGINE_FAILED


def test_only_the_latest_allowance_per_sequence_is_sent_in_order():
    request = SequenceRequest(prompt_tokens=(1, 2), max_tokens=4, sampling=SamplingParams())
    batch = [
        Submit(1, request),
        Allow(1, 10),
        Allow(2, 5),
        Allow(1, 11),
        Pause(2, True),
        Allow(1, 12),
        Cancel(3),
    ]
    assert _latest_allowances(batch) == [
        Submit(1, request),
        Allow(2, 5),
        Pause(2, True),
        Allow(1, 12),
        Cancel(3),
    ]


def test_a_fault_signal_inside_llama_decode_is_a_kernel_fault():
    death = WorkerEnd(-signal.SIGSEGV, WorkerPhase.DECODING)
    assert death.kernel_fault
    assert death.describe() == "died of SIGSEGV inside llama_decode"
    assert WorkerEnd(-signal.SIGILL, WorkerPhase.CANARY).kernel_fault


def test_kills_and_clean_exits_are_not_kernel_faults():
    assert not WorkerEnd(-signal.SIGKILL, WorkerPhase.DECODING).kernel_fault
    assert not WorkerEnd(-signal.SIGSEGV, WorkerPhase.IDLE).kernel_fault
    failed = WorkerEnd(EXIT_ENGINE_FAILED, WorkerPhase.IDLE)
    assert not failed.kernel_fault
    assert "engine thread failed" in failed.describe()
    hung = WorkerEnd(-signal.SIGKILL, WorkerPhase.DECODING, killed_for="no decode step in 9.0s")
    assert hung.describe().startswith("killed by the supervisor: no decode step")
