"""The AIPerf benchmark's pure parts: the tokenizer files made from a GGUF's vocabulary, the
AIPerf command line, the export read into a row, the CPU window, the tables. AIPerf itself is
never run here (it lives in its own venv and takes minutes)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest

from loadtest.bench.aiperf_report import (
    Cell,
    CpuSample,
    Measured,
    RunResult,
    cpu_shares,
    ratio_rows,
    read_export,
    read_records,
    render,
)
from loadtest.bench.aiperf_run import aiperf_argv, main, workloads
from loadtest.bench.aiperf_tokenizer import (
    GgufVocabulary,
    UnsupportedVocabulary,
    tokenizer_files,
)
from loadtest.bench.machine import describe_machine


def _vocabulary(**changes: object) -> GgufVocabulary:
    fields: dict[str, object] = {
        "model": "gpt2",
        "pre": "smollm",
        "tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>", "a", "b", "ab", "Ġ"],
        "token_types": [3, 3, 3, 4, 1, 1, 1, 1],
        "merges": ["a b"],
        "bos_id": 1,
        "eos_id": 2,
        "unk_id": 0,
        "pad_id": 2,
        "chat_template": "{{ messages }}",
        "context_length": 8192,
    }
    fields.update(changes)
    return GgufVocabulary(**fields)  # type: ignore[arg-type]


def test_tokenizer_files_carry_the_vocabulary_merges_and_special_tokens() -> None:
    files = tokenizer_files(_vocabulary())
    tokenizer = files["tokenizer.json"]
    assert tokenizer["model"]["type"] == "BPE"
    assert tokenizer["model"]["vocab"] == {
        "<|endoftext|>": 0,
        "<|im_start|>": 1,
        "<|im_end|>": 2,
        "<tool>": 3,
        "a": 4,
        "b": 5,
        "ab": 6,
        "Ġ": 7,
    }
    assert tokenizer["model"]["merges"] == [["a", "b"]]
    assert [(t["id"], t["content"], t["special"]) for t in tokenizer["added_tokens"]] == [
        (0, "<|endoftext|>", True),
        (1, "<|im_start|>", True),
        (2, "<|im_end|>", True),
        (3, "<tool>", False),  # user-defined: matched whole, but not special to HF
    ]
    # llama.cpp's smollm pre-tokenizer: every digit alone, then GPT-2's byte-level regex.
    steps = tokenizer["pre_tokenizer"]["pretokenizers"]
    assert steps[0] == {"type": "Digits", "individual_digits": True}
    assert steps[1]["type"] == "ByteLevel" and steps[1]["use_regex"] is True
    assert steps[1]["add_prefix_space"] is False
    config = files["tokenizer_config.json"]
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False
    assert config["model_max_length"] == 8192
    assert config["chat_template"] == "{{ messages }}"
    assert files["special_tokens_map.json"]["pad_token"] == "<|im_end|>"
    json.dumps(files)  # all of it is JSON


def test_plain_gpt2_pre_tokenizer_is_byte_level_alone() -> None:
    tokenizer = tokenizer_files(_vocabulary(pre="gpt-2"))["tokenizer.json"]
    assert tokenizer["pre_tokenizer"]["type"] == "ByteLevel"


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"model": "llama"}, "byte-level BPE"),
        ({"pre": "qwen2"}, "tokenizer.ggml.pre"),
        ({"add_bos": True}, "add_bos_token"),
        ({"merges": ["ab"]}, "not two tokens"),
        ({"tokens": ["a", "a"], "token_types": [1, 1], "merges": []}, "twice"),
    ],
)
def test_a_vocabulary_that_would_tokenize_differently_is_refused(
    changes: dict[str, object], why: str
) -> None:
    with pytest.raises(UnsupportedVocabulary, match=why):
        tokenizer_files(_vocabulary(**changes))


def test_workloads_scale_requests_with_concurrency_and_add_the_multi_turn_run() -> None:
    cells = workloads(
        [1, 8, 32],
        requests_per_slot=2,
        min_requests=8,
        multi_turn_conversations=8,
        multi_turn_turns=4,
        multi_turn_concurrency=4,
    )
    assert [(c.name, c.concurrency, c.requests, c.turns) for c in cells] == [
        ("c=1", 1, 8, 1),
        ("c=8", 8, 16, 1),
        ("c=32", 32, 64, 1),
        ("multi-turn 4×, c=4", 4, 32, 4),
    ]
    assert cells[-1].conversations == 8
    assert cells[2].conversations == 64  # one prompt per request: no whole-prompt cache hit
    assert len(workloads([1], requests_per_slot=1, min_requests=1, **_no_multi_turn())) == 1


def _no_multi_turn() -> dict[str, int]:
    return {"multi_turn_conversations": 0, "multi_turn_turns": 4, "multi_turn_concurrency": 4}


def _argv(cell: Cell) -> list[str]:
    return aiperf_argv(
        Path("/venv/bin/aiperf"),
        target_url="https://localhost:4433",
        model="SmolLM2",
        tokenizer=Path("/tok"),
        cell=cell,
        endpoint="chat",
        input_tokens=256,
        output_tokens=128,
        seed=41,
        artifact_dir=Path("/out/run"),
        request_timeout_s=900,
    )


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_aiperf_argv_asks_for_the_workload() -> None:
    argv = _argv(Cell(name="c=8", concurrency=8, requests=16))
    assert argv[:2] == ["/venv/bin/aiperf", "profile"]
    assert _flag(argv, "--url") == "https://localhost:4433"
    assert _flag(argv, "--endpoint-type") == "chat"
    assert "--streaming" in argv and "--use-server-token-count" in argv
    assert (_flag(argv, "--isl"), _flag(argv, "--isl-stddev")) == ("256", "0")
    assert (_flag(argv, "--osl"), _flag(argv, "--osl-stddev")) == ("128", "0")
    assert _flag(argv, "--extra-inputs") == "ignore_eos:true"
    assert _flag(argv, "--concurrency") == "8"
    assert _flag(argv, "--request-count") == "16"
    assert _flag(argv, "--conversation-num") == "16"
    assert _flag(argv, "--random-seed") == "41"
    assert _flag(argv, "--tokenizer") == "/tok"
    assert _flag(argv, "--workers-max") == "1"
    assert "--conversation-turn-mean" not in argv
    # Paced under the concurrency cap, so that AIPerf's timing service sleeps instead of spinning.
    assert _flag(argv, "--request-rate") == "200"
    assert _flag(argv, "--arrival-pattern") == "constant"
    # A connection a request: no pooled connection that the server is closing is written to.
    assert _flag(argv, "--connection-reuse-strategy") == "never"


def test_aiperf_argv_without_pacing_is_aiperfs_burst_mode() -> None:
    cell = Cell(name="c=8", concurrency=8, requests=16)
    argv = aiperf_argv(
        Path("aiperf"),
        target_url="http://127.0.0.1:1",
        model="m",
        tokenizer=Path("/tok"),
        cell=cell,
        endpoint="completions",
        input_tokens=256,
        output_tokens=128,
        seed=1,
        artifact_dir=Path("/out"),
        request_timeout_s=60,
        pace_rps=0,
    )
    assert "--request-rate" not in argv and "--arrival-pattern" not in argv
    assert _flag(argv, "--endpoint-type") == "completions"


def test_an_open_loop_workload_arrives_at_its_rate_whatever_is_in_flight() -> None:
    cells = workloads([8], requests_per_slot=2, min_requests=8, **_no_multi_turn(), rates=[0.45])
    assert cells[-1] == Cell(name="0.45/s", concurrency=48, requests=48, rate=0.45)
    argv = _argv(cells[-1])
    assert _flag(argv, "--request-rate") == "0.45"
    assert _flag(argv, "--arrival-pattern") == "poisson"
    assert _flag(argv, "--concurrency") == _flag(argv, "--request-count") == "48"


def test_aiperf_argv_multi_turn() -> None:
    argv = _argv(Cell(name="mt", concurrency=4, requests=32, turns=4))
    assert _flag(argv, "--conversation-turn-mean") == "4"
    assert _flag(argv, "--conversation-turn-stddev") == "0"
    assert _flag(argv, "--conversation-num") == "8"
    assert _flag(argv, "--request-count") == "32"


def _stats(p50: float, p90: float, unit: str = "ms") -> dict[str, object]:
    return {"unit": unit, "avg": (p50 + p90) / 2, "p50": p50, "p90": p90}


EXPORT = {
    "request_count": {"unit": "requests", "avg": 16.0},
    "time_to_first_token": _stats(812.5, 1400.0),
    "inter_token_latency": _stats(21.25, 30.0),
    "output_token_throughput": {"unit": "tokens/sec", "avg": 96.5},
    "request_throughput": {"unit": "requests/sec", "avg": 0.75},
    "usage_prompt_tokens": _stats(286.0, 286.0, "tokens"),
    "output_sequence_length": _stats(128.0, 128.0, "tokens"),
    "benchmark_duration": {"unit": "sec", "avg": 21.3},
    "error_summary": [
        {"error_details": {"code": 500, "message": "x"}, "count": 2},
        {"error_details": {"code": 503, "message": "y"}, "count": 1},
    ],
    "start_time": "2026-12-05T21:21:48.541917",
    "end_time": "2026-12-05T21:22:37.325131",
}


def test_read_export_takes_the_tables_numbers() -> None:
    measured = read_export(EXPORT)
    assert measured == Measured(
        requests_ok=16,
        errors=3,
        ttft_p50_ms=812.5,
        ttft_p90_ms=1400.0,
        itl_p50_ms=21.25,
        output_tokens_per_s=96.5,
        requests_per_s=0.75,
        prompt_tokens=286.0,
        output_tokens=128.0,
        duration_s=21.3,
    )


def test_read_export_of_a_run_where_everything_failed_reads_nan() -> None:
    measured = read_export({"error_summary": [{"count": 4}]})
    assert measured.requests_ok == 0 and measured.errors == 4
    assert math.isnan(measured.ttft_p50_ms) and math.isnan(measured.itl_p50_ms)
    assert measured.prompt_tokens is None


def test_read_export_refuses_successes_without_ttft() -> None:
    export = {k: v for k, v in EXPORT.items() if k != "time_to_first_token"}
    with pytest.raises(ValueError, match="time_to_first_token"):
        read_export(export)


def test_cpu_shares_keep_the_profiling_window_only() -> None:
    # 2 CPUs; AIPerf's start-up (t 0-10) burns 8 s of its own, then the window 10-20 s: the
    # machine busy 12 s, the server 8 s, AIPerf 2 s, so others 2 s.
    samples = [
        CpuSample(0.0, 100.0, 50.0, 0.0),
        CpuSample(10.0, 110.0, 50.0, 8.0),
        CpuSample(20.0, 122.0, 58.0, 10.0),
        CpuSample(30.0, 124.0, 58.0, 10.5),
    ]
    others, aiperf = cpu_shares(samples, 10.0, 20.0, cpus=2)
    assert others == pytest.approx(2 / 20) and aiperf == pytest.approx(2 / 20)
    # Between samples the counters are interpolated: 15-20 s is half of the second interval.
    others, aiperf = cpu_shares(samples, 15.0, 20.0, cpus=2)
    assert others == pytest.approx(1 / 10) and aiperf == pytest.approx(1 / 10)
    assert all(math.isnan(x) for x in cpu_shares(samples[:1], 0.0, 1.0, cpus=2))


def _result(
    server: str, cell: str, ttft: float, rate: float, served: tuple[float, float] | None = None
) -> RunResult:
    measured = Measured(
        requests_ok=8,
        errors=0,
        ttft_p50_ms=ttft,
        ttft_p90_ms=2 * ttft,
        itl_p50_ms=20.0,
        output_tokens_per_s=rate,
        requests_per_s=rate / 128,
        prompt_tokens=286.0,
        output_tokens=128.0,
        duration_s=10.0,
        first_token_at_s=None if served is None else served[0],
        end_at_s=None if served is None else served[1],
    )
    return RunResult(
        server=server,
        cell=cell,
        repeat=0,
        measured=measured,
        others_cpu_share=0.02,
        aiperf_cpu_share=0.1,
        loadavg_1m=1.5,
    )


def test_ratios_are_quicsrv_over_llama_server_per_workload() -> None:
    results = [
        _result("quicsrv", "c=1", 100.0, 60.0, (30.0, 45.0)),
        _result("llama-server", "c=1", 50.0, 80.0, (40.0, 50.0)),
        _result("quicsrv", "c=8", 400.0, 90.0),
        _result("llama-server", "c=8", 400.0, 90.0, (10.0, 20.0)),
    ]
    assert ratio_rows(results, ["c=1", "c=8"]) == [
        ["c=1", "2.00", "2.00", "1.00", "0.75", "0.75", "0.75", "0.90"],
        # A run saved before the records were read has no times: no ratio for them.
        ["c=8", "1.00", "1.00", "1.00", "1.00", "1.00", "–", "–"],
    ]
    text = render(results, ["c=1", "c=8"], heading="heading line")
    assert text.startswith("heading line")
    assert "| c=1 | llama-server | 1 | 8 | 50 | 100 | 20.0 | 80.0 |" in text
    assert "| 10 | 40.0 | 50.0 |" in text and "| 10 | – | – |" in text
    assert "| c=1 | 2.00 | 2.00 | 1.00 | 0.75 | 0.75 | 0.75 | 0.90 |" in text


def _record(start_s: float, ttft_ms: float | None, end_s: float) -> str:
    metrics = {} if ttft_ms is None else {"time_to_first_token": {"value": ttft_ms, "unit": "ms"}}
    return json.dumps(
        {
            "metadata": {
                "request_start_ns": int(start_s * 1e9),
                "request_end_ns": int(end_s * 1e9),
            },
            "metrics": metrics,
            **({"error": {"type": "ServerDisconnectedError"}} if ttft_ms is None else {}),
        }
    )


def test_read_records_times_first_tokens_and_ends_from_the_runs_first_send() -> None:
    # The run starts with a failed request at 100 s: it counts for the start only.
    lines = [
        _record(100.0, None, 100.01),
        _record(100.5, 1500.0, 104.0),  # first token at 2.0 s, end at 4.0 s
        _record(103.0, 3000.0, 110.0),  # first token at 6.0 s, end at 10.0 s
        "",
    ]
    first_tokens_at, ends_at = read_records(lines) or (0.0, 0.0)
    assert first_tokens_at == pytest.approx(4.0) and ends_at == pytest.approx(7.0)
    assert read_records([_record(1.0, None, 1.1)]) is None
    assert read_records([]) is None


def test_report_only_rerenders_a_saved_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    results = [_result("quicsrv", "c=1", 100.0, 60.0), _result("llama-server", "c=1", 50.0, 80.0)]
    meta = {
        "stamp": "20261205-000000",
        "aiperf_version": "0.13.0",
        "machine": "a machine",
        "loadavg_start": 1.0,
        "loadavg_end": 2.0,
        "endpoint_path": "chat/completions",
        "input_tokens": 256,
        "output_tokens": 128,
        "parallel": 8,
        "ctx": 2048,
        "threads": 2,
        "flash_attn": True,
        "llama_server_note": "",
    }
    saved = tmp_path / "run.json"
    saved.write_text(
        json.dumps({"meta": meta, "cells": ["c=1"], "results": [asdict(r) for r in results]})
    )
    assert main(["--report-only", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "on a machine; load average 1.00" in out
    assert "| c=1 | 2.00 |" in out


def test_describe_machine_names_cpu_units_cpus_and_memory() -> None:
    cpuinfo = "\n".join(
        [
            "processor\t: 0",
            "model name\t: Intel(R) Xeon(R)   Processor",
            "flags\t\t: fpu avx2 avx512f amx_tile amx_int8",
            "",
            "processor\t: 1",
            "model name\t: Intel(R) Xeon(R)   Processor",
            "flags\t\t: fpu avx2 avx512f amx_tile amx_int8",
        ]
    )
    meminfo = "MemTotal:       24683792 kB\nMemFree: 1 kB\n"
    assert describe_machine(cpuinfo, meminfo, usable_cpus=1) == (
        "Intel(R) Xeon(R) Processor with AMX/AVX-512/AVX2, 1 of 2 CPUs usable, 23.5 GiB"
    )
    assert describe_machine("", "", usable_cpus=4) == "unknown CPU, 4 of 4 CPUs usable"
