"""AIPerf (NVIDIA's LLM benchmark, PyPI ``aiperf``) against quicsrv's TCP endpoint and
llama.cpp's ``llama-server``, in the same run on the same machine (issue 40, item 4).

A benchmark nobody here wrote: AIPerf generates the prompts, keeps the concurrency, streams the
answers over HTTP/1.1 (aiohttp) and computes TTFT, inter-token latency and throughput by its own
definitions. This module only starts both servers the way the other benches do
(:mod:`.servers`, :mod:`.llama_server`: same model, threads, slots, context, batch, flash
attention), makes AIPerf's tokenizer offline from the GGUF (:mod:`.aiperf_tokenizer`, checked
token for token against llama.cpp), runs AIPerf against each server in turn, workload by
workload, and tabulates its exports (:mod:`.aiperf_report`)::

    make aiperf-venv                                  # AIPerf in its own venv, once
    .venv/bin/python -m loadtest.bench.llama_server_build   # llama-server, once (~12 min)
    .venv/bin/python -m loadtest.bench.aiperf_run     # or: make bench-aiperf

Workloads (defaults): streamed ``/v1/chat/completions``, synthetic 256-token user messages
(AIPerf's Shakespeare corpus) and 128-token answers (``ignore_eos``), concurrency 1, 8 and 32,
then a multi-turn run (conversations of 4 turns, each turn resending the history with the
answers). Every request of a workload has its own prompt (``--conversation-num`` = requests)
and each workload its own seed, so no prompt is ever answered from a whole-prompt cache hit;
both servers get the same seeds, hence the same prompts.

AIPerf lives in its own virtual environment (``~/.cache/quicsrv/aiperf/venv``, or
``$QUICSRV_AIPERF_HOME/venv``): its dependencies (transformers, pandas, numpy 2...) never
touch the project's. It is never run by the tests or CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest.bench.aiperf_report import (
    LLAMA_SERVER,
    QUICSRV,
    Cell,
    CpuSample,
    Measured,
    RunResult,
    cpu_shares,
    read_export,
    read_records,
    render,
)
from loadtest.bench.llama_server import llama_server, llama_server_argv
from loadtest.bench.llama_server_build import cmake_options, find_llama_server
from loadtest.bench.machine import Quiet, machine_busy_s, machine_name, tree_cpu_s
from loadtest.bench.servers import ServerSettings, quicsrv_server

__all__ = ["Target", "aiperf_argv", "aiperf_home", "ensure_tokenizer", "main", "workloads"]

AIPERF_VERSION = "0.13.0"
REPO = Path(__file__).resolve().parents[2]
_CPUS = os.cpu_count() or 1

#: Texts the built tokenizer must split exactly as llama.cpp does before a run: digits, runs of
#: spaces, tabs, newlines, contractions, non-ASCII, an emoji, the chat markers.
CHECK_TEXTS = (
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate:",
    "Rough winds do shake the darling buds of May,\n\n  And summer's lease hath all too short",
    "Numbers 1234567890 and 3.14159, tabs\tand    spaces; it's they'll we'd",
    "Ünïcödé: été, naïve, Straße, 東京, emoji 😀 and <|im_start|>user\nhi<|im_end|>",
)


def aiperf_home() -> Path:
    """Where AIPerf's venv and the tokenizers made for it live (outside the repository)."""
    root = os.environ.get("QUICSRV_AIPERF_HOME")
    return Path(root) if root else Path.home() / ".cache" / "quicsrv" / "aiperf"


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A started server as AIPerf reaches it."""

    name: str
    """``quicsrv`` or ``llama-server``."""
    url: str
    """Base URL (AIPerf appends ``/v1/chat/completions``)."""
    pid: int
    """The server process (its CPU is not "others'")."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables for AIPerf (``SSL_CERT_FILE``: quicsrv's dev CA, verification stays on)."""


def workloads(
    concurrencies: Sequence[int],
    *,
    requests_per_slot: int,
    min_requests: int,
    multi_turn_conversations: int,
    multi_turn_turns: int,
    multi_turn_concurrency: int,
    rates: Sequence[float] = (),
    rate_requests: int = 48,
) -> list[Cell]:
    """The workloads of a run: one per concurrency (``max(min_requests, requests_per_slot *
    concurrency)`` requests), one per open-loop rate (``rate_requests`` requests, none held
    back: at most all in flight), then the multi-turn one unless it has no conversations."""
    cells = [
        Cell(name=f"c={c}", concurrency=c, requests=max(min_requests, requests_per_slot * c))
        for c in concurrencies
    ]
    cells += [
        Cell(name=f"{rate:g}/s", concurrency=rate_requests, requests=rate_requests, rate=rate)
        for rate in rates
    ]
    if multi_turn_conversations > 0 and multi_turn_turns > 1:
        cells.append(
            Cell(
                name=f"multi-turn {multi_turn_turns}×, c={multi_turn_concurrency}",
                concurrency=multi_turn_concurrency,
                requests=multi_turn_conversations * multi_turn_turns,
                turns=multi_turn_turns,
            )
        )
    return cells


def aiperf_argv(
    executable: Path,
    *,
    target_url: str,
    model: str,
    tokenizer: Path,
    cell: Cell,
    endpoint: str,
    input_tokens: int,
    output_tokens: int,
    seed: int,
    artifact_dir: Path,
    request_timeout_s: float,
    pace_rps: float = 200.0,
    connection_reuse: str = "never",
) -> list[str]:
    """``aiperf profile`` for one workload against one server.

    One worker and one record processor: AIPerf runs a process per service, and on a 2-core
    machine every extra one takes CPU from the server it measures (one worker's aiohttp keeps
    32 streams). ``--use-server-token-count``: output tokens are the server's own count (exactly
    the 128 asked), not a re-tokenization of the text, which may merge or split differently;
    the tokenizer still sizes the prompts. Server /metrics and GPU telemetry are off.

    ``pace_rps``: AIPerf's plain concurrency mode ("concurrency burst") has its timing service
    retry for a free slot in a loop that only yields to its event loop, so it spins a whole core
    for the entire run (seen at 30-50% of this 2-core machine, taken from the servers). A
    request rate beside the concurrency makes it sleep between tries instead: at 200 requests/s
    (constant arrivals) it looks at most every 5 ms, so a freed slot waits 2.5 ms on average and
    a burst of 32 is sent within 160 ms. 0: AIPerf's spinning default. An open-loop workload
    (:attr:`Cell.rate`) is sent at its own rate instead, Poisson, its cap all its requests.

    ``connection_reuse`` (AIPerf's ``--connection-reuse-strategy``): ``never``, a connection a
    request, by default. With AIPerf's pooled default, llama-server (cpp-httplib: an idle
    kept-alive connection is closed after 5 s) failed 1-4 of 64 requests a c=32 run, each a
    pooled connection it had begun to close as AIPerf wrote to it (``ServerDisconnectedError``,
    "Cannot write to closing transport"). A failed request is work the server never does, so
    the rest of its queue moved up: its TTFT gained what its errors lost. On loopback a new
    connection costs well under a millisecond against TTFTs of seconds.
    """
    argv = [
        str(executable),
        "profile",
        "--model",
        model,
        "--url",
        target_url,
        "--endpoint-type",
        endpoint,
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "--isl",
        str(input_tokens),
        "--isl-stddev",
        "0",
        "--osl",
        str(output_tokens),
        "--osl-stddev",
        "0",
        # Both servers know llama.cpp's name; the answer is always output_tokens long.
        "--extra-inputs",
        "ignore_eos:true",
        "--use-server-token-count",
        "--concurrency",
        str(cell.concurrency),
        *_arrivals(cell, pace_rps),
        "--connection-reuse-strategy",
        connection_reuse,
        "--request-count",
        str(cell.requests),
        "--conversation-num",
        str(cell.conversations),
        "--random-seed",
        str(seed),
        "--request-timeout-seconds",
        f"{request_timeout_s:g}",
        "--artifact-dir",
        str(artifact_dir),
        "--workers-max",
        "1",
        "--record-processors",
        "1",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--ui",
        "none",
    ]
    if cell.turns > 1:
        argv += [
            "--conversation-turn-mean",
            str(cell.turns),
            "--conversation-turn-stddev",
            "0",
            "--conversation-turn-delay-mean",
            "0",
        ]
    return argv


def _arrivals(cell: Cell, pace_rps: float) -> list[str]:
    if cell.rate > 0:
        return ["--request-rate", f"{cell.rate:g}", "--arrival-pattern", "poisson"]
    if pace_rps > 0:
        return ["--request-rate", f"{pace_rps:g}", "--arrival-pattern", "constant"]
    return []


def _aiperf_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    # Not HF_HUB_OFFLINE: AIPerf 0.13 then looks a tokenizer up in the hub cache by name even
    # when it is a local folder and fails; a local path never reaches the network anyway.
    # AIPerf's timing service paces requests with a high-resolution timer loop by default,
    # which kept ~half a core busy on this machine even at a fixed concurrency (no rate to
    # pace): the event loop's timers are enough there, and the servers get that CPU back.
    env.update({"HF_HUB_DISABLE_TELEMETRY": "1", "AIPERF_TIMING_HIGH_RES_TIMER": "false", **extra})
    return env


async def _sample_cpu(
    server_pid: int, aiperf_pid: int, into: list[CpuSample], every_s: float = 0.5
) -> None:
    """Append a :class:`CpuSample` every ``every_s`` until cancelled."""
    while True:
        into.append(
            CpuSample(time.time(), machine_busy_s(), tree_cpu_s(server_pid), tree_cpu_s(aiperf_pid))
        )
        await asyncio.sleep(every_s)


async def _run_aiperf(
    argv: Sequence[str], target: Target, log: Path, timeout_s: float
) -> list[CpuSample]:
    """Run one AIPerf invocation to its end, sampling the CPU of the machine, the server and
    AIPerf's processes meanwhile (the caller keeps the profiling phase's window of them)."""
    samples: list[CpuSample] = []
    with log.open("w") as out:
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=REPO,
            env=_aiperf_env(target.env),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
        sampler = asyncio.create_task(_sample_cpu(target.pid, process.pid, samples))
        try:
            code = await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            raise RuntimeError(f"aiperf ran past {timeout_s:.0f}s; see {log}") from None
        finally:
            sampler.cancel()
            if process.returncode is None:
                # Timed out, interrupted (Ctrl-C) or cancelled: AIPerf's SIGINT handler stops
                # its services and exits; they must not go on loading the servers.
                process.send_signal(signal.SIGINT)
                try:
                    await asyncio.wait_for(asyncio.shield(process.wait()), 30)
                except TimeoutError:
                    process.kill()
    if code != 0:
        raise RuntimeError(f"aiperf exited with {code}; see {log}")
    return samples


def _profiling_window(export: Mapping[str, object]) -> tuple[float, float]:
    """The profiling phase's start and end (``time.time()`` scale): AIPerf writes them as local
    ISO times without a zone."""
    start, end = export.get("start_time"), export.get("end_time")
    if not isinstance(start, str) or not isinstance(end, str):
        return float("nan"), float("nan")
    return datetime.fromisoformat(start).timestamp(), datetime.fromisoformat(end).timestamp()


def _aiperf_python(home: Path) -> Path:
    return home / "venv" / "bin" / "python"


def ensure_tokenizer(model_path: Path, home: Path) -> Path:
    """The tokenizer folder for ``model_path`` (made once, in AIPerf's venv), after checking
    that it splits :data:`CHECK_TEXTS` into llama.cpp's tokens."""
    from quicsrv.engine.vocab import Vocabulary

    vocabulary = Vocabulary.load(model_path)
    try:
        folder = home / "tokenizers" / f"{model_path.stem}-{vocabulary.model_digest.hex()[:12]}"
        expected = [vocabulary.tokenize(text, add_special=False) for text in CHECK_TEXTS]
    finally:
        vocabulary.close()
    python = str(_aiperf_python(home))
    module = "loadtest.bench.aiperf_tokenizer"
    if not (folder / "tokenizer.json").is_file():
        partial = folder.with_name(folder.name + ".partial")
        _checked_run([python, "-m", module, "build", str(model_path), str(partial)])
        partial.rename(folder)
    encoded = _checked_run(
        [python, "-m", module, "encode", str(folder)], stdin=json.dumps(CHECK_TEXTS)
    )
    got = json.loads(encoded.splitlines()[-1])
    for text, ours, theirs in zip(CHECK_TEXTS, got, expected, strict=True):
        if ours != theirs:
            raise RuntimeError(
                f"tokenizer {folder} differs from llama.cpp on {text!r}:\n {ours}\n {theirs}"
            )
    return folder


def _checked_run(argv: Sequence[str], stdin: str | None = None) -> str:
    done = subprocess.run(
        argv, cwd=REPO, input=stdin, capture_output=True, text=True, env=_aiperf_env({})
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


async def _warm_up(target: Target, model: str, ca: Path | None) -> None:
    """One short chat completion, so that neither server's first measured request pays for its
    first use (allocations, page faults, the first graph)."""
    import httpx

    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
    }
    async with httpx.AsyncClient(verify=str(ca) if ca else False, timeout=120) as client:
        response = await client.post(f"{target.url}/v1/chat/completions", json=body)
        response.raise_for_status()


@contextlib.asynccontextmanager
async def _servers(
    settings: ServerSettings,
    binary: Path | None,
    logs: Path,
    model: str,
    tree: Path | None,
    queue_wait_s: float,
) -> AsyncIterator[list[Target]]:
    """quicsrv (HTTPS on its TCP listener; with ``tree``, that checkout's) and llama-server
    (plain HTTP), both up for the whole run."""
    from quicsrv.devcerts import ensure_dev_certs

    certs = ensure_dev_certs(logs / "certs")
    async with contextlib.AsyncExitStack() as stack:
        child = await stack.enter_async_context(
            quicsrv_server(
                settings,
                certs.server_cert,
                certs.server_key,
                logs / "quicsrv.log",
                tree=tree,
                # llama-server keeps a request in line for as long as it takes; quicsrv ends one
                # that cannot start within max_queue_wait_s (120 s) with deadline_exceeded,
                # which a slow machine reaches at concurrency 32. Same rule for both: the
                # request timeout.
                env={"QUICSRV_MAX_QUEUE_WAIT_S": f"{queue_wait_s:g}"},
            )
        )
        targets = [
            Target(
                name=QUICSRV,
                url=f"https://localhost:{child.port}",
                pid=child.pid,
                env={"SSL_CERT_FILE": str(certs.ca_cert)},
            )
        ]
        await _warm_up(targets[0], model, certs.ca_cert)
        if binary is not None:
            peer = await stack.enter_async_context(
                llama_server(binary, settings, logs / "llama-server.log")
            )
            targets.append(
                Target(name=LLAMA_SERVER, url=f"http://127.0.0.1:{peer.port}", pid=peer.pid)
            )
            await _warm_up(targets[1], model, None)
        yield targets


async def _measure(
    args: argparse.Namespace,
    settings: ServerSettings,
    binary: Path | None,
    tokenizer: Path,
    cells: Sequence[Cell],
    out: Path,
    save: Callable[[Sequence[RunResult]], object],
) -> list[RunResult]:
    """Every workload against every server; ``save`` gets the results so far after each run,
    so that an interrupted run (Ctrl-C, a session's end) still leaves its table."""
    model = settings.model_path.stem
    executable = aiperf_home() / "venv" / "bin" / "aiperf"
    quiet = Quiet(args.quiet_below, args.quiet_patience_s)
    results: list[RunResult] = []
    servers = _servers(settings, binary, out, model, args.tree, args.request_timeout_s)
    async with servers as targets:
        for r in range(args.repeats):
            for i, cell in enumerate(cells):
                # Same seed for both servers (same prompts), another for every workload and
                # repeat (no prompt answered twice by one server's cache).
                seed = args.seed + 1000 * r + i
                k = (r + i) % len(targets)  # who goes first alternates
                for target in targets[k:] + targets[:k]:
                    busy = await asyncio.to_thread(quiet)
                    run_dir = out / f"{target.name}-{i}-{cell.concurrency}-r{r}"
                    print(
                        f"repeat {r + 1}/{args.repeats} {cell.name}: {target.name} "
                        f"({cell.requests} requests, others' CPU {busy:.0%} before)",
                        flush=True,
                    )
                    argv = aiperf_argv(
                        executable,
                        target_url=target.url,
                        model=model,
                        tokenizer=tokenizer,
                        cell=cell,
                        endpoint=args.endpoint,
                        input_tokens=args.input_tokens,
                        output_tokens=args.output_tokens,
                        seed=seed,
                        artifact_dir=run_dir,
                        request_timeout_s=args.request_timeout_s,
                        pace_rps=args.pace_rps,
                        connection_reuse=args.connection_reuse,
                    )
                    samples = await _run_aiperf(
                        argv, target, out / f"{run_dir.name}.log", args.run_timeout_s
                    )
                    export = json.loads((run_dir / "profile_export_aiperf.json").read_text())
                    others, aiperf_cpu = cpu_shares(samples, *_profiling_window(export), _CPUS)
                    result = RunResult(
                        server=target.name,
                        cell=cell.name,
                        repeat=r,
                        measured=_measured(export, run_dir / "profile_export.jsonl"),
                        others_cpu_share=others,
                        aiperf_cpu_share=aiperf_cpu,
                        loadavg_1m=os.getloadavg()[0],
                    )
                    m = result.measured
                    print(
                        f"  TTFT p50 {m.ttft_p50_ms:.0f} ms, p90 {m.ttft_p90_ms:.0f} ms, "
                        f"ITL p50 {m.itl_p50_ms:.1f} ms, {m.output_tokens_per_s:.1f} tok/s, "
                        f"first tokens at {_seconds(m.first_token_at_s)}, "
                        f"{m.requests_ok} ok, {m.errors} failed, others' CPU {others:.0%}, "
                        f"AIPerf {aiperf_cpu:.0%}",
                        flush=True,
                    )
                    results.append(result)
                    save(results)
    return results


def _measured(export: Mapping[str, Any], records: Path) -> Measured:
    """AIPerf's summary, with when the requests were served from its per-request records."""
    measured = read_export(export)
    if not records.exists():
        return measured
    with records.open() as lines:
        served = read_records(lines)
    if served is None:
        return measured
    return replace(measured, first_token_at_s=served[0], end_at_s=served[1])


def _rates(text: str) -> list[float]:
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("a comma-separated list of positive rates")
    return values


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f} s"


def _concurrencies(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.aiperf_run",
        description="AIPerf against quicsrv (TCP) and llama-server, alternating, same machine",
    )
    add = parser.add_argument
    add("--concurrency", type=_concurrencies, default=[1, 8, 32], metavar="1,8,32")
    add(
        "--rates",
        type=_rates,
        default=[],
        metavar="0.4,0.5",
        help="open-loop workloads: requests/s arriving on their own (Poisson, seeded)",
    )
    add("--rate-requests", type=int, default=48, help="requests of each open-loop workload")
    add("--requests-per-slot", type=int, default=2, help="requests = this × concurrency ...")
    add("--min-requests", type=int, default=8, help="... but at least this many")
    add("--input-tokens", type=int, default=256, help="synthetic prompt (user message) tokens")
    add("--output-tokens", type=int, default=128, help="answer tokens (ignore_eos)")
    add("--multi-turn-conversations", type=int, default=8, help="0: no multi-turn run")
    add("--multi-turn-turns", type=int, default=4)
    add("--multi-turn-concurrency", type=int, default=4)
    add("--endpoint", choices=("chat", "completions"), default="chat")
    add("--repeats", type=int, default=1)
    add("--seed", type=int, default=40)
    add("--llama-server", default="auto", metavar="PATH|auto|none")
    add("--parallel", type=int, default=8, help="slots of each server")
    add("--threads", type=int, default=2)
    add("--ctx", type=int, default=2048, help="context per slot")
    add("--flash-attn", action=argparse.BooleanOptionalAction, default=None)
    add("--model", type=Path, help="GGUF (default: the project's default)")
    add(
        "--tree",
        type=Path,
        help="run the quicsrv of this checkout (e.g. `git archive HEAD` unpacked: the committed "
        "code while a working tree is being edited)",
    )
    add(
        "--pace-rps",
        type=float,
        default=200.0,
        help="AIPerf sends at most this many requests/s (constant) under the concurrency cap; "
        "0: its busy-polling burst mode",
    )
    add(
        "--connection-reuse",
        choices=("never", "pooled", "sticky-user-sessions"),
        default="never",
        help="AIPerf's --connection-reuse-strategy (pooled: AIPerf's default, on which "
        "llama-server drops a request or two a run)",
    )
    add("--request-timeout-s", type=float, default=900.0)
    add("--run-timeout-s", type=float, default=3600.0, help="one AIPerf invocation at most")
    add("--quiet-below", type=float, default=0.15)
    add("--quiet-patience-s", type=float, default=60.0)
    add("--out", type=Path, default=Path("loadtest/results"))
    add("--report-only", type=Path, metavar="JSON", help="re-render a run's JSON")
    return parser


def _heading(meta: Mapping[str, object]) -> str:
    return (
        f"AIPerf {meta['aiperf_version']} run {meta['stamp']} on {meta['machine']}; "
        f"load average {meta['loadavg_start']:.2f} at the start, {meta['loadavg_end']:.2f} at "
        f"the end. Streamed `/v1/{meta['endpoint_path']}`, {meta['input_tokens']}-token "
        f"synthetic prompts, {meta['output_tokens']}-token answers; both servers "
        f"{meta['parallel']} slots of {meta['ctx']} tokens, {meta['threads']} threads, flash "
        f"attention {'on' if meta['flash_attn'] else 'off'}; AIPerf's connections "
        f"{meta.get('connection_reuse', 'pooled')}. {meta.get('quicsrv', '')}; "
        f"{meta['llama_server_note']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.report_only is not None:
        saved = json.loads(args.report_only.read_text())
        results = [
            RunResult(**{**r, "measured": Measured(**r["measured"])}) for r in saved["results"]
        ]
        print(render(results, saved["cells"], heading=_heading(saved["meta"])))
        return 0
    from quicsrv.config import ServerConfig
    from quicsrv.engine import default_model_path
    from quicsrv.settings import probe_cpu_extra_buffers

    executable = aiperf_home() / "venv" / "bin" / "aiperf"
    if not executable.exists():
        print(f"no AIPerf at {executable}: run `make aiperf-venv` first", file=sys.stderr)
        return 2
    model = args.model or default_model_path()
    flash_attn = ServerConfig().flash_attn if args.flash_attn is None else args.flash_attn
    settings = ServerSettings(
        model_path=model,
        n_threads=args.threads,
        context_per_sequence=args.ctx,
        parallel=args.parallel,
        flash_attn=flash_attn,
        # quicsrv's canary decides (AMX machines crash with them); llama-server follows.
        cpu_extra_buffers=probe_cpu_extra_buffers(model),
    )
    binary: Path | None
    if args.llama_server == "none":
        binary, note = None, "llama-server skipped (--llama-server none)."
    elif args.llama_server == "auto":
        binary = find_llama_server()
        note = (
            "llama-server: the cached build of loadtest.bench.llama_server_build."
            if binary
            else "llama-server skipped: no build (python -m loadtest.bench.llama_server_build)."
        )
    else:
        binary, note = Path(args.llama_server), f"llama-server: {args.llama_server}."
    cells = workloads(
        args.concurrency,
        requests_per_slot=args.requests_per_slot,
        min_requests=args.min_requests,
        multi_turn_conversations=args.multi_turn_conversations,
        multi_turn_turns=args.multi_turn_turns,
        multi_turn_concurrency=args.multi_turn_concurrency,
        rates=args.rates,
        rate_requests=args.rate_requests,
    )
    tokenizer = ensure_tokenizer(model, aiperf_home())
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = (args.out / f"aiperf-{stamp}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    loadavg_start = os.getloadavg()[0]
    names = [c.name for c in cells]

    def save(results: Sequence[RunResult]) -> str:
        meta = {
            "stamp": stamp,
            "aiperf_version": AIPERF_VERSION,
            "machine": machine_name(),
            "loadavg_start": loadavg_start,
            "loadavg_end": os.getloadavg()[0],
            "endpoint_path": "chat/completions" if args.endpoint == "chat" else "completions",
            "input_tokens": args.input_tokens,
            "output_tokens": args.output_tokens,
            "parallel": settings.parallel,
            "ctx": settings.context_per_sequence,
            "threads": settings.n_threads,
            "flash_attn": settings.flash_attn,
            "connection_reuse": args.connection_reuse,
            "llama_server_note": note,
            "quicsrv": f"quicsrv from {args.tree}" if args.tree else "quicsrv from this checkout",
        }
        text = render(results, names, heading=_heading(meta))
        (args.out / f"aiperf-{stamp}.md").write_text(text + "\n")
        saved = {
            "argv": sys.argv[1:] if argv is None else argv,
            "meta": meta,
            "cells": names,
            "workloads": [asdict(c) for c in cells],
            "tokenizer": str(tokenizer),
            "settings": {k: str(v) for k, v in asdict(settings).items()},
            "llama_server": None
            if binary is None
            else {"argv": llama_server_argv(binary, settings), "cmake": cmake_options()},
            "results": [asdict(r) for r in results],
        }
        (args.out / f"aiperf-{stamp}.json").write_text(json.dumps(saved, indent=1))
        return text

    results = asyncio.run(_measure(args, settings, binary, tokenizer, cells, out, save))
    print(save(results))
    print(f"wrote {args.out / f'aiperf-{stamp}.md'} and .json; AIPerf's artifacts in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
