"""What the engine's answers mean for a session (sessions.runner, sessions.errors), and the
runner's answers that need no loop: which plan a record keeps, how a restart rebuilds cells."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest

from quicsrv.engine import (
    CannotReplay,
    EngineError,
    EngineUnavailable,
    FinishReason,
    InvalidSchema,
    Overloaded,
    PrefillPlan,
    PromptTooLong,
    ResumePath,
    SamplingParams,
    Segment,
)
from quicsrv.sessions.errors import ENGINE_CODES, engine_error_code
from quicsrv.sessions.lifecycle import SessionState, allows
from quicsrv.sessions.record import SessionRecord
from quicsrv.sessions.runner import (
    DEFAULT_RETRY_S,
    FINISHES,
    GiveUp,
    Retry,
    Runner,
    after_refusal,
)
from quicsrv.sessions.spec import GenerationSpec
from quicsrv.settings import session_settings_for
from quicsrv_proto import EndReason, ErrorCode


class _Crashed(EngineUnavailable):
    """A refusal more specific than the table knows."""


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (PromptTooLong("too long"), ErrorCode.PROMPT_TOO_LONG),
        (CannotReplay("plan"), ErrorCode.MODEL_CHANGED),
        (EngineUnavailable("down"), ErrorCode.ENGINE_UNAVAILABLE),
        (_Crashed("down"), ErrorCode.ENGINE_UNAVAILABLE),
        (Overloaded("busy", retry_after_s=2.0), ErrorCode.OVERLOADED),
        (EngineError("shutting down"), ErrorCode.SHUTTING_DOWN),
        (InvalidSchema("bad", path="x"), ErrorCode.SHUTTING_DOWN),
    ],
)
def test_an_engine_refusal_has_one_wire_code(exc, code):
    assert engine_error_code(exc) is code


def test_the_table_lists_the_most_specific_class_first():
    kinds = list(ENGINE_CODES)
    for i, kind in enumerate(kinds):
        assert not any(issubclass(later, kind) for later in kinds[i + 1 :]), kind
    assert kinds[-1] is EngineError  # anything the engine refuses has a code


@pytest.mark.parametrize(
    ("exc", "answer"),
    [
        (EngineUnavailable("down"), GiveUp(ErrorCode.ENGINE_UNAVAILABLE, "down")),
        (CannotReplay("plan"), GiveUp(ErrorCode.MODEL_CHANGED, "plan")),
        (PromptTooLong("too long"), GiveUp(ErrorCode.PROMPT_TOO_LONG, "too long")),
        (Overloaded("busy", retry_after_s=2.5), Retry(2.5)),
        (EngineError("shutting down"), Retry(DEFAULT_RETRY_S)),
        (EngineError("soon", retry_after_s=0.25), Retry(0.25)),
    ],
)
def test_a_refused_restart_is_tried_again_unless_no_retry_can_help(exc, answer):
    assert after_refusal(exc) == answer


def test_only_a_natural_end_ends_the_record_and_only_a_failure_tells_the_reader():
    assert set(FINISHES) == set(FinishReason)
    ends = {reason: finish.end for reason, finish in FINISHES.items() if finish.end}
    assert ends == {FinishReason.LENGTH: EndReason.LENGTH, FinishReason.EOS: EndReason.EOS}
    failing = {reason for reason, finish in FINISHES.items() if finish.failure}
    assert failing == {FinishReason.FAILED, FinishReason.POISONED}


@pytest.mark.parametrize("reason", list(FinishReason))
def test_every_end_report_is_an_event_the_lifecycle_takes_from_a_running_sequence(reason):
    for state in (SessionState.RUNNING, SessionState.PAUSING, SessionState.STOPPING):
        assert allows(state, FINISHES[reason].event)


class _KV:
    """Which blobs a KV store has (the runner only asks)."""

    def __init__(self, *held: int) -> None:
        self.held = set(held)

    def has(self, session: bytes, n_generated: int) -> bool:
        return n_generated in self.held


def _runner(record, kv=None, inexact_reprefill=False) -> Runner:
    flow = session_settings_for(Path("/unused"), inexact_reprefill=inexact_reprefill).flow
    # Nothing here runs, waits or submits: no engine, sink, gate or loop is touched.
    return Runner(record, None, None, kv=kv or _KV(), gate=None, flow=flow, loop=None)  # type: ignore[arg-type]


def test_a_new_generation_keeps_the_plan_a_replay_must_follow():
    cold = PrefillPlan.plain(100, 256)
    reused = PrefillPlan((Segment(64, 64), Segment(100, 256)), reused=64)
    record = _record()
    runner = _runner(record)
    assert not runner.planned(cold)  # a cold start: a replay without a plan is exact
    assert record.prefill_plan is None
    assert runner.planned(reused)  # changed: to be saved before any token goes out
    assert record.prefill_plan == reused
    assert not runner.planned(reused)  # no change, no save
    record.generated.append(7)
    assert not runner.planned(cold)  # a resume follows the plan on record
    assert record.prefill_plan == reused


@pytest.mark.parametrize(
    ("generated", "held", "inexact", "path"),
    [
        ((), {0}, False, None),  # it never ran: nothing to rebuild
        ((5, 6), {2}, False, ResumePath.KV_RESTORE),
        ((5, 6), {1}, False, ResumePath.REPLAY),  # a blob of another length is no use
        ((5, 6), set(), True, ResumePath.REPREFILL),
    ],
)
def test_a_restart_rebuilds_the_cells_from_a_kept_blob_else_by_replay(
    generated, held, inexact, path
):
    runner = _runner(_record(generated), _KV(*held), inexact_reprefill=inexact)
    assert runner.resume_path() is path


def _record(generated=()) -> SessionRecord:
    spec = GenerationSpec(
        prompt_tokens=tuple(range(100)),
        sampling=SamplingParams(seed=1),
        max_tokens=16,
        stop=(),
        ignore_eos=False,
        prefill_chunk=256,
    )
    return SessionRecord(
        session_id=b"s" * 16,
        model_digest=b"m" * 32,
        spec=spec,
        created_at_s=0.0,
        expires_at_s=1.0,
        generated=array("I", generated),
    )
