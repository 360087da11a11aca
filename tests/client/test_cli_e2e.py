"""The command-line client against a real server process: generate --json, resume, demo."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import server_process

pytestmark = [pytest.mark.model, pytest.mark.slow]


async def _cli(port: int, ca, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "quicsrv_client.cli",
        *args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ca",
        str(ca),
        "--ticket-cache",
        "",
    ]
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=300
    )


@pytest.mark.asyncio
async def test_generate_json_then_resume_from_its_checkpoint(certs, tmp_path):
    async with server_process(certs, tmp_path) as (_process, port):
        generated = await _cli(
            port, certs.ca_cert, "generate", "Count to twenty:", "--max-tokens", "30",
            "--ignore-eos", "--json",
        )  # fmt: skip
        assert generated.returncode == 0, generated.stderr
        events = [json.loads(line) for line in generated.stdout.splitlines()]
        kinds = {e["type"] for e in events}
        assert {"session", "checkpoint", "token", "end"} <= kinds
        session = next(e["session"] for e in events if e["type"] == "session")
        checkpoint = next(e for e in events if e["type"] == "checkpoint" and e["index"] == 15)
        resumed = await _cli(
            port, certs.ca_cert, "resume", "--session", session, "--from-index", "20",
            "--checkpoint-index", "15", "--hash", checkpoint["hash"], "--json",
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        tail = [json.loads(line) for line in resumed.stdout.splitlines()]
        forged = await _cli(
            port, certs.ca_cert, "resume", "--session", session, "--from-index", "20",
            "--hash", "00" * 32, "--json",
        )  # fmt: skip
    expected = [e for e in events if e["type"] == "token" and e["index"] > 20]
    assert [e for e in tail if e["type"] == "token"] == expected
    assert [e for e in tail if e["type"] == "end"] == [e for e in events if e["type"] == "end"]
    assert forged.returncode == 1
    error = json.loads(forged.stdout.splitlines()[-1])
    assert (error["type"], error["name"]) == ("error", "hash_mismatch")


def test_make_demo_resume_joins_the_text_exactly():
    # The same entry point as `make demo-resume`: its own server, a cut, a resume, a check.
    done = subprocess.run(
        [sys.executable, "-m", "quicsrv.demo", "resume"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "joined output identical to the uninterrupted run: yes" in done.stdout
    assert "time to first resumed token" in done.stdout


def test_make_demo_shows_the_text_and_names_the_server_log():
    # `make demo`: the generated text alone on the terminal, the server's log in a file.
    done = subprocess.run(
        [sys.executable, "-m", "quicsrv.demo"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[end: " in done.stderr  # the client's closing line
    for output in (done.stdout, done.stderr):  # no server log line (timestamped) on either
        assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", output, re.MULTILINE) is None
    log = Path(done.stdout.rstrip().rsplit("the server's log: ", 1)[1])
    assert "quicsrv listening on" in log.read_text()
    assert "stream ended" in log.read_text()
