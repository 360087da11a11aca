"""The Open Responses bench's own logic (no download, no server): which verdict each of the
suite's results gets, and what is printed."""

from __future__ import annotations

from pathlib import Path

from loadtest.bench.open_responses import SUITE_COMMIT, archive_url, judge, render, suite_argv


def test_the_suite_is_pinned_to_one_commit() -> None:
    assert len(SUITE_COMMIT) == 40 and int(SUITE_COMMIT, 16) >= 0
    assert archive_url().endswith(f"/archive/{SUITE_COMMIT}.tar.gz")


def test_the_suite_runs_every_test_against_the_servers_v1_with_json_results() -> None:
    argv = suite_argv(Path("/b/bun"), "https://localhost:1/v1", "qwen")
    assert argv[:3] == ["/b/bun", "run", "bin/compliance-test.ts"]
    assert argv[argv.index("--base-url") + 1] == "https://localhost:1/v1"
    assert argv[argv.index("--model") + 1] == "qwen"
    assert "--json" in argv and "--filter" not in argv


def test_each_result_gets_its_verdict() -> None:
    verdicts = judge(
        [
            {"id": "basic-response", "name": "Basic", "status": "passed", "errors": []},
            {"id": "streaming-response", "name": "S", "status": "failed", "errors": ["x: bad"]},
            {"id": "image-input", "name": "I", "status": "failed", "errors": ["HTTP 400"]},
            {"id": "websocket-mode", "name": "W", "status": "failed", "errors": []},
            {"id": "responses-compact", "name": "C", "status": "failed", "errors": []},
            {"id": "tool-calling", "name": "T", "status": "failed", "errors": ["HTTP 400"]},
            {
                "id": "tool-calling-2",
                "name": "T2",
                "status": "failed",
                "errors": ['Expected output item of type "function_call" but none found'],
            },
            {"id": "file-search", "name": "F", "status": "skipped", "errors": ["optional"]},
            {
                "id": "system-prompt",
                "name": "P",
                "status": "failed",
                "errors": ['Expected status "completed" but got "incomplete"'],
            },
        ]
    )
    kinds = {v.id: v.kind for v in verdicts}
    assert kinds == {
        "basic-response": "in scope",
        "streaming-response": "in scope",
        "image-input": "out of scope",
        "websocket-mode": "out of scope",
        "responses-compact": "out of scope",
        "tool-calling": "in scope",
        "tool-calling-2": "in scope",
        "file-search": "skipped by the suite",
        "system-prompt": "in scope",
    }
    against = [v.id for v in verdicts if v.counts_against]
    assert against == ["streaming-response", "tool-calling", "tool-calling-2", "system-prompt"]
    assert "ran on to max_output_tokens" in verdicts[-1].why
    # A text answer where a call was expected: the model's choice under auto, and still a failure.
    assert verdicts[5].why == "" and "answered in text" in verdicts[6].why
    table = render(verdicts, "# run")
    assert "| streaming-response | failed | in scope | x: bad |" in table
    assert "In scope: 1 of 5 passed; 1 of 9 in all." in table
