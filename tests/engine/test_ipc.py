"""The worker's messages cross the pipe intact, and load as plain constructor calls."""

from __future__ import annotations

import pickle
import pickletools

import pytest

from quicsrv.engine import (
    FinishReason,
    PrefillPlan,
    ResumePath,
    SamplingParams,
    Segment,
    SequenceRequest,
    TokenLogprobs,
)
from quicsrv.engine.ipc import (
    Allow,
    Cancel,
    Pause,
    PrefixHeld,
    Ready,
    SequenceFinished,
    SequencePaused,
    SequencePlanned,
    SequenceResumed,
    Step,
    Stop,
    Submit,
    TokenGenerated,
)

MESSAGES = [
    Submit(
        key=1,
        request=SequenceRequest(
            prompt_tokens=(1, 2, 3), max_tokens=4, sampling=SamplingParams(seed=7)
        ),
        kv_file="kv-1",
    ),
    Cancel(key=2),
    Pause(key=3, capture_kv=True),
    Allow(key=4, n_tokens=16),
    Stop(),
    Ready(pid=5, cpu_extra_buffers=False, load_s=0.5, canary_s=0.25, prefix_cache=True),
    Step(
        events=(
            TokenGenerated(
                key=1,
                index=0,
                token_id=42,
                piece=b" hi",
                logprobs=TokenLogprobs(-0.5, ((42, -0.5), (7, -1.25))),
            ),
            SequenceFinished(key=1, reason=FinishReason.LENGTH, completion_tokens=1),
            SequencePaused(key=2, generated=(9, 8), kv_file=None),
            SequenceResumed(key=3, path=ResumePath.KV_RESTORE),
            SequencePlanned(
                key=4,
                plan=PrefillPlan((Segment(130, 64), Segment(150, 1), Segment(170, 64)), 150),
            ),
            PrefixHeld(key=4, resident_tokens=300, blob_bytes=0, disk_bytes=5, shelf_dropped=2),
        ),
        finished_at=12.5,
    ),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_survives_the_pipe(message):
    assert pickle.loads(pickle.dumps(message, pickle.HIGHEST_PROTOCOL)) == message


def test_a_step_loads_without_setstate():
    # BUILD is the opcode of __setstate__: for a frozen dataclass with slots it is a walk over
    # fields() and an object.__setattr__ per field, for every event on the event loop.
    step = MESSAGES[-1]
    opcodes = {op.name for op, _, _ in pickletools.genops(pickle.dumps(step, 5))}
    assert "BUILD" not in opcodes
