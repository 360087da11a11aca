"""One greedy connection against a polite one: does the polite client still get served?

A "hog" connection opens ``--hog-streams`` long GENERATE streams at once (EOS ignored); once
each was admitted, queued or refused, a second connection asks for ``--polite-tokens`` tokens.
Reported: how the hog's requests ended (admitted, queued, refused by code, the retry hints),
and the polite request's outcome, time to its first token and to its end. With ``--tree`` the
same probe also runs against another checkout's quicsrv (e.g. before per-client limits).

Run: ``.venv/bin/python -m loadtest.bench.abuse_probe [--hog-streams 120] [--tree /path/to/old]``.
Prints a table; writes ``loadtest/results/abuse-<time>.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from loadtest.bench.servers import ServerSettings, quicsrv_server
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.engine import default_model_path
from quicsrv_client import (
    Client,
    ClientError,
    GenerationEnded,
    ServerError,
    SessionStarted,
    TokenReceived,
)

HOG_PROMPT = "Write a very long story about a lighthouse keeper."


@dataclass
class Probe:
    server: str
    hog_streams: int
    hog_admitted: int = 0
    hog_refused: dict[str, int] = field(default_factory=dict)
    hog_retry_after_s: list[float] = field(default_factory=list)
    hog_waiting: int = 0
    polite_outcome: str = ""
    polite_ttft_s: float | None = None
    polite_total_s: float | None = None


async def _probe(port: int, ca: Path, label: str, args: argparse.Namespace) -> Probe:
    probe = Probe(server=label, hog_streams=args.hog_streams)
    decided: asyncio.Queue[None] = asyncio.Queue()
    refused: Counter[str] = Counter()

    async def hog_stream(hog: Client) -> None:
        try:
            async for event in hog.generate(
                HOG_PROMPT, max_tokens=args.hog_tokens, ignore_eos=True
            ):
                if isinstance(event, SessionStarted):
                    probe.hog_admitted += 1
                    decided.put_nowait(None)
        except ServerError as exc:
            refused[exc.slug] += 1
            if exc.retry_after_s is not None:
                probe.hog_retry_after_s.append(exc.retry_after_s)
            decided.put_nowait(None)
        except ClientError:
            decided.put_nowait(None)

    async with Client("127.0.0.1", port, ca=ca) as hog:
        tasks = [asyncio.create_task(hog_stream(hog)) for _ in range(args.hog_streams)]
        # Every hog request is admitted, refused, or still waiting when the settle time passes.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(args.settle_s):
                for _ in range(args.hog_streams):
                    await decided.get()
        probe.hog_refused = dict(refused)
        probe.hog_waiting = args.hog_streams - probe.hog_admitted - sum(refused.values())
        started = time.perf_counter()
        try:
            async with Client("127.0.0.1", port, ca=ca) as polite:
                async with asyncio.timeout(args.polite_timeout_s):
                    async for event in polite.generate(
                        "Say hello.", max_tokens=args.polite_tokens, ignore_eos=True
                    ):
                        if isinstance(event, TokenReceived) and probe.polite_ttft_s is None:
                            probe.polite_ttft_s = time.perf_counter() - started
                        elif isinstance(event, GenerationEnded):
                            probe.polite_total_s = time.perf_counter() - started
                            probe.polite_outcome = "served"
        except ServerError as exc:
            probe.polite_outcome = f"refused: {exc.slug} ({exc.http_status})"
        except TimeoutError:
            probe.polite_outcome = f"no answer in {args.polite_timeout_s:.0f} s"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return probe


async def measure(args: argparse.Namespace) -> list[Probe]:
    certs = ensure_dev_certs(Path(tempfile.mkdtemp(prefix="quicsrv-abuse-certs-")))
    settings = ServerSettings(model_path=args.model or default_model_path())
    targets: list[tuple[str, Path | None]] = [("this tree", None)]
    if args.tree is not None:
        targets.append((f"tree {args.tree}", args.tree))
    probes = []
    with tempfile.TemporaryDirectory(prefix="quicsrv-abuse-") as scratch:
        for n, (label, tree) in enumerate(targets):
            log = Path(scratch) / f"server-{n}.log"
            async with quicsrv_server(
                settings,
                certs.server_cert,
                certs.server_key,
                log,
                tree=tree,
                per_client_caps=True,
            ) as child:
                probes.append(await _probe(child.port, certs.ca_cert, label, args))
    return probes


def report(probes: list[Probe], args: argparse.Namespace) -> str:
    def seconds(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    def retry(values: list[float]) -> str:
        return "–" if not values else f"{min(values):.1f}–{max(values):.1f}"

    rows = [
        f"| {p.server} | {p.hog_admitted} | {p.hog_waiting} | "
        f"{', '.join(f'{n} × {code}' for code, n in sorted(p.hog_refused.items())) or '–'} | "
        f"{retry(p.hog_retry_after_s)} | {p.polite_outcome} | {seconds(p.polite_ttft_s)} | "
        f"{seconds(p.polite_total_s)} |"
        for p in probes
    ]
    return (
        "\n".join(
            [
                f"# Abuse probe ({datetime.now(UTC):%Y-%m-%d %H:%M} UTC)",
                "",
                f"`python -m loadtest.bench.abuse_probe --hog-streams {args.hog_streams} "
                f"--hog-tokens {args.hog_tokens} --polite-tokens {args.polite_tokens}`; one hog "
                f"connection, then one polite connection; server defaults; {os.cpu_count()} CPUs.",
                "",
                "| server | hog admitted | hog waiting | hog refused | retry_after_s "
                "| polite request | polite TTFT s | polite total s |",
                "|---|---:|---:|---|---|---|---:|---:|",
                *rows,
            ]
        )
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.abuse_probe")
    parser.add_argument("--hog-streams", type=int, default=120)
    parser.add_argument("--hog-tokens", type=int, default=512)
    parser.add_argument("--polite-tokens", type=int, default=8)
    parser.add_argument("--settle-s", type=float, default=20.0)
    parser.add_argument("--polite-timeout-s", type=float, default=120.0)
    parser.add_argument("--tree", type=Path, help="another checkout to probe the same way")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    probes = asyncio.run(measure(args))
    text = report(probes, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"abuse-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps([asdict(p) for p in probes], indent=1))
    print(f"wrote {stem}.md, {stem}.json")


if __name__ == "__main__":
    main()
