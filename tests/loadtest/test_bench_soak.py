"""``python -m loadtest.bench.soak``: its census counts what it should, tells leaks apart from
the event loop's executor, and its thread namer works (no model, no server; the soak itself
runs in tests/quicsrv/test_leaks_e2e.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from loadtest.bench.isolated import isolated
from loadtest.bench.soak import (
    POOL_MAX_THREADS,
    Census,
    ProcessCensus,
    main,
    process_census,
    thread_namer,
)


def _census_round(held: str) -> tuple[ProcessCensus, ProcessCensus, ProcessCensus]:
    """This process's census before, while and after it holds ``held`` open and a thread."""
    before = process_census(os.getpid())
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    with open(held, "w"):
        thread.start()
        during = process_census(os.getpid())
        stop.set()
        thread.join()
    return before, during, process_census(os.getpid())


def test_the_census_sees_a_descriptor_and_a_thread_come_and_go(tmp_path):
    # In a fresh interpreter: the test process's own threads (llama.cpp's, earlier tests'
    # executors') may start or end while it counts, which is no leak of the census's.
    held = str(tmp_path / "held")
    before, during, after = isolated(_census_round, held)
    assert len(during.fds) == len(before.fds) + 1 and held in during.fds
    assert len(during.threads) == len(before.threads) + 1
    assert (after.fds, after.threads) == (before.fds, before.threads)
    assert before.rss_kib > 0


def _census(server_threads: tuple[str, ...], kv: tuple[str, ...] = ()) -> Census:
    server = ProcessCensus(1, ("/dev/null", "socket"), server_threads, 1024)
    worker = ProcessCensus(2, ("pipe",), ("llama-engine",), 2048)
    return Census(server=server, worker=worker, spool=("phase-0",), kv=kv, sessions=0)


def test_differences_name_what_leaked_and_spare_the_executor_up_to_its_bound():
    baseline = _census(("python", "asyncio_0", "kv-spill_0"))
    grown_pool = _census(("python", "asyncio_0", "asyncio_1", "asyncio_2", "kv-spill_0"))
    assert grown_pool.differences(baseline) == []
    assert grown_pool.counts() == baseline.counts()
    assert grown_pool.pool_threads() == {"server": 2, "worker": 0}
    leaked = _census(("python", "asyncio_0", "kv-spill_0", "kv-spill_0"), kv=("<id>.kv",))
    assert leaked.differences(baseline) == [
        "server threads: 3 -> 4; +1 kv-spill_0",
        "kv files: 0 -> 1; +1 <id>.kv",
    ]
    past_bound = tuple(f"asyncio_{n}" for n in range(1, POOL_MAX_THREADS + 2))
    assert _census(("python", "asyncio_0", "kv-spill_0", *past_bound)).differences(baseline) == [
        f"server default executor threads: {POOL_MAX_THREADS + 1} > {POOL_MAX_THREADS}"
    ]


def test_the_thread_namer_gives_python_threads_their_names_in_proc(tmp_path):
    probe = (
        "import threading\n"
        "def show():\n"
        "    print(open(f'/proc/self/task/{threading.get_native_id()}/comm').read().strip())\n"
        "t = threading.Thread(target=show, name='soak-probe-thread-long')\n"
        "t.start(); t.join()\n"
    )
    env = {**os.environ, "PYTHONPATH": thread_namer(tmp_path / "instrument")}
    shown = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert shown.stdout.strip() == "soak-probe-thre"  # the kernel keeps 15 bytes


def test_fewer_than_three_rounds_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--rounds", "2"])
    assert exit_info.value.code == 2
    assert "at least 3" in capsys.readouterr().err
