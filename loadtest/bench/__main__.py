"""Side-by-side benchmark: raw llama.cpp ceiling, quicsrv over QUIC, llama-cpp-python's server.

Same model, same prompts, greedy, ``max_tokens`` fixed, end-of-generation ignored. Everything
runs one after another on this machine, never two model servers at once::

    .venv/bin/python -m loadtest.bench            # full run: 15-30 min on 2 cores (3 repeats,
                                                  # each waiting up to 60 s for a quiet machine)
    .venv/bin/python -m loadtest.bench --quick    # smoke run, about a minute

Prints the markdown table and writes ``loadtest/results/bench-<timestamp>.{md,json,png}``.
See ``loadtest/README.md`` for what each column means.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest.bench.engine import ENGINE, measure_engine
from loadtest.bench.isolated import isolated
from loadtest.bench.llama_server import llama_server, llama_server_argv
from loadtest.bench.llama_server_build import find_llama_server
from loadtest.bench.load import run_quicsrv_load, run_sse_load
from loadtest.bench.machine import CpuMeter, Quiet, process_cpu_s
from loadtest.bench.raw import BEST_VARIANT, RawResult, end_of_generation_tokens, measure_raw
from loadtest.bench.report import QUICSRV, Report, write_chart
from loadtest.bench.servers import (
    ServerSettings,
    llama_cpp_server,
    llama_cpp_server_argv,
    quicsrv_server,
)
from loadtest.bench.stats import LoadResult, StreamResult, summarise
from quicsrv.config import ServerConfig
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv.settings import probe_cpu_extra_buffers

DESCRIPTION = "Side-by-side benchmark: raw llama.cpp, quicsrv over QUIC, llama-cpp-python server."
LLAMA_SERVER = "llama-cpp-python server"
LLAMA_SERVER_QUEUED = "llama-cpp-python server (queued)"
LLAMA_CPP_SERVER = "llama-server (llama.cpp)"
WARMUP_TOKENS = 8

_Driver = Callable[[int, int, float], Awaitable[tuple[float, list[StreamResult]]]]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench", description=DESCRIPTION)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument(
        "--loads",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 4, 8, 16],
        help="comma-separated concurrent stream counts (default 1,4,8,16)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per cell; of the least disturbed, the median is shown (default 3)",
    )
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
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"), help="output dir")
    parser.add_argument(
        "--llama-server",
        choices=["both", "default", "queued", "none"],
        default="both",
        help="llama-cpp-python server variants: its default (interrupt_requests=True), "
        "queued (interrupt_requests=False), both, or none",
    )
    parser.add_argument(
        "--llama-cpp-server",
        default="auto",
        metavar="PATH|auto|none",
        help="llama.cpp's C++ llama-server too: auto (default) runs the cached build of "
        "`python -m loadtest.bench.llama_server_build` if there is one",
    )
    parser.add_argument("--parallel", type=int, default=8, help="quicsrv sequences per step")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads (all)")
    parser.add_argument("--ctx", type=int, default=2048, help="context per sequence")
    parser.add_argument("--prefill-chunk", type=int, help="quicsrv prefill_chunk_tokens")
    parser.add_argument(
        "--flash-attn",
        action=argparse.BooleanOptionalAction,
        default=ServerConfig().flash_attn,
        help="flash attention for all targets (default: quicsrv's default, on)",
    )
    parser.add_argument("--model", type=Path, help="GGUF (default: the project's default)")
    parser.add_argument(
        "--report-only",
        type=Path,
        metavar="JSON",
        help="measure nothing: re-render a previous run's bench-*.json (md, png, json)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 16 tokens, loads 1,4, one repeat"
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        metavar="DIR",
        help="also run the quicsrv of another checkout (e.g. `git worktree add /tmp/base HEAD~3`)"
        ", its runs interleaved with this tree's, as a before/after comparison",
    )
    parser.add_argument(
        "--baseline-ack-delay-ms",
        type=float,
        metavar="MS",
        help="the load client's ACK delay against the baseline tree (e.g. 1: aioquic's own, "
        "as clients acknowledged before they delayed ACKs); default: the client's default",
    )
    return parser


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _commit(tree: Path | None = None) -> str:
    git = ["git"] if tree is None else ["git", "-C", str(tree)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"], check=False).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _timeout_s(streams: int, max_tokens: int) -> float:
    # Generous: 60 s plus 20 tokens/s aggregate, far below anything measured here.
    return 60.0 + streams * max_tokens / 20.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What every server is put through, and how long to wait for a quiet machine first."""

    loads: list[int]
    max_tokens: int
    repeats: int
    settle: Quiet
    """Called before every run: waits (bounded) until other processes leave the machine."""


def _sse_driver(port: int, suppressed_tokens: list[int]) -> _Driver:
    """Load an OpenAI-compatible server on ``port`` over SSE (end tokens biased away)."""

    async def drive(
        streams: int, max_tokens: int, timeout_s: float
    ) -> tuple[float, list[StreamResult]]:
        return await run_sse_load(
            port,
            streams=streams,
            max_tokens=max_tokens,
            timeout_s=timeout_s,
            suppressed_tokens=suppressed_tokens,
        )

    return drive


async def _measure_server(target: str, pid: int, drive: _Driver, plan: Plan) -> list[LoadResult]:
    """Warm up with one short stream, then every load ``plan.repeats`` times."""
    return await _measure_interleaved([(target, pid, drive)], plan)


#: Runs the raw loop at a load's sequence count, tagged with a round (blocking, in-process).
_RawProbe = Callable[[int, int], list[RawResult]]


async def _measure_interleaved(
    targets: list[tuple[str, int, _Driver]],
    plan: Plan,
    raw_probe: _RawProbe | None = None,
    raw_runs: list[RawResult] | None = None,
) -> list[LoadResult]:
    """Like :func:`_measure_server` for servers running side by side: each repeat of a load
    (a round) runs every target in turn, in alternating order, so drift in the machine hits
    all alike. With ``raw_probe`` the raw loop takes its turn in every round too (its results
    go to ``raw_runs``), so each server run has a raw rate measured beside it."""
    for _, _, drive in targets:
        await drive(1, WARMUP_TOKENS, _timeout_s(1, WARMUP_TOKENS))
    results: list[LoadResult] = []
    rounds = itertools.count()
    for streams in plan.loads:
        for repeat in range(plan.repeats):
            round_ = next(rounds)
            turns: list[tuple[str, int, _Driver] | None] = [*targets]
            if raw_probe is not None:
                turns.insert(0, None)  # the raw loop's turn
            for turn in turns if repeat % 2 == 0 else turns[::-1]:
                await asyncio.to_thread(plan.settle)
                if turn is None:
                    assert raw_probe is not None and raw_runs is not None
                    raw_runs += await asyncio.to_thread(raw_probe, streams, round_)
                    continue
                target, pid, drive = turn
                meter = CpuMeter([os.getpid(), pid])
                server_cpu = process_cpu_s(pid)
                started, seen = await drive(
                    streams, plan.max_tokens, _timeout_s(streams, plan.max_tokens)
                )
                result = summarise(target, plan.max_tokens, started, seen, meter.stop())
                if target.startswith("quicsrv"):
                    result = dataclasses.replace(
                        result, server_cpu_s=process_cpu_s(pid) - server_cpu
                    )
                if raw_probe is not None:
                    result = dataclasses.replace(result, round=round_)
                _log(
                    f"  {target}, {streams} streams: {result.tokens_per_s:.1f} tokens/s, "
                    f"{result.delivered_tokens}/{result.expected_tokens} tokens delivered, "
                    f"finishes {result.finishes}, others' CPU {result.others_cpu_share:.0%}"
                    + (
                        f", server process {cpu:.0f} µs CPU per token"
                        if (cpu := result.server_cpu_us_per_token) is not None
                        else ""
                    )
                )
                results.append(result)
    return results


def _fastest(settings: ServerSettings) -> ServerSettings:
    """The reference the issue's 8-stream target names: the fastest raw settings, even those
    quicsrv cannot use because resumes would not be exact."""
    return dataclasses.replace(settings, flash_attn=True, kv_unified=True)


def _raw_probe(settings: ServerSettings, max_tokens: int) -> _RawProbe:
    """The raw loop at a load's sequence count (and at the fastest settings at full batch)."""

    def probe(streams: int, round_: int) -> list[RawResult]:
        n = min(streams, settings.parallel)
        runs = isolated(measure_raw, settings, [n], max_tokens)
        if n == settings.parallel:
            runs += isolated(measure_raw, _fastest(settings), [n], max_tokens, variant=BEST_VARIANT)
        return [dataclasses.replace(r, round=round_) for r in runs]

    return probe


async def _measure_servers(
    settings: ServerSettings,
    plan: Plan,
    args: argparse.Namespace,
    logs: Path,
    eog: list[int],
    paired_raw: list[RawResult],
    llama_cpp_binary: Path | None,
) -> list[LoadResult]:
    """Every server; quicsrv's runs each get a raw run beside them (into ``paired_raw``)."""
    # SIGTERM cancels this task, so the servers it started are stopped on the way out.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    results: list[LoadResult] = []
    with tempfile.TemporaryDirectory(prefix="quicsrv-bench-") as tmp:
        certs = ensure_dev_certs(Path(tmp))
        _log(f"quicsrv over QUIC (log: {logs / 'quicsrv.log'})")
        async with contextlib.AsyncExitStack() as servers:
            targets: list[tuple[str, int, _Driver]] = []
            trees: list[tuple[str, Path | None, str, float | None]] = [
                (QUICSRV, None, "quicsrv.log", None)
            ]
            if args.baseline_tree is not None:
                name = f"quicsrv @ {_commit(args.baseline_tree)}"
                ack_ms = args.baseline_ack_delay_ms
                if ack_ms is not None:
                    name += f" (client ACK delay {ack_ms:g} ms)"
                ack_s = None if ack_ms is None else ack_ms / 1000
                trees.append((name, args.baseline_tree.resolve(), "quicsrv-baseline.log", ack_s))
            for target, tree, log_name, ack_delay_s in trees:
                quic = await servers.enter_async_context(
                    quicsrv_server(
                        settings,
                        certs.server_cert,
                        certs.server_key,
                        logs / log_name,
                        prefill_chunk=args.prefill_chunk,
                        tree=tree,
                    )
                )

                async def drive_quic(
                    streams: int,
                    max_tokens: int,
                    timeout_s: float,
                    port: int = quic.port,
                    ack_delay_s: float | None = ack_delay_s,
                ) -> tuple[float, list[StreamResult]]:
                    return await run_quicsrv_load(
                        port,
                        certs.ca_cert,
                        streams=streams,
                        max_tokens=max_tokens,
                        timeout_s=timeout_s,
                        ack_delay_s=ack_delay_s,
                    )

                targets.append((target, quic.pid, drive_quic))
            probe = _raw_probe(settings, plan.max_tokens)
            results += await _measure_interleaved(targets, plan, probe, paired_raw)
    variants = {
        "both": [(LLAMA_SERVER, True), (LLAMA_SERVER_QUEUED, False)],
        "default": [(LLAMA_SERVER, True)],
        "queued": [(LLAMA_SERVER_QUEUED, False)],
        "none": [],
    }[args.llama_server]
    if variants and not settings.cpu_extra_buffers:
        # quicsrv's canary found that llama.cpp's extra CPU buffers crash here (AMX), and
        # llama-cpp-python's server has no way to turn them off: it would die on its first
        # batched decode.
        _log("llama-cpp-python server skipped: its llama.cpp extra CPU buffers crash on this CPU")
        variants = []
    for name, interrupt in variants:
        log = logs / f"llama_cpp_server-interrupt_{interrupt}.log"
        _log(f"{name} over SSE (log: {log})")
        async with llama_cpp_server(settings, log, interrupt_requests=interrupt) as http:
            drive = _sse_driver(http.port, eog)
            results += await _measure_server(name, http.pid, drive, plan)
    if llama_cpp_binary is not None:
        log = logs / "llama-server.log"
        _log(f"{LLAMA_CPP_SERVER} over SSE (log: {log})")
        async with llama_server(llama_cpp_binary, settings, log) as http:
            drive = _sse_driver(http.port, eog)
            results += await _measure_server(LLAMA_CPP_SERVER, http.pid, drive, plan)
    return results


def _llama_cpp_server_binary(choice: str) -> Path | None:
    """llama.cpp's llama-server to measure: a path, the cached build (auto), or none."""
    if choice == "none":
        return None
    found = find_llama_server() if choice == "auto" else Path(choice)
    if found is None or not found.is_file():
        _log(
            f"{LLAMA_CPP_SERVER} skipped: "
            + (
                "no build (python -m loadtest.bench.llama_server_build)"
                if found is None
                else f"{found} not found"
            )
        )
        return None
    return found


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.report_only is not None:
        _write(Report.from_json(args.report_only.read_text()), args.report_only.with_suffix(""))
        return 0
    if args.quick:
        args.max_tokens, args.loads, args.repeats, args.quiet_patience_s = 16, [1, 4], 1, 0.0
    settings = ServerSettings(
        model_path=args.model or default_model_path(),
        n_threads=args.threads,
        context_per_sequence=args.ctx,
        parallel=args.parallel,
        flash_attn=args.flash_attn,
        # In-process targets below run llama.cpp in this process: a worker process tries the
        # extra buffers (AMX) first, so a machine where they crash measures the safe mode.
        cpu_extra_buffers=probe_cpu_extra_buffers(args.model or default_model_path()),
    )
    timestamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / f"bench-{timestamp}-logs"
    logs.mkdir()
    loadavg_start = os.getloadavg()[0]

    plan = Plan(
        loads=args.loads,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        settle=Quiet(args.quiet_below, args.quiet_patience_s),
    )
    counts = sorted({min(n, args.parallel) for n in args.loads} | {1, args.parallel})
    _log(f"raw llama_decode loop: {counts} sequences per step")
    all_raw: list[RawResult] = []
    for _ in range(args.repeats):
        all_raw += isolated(measure_raw, settings, counts, args.max_tokens, before_each=plan.settle)
    for _ in range(args.repeats):
        all_raw += isolated(
            measure_raw,
            _fastest(settings),
            [args.parallel],
            args.max_tokens,
            before_each=plan.settle,
            variant=BEST_VARIANT,
        )
    for r in all_raw:
        _log(
            f"  raw{f' ({r.variant})' if r.variant else ''}, {r.sequences} sequences: "
            f"{r.tokens_per_s:.1f} tokens/s, others' CPU {r.others_cpu_share:.0%}"
        )
    _log("quicsrv's engine in-process (no transport)")
    all_loads = isolated(
        measure_engine,
        settings,
        args.loads,
        args.max_tokens,
        args.repeats,
        prefill_chunk=args.prefill_chunk,
        before_each=plan.settle,
    )
    for result in all_loads:
        _log(
            f"  engine, {result.streams} streams: {result.tokens_per_s:.1f} tokens/s, "
            f"others' CPU {result.others_cpu_share:.0%}"
        )
    eog = end_of_generation_tokens(settings)
    llama_cpp_binary = _llama_cpp_server_binary(args.llama_cpp_server)
    paired_raw: list[RawResult] = []
    try:
        all_loads += asyncio.run(
            _measure_servers(settings, plan, args, logs, eog, paired_raw, llama_cpp_binary)
        )
    except (KeyboardInterrupt, asyncio.CancelledError):
        _log("interrupted: servers stopped, nothing written")
        return 130

    baselines = list(
        dict.fromkeys(r.target for r in all_loads if r.target not in (QUICSRV, ENGINE))
    )
    meta: dict[str, Any] = {
        "timestamp": timestamp,
        "model": settings.model_path.name,
        "max_tokens": args.max_tokens,
        "loads": args.loads,
        "repeats": args.repeats,
        "quiet_below": args.quiet_below,
        "quiet_patience_s": args.quiet_patience_s,
        "n_threads": settings.n_threads,
        "context_per_sequence": settings.context_per_sequence,
        "n_batch": settings.n_batch,
        "parallel": settings.parallel,
        "flash_attn": settings.flash_attn,
        "prefill_chunk": args.prefill_chunk or ServerConfig().prefill_chunk_tokens,
        "cpus": os.cpu_count(),
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg()[0],
        "commit": _commit(),
        "llama_cpp_server_argv": llama_cpp_server_argv(settings, interrupt_requests=True)[1:],
        "llama_server_argv": (
            None if llama_cpp_binary is None else llama_server_argv(llama_cpp_binary, settings)
        ),
        "end_of_generation_tokens": eog,
        "notes": [
            "quicsrv: all streams of a load share one QUIC connection (project client); "
            "llama-cpp-python server: one HTTP/1.1 connection per stream (httpx), "
            "`/v1/completions` with `stream: true`.",
            f"llama-cpp-python server flags: --n_ctx {settings.context_per_sequence} "
            f"--n_batch {settings.n_batch} --n_ubatch {settings.n_batch} "
            f"--n_threads {settings.n_threads} --n_threads_batch {settings.n_threads} "
            f"--flash_attn {settings.flash_attn} --logits_all False --verbose False "
            "--interrupt_requests True|False; it decodes one sequence at a time (it has no "
            "parallel setting), so its context is one sequence's.",
            "EOS: quicsrv and the raw loop decode past it (ignore_eos); the OpenAI API has no "
            f"such flag, so the server gets logit_bias -100 on {eog} instead.",
            "`÷ raw` compares with the raw rate at min(streams, parallel) sequences per step.",
            f"`{ENGINE}`: quicsrv's LlamaEngine driven directly, tokens timed on its worker "
            "thread: the engine's own overhead without sessions, HTTP/3, QUIC or a client.",
            *(
                []
                if settings.cpu_extra_buffers
                else [
                    "llama.cpp's extra CPU buffers crash on this CPU (quicsrv's canary): every "
                    "target runs without them, and llama-cpp-python's server, which cannot turn "
                    "them off, is not measured."
                ]
            ),
        ],
    }
    report = Report.build(meta, all_raw + paired_raw, all_loads, baselines)
    _write(report, args.out / f"bench-{timestamp}")
    _log(f"server logs in {logs}")
    return 0


def _write(report: Report, stem: Path) -> None:
    markdown = report.markdown()
    Path(f"{stem}.md").write_text(markdown)
    Path(f"{stem}.json").write_text(report.to_json())
    write_chart(report, Path(f"{stem}.png"))
    print(markdown)
    _log(f"wrote {stem}.md, {stem}.json, {stem}.png")


if __name__ == "__main__":
    started = time.monotonic()
    status = main()
    _log(f"done in {time.monotonic() - started:.0f} s")
    sys.exit(status)
