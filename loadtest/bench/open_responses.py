"""The Open Responses compliance suite against a real quicsrv (issue 41, item 4).

Open Responses (openresponses.org) is the open specification of OpenAI's Responses API; its
repository ships a compliance CLI (``bin/compliance-test.ts``, run with bun) that sends requests
to ``{base_url}/responses`` and checks each answer with zod schemas generated from the spec:
the whole ``ResponseResource`` (every field, with its type), every streamed event, and what
each test asks for (a completed status, a ``function_call`` item, ``previous_response_id``
keeping the conversation...). This module runs it, unchanged, against quicsrv::

    make compliance-open-responses          # or: .venv/bin/python -m loadtest.bench.open_responses

1. The suite: the repository at the pinned commit :data:`SUITE_COMMIT`, downloaded once as
   GitHub's archive into ``~/.cache/quicsrv/open-responses/suite-<commit>`` (``--suite DIR``:
   a checkout made by hand, for a machine that cannot reach GitHub), its dependencies installed
   by bun from its lockfile.
2. bun: the one on PATH, else the npm package ``bun`` at :data:`BUN_VERSION`, installed once
   under ``~/.cache/quicsrv/open-responses/bun``.
3. ``quicsrv serve`` with the default model (or ``--model``), as the other benches start it
   (:mod:`.servers`), over TCP with the dev certificates (bun trusts their CA through
   ``NODE_EXTRA_CA_CERTS``).
4. The suite's JSON results, each test given a verdict: passed, failed, skipped by the suite
   (its optional tests need a vector store or a web search), out of scope
   (:data:`OUT_OF_SCOPE`: WebSocket mode, ``/responses/compact``, image input) or in scope.
   Printed, and written with the raw results and the server's log under
   ``loadtest/results/open-responses-<stamp>/``. Exit status 1 when a test in scope failed.

It is never run by the tests or CI (it downloads, and takes minutes on a CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = [
    "BUN_VERSION",
    "SUITE_COMMIT",
    "Verdict",
    "archive_url",
    "judge",
    "main",
    "render",
    "suite_argv",
]

SUITE_REPOSITORY = "openresponses/openresponses"
SUITE_COMMIT = "18e565604fdf7a08ad3a06bbc30d1ddaee999ea4"
"""The suite's version: a commit of its repository (the CLI has no package of its own)."""
BUN_VERSION = "1.4.5"
API_KEY = "unused"  # an open server; the CLI insists on one

#: Tests this server is not meant to pass, by id (or a word of the id, for the tests of later
#: versions of the suite), and why.
OUT_OF_SCOPE: dict[str, str] = {
    "image-input": "image input: the model reads text only (input_image is refused, 400)",
    "websocket": "WebSocket mode: a later step (an upgrade is refused, 400 JSON)",
    "compact": "/v1/responses/compact is not served (404 unknown_endpoint)",
    "image": "image input: the model reads text only",
}


#: The suite's one error when a response is whole but ended at its token limit.
_RAN_ON = 'Expected status "completed" but got "incomplete"'
#: Its error when the model answered in text where a test expects a call.
_NO_CALL = 'Expected output item of type "function_call" but none found'


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """One test of the suite, and what its result means here."""

    id: str
    name: str
    status: str
    """The suite's: passed, failed or skipped."""
    kind: str
    """in scope, out of scope, or skipped by the suite."""
    why: str
    errors: tuple[str, ...]

    @property
    def counts_against(self) -> bool:
        """A failure of a test this server is meant to pass."""
        return self.status == "failed" and self.kind == "in scope"


def archive_url(commit: str = SUITE_COMMIT) -> str:
    return f"https://github.com/{SUITE_REPOSITORY}/archive/{commit}.tar.gz"


def suite_argv(bun: Path, base_url: str, model: str) -> list[str]:
    """The suite's CLI, every test, results as JSON on stdout."""
    return [
        str(bun),
        "run",
        "bin/compliance-test.ts",
        "--base-url",
        base_url,
        "--api-key",
        API_KEY,
        "--model",
        model,
        "--json",
    ]


def judge(results: Sequence[dict[str, Any]]) -> list[Verdict]:
    """The suite's results (its ``--json`` output's ``results``), each with its verdict."""
    verdicts = []
    for result in results:
        test_id = str(result.get("id", ""))
        status = str(result.get("status", ""))
        errors = tuple(str(e) for e in result.get("errors") or ())
        reason = OUT_OF_SCOPE.get(test_id) or next(
            (why for word, why in OUT_OF_SCOPE.items() if word in test_id), None
        )
        if status == "skipped":
            kind, why = "skipped by the suite", "; ".join(errors) or "optional"
        elif reason is not None:
            kind, why = "out of scope", reason
        else:
            kind, why = "in scope", ""
        if status == "failed" and errors and all(e == _RAN_ON for e in errors):
            why = (
                "the answer ran on to max_output_tokens (256 when not given): the model's "
                "length, the object itself is whole"
            )
        elif status == "failed" and errors and all(e == _NO_CALL for e in errors):
            why = (
                "the model answered in text: under tool_choice auto it decides whether to call "
                "(how often it does, here and on llama-server: loadtest.bench.tool_choice)"
            )
        verdicts.append(
            Verdict(
                id=test_id,
                name=str(result.get("name", test_id)),
                status=status,
                kind=kind,
                why=why,
                errors=errors,
            )
        )
    return verdicts


def render(verdicts: Sequence[Verdict], heading: str) -> str:
    """A Markdown table of the verdicts, and the counts."""
    lines = [heading, "", "| test | result | kind | why / first error |", "|---|---|---|---|"]
    for v in verdicts:
        note = v.why or (v.errors[0] if v.errors else "")
        note = note.replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(f"| {v.id} | {v.status} | {v.kind} | {note} |")
    scoped = [v for v in verdicts if v.kind == "in scope"]
    passed = sum(v.status == "passed" for v in scoped)
    lines += [
        "",
        f"In scope: {passed} of {len(scoped)} passed; "
        f"{sum(v.status == 'passed' for v in verdicts)} of {len(verdicts)} in all.",
    ]
    return "\n".join(lines)


# --- set-up ---------------------------------------------------------------------------------


def home() -> Path:
    return Path(os.environ.get("QUICSRV_OPEN_RESPONSES_HOME", "~/.cache/quicsrv/open-responses"))


def ensure_bun(root: Path) -> Path:
    """bun on PATH, else the npm package at BUN_VERSION under ``root`` (installed once)."""
    found = shutil.which("bun")
    if found:
        return Path(found)
    prefix = root / f"bun-{BUN_VERSION}"
    binary = prefix / "node_modules" / ".bin" / "bun"
    if not binary.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["npm", "install", "--prefix", str(prefix), "--no-save", f"bun@{BUN_VERSION}"],
            check=True,
        )
    return binary


def ensure_suite(root: Path, bun: Path, commit: str = SUITE_COMMIT) -> Path:
    """The suite's checkout at ``commit``, with its dependencies (downloaded once)."""
    folder = root / f"suite-{commit}"
    if not (folder / "bin" / "compliance-test.ts").exists():
        partial = root / f"suite-{commit}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        archive = partial / "suite.tar.gz"
        print(f"downloading {archive_url(commit)}", file=sys.stderr)
        with urllib.request.urlopen(archive_url(commit), timeout=120) as response:
            archive.write_bytes(response.read())
        with tarfile.open(archive) as tar:
            tar.extractall(partial, filter="data")
        (top,) = [p for p in partial.iterdir() if p.is_dir()]
        top.rename(folder)
        shutil.rmtree(partial)
    install_dependencies(folder, bun)
    return folder


def install_dependencies(folder: Path, bun: Path) -> None:
    """The suite's packages, as its lockfile pins them (its scripts are not run: husky...)."""
    if not (folder / "node_modules" / "zod").exists():
        subprocess.run(
            [str(bun), "install", "--frozen-lockfile", "--ignore-scripts"], cwd=folder, check=True
        )


# --- the run --------------------------------------------------------------------------------


async def _run(args: argparse.Namespace, suite: Path, bun: Path, out: Path) -> int:
    import httpx

    from loadtest.bench.servers import ServerSettings, quicsrv_server
    from quicsrv.devcerts import ensure_dev_certs
    from quicsrv.engine import default_model_path
    from quicsrv.settings import probe_cpu_extra_buffers

    certs = ensure_dev_certs(out / "certs")
    model = args.model or default_model_path()
    settings = ServerSettings(
        model_path=model,
        n_threads=args.threads,
        parallel=4,
        # As the other benches: the canary decides (on an AMX Xeon "on" crashes every worker).
        cpu_extra_buffers=probe_cpu_extra_buffers(model),
    )
    async with quicsrv_server(
        settings, certs.server_cert, certs.server_key, out / "quicsrv.log"
    ) as child:
        url = f"https://localhost:{child.port}/v1"
        async with httpx.AsyncClient(verify=str(certs.ca_cert), timeout=60) as client:
            model = (await client.get(f"{url}/models")).json()["data"][0]["id"]
        env = {**os.environ, "NODE_EXTRA_CA_CERTS": str(certs.ca_cert)}
        process = await asyncio.create_subprocess_exec(
            *suite_argv(bun, url, model),
            cwd=suite,
            env=env,
            stdout=asyncio.subprocess.PIPE,
        )
        stdout, _ = await process.communicate()
    (out / "suite.json").write_bytes(stdout)
    try:
        results = json.loads(stdout)["results"]
    except (ValueError, KeyError):
        print(f"the suite printed no JSON results (exit {process.returncode}); see {out}")
        return 2
    verdicts = judge(results)
    heading = (
        f"Open Responses compliance suite ({SUITE_REPOSITORY}@{SUITE_COMMIT[:12]}) against "
        f"quicsrv, model {model}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    )
    table = render(verdicts, heading)
    (out / "report.md").write_text(table + "\n")
    (out / "verdicts.json").write_text(json.dumps([asdict(v) for v in verdicts], indent=2))
    print(table)
    print(f"\nwritten: {out}")
    return 1 if any(v.counts_against for v in verdicts) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", type=Path, help="a checkout of the suite (no download)")
    parser.add_argument("--model", type=Path, help="a GGUF (default: quicsrv's default model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args(argv)
    root = home().expanduser()
    bun = ensure_bun(root)
    if args.suite is not None:
        suite = args.suite.resolve()
        install_dependencies(suite, bun)
    else:
        suite = ensure_suite(root, bun)
    out = (args.out / f"open-responses-{datetime.now(UTC):%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    return asyncio.run(_run(args, suite, bun, out))


if __name__ == "__main__":
    sys.exit(main())
