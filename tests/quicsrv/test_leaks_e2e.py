"""Leaks: after rounds of generations with cuts, resumes and cancels, a real ``quicsrv serve``
and its engine worker hold exactly what they held before.

The machinery is ``loadtest.bench.soak`` (its longer run is ``python -m loadtest.bench.soak``):
a server process with a data dir of its own, every paused KV blob written to a KV file (no
memory budget), rounds that each mix every :class:`~loadtest.bench.soak.Kind` three times, in
all its variants (read to the end; cut and resumed once paused, by KV restore; stopped by
DELETE at once after a stream reset, at once after a cut, racing a pause that captures the KV
cells, and after a cut once the pause landed; SSE over TCP cut and resumed by Last-Event-ID over
TCP and over HTTP/3; SSE stopped by DELETE while read).

The baseline is the census after the first round, not before any: that round warms what is
made once and kept (thread pools grown to the lanes' concurrency, llama.cpp's threads, caches),
which is no leak. After each round the server is polled until it is at rest (no generation or
live session in ``/metrics``, no TCP connection, no blob in the spool or in memory), never slept
on. Then the server's and the worker's open fds and threads, the spool files and the KV files
must equal the baseline's exactly, item by item (threads by name: the two processes run with a
``sitecustomize`` that gives each Python thread's name to the kernel). One exception, bounded:
the event loop's default executor starts a thread whenever a job finds all of its threads busy
and keeps it, so its count past the first depends on how jobs overlapped; it is only checked
against concurrent.futures' bound. Session *records* are kept until their TTL by design (a late
resume needs them): they are not compared; every session here ends (finished or cancelled), and
an ended session holds no descriptor and no KV file. RSS may grow by at most
``RSS_GROWTH_BOUND_MIB`` between the second round and the last. After SIGTERM, the worker is gone
and the spool directory with it.
"""

from __future__ import annotations

import os

import pytest

from loadtest.bench.soak import (
    RSS_GROWTH_BOUND_MIB,
    Kind,
    SoakSettings,
    rss_growth_mib,
    soak,
    soak_server,
)

pytestmark = [pytest.mark.model, pytest.mark.asyncio]

ROUNDS = 3
PER_ROUND = 3 * len(Kind)  # each kind in all of its variants
# Short generations, five at a time (one decode step serves them all): a cut at token 3 still
# leaves the 32 tokens a cut reader's allowance may run ahead, and a few more.
SETTINGS = SoakSettings(max_tokens=40, lanes=len(Kind))


async def test_fds_threads_spool_and_kv_files_come_back_after_cuts_resumes_and_cancels(
    model_path, certs, tmp_path
):
    async with soak_server(tmp_path, certs, model_path=model_path) as server:
        results = await soak(server, SETTINGS, ROUNDS, PER_ROUND)
    baseline = results[0].census
    for result in results[1:]:
        assert result.differences == [], f"round {result.round}: {result.differences}"
        assert result.census.counts() == baseline.counts()
        assert result.kinds == {kind.value: 3 for kind in Kind}
    # Cut generations were resumed from their KV files (the path through the spool). Not each
    # of them: a client that lags (2 busy cores) acknowledges tokens its reader never took, so
    # a generation may run to its end before the cut.
    assert any(result.resume_paths.get("kv-restore") for result in results), results
    # One worker's phase file (the safe-mode worker's on a CPU whose canary crashes).
    assert baseline.kv == () and len(baseline.spool) == 1
    assert baseline.spool[0].startswith("phase-")
    assert results[-1].census.sessions == ROUNDS * PER_ROUND  # kept until their TTL
    growth = rss_growth_mib(results)
    assert max(growth.values()) <= RSS_GROWTH_BOUND_MIB, growth
    # The server stopped (SIGTERM): its worker went with it, and the spool directory too.
    assert not os.path.exists(f"/proc/{server.worker_pid}")
    assert not server.spool_dir.exists()
