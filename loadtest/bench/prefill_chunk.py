"""Which prefill chunk size? Stall of decoding streams vs time to first token of a long prompt.

For each chunk size: 4 sequences are decoding in the engine; once each has a few tokens, a
~2000-token prompt arrives and is prefilled one chunk per step alongside their tokens. Measured
on the engine thread (no transport in the way): the long prompt's time to first token, and the
decoding streams' inter-token gaps while it is prefilled (the largest one is the stall a user
sees). A chunk as large as the prompt (one step, ``n_batch`` raised to fit) is the unchunked
reference. Run: ``.venv/bin/python -m loadtest.bench.prefill_chunk`` (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from loadtest.bench.machine import CpuMeter, wait_until_quiet
from loadtest.bench.report import pick
from loadtest.bench.stats import PROMPTS, percentile
from quicsrv.config import ServerConfig
from quicsrv.engine import FinishReason, SamplingParams, SequenceRequest
from quicsrv.engine import default_model_path as _default_model_path
from quicsrv.engine.llama import LlamaEngine
from quicsrv.settings import engine_settings_for, probe_cpu_extra_buffers

WAIT_S = 120.0
"""Upper bound on any one wait; a run that needs longer is broken, not slow."""

_PARAGRAPH = (
    "The printing press changed how knowledge moved through Europe. Before it, books were "
    "copied by hand, slowly and at great cost, and few people ever owned one. Within fifty "
    "years of Gutenberg's first Bible, presses in more than two hundred cities had printed "
    "millions of volumes: grammars, almanacs, sermons, maps and pamphlets. Scholars could "
    "compare identical copies, errors could be corrected in later editions, and ideas spread "
    "faster than any authority could stop them. "
)


class _Recorder:
    """A token sink that timestamps every token and lets another thread wait for a count."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.finished = False
        self._changed = threading.Condition()

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: object = None
    ) -> None:
        with self._changed:
            self.times.append(time.perf_counter())
            self._changed.notify_all()

    def prompt_scored(self, logprobs: object, ended: object) -> None:
        pass  # never asked for here

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None:
        with self._changed:
            self.finished = True
            self._changed.notify_all()

    # Never paused or resumed here; ``object`` keeps these in step with the sink protocol.
    def sequence_paused(self, state: object) -> None:
        self.sequence_finished(FinishReason.CANCELLED, 0)

    def sequence_resumed(self, path: object) -> None:
        pass

    def sequence_planned(self, plan: object) -> None:
        pass

    def wait_for(self, tokens: int) -> None:
        """Block until ``tokens`` tokens arrived or the sequence ended (bounded by WAIT_S)."""
        with self._changed:
            if not self._changed.wait_for(
                lambda: len(self.times) >= tokens or self.finished, timeout=WAIT_S
            ):
                raise TimeoutError(f"no {tokens} tokens within {WAIT_S:.0f}s")

    def wait_finished(self) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self.finished, timeout=WAIT_S):
                raise TimeoutError(f"sequence not finished within {WAIT_S:.0f}s")


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkRun:
    chunk: int
    n_batch: int
    prompt_tokens: int
    long_ttft_s: float
    """From submitting the long prompt to its first token."""
    stall_max_s: float
    """Largest inter-token gap of any decoding stream overlapping the prefill."""
    gap_p50_during_s: float
    gap_p50_before_s: float
    """The decoding streams' median gap before the long prompt arrived (baseline)."""
    decode_tokens_per_s_during: float
    """The decoding streams' aggregate rate while the long prompt was prefilled."""
    others_cpu_share: float
    """CPU used by other processes during the run, as a share of the whole machine."""


def _request(tokens: list[int], max_tokens: int) -> SequenceRequest:
    return SequenceRequest(
        prompt_tokens=tuple(tokens),
        max_tokens=max_tokens,
        sampling=SamplingParams(),
        ignore_eos=True,
    )


def measure_once(engine: LlamaEngine, long_prompt: list[int], decoders: int) -> ChunkRun:
    """One long prompt arriving while ``decoders`` sequences decode."""
    meter = CpuMeter([os.getpid()])
    warm, tail = 8, 4
    recorders = [_Recorder() for _ in range(decoders)]
    budget = engine.settings.context_per_sequence - 32
    handles = [
        engine.submit(_request(engine.tokenize(PROMPTS[i], add_special=True), budget), r)
        for i, r in enumerate(recorders)
    ]
    try:
        for r in recorders:
            r.wait_for(warm)
        long = _Recorder()
        submitted = time.perf_counter()
        engine.submit(_request(long_prompt, 4), long)
        long.wait_for(1)
        first = long.times[0]
        # Each stream's first token after the prefill closes the gap that spans it.
        for r in recorders:
            r.wait_for(len([t for t in r.times if t <= first]) + tail)
        long.wait_finished()
    finally:
        for h in handles:
            h.cancel()
        for r in recorders:
            r.wait_finished()
    during: list[float] = []
    before: list[float] = []
    tokens_during = 0
    for r in recorders:
        for a, b in zip(r.times, r.times[1:], strict=False):
            if b > submitted and a < first:
                during.append(b - a)
            elif b <= submitted:
                before.append(b - a)
        tokens_during += sum(1 for t in r.times if submitted < t <= first)
    return ChunkRun(
        chunk=engine.settings.prefill_chunk,
        n_batch=engine.settings.n_batch,
        prompt_tokens=len(long_prompt),
        long_ttft_s=first - submitted,
        stall_max_s=max(during),
        gap_p50_during_s=percentile(during, 50) or 0.0,
        gap_p50_before_s=percentile(before, 50) or 0.0,
        decode_tokens_per_s_during=tokens_during / (first - submitted),
        others_cpu_share=meter.stop(),
    )


def measure(
    model: Path,
    chunk: int,
    prompt_tokens: int,
    decoders: int,
    repeats: int,
    settle: Callable[[], object],
) -> list[ChunkRun]:
    # The engine wants a chunk to fit beside one token of every sequence it could hold
    # (chunk <= n_batch - n_seq_max); only chunks above 504 need more than the default 512.
    n_seq_max = ServerConfig().n_seq_max
    n_batch = max(512, chunk + n_seq_max)
    engine = LlamaEngine(
        engine_settings_for(
            model,
            prefill_chunk=chunk,
            n_batch=n_batch,
            cpu_extra_buffers=probe_cpu_extra_buffers(model),
        )
    )
    try:
        text = _PARAGRAPH * (prompt_tokens // 60 + 2)
        long_prompt = engine.tokenize(text, add_special=True)[:prompt_tokens]
        warmup = _Recorder()
        engine.submit(_request(long_prompt[:64], 2), warmup)
        warmup.wait_finished()
        runs: list[ChunkRun] = []
        for _ in range(repeats):
            settle()
            runs.append(measure_once(engine, long_prompt, decoders))
        return runs
    finally:
        engine.close()


def markdown(results: dict[int, list[ChunkRun]], meta: dict[str, object], decoders: int) -> str:
    lines = [
        f"# Prefill chunk size {meta['timestamp']}",
        "",
        f"{decoders} streams decoding; a {meta['prompt_tokens']}-token prompt arrives. "
        f"{meta['repeats']} run(s) per chunk size; shown: of the runs least disturbed by other "
        f"processes, the median TTFT; {meta['cpus']} CPUs, load average "
        f"{meta['loadavg_start']:.2f} at start, {meta['loadavg_end']:.2f} at end.",
        "",
        "| chunk | steps | long prompt TTFT ms | decode stall (max gap) ms | gap p50 while "
        "prefilling ms | gap p50 before ms | decode tokens/s while prefilling | others' CPU |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for chunk, runs in results.items():
        r = pick(runs, lambda r: r.others_cpu_share, lambda r: r.long_ttft_s)
        room = min(chunk, r.n_batch - decoders)
        steps = -(-r.prompt_tokens // room)
        label = f"{chunk} (unchunked)" if steps == 1 else str(chunk)
        lines.append(
            f"| {label} | {steps} | {r.long_ttft_s * 1e3:.0f} | {r.stall_max_s * 1e3:.0f} "
            f"| {r.gap_p50_during_s * 1e3:.0f} | {r.gap_p50_before_s * 1e3:.0f} "
            f"| {r.decode_tokens_per_s_during:.1f} | {r.others_cpu_share:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.prefill_chunk")
    parser.add_argument(
        "--chunks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[32, 64, 128, 256, 512, 2048],
        help="chunk sizes; one >= the prompt is the unchunked reference",
    )
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    parser.add_argument(
        "--quiet-below",
        type=float,
        default=0.15,
        help="before each run, wait until other processes use less than this share of the "
        "machine (default 0.15)",
    )
    parser.add_argument(
        "--quiet-patience-s",
        type=float,
        default=60.0,
        help="longest wait for that before running anyway; 0 never waits (default 60)",
    )
    parser.add_argument(
        "--report-only",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="measure nothing: print the table of earlier runs' prefill-chunk-*.json (runs of "
        "the same chunk size from several files are pooled)",
    )
    parser.add_argument("--quick", action="store_true", help="chunks 64,256; 500 tokens; 1 run")
    args = parser.parse_args(argv)
    if args.report_only:
        print(_rerender(args.report_only))
        return 0
    if args.quick:
        args.chunks, args.prompt_tokens, args.repeats = [64, 256], 500, 1
        args.quiet_patience_s = 0.0
    model = args.model or _default_model_path()
    timestamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    loadavg_start = os.getloadavg()[0]

    def settle() -> float:
        if args.quiet_patience_s <= 0:
            return 0.0
        return wait_until_quiet(args.quiet_below, args.quiet_patience_s)

    results: dict[int, list[ChunkRun]] = {}
    for chunk in args.chunks:
        runs = measure(model, chunk, args.prompt_tokens, args.decoders, args.repeats, settle)
        results[chunk] = runs
        for r in runs:
            print(
                f"chunk {chunk}: TTFT {r.long_ttft_s * 1e3:.0f} ms, "
                f"stall {r.stall_max_s * 1e3:.0f} ms, others' CPU {r.others_cpu_share:.0%}",
                file=sys.stderr,
                flush=True,
            )
    meta: dict[str, object] = {
        "timestamp": timestamp,
        "model": model.name,
        "prompt_tokens": args.prompt_tokens,
        "decoders": args.decoders,
        "repeats": args.repeats,
        "quiet_below": args.quiet_below,
        "quiet_patience_s": args.quiet_patience_s,
        "cpus": os.cpu_count(),
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg()[0],
    }
    text = markdown(results, meta, args.decoders)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"prefill-chunk-{timestamp}"
    Path(f"{stem}.md").write_text(text)
    payload = {"meta": meta, "runs": {c: [asdict(r) for r in rs] for c, rs in results.items()}}
    Path(f"{stem}.json").write_text(json.dumps(payload, indent=2))
    print(text)
    print(f"wrote {stem}.md and {stem}.json", file=sys.stderr)
    return 0


def _rerender(paths: list[Path]) -> str:
    payloads = [json.loads(p.read_text()) for p in paths]
    results: dict[int, list[ChunkRun]] = {}
    for payload in payloads:
        for chunk, runs in payload["runs"].items():
            results.setdefault(int(chunk), []).extend(ChunkRun(**r) for r in runs)
    meta = dict(payloads[0]["meta"])
    if len(paths) > 1:
        meta["timestamp"] = " + ".join(str(p["meta"]["timestamp"]) for p in payloads)
        meta["loadavg_end"] = payloads[-1]["meta"]["loadavg_end"]
    return markdown(dict(sorted(results.items())), meta, int(meta["decoders"]))


if __name__ == "__main__":
    sys.exit(main())
