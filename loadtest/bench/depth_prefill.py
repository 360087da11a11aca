"""How much of a comparison is the draw of a context's memory: the same prefill of ``--new``
tokens after ``--depth`` kept cells (a chat's turn 8: ~162 new tokens after ~1594), timed in
several fresh llama.cpp contexts of each kind, side by side.

- **llama-server**: a fresh server per start; a prompt of ``--depth`` tokens into slot 0, then
  ``--repeats`` prompts that add ``--new`` different tokens each (``cache_prompt``: the first
  ``--depth`` are kept); its own ``timings.prompt_ms`` per request (``prompt_n`` must be
  ``--new``).
- **raw**: a fresh interpreter per start with :func:`~quicsrv.engine.llama.open_context`'s
  context (quicsrv's settings), the same tokens prefilled with ``llama_decode`` in chunks of
  ``n_batch``; and the same new tokens at depth 0 in that context, for the part that is the
  weights' matmuls alone.

The tokens are random ids from a seed, the same for both. A start's median against the spread
of the starts' medians says how far apart two servers' single starts may read for the same work
(loadtest/README.md, "the draw of a context's memory")::

    python -m loadtest.bench.depth_prefill [--starts 4] [--repeats 4] [--depth 1594] [--new 162]
        [--llama-server auto|none|PATH]

Prints the table and writes ``loadtest/results/depth-prefill-<ts>.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from loadtest.bench.conversation_raw import _Context
from loadtest.bench.isolated import isolated
from loadtest.bench.llama_server import llama_server
from loadtest.bench.llama_server_build import chosen_llama_server
from loadtest.bench.machine import machine_name
from loadtest.bench.servers import ServerSettings
from quicsrv.engine import default_model_path
from quicsrv.settings import probe_cpu_extra_buffers

__all__ = ["main"]

RAW = "raw llama_decode"
RAW_DEPTH_0 = "raw, depth 0"
LLAMA_SERVER = "llama-server"
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Start:
    """One fresh context's timings, ms."""

    system: str
    start: int
    ms: list[float]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.ms)


def _tokens(seed: int, depth: int, new: int, repeats: int) -> tuple[list[int], list[list[int]]]:
    """The kept prompt and each repeat's new tokens: ids of ordinary words' range, seeded."""
    rng = random.Random(seed)
    kept = [rng.randrange(100, 40000) for _ in range(depth)]
    return kept, [[rng.randrange(100, 40000) for _ in range(new)] for _ in range(repeats)]


def _raw_start(settings: ServerSettings, kept: list[int], news: list[list[int]]) -> list[Start]:
    """One fresh context (run in a fresh interpreter): the new tokens after ``kept``, then at 0."""
    context = _Context(settings)
    try:
        context.prefill(kept, 0, 0)
        deep: list[float] = []
        for new in news:
            started = time.perf_counter()
            context.prefill(new, len(kept), 0)
            deep.append((time.perf_counter() - started) * 1000)
            context.drop(0, len(kept))
        shallow: list[float] = []
        for new in news:
            started = time.perf_counter()
            context.prefill(new, 0, 1)
            shallow.append((time.perf_counter() - started) * 1000)
            context.drop(1)
    finally:
        context.close()
    return [Start(RAW, 0, deep), Start(RAW_DEPTH_0, 0, shallow)]


async def _server_start(
    binary: Path, settings: ServerSettings, kept: list[int], news: list[list[int]], log: Path
) -> Start:
    async with llama_server(binary, settings, log) as child:
        url = f"http://127.0.0.1:{child.port}/completion"
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:

            async def timed(prompt: list[int]) -> dict[str, float]:
                body = {"prompt": prompt, "n_predict": 1, "cache_prompt": True, "id_slot": 0}
                response = await client.post(url, json=body)
                response.raise_for_status()
                timings: dict[str, float] = response.json()["timings"]
                return timings

            await timed(kept)
            ms: list[float] = []
            for new in news:
                timings = await timed(kept + new)
                if timings["prompt_n"] != len(new):
                    raise RuntimeError(f"llama-server computed {timings['prompt_n']} tokens")
                ms.append(timings["prompt_ms"])
    return Start(LLAMA_SERVER, 0, ms)


def render(starts: list[Start], meta: dict[str, object]) -> str:
    lines = [
        f"{meta['new']} new tokens after {meta['depth']} kept cells, {meta['repeats']} repeats "
        f"a start, fresh contexts taking turns; {meta['machine']}; ms",
        "",
        "| system | each start's median | median | spread (max / min) |",
        "|---|---|---:|---:|",
    ]
    for system in (RAW, LLAMA_SERVER, RAW_DEPTH_0):
        medians = [s.median_ms for s in starts if s.system == system]
        if not medians:
            continue
        cells = ", ".join(f"{m:.0f}" for m in medians)
        spread = max(medians) / min(medians)
        lines.append(f"| {system} | {cells} | {statistics.median(medians):.0f} | {spread:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.depth_prefill")
    parser.add_argument("--starts", type=int, default=4, help="fresh contexts of each kind")
    parser.add_argument("--repeats", type=int, default=4, help="prefills in each")
    parser.add_argument("--depth", type=int, default=1594, help="cells kept before them")
    parser.add_argument("--new", type=int, default=162, help="tokens prefilled after them")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--llama-server", default="auto", help="auto, none, or a binary's path")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)

    model = default_model_path()
    settings = ServerSettings(model_path=model, cpu_extra_buffers=probe_cpu_extra_buffers(model))
    if args.depth + args.new > settings.context_per_sequence:
        parser.error(f"--depth + --new must fit a slot's {settings.context_per_sequence} cells")
    binary = chosen_llama_server(args.llama_server)
    kept, news = _tokens(args.seed, args.depth, args.new, args.repeats)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    starts: list[Start] = []
    for start in range(args.starts):
        before = len(starts)
        for result in isolated(_raw_start, settings, kept, news):
            starts.append(Start(result.system, start, result.ms))
        if binary is not None:
            log = args.out / f"depth-prefill-{stamp}-llama-server-{start}.log"
            result = asyncio.run(_server_start(binary, settings, kept, news, log))
            starts.append(Start(result.system, start, result.ms))
        for s in starts[before:]:
            print(f"start {start} {s.system:18} median {s.median_ms:.0f} ms", flush=True)
    meta: dict[str, object] = {
        "depth": args.depth,
        "new": args.new,
        "repeats": args.repeats,
        "machine": machine_name(),
    }
    text = render(starts, meta)
    print(text)
    base = args.out / f"depth-prefill-{stamp}"
    base.with_suffix(".md").write_text(text)
    record = {"argv": sys.argv, **meta, "starts": [asdict(s) for s in starts]}
    base.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print(f"wrote {base}.md and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
