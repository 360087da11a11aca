"""The benchmark report's ratios (loadtest.bench.report), on made-up measurements."""

from __future__ import annotations

import dataclasses

from loadtest.bench.raw import BEST_VARIANT, RawResult
from loadtest.bench.report import QUICSRV, Report
from loadtest.bench.stats import LoadResult

META = {
    "parallel": 8,
    "timestamp": "t",
    "model": "m",
    "max_tokens": 100,
    "n_threads": 2,
    "context_per_sequence": 2048,
    "n_batch": 512,
    "prefill_chunk": 64,
    "repeats": 2,
    "cpus": 2,
    "loadavg_start": 0.0,
    "loadavg_end": 0.0,
    "commit": "c",
}


def raw(sequences: int, tokens_per_s: float, round_: int = -1, variant: str = "") -> RawResult:
    wall_s = sequences * 100 / tokens_per_s
    return RawResult(
        sequences=sequences,
        max_tokens=100,
        wall_s=wall_s,
        ttft_s=0.01,
        decode_step_s=wall_s / 100,
        variant=variant,
        round=round_,
    )


def load(streams: int, tokens_per_s: float, round_: int, target: str = QUICSRV) -> LoadResult:
    return LoadResult(
        target=target,
        streams=streams,
        max_tokens=100,
        wall_s=streams * 100 / tokens_per_s,
        delivered_tokens=streams * 100,
        expected_tokens=streams * 100,
        tokens_per_s=tokens_per_s,
        ttft_p50_s=0.01,
        ttft_p99_s=0.01,
        gap_p50_s=0.01,
        gap_p99_s=0.01,
        gap_max_s=0.01,
        delivered_min=100,
        delivered_mean=100.0,
        delivered_max=100,
        complete_streams=streams,
        finishes={"length": streams},
        others_cpu_share=0.0,
        loadavg_1m=0.0,
        round=round_,
    )


def test_each_run_is_divided_by_the_raw_rate_of_its_own_round():
    # The machine slowed down between the rounds: against its own round each run is at 96-98%,
    # against the fast round's raw rate the slow run would look like 78%.
    report = Report.build(
        META,
        [raw(1, 100.0, 0), raw(1, 80.0, 1)],
        [load(1, 98.0, 0), load(1, 76.8, 1)],
        [],
    )
    assert report.paired_ratios(QUICSRV, 1) == [0.98, 0.96]
    target = report.targets()[0]
    assert target[2] is True and "median 97.0% over 2 runs" in target[1]
    row = next(line for line in report.markdown().splitlines() if line.startswith(f"| {QUICSRV}"))
    assert "| 0.97 |" in row  # the paired median column


def test_the_eight_stream_target_uses_the_fastest_raw_settings_of_the_round():
    report = Report.build(
        META,
        [raw(8, 200.0, 0), raw(8, 250.0, 0, BEST_VARIANT)],
        [load(8, 205.0, 0)],
        [],
    )
    assert report.paired_ratios(QUICSRV, 8) == [205.0 / 200.0]
    assert report.paired_ratios(QUICSRV, 8, best=True) == [205.0 / 250.0]
    target = report.targets()[1]
    assert target[2] is False  # 82% of the fastest raw rate, though 102.5% of quicsrv's own


def test_server_cpu_per_token_is_pooled_over_every_run_of_a_cell():
    # One tick more or less in a short run moves its own figure by a lot; pooled, much less.
    runs = [
        dataclasses.replace(load(1, 100.0, round_), server_cpu_s=cpu_s)
        for round_, cpu_s in enumerate((0.02, 0.03, 0.02))
    ]
    report = Report.build(META, [raw(1, 100.0, 0)], runs, [])
    assert report.server_cpu_us_per_token(QUICSRV, 1) == 1e6 * 0.07 / 300
    assert report.server_cpu_us_per_token(QUICSRV, 8) is None
    row = next(line for line in report.markdown().splitlines() if line.startswith(f"| {QUICSRV}"))
    assert "| 233 |" in row


def test_the_cpu_target_compares_with_the_baseline_tree_pooled():
    before = "quicsrv @ abc1234"
    runs = [
        dataclasses.replace(load(8, 100.0, 0), server_cpu_s=0.1),
        dataclasses.replace(load(8, 100.0, 0, target=before), server_cpu_s=0.25),
        dataclasses.replace(load(8, 100.0, 1), server_cpu_s=0.2),
        dataclasses.replace(load(8, 100.0, 1, target=before), server_cpu_s=0.25),
    ]
    report = Report.build(META, [raw(8, 100.0, 0)], runs, [])
    cpu = {what: (measured, met) for what, measured, met in report.targets()}
    assert cpu[f"server CPU per token at 8 streams <= 50% of {before}"][1] is False  # 60%
    assert cpu["server CPU per token at 1 stream <= 50% of the tree before (--baseline-tree)"] == (
        "not measured",
        None,
    )
