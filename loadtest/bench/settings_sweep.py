"""Which llama.cpp settings are fastest while keeping quicsrv's resumes exact?

For every combination of flash attention (off/on) and a unified KV cache (off/on), quicsrv's own
engine (in this process, llama.cpp's extra CPU buffers as the start-up canary decides) measures:

- **speed**: aggregate tokens/s with 1, 4 and 8 sequences decoding together (greedy, EOS ignored);
- **determinism**: of 16 prompts, how many greedy sequences decoded 8 at a time differ from the
  same prompt decoded alone (a resume by replay meets other batch neighbours than the original);
- **replay exactness**: 8 sequences generated together; each is then rebuilt without its KV cells
  from its first K tokens (the exact replay a resume or an engine restart uses), 4 at a time, and
  continued: how many continuations differ from the original;
- **KV-restore exactness**: the same, but paused with its KV cells captured and restored.

Run: ``.venv/bin/python -m loadtest.bench.settings_sweep [--max-tokens 64] [--cut 24]``. Prints a
table, writes ``loadtest/results/settings-<time>.{md,json}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from loadtest.bench.stats import PROMPTS
from quicsrv.engine import (
    FinishReason,
    PausedState,
    ResumePath,
    ResumePoint,
    SamplingParams,
    SequenceRequest,
    default_model_path,
)
from quicsrv.engine.llama import LlamaEngine
from quicsrv.settings import engine_settings_for, probe_cpu_extra_buffers


class _Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.paused: PausedState | None = None
        self.first_token_at: float | None = None
        self.done = threading.Event()

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.append(token_id)

    def prompt_scored(self, logprobs: object, ended: object) -> None:
        pass  # never asked for here

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        self.done.set()

    def sequence_paused(self, state: PausedState) -> None:
        self.paused = state
        self.done.set()

    def sequence_resumed(self, path: ResumePath) -> None:
        pass

    def sequence_planned(self, plan: object) -> None:
        pass


@dataclass(frozen=True, slots=True)
class Row:
    flash_attn: bool
    kv_unified: bool
    tokens_per_s: dict[int, float]  # sequences together -> aggregate decode tokens/s
    differing_batched: int  # of len(PROMPTS), greedy batch-of-8 vs alone
    differing_replay: int  # of 8 continuations after an exact replay
    differing_restore: int  # of 8 continuations after a KV restore


def _request(
    engine: LlamaEngine, prompt: str, max_tokens: int, resume: ResumePoint | None = None
) -> SequenceRequest:
    return SequenceRequest(
        prompt_tokens=tuple(engine.tokenize(prompt, add_special=True)),
        max_tokens=max_tokens,
        sampling=SamplingParams(),
        ignore_eos=True,
        resume=resume,
    )


def _run(engine: LlamaEngine, requests: list[SequenceRequest]) -> list[_Sink]:
    sinks = [_Sink() for _ in requests]
    for request, sink in zip(requests, sinks, strict=True):
        engine.submit(request, sink)
    for sink in sinks:
        sink.done.wait()
    return sinks


def _speed(engine: LlamaEngine, sequences: int, max_tokens: int) -> float:
    requests = [_request(engine, PROMPTS[i], max_tokens) for i in range(sequences)]
    started = time.perf_counter()
    sinks = _run(engine, requests)
    # Decode rate once every sequence is past its prompt: the settings' effect on steps.
    decoding_from = max(s.first_token_at or started for s in sinks)
    decoded = sum(len(s.tokens) for s in sinks) - sequences
    return decoded / (time.perf_counter() - decoding_from)


def _continuations(
    engine: LlamaEngine, originals: list[list[int]], cut: int, max_tokens: int, restore: bool
) -> int:
    """Rebuild each sequence from its first ``cut`` tokens and count differing continuations."""
    differing = 0
    for group in range(0, len(originals), 4):
        resumes = []
        for i in range(group, min(group + 4, len(originals))):
            kv = None
            if restore:  # generate to the cut alone, pause it with its cells captured
                sink = _Sink()
                handle = engine.submit(_request(engine, PROMPTS[i], max_tokens), sink)
                handle.allow(cut)
                sink.done.wait()
                assert sink.paused is not None and sink.paused.generated == tuple(
                    originals[i][:cut]
                ), "the prefix itself differs: see the determinism column"
                kv = sink.paused.kv_state
            point = ResumePoint(generated=tuple(originals[i][:cut]), kv_state=kv)
            resumes.append(_request(engine, PROMPTS[i], max_tokens, point))
        for offset, sink in enumerate(_run(engine, resumes)):
            differing += sink.tokens != originals[group + offset][cut:]
    return differing


def measure(
    model: Path, extra_buffers: bool, flash_attn: bool, kv_unified: bool, args: argparse.Namespace
) -> Row:
    engine = LlamaEngine(
        engine_settings_for(
            model,
            flash_attn=flash_attn,
            kv_unified=kv_unified,
            cpu_extra_buffers=extra_buffers,
        )
    )
    try:
        _speed(engine, 1, 8)  # warm-up
        speeds = {n: round(_speed(engine, n, args.max_tokens), 1) for n in (1, 4, 8)}
        alone = [_run(engine, [_request(engine, p, args.max_tokens)])[0].tokens for p in PROMPTS]
        groups = [PROMPTS[g : g + 8] for g in range(0, len(PROMPTS), 8)]
        together = [
            s.tokens
            for group in groups
            for s in _run(engine, [_request(engine, p, args.max_tokens) for p in group])
        ]
        batched = sum(a != b for a, b in zip(alone, together, strict=True))
        originals = together[:8]
        replay = _continuations(engine, originals, args.cut, args.max_tokens, restore=False)
        try:
            restore = _continuations(engine, alone[:8], args.cut, args.max_tokens, restore=True)
        except AssertionError:
            restore = -1
        return Row(flash_attn, kv_unified, speeds, batched, replay, restore)
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.settings_sweep")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--cut", type=int, default=24, help="tokens kept before a rebuild")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    model = default_model_path()
    extra_buffers = probe_cpu_extra_buffers(model)
    rows = []
    for flash_attn, kv_unified in itertools.product((False, True), repeat=2):
        row = measure(model, extra_buffers, flash_attn, kv_unified, args)
        print(row, flush=True)
        rows.append(row)
    lines = [
        f"# llama.cpp settings sweep ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)",
        "",
        "`python -m loadtest.bench.settings_sweep "
        f"--max-tokens {args.max_tokens} --cut {args.cut}`; "
        f"{len(PROMPTS)} prompts, greedy; cpu extra buffers {'on' if extra_buffers else 'off'}.",
        "",
        "| flash attn | kv unified | decode tok/s B=1 | B=4 | B=8 | batch-of-8 ≠ alone "
        "| replay ≠ original | KV restore ≠ original |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        restore = "prefix differs" if r.differing_restore < 0 else f"{r.differing_restore}/8"
        lines.append(
            f"| {'on' if r.flash_attn else 'off'} | {'on' if r.kv_unified else 'off'} "
            f"| {r.tokens_per_s[1]} | {r.tokens_per_s[4]} | {r.tokens_per_s[8]} "
            f"| {r.differing_batched}/{len(PROMPTS)} | {r.differing_replay}/8 | {restore} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"settings-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(f"wrote {stem}.md, {stem}.json")


if __name__ == "__main__":
    main()
