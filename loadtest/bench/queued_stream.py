"""What a streamed request that must wait for a slot sees, and when: a proxy between cuts a
stream that is silent for its read timeout (often 30-60 s).

Every slot of a ``quicsrv serve --parallel 2`` is taken by a long generation; then a streamed
``/v1/chat/completions`` over TCP (HTTP/1.1, httpx) waits in line. Per round: seconds to its
response headers, to its first byte, to its first event with an id (a cursor to resume from),
to its first token, the longest silence before the first token, and how many keep-alive lines
came. ``--baseline-tree`` runs an older checkout the same way in the same run, rounds
interleaved.

    python -m loadtest.bench.queued_stream --rounds 2 --baseline-tree /tmp/old-checkout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from quicsrv.devcerts import DevCertPaths, ensure_dev_certs
from quicsrv.engine.model import default_model_path
from quicsrv.spawn import spawn_server_async

__all__ = ["main"]

HOG_TOKENS = 500  # each of the 2 slots: the stream below waits ~8-10 s here
KEEPALIVE_S = 2.0  # the server's sse_keepalive_s here (15 s by default), to see several


@dataclass(frozen=True, slots=True)
class Round:
    tree: str
    headers_s: float | None
    first_byte_s: float | None
    first_cursor_s: float | None
    first_token_s: float
    longest_silence_s: float
    keepalives: int
    outcome: str
    """``token``, or what ended the stream before one (an error's code)."""


async def _round(tree: str, cwd: Path | None, work: Path, certs: DevCertPaths) -> Round:
    serve = ["--host", "127.0.0.1", "--port", "0", "--parallel", "2"]
    serve += ["--data-dir", str(work / "data")]
    serve += ["--cert", str(certs.server_cert), "--key", str(certs.server_key)]
    env = {"QUICSRV_SSE_KEEPALIVE_S": str(KEEPALIVE_S), "QUICSRV_MAX_ACTIVE_PER_CLIENT": "2"}
    async with spawn_server_async(serve, log=work / f"{tree}.log", env=env, cwd=cwd) as server:
        url = f"https://127.0.0.1:{server.port}"
        context = ssl.create_default_context(cafile=str(certs.ca_cert))
        model = default_model_path().stem
        hog = {"model": model, "prompt": "Once upon a time", "stream": True, "ignore_eos": True}
        hog["max_tokens"] = HOG_TOKENS
        waiting = {
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8,
            "stream": True,
        }
        async with httpx.AsyncClient(verify=context, timeout=None) as client:
            generating = [asyncio.Event() for _ in range(2)]
            hogs = [
                asyncio.ensure_future(_read(client, f"{url}/v1/completions", hog, first))
                for first in generating
            ]
            await asyncio.gather(*(first.wait() for first in generating))  # both slots taken
            started = time.perf_counter()
            headers_s = first_byte_s = first_cursor_s = None
            first_token_s, keepalives, last, longest = 0.0, 0, started, 0.0
            outcome = "ended without a token"
            async with client.stream("POST", f"{url}/v1/chat/completions", json=waiting) as r:
                headers_s = time.perf_counter() - started
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    longest, last = max(longest, now - last), now
                    first_byte_s = first_byte_s if first_byte_s is not None else now - started
                    if line.startswith("id: ") and first_cursor_s is None:
                        first_cursor_s = now - started
                    elif line.startswith(":"):
                        keepalives += 1
                    elif line.startswith('data: {"error"'):
                        outcome = json.loads(line[6:])["error"].get("code", "error")
                        break
                    elif line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                        if '"content":""' not in line.replace(" ", ""):
                            first_token_s, outcome = now - started, "token"
                            break
            for task in hogs:
                task.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)
    return Round(
        tree=tree,
        headers_s=headers_s,
        first_byte_s=first_byte_s,
        first_cursor_s=first_cursor_s,
        first_token_s=first_token_s,
        longest_silence_s=longest,
        keepalives=keepalives,
        outcome=outcome,
    )


async def _read(
    client: httpx.AsyncClient, url: str, body: dict[str, object], first: asyncio.Event
) -> None:
    """Read a stream to its end; ``first`` is set at its first token."""
    async with client.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                first.set()


def _fmt(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.queued_stream",
        description="what a streamed request waiting for a slot sees, and when",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline-tree", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)
    trees: list[tuple[str, Path | None]] = [("this", None)]
    if args.baseline_tree is not None:
        trees.append(("baseline", args.baseline_tree.resolve()))
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="quicsrv-queued-") as tmp:
        certs = ensure_dev_certs(Path(tmp) / "certs")
        for i in range(args.rounds):
            for name, cwd in trees:
                work = Path(tmp) / f"{name}-{i}"
                work.mkdir()
                result = asyncio.run(_round(name, cwd, work, certs))
                print(
                    f"round {i} {name}: headers {_fmt(result.headers_s)}, first byte "
                    f"{_fmt(result.first_byte_s)}, first cursor {_fmt(result.first_cursor_s)}, "
                    f"first token {result.first_token_s:.2f} s, longest silence "
                    f"{result.longest_silence_s:.2f} s, keep-alives {result.keepalives}, "
                    f"{result.outcome}",
                    flush=True,
                )
                rounds.append(result)
    for name, _ in trees:
        mine = [r for r in rounds if r.tree == name]
        print(
            f"{name}: median longest silence "
            f"{statistics.median(r.longest_silence_s for r in mine):.2f} s, median first token "
            f"{statistics.median(r.first_token_s for r in mine):.2f} s"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out / f"queued-stream-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "argv": sys.argv[1:] if argv is None else argv,
                "keepalive_s": KEEPALIVE_S,
                "rounds": [asdict(r) for r in rounds],
            }
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
