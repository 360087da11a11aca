"""What the prefix cache changes in the output, and what it never changes.

With the engine as the server runs it (in process, one sequence at a time): for each prompt of
the determinism probe (:data:`loadtest.bench.stats.PROMPTS`) as a first user message, a chat of
``--turns`` turns whose every turn resends the whole history (chat template, greedy answers).

* **warm**: an engine with the prefix cache on runs the turns in order, so each later turn
  starts from the cells the turn before left (its prompt and its decoded answer);
* **cold**: an engine with the cache off runs the same prompt of each later turn;
* **replay**: the cold engine resumes each warm turn from its 8th token, following the plan
  the warm turn reported (as a resume after a worker's ``kill -9`` does).

It counts the later turns whose warm answer differs from the cold one (reuse may change the
output: the reused cells were computed in other batches) and the replays that differ from the
warm answer (must be none: a resume is exact). Run:
``.venv/bin/python -m loadtest.bench.prefix_reuse [--conversations 16 --turns 3]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from pathlib import Path

from loadtest.bench.stats import PROMPTS
from quicsrv.engine import (
    FinishReason,
    PausedState,
    PrefillPlan,
    ResumePath,
    ResumePoint,
    SamplingParams,
    SequenceRequest,
    default_model_path,
)
from quicsrv.engine.llama import LlamaEngine
from quicsrv.settings import engine_settings_for, probe_cpu_extra_buffers

FOLLOW_UPS = ("Tell me more about that.", "Can you sum it up in one sentence?", "Why?")
REPLAY_FROM = 8


class _Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.plan: PrefillPlan | None = None
        self.done = threading.Event()

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        self.tokens.append(token_id)

    def prompt_scored(self, logprobs: object, ended: object) -> None:
        pass  # never asked for here

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self.done.set()

    def sequence_paused(self, state: PausedState) -> None:
        self.done.set()

    def sequence_resumed(self, path: ResumePath) -> None:
        pass

    def sequence_planned(self, plan: PrefillPlan) -> None:
        self.plan = plan


def _run(engine: LlamaEngine, request: SequenceRequest) -> _Sink:
    sink = _Sink()
    engine.submit(request, sink)
    sink.done.wait()
    return sink


def _prompt(engine: LlamaEngine, first: str, answers: list[str], turn: int) -> tuple[int, ...]:
    messages = [{"role": "user", "content": first}]
    for k in range(turn):
        messages.append({"role": "assistant", "content": answers[k]})
        messages.append({"role": "user", "content": FOLLOW_UPS[k % len(FOLLOW_UPS)]})
    return tuple(engine.tokenize(engine.render_chat(messages), add_special=False))


def measure(conversations: int, turns: int, max_tokens: int) -> dict[str, object]:
    model = default_model_path()
    settings = engine_settings_for(
        model, n_seq_max=2, cpu_extra_buffers=probe_cpu_extra_buffers(model)
    )
    warm_engine = LlamaEngine(settings)
    cold_engine = LlamaEngine(dataclasses.replace(settings, prefix_cache=False))
    later_turns = differing = replays_differing = reused = prompt_tokens = 0
    started = time.monotonic()
    try:
        for first in PROMPTS[:conversations]:
            answers: list[str] = []
            for turn in range(turns):
                prompt = _prompt(warm_engine, first, answers, turn)
                request = SequenceRequest(
                    prompt_tokens=prompt, max_tokens=max_tokens, sampling=SamplingParams()
                )
                warm = _run(warm_engine, request)
                answers.append(
                    b"".join(warm_engine.piece(t) for t in warm.tokens).decode(errors="replace")
                )
                if turn == 0:
                    continue
                assert warm.plan is not None
                later_turns += 1
                reused += warm.plan.reused
                prompt_tokens += len(prompt)
                cold = _run(cold_engine, request)
                differing += cold.tokens != warm.tokens
                if len(warm.tokens) > REPLAY_FROM:
                    resume = ResumePoint(generated=tuple(warm.tokens[:REPLAY_FROM]))
                    replay = _run(
                        cold_engine,
                        dataclasses.replace(request, resume=resume, prefill_plan=warm.plan),
                    )
                    replays_differing += replay.tokens != warm.tokens[REPLAY_FROM:]
    finally:
        warm_engine.close()
        cold_engine.close()
    return {
        "conversations": conversations,
        "turns": turns,
        "max_tokens": max_tokens,
        "later_turns": later_turns,
        "reused_prompt_tokens": reused,
        "prompt_tokens": prompt_tokens,
        "warm_differs_from_cold": differing,
        "replays_differing_from_warm": replays_differing,
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.prefix_reuse")
    parser.add_argument("--conversations", type=int, default=len(PROMPTS))
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/prefix_reuse.json"))
    args = parser.parse_args()
    result = measure(args.conversations, args.turns, args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(
        f"{result['later_turns']} later turns: {result['reused_prompt_tokens']} of "
        f"{result['prompt_tokens']} prompt tokens reused; warm answer differs from the cold "
        f"one in {result['warm_differs_from_cold']}; replays by plan differing from the warm "
        f"answer: {result['replays_differing_from_warm']} ({result['seconds']} s)"
    )


if __name__ == "__main__":
    main()
