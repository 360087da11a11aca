"""Resume latency: RESUME_STREAM to the first *new* token, by how the decoder state comes back.

For contexts of 100, 500 and 1,000 generated tokens: a generation is cut (its connection closed)
once the server has generated exactly that many tokens, then resumed on a new connection. The
clock runs from sending RESUME_STREAM to the arrival of the first token the server had not
generated before the cut. Paths:

- kv-restore: the paused sequence's KV blob (``llama_state_seq_get_data``) is restored;
- replay: no blob; the prompt is prefilled with its original chunking and every generated token
  decoded alone again (exact);
- re-prefill: no blob; prompt + generated tokens in chunks (``--inexact-reprefill``; fast, not
  bit-exact);
- scratch: a new GENERATE of the same request, timed to the same token.

Also: memory per paused session (its KV blob plus its record). Same model, greedy, one stream at
a time, in-process server over QUIC on loopback.

Run: ``.venv/bin/python -m loadtest.bench.resume [--contexts 100 500 1000] [--runs 3]``
Writes ``loadtest/results/resume-<time>.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quicsrv.app import start
from quicsrv.config import ServerConfig
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv.engine.llama import LlamaEngine
from quicsrv.sessions.manager import SessionManager
from quicsrv.sessions.settings import SessionSettings
from quicsrv.settings import engine_settings_for, probe_cpu_extra_buffers, session_settings_for
from quicsrv.transport import RunningServer
from quicsrv_client import Client, SessionStarted, TokenReceived

PROMPT = "Write a long, detailed history of the city of Rome, century by century."
PATHS = ("kv-restore", "replay", "re-prefill")


@dataclass
class Sample:
    path: str
    context: int
    seconds: float
    served_by: str | None


def _settings(data_dir: Path, path: str, ahead: int) -> SessionSettings:
    no_kv = path != "kv-restore"
    return session_settings_for(
        data_dir,
        kv_memory_budget_bytes=0 if no_kv else 1 << 30,
        kv_disk_budget_bytes=0 if no_kv else 1 << 30,
        max_tokens_ahead=ahead,
        inexact_reprefill=path == "re-prefill",
    )


async def _cut_at(server: RunningServer, ca: Path, context: int) -> Any:
    """Generate ``context`` tokens, then drop the connection (the server may hold up to
    ``max_tokens_ahead`` more, which a resume replays from history before the first new one)."""
    async with Client("127.0.0.1", server.port, ca=ca) as c:
        generation = c.generate(PROMPT, max_tokens=context + 256, ignore_eos=True)
        live = None
        async for event in generation:
            if isinstance(event, SessionStarted):
                live = server.sessions.live(bytes.fromhex(event.session_id))
            if isinstance(event, TokenReceived) and event.index == context - 1:
                break
        position = generation.position
    assert live is not None and position is not None
    await asyncio.wait_for(live.idle.wait(), 120)
    return position, live


async def _resume_latency(server: RunningServer, ca: Path, context: int) -> tuple[float, str]:
    position, live = await _cut_at(server, ca, context)
    held = len(live.record.generated)  # a token or two past the cut: not new on resume
    async with Client("127.0.0.1", server.port, ca=ca) as c:
        started = time.perf_counter()
        resumed = c.resume_from(position)
        async for event in resumed:
            if isinstance(event, TokenReceived) and event.index >= held:
                elapsed = time.perf_counter() - started
                break
        await resumed.aclose()
    return elapsed, resumed.resume_path or "?"


async def _scratch_latency(server: RunningServer, ca: Path, context: int) -> float:
    async with Client("127.0.0.1", server.port, ca=ca) as c:
        started = time.perf_counter()
        generation = c.generate(PROMPT, max_tokens=context + 256, ignore_eos=True)
        async for event in generation:
            if isinstance(event, TokenReceived) and event.index >= context:
                elapsed = time.perf_counter() - started
                break
        await generation.aclose()
    return elapsed


async def _paused_memory(engine: LlamaEngine, certs: Any, context: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as scratch:
        sessions = SessionManager(engine, _settings(Path(scratch), "kv-restore", 64))
        server = await start(engine, _config(certs), sessions)
        try:
            _position, live = await _cut_at(server, certs.ca_cert, context)
            usage = sessions.kv.usage()
            record = sessions.store.usage()
        finally:
            await server.shutdown(5.0)
    return {
        "kv_bytes": usage.memory_bytes,
        "kv_bytes_per_token": usage.memory_bytes / (context + len(live.record.spec.prompt_tokens)),
        "record_disk_bytes": record.disk_bytes,
    }


def _config(certs: Any) -> ServerConfig:
    return ServerConfig(
        host="127.0.0.1", port=0, cert_path=certs.server_cert, key_path=certs.server_key
    )


async def run(contexts: list[int], runs: int) -> dict[str, Any]:
    max_context = max(contexts) + 256
    model = default_model_path()
    engine = LlamaEngine(
        engine_settings_for(
            model,
            n_seq_max=4,
            context_per_sequence=max_context + 128,
            cpu_extra_buffers=probe_cpu_extra_buffers(model),
        )
    )
    samples: list[Sample] = []
    memory: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as certs_dir:
        certs = ensure_dev_certs(Path(certs_dir))
        try:
            for path in PATHS:
                with tempfile.TemporaryDirectory() as scratch:
                    sessions = SessionManager(engine, _settings(Path(scratch), path, 64))
                    server = await start(engine, _config(certs), sessions)
                    try:
                        for context in contexts:
                            for _ in range(runs):
                                seconds, served = await _resume_latency(
                                    server, certs.ca_cert, context
                                )
                                samples.append(Sample(path, context, seconds, served))
                    finally:
                        await server.shutdown(5.0)
            with tempfile.TemporaryDirectory() as scratch:
                sessions = SessionManager(engine, _settings(Path(scratch), "kv-restore", 64))
                server = await start(engine, _config(certs), sessions)
                try:
                    for context in contexts:
                        for _ in range(runs):
                            seconds = await _scratch_latency(server, certs.ca_cert, context)
                            samples.append(Sample("scratch", context, seconds, "generate"))
                finally:
                    await server.shutdown(5.0)
            for context in contexts:
                memory[context] = await _paused_memory(engine, certs, context)
        finally:
            engine.close()
    return {"samples": [s.__dict__ for s in samples], "memory": memory, "runs": runs}


def _table(result: dict[str, Any], contexts: list[int]) -> str:
    samples = [Sample(**s) for s in result["samples"]]
    lines = [
        "| context (tokens) | kv-restore | replay | re-prefill | scratch | "
        "scratch / kv-restore | paused KV blob |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for context in contexts:

        def median_ms(path: str, ctx: int = context) -> float:
            values = [s.seconds for s in samples if s.path == path and s.context == ctx]
            return statistics.median(values) * 1000

        kv, scratch = median_ms("kv-restore"), median_ms("scratch")
        blob = result["memory"][context]["kv_bytes"] / 2**20
        lines.append(
            f"| {context} | {kv:.1f} ms | {median_ms('replay'):.1f} ms | "
            f"{median_ms('re-prefill'):.1f} ms | {scratch:.1f} ms | {scratch / kv:.0f}x | "
            f"{blob:.1f} MiB |"
        )
    mismatched = [s for s in samples if s.path != "scratch" and s.served_by != s.path]
    if mismatched:
        lines.append(f"\n{len(mismatched)} resumes were served by another path than asked.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.resume", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    result = asyncio.run(run(args.contexts, args.runs))
    table = _table(result, args.contexts)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"resume-{stamp}.md").write_text(table + "\n")
    (args.out / f"resume-{stamp}.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}/resume-{stamp}.{{md,json}}")


if __name__ == "__main__":
    main()
