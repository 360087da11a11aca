"""``quicsrv.spawn``: leaving the block ends the server and everything it started, even when
they ignore SIGTERM and hold its output pipe (else the block, and the test around it, hangs)."""

from __future__ import annotations

import os
import select
import sys
import textwrap
from pathlib import Path

import pytest

from quicsrv.spawn import spawn_server

# Stands in for ``quicsrv serve`` (run as the spawn's prefix, its own arguments ignored): a
# child that ignores SIGTERM and keeps stdout open, a parent that ignores it too.
_STUBBORN = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = os.fork()
    if child == 0:
        while True:
            time.sleep(1)
    print(f"child {child}", flush=True)
    print("quicsrv listening on 127.0.0.1:4999 (stub)", flush=True)
    while True:
        time.sleep(1)
    """
)


def _ends(pid: int, within_s: float = 30.0) -> bool:
    """Whether ``pid`` has ended, or ends within ``within_s``: a SIGKILL to a process group is
    carried out by each process on its own, after ``killpg`` returns (CI once saw the child
    closing its files, which ends the spawn's read, but not yet dead). A pidfd becomes readable
    when its process ends, a zombie included."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([pidfd], [], [], within_s)
        return bool(readable)
    finally:
        os.close(pidfd)


def test_leaving_kills_a_server_and_its_children_that_ignore_sigterm(tmp_path: Path) -> None:
    script = tmp_path / "stubborn.py"
    script.write_text(_STUBBORN)
    with spawn_server([], prefix=[sys.executable, str(script)], stop_timeout_s=0.5) as server:
        assert server.port == 4999
        child = next(int(line.split()[1]) for line in server.lines if line.startswith("child"))
        parent = server.process.pid
        assert not _ends(child, within_s=0)
    assert server.process.returncode is not None
    assert _ends(parent)
    assert _ends(child)


def test_a_log_that_cannot_be_opened_is_an_error_at_once(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError), spawn_server([], log=tmp_path / "absent" / "log"):
        pass
