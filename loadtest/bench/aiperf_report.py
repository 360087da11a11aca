"""AIPerf's summary export read into one row per run, and the tables of a run: pure functions.

AIPerf writes ``profile_export_aiperf.json`` into each run's artifact folder: one object per
metric (``{"unit": "ms", "avg": ..., "p50": ..., "p90": ...}``) plus ``error_summary``
(``[{"error_details": {...}, "count": N}]``). :func:`read_export` takes the few numbers the
tables show; :func:`render` draws them, every run a row and quicsrv over llama-server per
workload.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Cell",
    "CpuSample",
    "Measured",
    "RunResult",
    "cpu_shares",
    "ratio_rows",
    "read_export",
    "read_records",
    "render",
]

QUICSRV = "quicsrv"
LLAMA_SERVER = "llama-server"


@dataclass(frozen=True, slots=True, kw_only=True)
class Cell:
    """One workload: what one AIPerf invocation is asked to do against each server."""

    name: str
    """Its label in the tables (``c=8``, ``multi-turn``)."""
    concurrency: int
    """Requests (sessions, for multi-turn) in flight at once."""
    requests: int
    """Requests in all (every turn of a conversation is one)."""
    turns: int = 1
    """Turns per conversation: above 1 each turn resends the history with the answers."""
    rate: float = 0.0
    """Requests a second arriving on their own (Poisson, from the run's seed: the same times
    for both servers), whatever is in flight: an open loop, where no request waits for another
    to end before it is sent. 0: a closed loop of ``concurrency``."""

    @property
    def conversations(self) -> int:
        """Distinct conversations: one per request unless multi-turn, so no prompt repeats."""
        return max(1, self.requests // self.turns)


@dataclass(frozen=True, slots=True, kw_only=True)
class Measured:
    """What AIPerf measured in one run (its own definitions, client side, over TCP)."""

    requests_ok: int
    """Requests that completed without error."""
    errors: int
    """Requests that ended in an error."""
    ttft_p50_ms: float
    """Time to first token, median: from sending the request to the first content chunk."""
    ttft_p90_ms: float
    """Time to first token, 90th percentile."""
    itl_p50_ms: float
    """Inter-token latency, median over requests of (latency - TTFT) / (tokens - 1)."""
    output_tokens_per_s: float
    """Output tokens of all requests over the benchmark's duration."""
    requests_per_s: float
    """Completed requests over the benchmark's duration."""
    prompt_tokens: float | None
    """Mean prompt tokens the server reported (``usage``): the chat template included."""
    output_tokens: float
    """Mean output tokens per request."""
    duration_s: float
    """The benchmark's duration."""
    first_token_at_s: float | None = None
    """When requests got their first token, mean seconds after the run's first request was
    sent (:func:`read_records`): how soon the server served the run, whatever sent when."""
    end_at_s: float | None = None
    """When requests ended, the same way."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """One AIPerf run against one server, with what the machine was doing meanwhile."""

    server: str
    """``quicsrv`` or ``llama-server``."""
    cell: str
    """:attr:`Cell.name`."""
    repeat: int
    """0-based repeat index."""
    measured: Measured
    """AIPerf's numbers."""
    others_cpu_share: float
    """CPU that neither the server nor AIPerf used during the profiling phase, as a share of
    the machine (other people's jobs, the idle peer server)."""
    aiperf_cpu_share: float
    """CPU that AIPerf's own processes used during the profiling phase, as a share."""
    loadavg_1m: float
    """1-minute load average when the run ended."""


@dataclass(frozen=True, slots=True)
class CpuSample:
    """Cumulative CPU seconds at one instant, sampled during an AIPerf run."""

    at_s: float
    """Wall-clock time (``time.time()``)."""
    machine_s: float
    """The whole machine's busy CPU since boot."""
    server_s: float
    """The server under test and its engine worker."""
    aiperf_s: float
    """AIPerf's processes (one per service, all alive through the profiling phase)."""


def _at(samples: Sequence[CpuSample], t: float) -> tuple[float, float, float]:
    """The cumulative counters at ``t``, linear between the samples around it (clamped to the
    first and last sample)."""
    if t <= samples[0].at_s:
        first = samples[0]
        return first.machine_s, first.server_s, first.aiperf_s
    for before, after in zip(samples, samples[1:], strict=False):
        if before.at_s <= t <= after.at_s:
            span = after.at_s - before.at_s
            w = (t - before.at_s) / span if span > 0 else 1.0
            return (
                before.machine_s + w * (after.machine_s - before.machine_s),
                before.server_s + w * (after.server_s - before.server_s),
                before.aiperf_s + w * (after.aiperf_s - before.aiperf_s),
            )
    last = samples[-1]
    return last.machine_s, last.server_s, last.aiperf_s


def cpu_shares(
    samples: Sequence[CpuSample], start_s: float, end_s: float, cpus: int
) -> tuple[float, float]:
    """(others' share, AIPerf's share) of the machine between ``start_s`` and ``end_s`` (AIPerf's
    profiling phase, not its start-up): 0.0 idle, 1.0 every core busy. Others' is what neither
    the server nor AIPerf used."""
    wall = end_s - start_s
    if len(samples) < 2 or wall <= 0:
        return float("nan"), float("nan")
    m0, s0, a0 = _at(samples, start_s)
    m1, s1, a1 = _at(samples, end_s)
    aiperf = max(0.0, a1 - a0)
    others = max(0.0, (m1 - m0) - (s1 - s0) - aiperf)
    return others / (wall * cpus), aiperf / (wall * cpus)


def _metric(export: Mapping[str, Any], name: str, stat: str) -> float | None:
    entry = export.get(name)
    if not isinstance(entry, Mapping):
        return None
    value = entry.get(stat)
    return float(value) if isinstance(value, int | float) else None


def _latency(export: Mapping[str, Any], name: str, stat: str, *, ok: int) -> float:
    """A latency metric; NaN when no request succeeded (AIPerf then writes none)."""
    value = _metric(export, name, stat)
    if value is not None:
        return value
    if ok:
        raise ValueError(f"AIPerf export has no {name}.{stat} although {ok} requests succeeded")
    return float("nan")


def read_export(export: Mapping[str, Any]) -> Measured:
    """The numbers of ``profile_export_aiperf.json`` (parsed) that the tables show.

    A run in which every request failed has no latency metrics: those read as NaN, and the
    errors say why. A run with successes but no TTFT (not streamed) is refused.
    """
    errors = sum(
        int(entry.get("count", 0))
        for entry in export.get("error_summary") or []
        if isinstance(entry, Mapping)
    )
    ok = int(_metric(export, "request_count", "avg") or 0)
    return Measured(
        requests_ok=ok,
        errors=errors,
        ttft_p50_ms=_latency(export, "time_to_first_token", "p50", ok=ok),
        ttft_p90_ms=_latency(export, "time_to_first_token", "p90", ok=ok),
        itl_p50_ms=_latency(export, "inter_token_latency", "p50", ok=ok),
        output_tokens_per_s=_metric(export, "output_token_throughput", "avg") or 0.0,
        requests_per_s=_metric(export, "request_throughput", "avg") or 0.0,
        prompt_tokens=_metric(export, "usage_prompt_tokens", "avg"),
        output_tokens=_metric(export, "output_sequence_length", "avg") or 0.0,
        duration_s=_metric(export, "benchmark_duration", "avg") or 0.0,
    )


def read_records(lines: Iterable[str]) -> tuple[float, float] | None:
    """(first tokens at, ends at) from ``profile_export.jsonl``, a request a line: the mean
    over successful requests of their first token's and their end's time, in seconds after
    the run's first request was sent (None: no successful request).

    A closed loop (AIPerf's concurrency) sends a request when an earlier one ends, and its TTFT
    starts there: a server that ends a request sooner has its next request sent sooner, and at
    a queue's length (c=32, 8 slots) that request waits longer for the same turn. Measured from
    the run's start, the same requests' first tokens and ends say which server served them
    sooner."""
    records = [json.loads(line) for line in lines if line.strip()]
    if not records:
        return None
    start = min(r["metadata"]["request_start_ns"] for r in records)
    ok = [r for r in records if not r.get("error") and "time_to_first_token" in r["metrics"]]
    if not ok:
        return None
    firsts = [
        (r["metadata"]["request_start_ns"] - start) / 1e9
        + r["metrics"]["time_to_first_token"]["value"] / 1e3
        for r in ok
    ]
    ends = [(r["metadata"]["request_end_ns"] - start) / 1e9 for r in ok]
    return statistics.fmean(firsts), statistics.fmean(ends)


def _median(results: Sequence[RunResult], field: str) -> float:
    return float(statistics.median(getattr(r.measured, field) for r in results))


#: The comparisons: (label, field, higher is better).
_RATIOS = (
    ("TTFT p50", "ttft_p50_ms", False),
    ("TTFT p90", "ttft_p90_ms", False),
    ("ITL p50", "itl_p50_ms", False),
    ("output tok/s", "output_tokens_per_s", True),
    ("req/s", "requests_per_s", True),
    ("first tokens at", "first_token_at_s", False),
    ("ends at", "end_at_s", False),
)


def ratio_rows(results: Sequence[RunResult], cells: Sequence[str]) -> list[list[str]]:
    """Per workload, quicsrv's median over llama-server's for each metric (``–`` where one
    server has no run). For latencies below 1.00 is quicsrv faster; for rates above."""
    rows = []
    for cell in cells:
        ours = [r for r in results if r.cell == cell and r.server == QUICSRV]
        theirs = [r for r in results if r.cell == cell and r.server == LLAMA_SERVER]
        row = [cell]
        for _, field, _ in _RATIOS:
            known = all(getattr(r.measured, field) is not None for r in [*ours, *theirs])
            if ours and theirs and known and _median(theirs, field) > 0:
                row.append(f"{_median(ours, field) / _median(theirs, field):.2f}")
            else:
                row.append("–")
        rows.append(row)
    return rows


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right_from: int) -> str:
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _run_row(result: RunResult) -> list[str]:
    m = result.measured
    prompt = "–" if m.prompt_tokens is None else f"{m.prompt_tokens:.0f}"
    return [
        result.cell,
        result.server,
        str(result.repeat + 1),
        f"{m.requests_ok}" + (f" (+{m.errors} failed)" if m.errors else ""),
        f"{m.ttft_p50_ms:.0f}",
        f"{m.ttft_p90_ms:.0f}",
        f"{m.itl_p50_ms:.1f}",
        f"{m.output_tokens_per_s:.1f}",
        f"{m.requests_per_s:.3f}",
        f"{prompt} / {m.output_tokens:.0f}",
        f"{m.duration_s:.0f}",
        "–" if m.first_token_at_s is None else f"{m.first_token_at_s:.1f}",
        "–" if m.end_at_s is None else f"{m.end_at_s:.1f}",
        f"{result.others_cpu_share:.0%}",
        f"{result.aiperf_cpu_share:.0%}",
        f"{result.loadavg_1m:.1f}",
    ]


def render(results: Sequence[RunResult], cells: Sequence[str], *, heading: str) -> str:
    """The run's markdown: ``heading`` (machine, settings), every run, then the ratios."""
    order = {cell: i for i, cell in enumerate(cells)}
    runs = sorted(results, key=lambda r: (order.get(r.cell, len(order)), r.server, r.repeat))
    header = [
        "workload",
        "server",
        "repeat",
        "requests ok",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "ITL p50 ms",
        "output tok/s",
        "req/s",
        "prompt / output tokens",
        "s",
        "first tokens at s",
        "ends at s",
        "others' CPU",
        "AIPerf CPU",
        "load avg",
    ]
    ratio_header = ["workload", *(f"{label} ×" for label, _, _ in _RATIOS)]
    return "\n\n".join(
        [
            heading,
            _table(header, [_run_row(r) for r in runs], right_from=2),
            "quicsrv ÷ llama-server (medians; latency below 1.00 and rate above 1.00: "
            "quicsrv better). First tokens at, ends at: the requests' mean times from the "
            "run's start (a closed loop sends a request when another ends, so a TTFT starts "
            "wherever the server ended the one before):",
            _table(ratio_header, ratio_rows(results, cells), right_from=1),
        ]
    )
