"""The spool directory: its files' names, a dead worker's leftovers, a dead server's directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from quicsrv.engine.spool import Spool, out_path, phase_path, take


def test_a_blob_goes_in_and_comes_out_once(tmp_path: Path):
    spool = Spool(tmp_path)
    try:
        kv_file = spool.write_in(3, 7, b"cells")
        assert kv_file is not None and Path(kv_file).read_bytes() == b"cells"
        out = out_path(spool.path, 3, 7, 12)
        out.write_bytes(b"more cells")
        assert take(str(out)) == b"more cells"
        assert not out.exists()  # taken means removed
        assert take(str(out)) is None and take(None) is None
    finally:
        spool.remove()
    assert not spool.path.exists()


def test_a_dead_workers_files_are_discarded_and_no_other(tmp_path: Path):
    spool = Spool(tmp_path)
    for incarnation in (0, 1):
        spool.write_in(incarnation, 1, b"x")
        out_path(spool.path, incarnation, 2, 5).write_bytes(b"y")
        phase_path(spool.path, incarnation).write_bytes(b"\x03")
    spool.discard(0)
    assert sorted(p.name for p in spool.path.iterdir()) == ["in-1-1.kv", "out-1-2-5.kv", "phase-1"]


def test_a_dead_servers_directory_goes_when_the_next_one_starts(tmp_path: Path):
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead_pid = int(gone.stdout)  # exited: its pid names no process (reused: kept, harmless)
    orphan = tmp_path / f"quicsrv-kv-{dead_pid}-abc123"
    orphan.mkdir()
    (orphan / "phase-0").write_bytes(b"\x01")
    living = tmp_path / f"quicsrv-kv-{os.getpid()}-def456"  # another engine of a live server
    living.mkdir()
    unrelated = tmp_path / "quicsrv-kv-oldstyle"
    unrelated.mkdir()
    spool = Spool(tmp_path)
    assert not orphan.exists()
    assert living.exists() and unrelated.exists() and spool.path.exists()
    assert spool.path.name.startswith(f"quicsrv-kv-{os.getpid()}-")
