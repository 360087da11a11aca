"""lm-evaluation-harness (PyPI ``lm-eval``, EleutherAI) against quicsrv and against a reference
on the same model, and the per-item comparison (issue 43, item 4).

An evaluation harness nobody here wrote: its ``local-completions`` model sends the requests
(OpenAI text completions: ``echo`` + ``logprobs`` + ``max_tokens: 1`` to score each choice by
log-likelihood, plain completions with ``stop`` for generation), slices the log-probabilities
and scores the tasks by its own definitions. The tasks are ours, with local data files
(``loadtest/eval``: 300 four-choice items, 100 generation items, made by a seeded script: no
download). This module starts each server, runs ``lm_eval`` against it with the same
arguments, reads the per-item samples it logs and compares them::

    make lm-eval-venv                     # lm-eval in its own venv, once
    .venv/bin/python -m loadtest.bench.lm_eval_run     # or: make bench-lm-eval

The servers, on equal terms (model, threads, context, batch, flash attention, llama.cpp's extra
CPU buffers as quicsrv's canary decides):

- ``quicsrv serve`` with the default settings, over its TCP endpoint (HTTPS, the dev CA);
- the reference: llama-cpp-python's own ``Llama`` (the same llama.cpp build) behind
  :mod:`loadtest.bench.llama_cpp_reference`, which reads each prompt token's log-probability
  from the logits row before it. Not ``python -m llama_cpp.server`` as it is: its echoed
  log-probabilities are shifted by one token (see that module), and llama-server refuses
  ``echo``.

``local-completions`` runs with ``tokenized_requests=False`` (the prompt sent as text: neither
server takes token-id prompts) and the Hugging Face tokenizer made offline from the GGUF (the
one AIPerf uses: :func:`loadtest.bench.aiperf_run.ensure_tokenizer`, checked token for token
against llama.cpp), which lm-eval needs to find where the continuation starts.

The comparison, item by item: the choice each server's log-likelihoods pick (argmax, lm-eval's
``acc``), the largest absolute difference of a continuation's log-likelihood, and the generated
text. lm-eval runs in its own venv (``~/.cache/quicsrv/lm-eval/venv`` or
``$QUICSRV_LM_EVAL_HOME/venv``); never run by the tests or CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtest.bench.aiperf_run import ensure_tokenizer
from loadtest.bench.machine import machine_name
from loadtest.bench.servers import ServerSettings, llama_cpp_reference_server, quicsrv_server

__all__ = [
    "GenerationComparison",
    "ChoiceComparison",
    "compare_choices",
    "compare_generations",
    "lm_eval_argv",
    "main",
    "read_samples",
    "render",
]

LM_EVAL_VERSION = "0.4.13"
REPO = Path(__file__).resolve().parents[2]
TASKS_DIR = REPO / "loadtest" / "eval" / "tasks"
QUICSRV = "quicsrv"
REFERENCE = "reference"
REFERENCE_NAME = "llama-cpp-python `Llama` (reference)"
MC_TASK = "quicsrv_mc"
GEN_TASK = "quicsrv_gen"

#: The largest absolute difference of one continuation's log-likelihood (nats) that counts as
#: the same number: the two servers run the same weights through the same llama.cpp, but not the
#: same batches (quicsrv prefills in chunks and reuses cached prefixes; the reference evaluates
#: every prompt whole), and llama.cpp's float sums depend on the batch shape.
DEFAULT_TOLERANCE = 0.02


def lm_eval_home() -> Path:
    """Where lm-eval's venv and its tokenizers live (outside the repository)."""
    root = os.environ.get("QUICSRV_LM_EVAL_HOME")
    return Path(root) if root else Path.home() / ".cache" / "quicsrv" / "lm-eval"


def lm_eval_argv(
    executable: Path,
    *,
    completions_url: str,
    model: str,
    tokenizer: Path,
    tasks: Sequence[str],
    output: Path,
    limit: int | None,
) -> list[str]:
    """``lm_eval`` with ``local-completions`` against one server: one request at a time
    (``num_concurrent=1``: the per-item numbers do not depend on what else runs), the prompt
    as text, no retry (a failure is reported, not hidden)."""
    model_args = ",".join(
        [
            f"base_url={completions_url}",
            f"model={model}",
            f"tokenizer={tokenizer}",
            "tokenizer_backend=huggingface",
            "tokenized_requests=False",
            "num_concurrent=1",
            "max_retries=1",
            "timeout=600",
        ]
    )
    argv = [
        str(executable),
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        ",".join(tasks),
        "--include_path",
        str(TASKS_DIR),
        "--output_path",
        str(output),
        "--log_samples",
    ]
    if limit is not None:
        argv += ["--limit", str(limit)]
    return argv


def read_samples(output: Path) -> dict[str, list[dict[str, Any]]]:
    """The per-item samples lm-eval logged under ``output``, by task, ordered by ``doc_id``."""
    samples: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(output.rglob("samples_*.jsonl")):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        samples[task] = sorted(rows, key=lambda row: int(row["doc_id"]))
    return samples


def _loglikelihoods(sample: Mapping[str, Any]) -> list[float]:
    """A multiple-choice sample's log-likelihood of each choice (lm-eval logs them as text)."""
    return [float(ll) for ll, _greedy in sample["filtered_resps"]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ChoiceComparison:
    """Two runs of the multiple-choice task, item by item."""

    items: int
    same_choice: int
    """Items where both picked the same choice (argmax of the log-likelihoods)."""
    max_abs_diff: float
    """The largest |Δ| of one continuation's log-likelihood, over every choice of every item."""
    mean_abs_diff: float
    within_tolerance: int
    """Continuations whose |Δ| is at most the tolerance."""
    continuations: int
    accuracy: tuple[float, float]
    """lm-eval's ``acc`` of each run."""
    disagreements: tuple[dict[str, Any], ...]
    """The items where the choices differ: id, both choices, both log-likelihood lists."""


def compare_choices(
    ours: Sequence[Mapping[str, Any]], theirs: Sequence[Mapping[str, Any]], tolerance: float
) -> ChoiceComparison:
    """Compare two runs' samples of the same multiple-choice items."""
    if [s["doc_id"] for s in ours] != [s["doc_id"] for s in theirs]:
        raise ValueError("the two runs scored different items")
    diffs: list[float] = []
    same = 0
    disagreements = []
    for a, b in zip(ours, theirs, strict=True):
        la, lb = _loglikelihoods(a), _loglikelihoods(b)
        diffs += [abs(x - y) for x, y in zip(la, lb, strict=True)]
        pick_a, pick_b = la.index(max(la)), lb.index(max(lb))
        if pick_a == pick_b:
            same += 1
        else:
            disagreements.append({"doc_id": a["doc_id"], "picks": [pick_a, pick_b], "ll": [la, lb]})
    n = len(ours)
    return ChoiceComparison(
        items=n,
        same_choice=same,
        max_abs_diff=max(diffs, default=0.0),
        mean_abs_diff=sum(diffs) / len(diffs) if diffs else 0.0,
        within_tolerance=sum(d <= tolerance for d in diffs),
        continuations=len(diffs),
        accuracy=(
            sum(float(s["acc"]) for s in ours) / n if n else 0.0,
            sum(float(s["acc"]) for s in theirs) / n if n else 0.0,
        ),
        disagreements=tuple(disagreements),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationComparison:
    """Two runs of the generation task, item by item."""

    items: int
    same_text: int
    """Items whose generated text (before lm-eval's filter) is the same."""
    exact_match: tuple[float, float]
    differing: tuple[dict[str, Any], ...]


def compare_generations(
    ours: Sequence[Mapping[str, Any]], theirs: Sequence[Mapping[str, Any]]
) -> GenerationComparison:
    """Compare two runs' samples of the same generation items."""
    if [s["doc_id"] for s in ours] != [s["doc_id"] for s in theirs]:
        raise ValueError("the two runs scored different items")
    same, differing = 0, []
    for a, b in zip(ours, theirs, strict=True):
        ta, tb = a["resps"][0][0], b["resps"][0][0]
        if ta == tb:
            same += 1
        else:
            differing.append({"doc_id": a["doc_id"], "texts": [ta, tb]})
    n = len(ours)
    return GenerationComparison(
        items=n,
        same_text=same,
        exact_match=(
            sum(float(s["exact_match"]) for s in ours) / n if n else 0.0,
            sum(float(s["exact_match"]) for s in theirs) / n if n else 0.0,
        ),
        differing=tuple(differing),
    )


def render(
    choices: ChoiceComparison | None,
    generations: GenerationComparison | None,
    *,
    tolerance: float,
    heading: str,
    wall_s: Mapping[str, float],
) -> str:
    """The Markdown table of a comparison (loadtest/README.md keeps one)."""
    lines = [heading, "", f"| | {QUICSRV} | {REFERENCE_NAME} | agreement |", "|---|---|---|---|"]
    if choices is not None:
        c = choices
        lines += [
            f"| `{MC_TASK}` acc ({c.items} items × 4 choices) | {c.accuracy[0]:.3f} | "
            f"{c.accuracy[1]:.3f} | same choice on {c.same_choice}/{c.items} |",
            f"| log-likelihood of a continuation, \\|Δ\\| | | | max {c.max_abs_diff:.2g}, mean "
            f"{c.mean_abs_diff:.2g} nats; {c.within_tolerance}/{c.continuations} within "
            f"{tolerance:g} |",
        ]
    if generations is not None:
        g = generations
        lines.append(
            f"| `{GEN_TASK}` exact match ({g.items} items, greedy) | {g.exact_match[0]:.3f} | "
            f"{g.exact_match[1]:.3f} | same text on {g.same_text}/{g.items} |"
        )
    lines.append(
        f"| lm-eval wall time | {wall_s.get(QUICSRV, float('nan')):.0f} s | "
        f"{wall_s.get(REFERENCE, float('nan')):.0f} s | |"
    )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True, slots=True, kw_only=True)
class _Target:
    name: str
    completions_url: str
    env: Mapping[str, str]


@contextlib.asynccontextmanager
async def _started(
    name: str, settings: ServerSettings, out: Path, quicsrv_env: Mapping[str, str]
) -> AsyncIterator[_Target]:
    if name == REFERENCE:
        async with llama_cpp_reference_server(settings, out / "reference.log") as child:
            yield _Target(
                name=name, completions_url=f"http://127.0.0.1:{child.port}/v1/completions", env={}
            )
        return
    from quicsrv.devcerts import ensure_dev_certs

    certs = ensure_dev_certs(out / "certs")
    async with quicsrv_server(
        settings, certs.server_cert, certs.server_key, out / "quicsrv.log", env=quicsrv_env
    ) as child:
        ca = str(certs.ca_cert)
        yield _Target(
            name=name,
            completions_url=f"https://localhost:{child.port}/v1/completions",
            # requests (lm-eval's client when num_concurrent is 1) verifies with this bundle.
            env={"REQUESTS_CA_BUNDLE": ca, "SSL_CERT_FILE": ca},
        )


def _run_lm_eval(argv: Sequence[str], env: Mapping[str, str], log: Path, timeout_s: float) -> None:
    with log.open("w") as out:
        done = subprocess.run(
            argv,
            cwd=REPO,  # the tasks name their data files relative to the repository root
            env={
                **os.environ,
                "HF_DATASETS_OFFLINE": "1",
                "HF_HUB_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1",
                "TOKENIZERS_PARALLELISM": "false",
                **env,
            },
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval exited with {done.returncode}; see {log}")


async def _evaluate(args: argparse.Namespace, out: Path) -> dict[str, float]:
    from quicsrv.engine import default_model_path
    from quicsrv.settings import probe_cpu_extra_buffers

    model_path = args.model or default_model_path()
    home = lm_eval_home()
    executable = home / "venv" / "bin" / "lm_eval"
    if not executable.is_file():
        raise SystemExit(f"{executable} is missing: make lm-eval-venv")
    tokenizer = ensure_tokenizer(model_path, home)
    settings = ServerSettings(
        model_path=model_path,
        n_threads=args.threads,
        context_per_sequence=args.ctx,
        parallel=args.parallel,
        flash_attn=args.flash_attn,
        cpu_extra_buffers=probe_cpu_extra_buffers(model_path),
    )
    wall: dict[str, float] = {}
    for name in args.targets:
        if name not in (QUICSRV, REFERENCE):
            raise SystemExit(f"--targets: {name!r} is not {QUICSRV!r} or {REFERENCE!r}")
        run_dir = out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        async with _started(name, settings, run_dir, dict(args.quicsrv_env)) as target:
            argv = lm_eval_argv(
                executable,
                completions_url=target.completions_url,
                model=model_path.stem,
                tokenizer=tokenizer,
                tasks=args.tasks,
                output=run_dir / "lm_eval",
                limit=args.limit,
            )
            print(f"{name}: {' '.join(argv[1:])}", flush=True)
            started = time.monotonic()
            await asyncio.to_thread(
                _run_lm_eval, argv, target.env, run_dir / "lm_eval.log", args.timeout_s
            )
            wall[name] = time.monotonic() - started
            print(f"{name}: lm_eval done in {wall[name]:.0f} s", flush=True)
    return wall


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench.lm_eval_run",
        description="lm-evaluation-harness against quicsrv and llama-cpp-python's Llama",
    )
    add = parser.add_argument
    add("--model", type=Path, help="GGUF (default: the project's default)")
    add("--tasks", type=lambda s: s.split(","), default=[MC_TASK, GEN_TASK])
    add("--limit", type=int, help="items per task (default: all)")
    add("--targets", type=lambda s: s.split(","), default=[QUICSRV, REFERENCE],
        help=f"comma-separated: {QUICSRV!r}, {REFERENCE!r}")  # fmt: skip
    add("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="nats, per continuation")
    # One request at a time: a second thread only spins against the other server's and the
    # harness's on 2 shared cores (15-token prompt: 1.2-4 s with 2 threads, 0.3 s with 1, seen
    # at load 5). Thread count does not change llama.cpp's sums (each row is one thread's).
    add("--threads", type=int, default=1)
    add("--ctx", type=int, default=2048)
    add("--parallel", type=int, default=8, help="quicsrv's slots (one is used at a time)")
    add("--flash-attn", action=argparse.BooleanOptionalAction, default=True)
    add("--timeout-s", type=float, default=3600.0, help="one lm_eval run at most")
    add(
        "--quicsrv-env",
        type=lambda s: tuple(s.split("=", 1)),
        action="append",
        default=[],
        metavar="QUICSRV_KEY=VALUE",
        help="a quicsrv setting for the run (e.g. QUICSRV_PREFILL_CHUNK_TOKENS=512: every "
        "prompt in one batch, as the reference evaluates it)",
    )
    add("--out", type=Path, help="default: loadtest/results/lm-eval-<time>")
    add("--compare-only", type=Path, metavar="DIR", help="compare the runs already in DIR")
    return parser


def _compare(out: Path, tolerance: float, wall: Mapping[str, float]) -> str:
    runs = {name: read_samples(out / name / "lm_eval") for name in (QUICSRV, REFERENCE)}
    ours, theirs = runs[QUICSRV], runs[REFERENCE]
    choices = (
        compare_choices(ours[MC_TASK], theirs[MC_TASK], tolerance)
        if MC_TASK in ours and MC_TASK in theirs
        else None
    )
    generations = (
        compare_generations(ours[GEN_TASK], theirs[GEN_TASK])
        if GEN_TASK in ours and GEN_TASK in theirs
        else None
    )
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    heading = (
        f"lm-eval {LM_EVAL_VERSION} `local-completions`, {stamp}, {machine_name()}, load "
        f"average {os.getloadavg()[0]:.2f} at the end; tolerance {tolerance:g} nats."
    )
    table = render(choices, generations, tolerance=tolerance, heading=heading, wall_s=wall)
    (out / "comparison.md").write_text(table)
    (out / "comparison.json").write_text(
        json.dumps(
            {
                "choices": None if choices is None else asdict(choices),
                "generations": None if generations is None else asdict(generations),
                "wall_s": dict(wall),
            },
            indent=1,
        )
    )
    return table


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.compare_only is not None:
        wall_file = args.compare_only / "wall_s.json"
        wall = json.loads(wall_file.read_text()) if wall_file.is_file() else {}
        print(_compare(args.compare_only, args.tolerance, wall))
        return 0
    out = args.out or REPO / "loadtest" / "results" / (
        "lm-eval-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    )
    out.mkdir(parents=True, exist_ok=True)
    wall_file = out / "wall_s.json"
    # A run of one target into a folder that has the other's (--out): compared with it.
    wall = json.loads(wall_file.read_text()) if wall_file.is_file() else {}
    wall.update(asyncio.run(_evaluate(args, out)))
    wall_file.write_text(json.dumps(wall))
    if all((out / name / "lm_eval").is_dir() for name in (QUICSRV, REFERENCE)):
        print(_compare(out, args.tolerance, wall))
    else:
        print(f"one target only: samples in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
