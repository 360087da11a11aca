"""``quicsrv serve --workers N``: N server processes on one UDP port (SO_REUSEPORT).

Each worker is a whole server (QUIC, sessions, its own llama.cpp engine worker, so N model
copies) sharing sessions, MAC keys, tickets and KV blobs through the Redis store; the kernel
spreads datagrams over the workers' sockets by a hash of each datagram's 4-tuple, so one QUIC
connection stays on one worker (README: Scaling out). This parent only starts the workers,
reports once they all listen, replaces one that dies, and stops them all on SIGINT/SIGTERM.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from multiprocessing.context import SpawnProcess
from typing import Any

from .config import ServerConfig
from .cpus import usable_cpus
from .spawn import die_with_parent

__all__ = ["run_workers", "worker_configs"]

log = logging.getLogger("quicsrv.workers")

# More deaths than this within the window is a crash loop, not bad luck: stop everything.
_MAX_REPLACEMENTS = 5
_REPLACEMENT_WINDOW_S = 600.0


def worker_configs(config: ServerConfig, port: int) -> list[ServerConfig]:
    """What each of ``config.workers`` processes runs: the same port with SO_REUSEPORT, its
    own data directory (local KV spill), the engine threads split between them."""
    n = config.workers
    budget = max(1, usable_cpus().count // n)
    threads = min(config.n_threads, budget) if config.n_threads > 0 else budget
    shared_kv = config.kv_shared_dir or config.data_dir / "kv-shared"
    return [
        dataclasses.replace(
            config,
            port=port,
            workers=1,
            udp_reuse_port=True,
            n_threads=threads,
            data_dir=config.data_dir / f"worker-{i}",
            kv_shared_dir=shared_kv,  # one node: every worker sees the same directory
        )
        for i in range(n)
    ]


def run_workers(config: ServerConfig) -> int:
    """Start the workers, print one "listening" line when all listen, wait for a signal."""
    if config.store in ("", "file"):
        log.error("--workers %d needs a shared store: --store redis://...", config.workers)
        return 2
    # Hold the port (in the same SO_REUSEPORT group) until every worker has bound it, so an
    # ephemeral port cannot be taken by someone else in between; nothing reads this socket,
    # and it is closed before anything is announced.
    holders = _hold_port(config.host, config.port, tcp=config.tcp_listener)
    port = holders[0].getsockname()[1]
    context = multiprocessing.get_context("spawn")
    configs = worker_configs(config, port)
    stop = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stop
        stop = True

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    workers: list[tuple[SpawnProcess, multiprocessing.connection.Connection, float]] = []
    try:
        for i, worker_config in enumerate(configs):
            workers.append(_start(context, i, worker_config))
        for process, ready, _started in workers:
            if not _wait_ready(process, ready):
                log.error("worker pid %s did not start", process.pid)
                return 1
        for holder in holders:
            holder.close()
        transports = "udp, h3" + (" + tcp, h2, http/1.1" if config.tcp_listener else "")
        print(
            f"quicsrv listening on {config.address(port)} ({transports}) workers={len(workers)} "
            f"pids={','.join(str(p.pid) for p, _, _ in workers)}",
            flush=True,
        )
        deaths: list[float] = []
        while not stop:
            sentinels = [p.sentinel for p, _, _ in workers]
            multiprocessing.connection.wait(sentinels, timeout=0.5)  # wakes for signals too
            for i, (process, _ready, _started) in enumerate(workers):
                if stop or process.is_alive():
                    continue
                log.error("worker %d (pid %s) exited with %s", i, process.pid, process.exitcode)
                now = time.monotonic()
                deaths = [t for t in deaths if now - t < _REPLACEMENT_WINDOW_S] + [now]
                if len(deaths) > _MAX_REPLACEMENTS:
                    log.error(
                        "%d worker deaths in %.0fs: stopping", len(deaths), _REPLACEMENT_WINDOW_S
                    )
                    return 1
                # Its sessions are in Redis: a resume reaching any worker continues them.
                workers[i] = _start(context, i, configs[i])
                if not _wait_ready(workers[i][0], workers[i][1]):
                    log.error("the replacement of worker %d did not start: stopping", i)
                    return 1
                log.info("worker %d replaced (pid %s)", i, workers[i][0].pid)
        return 0
    finally:
        for holder in holders:
            holder.close()
        for process, _ready, _started in workers:
            if process.is_alive():
                os.kill(process.pid or 0, signal.SIGTERM)
        for process, _ready, _started in workers:
            process.join(config.shutdown_grace_s + 30)
            if process.is_alive():
                process.kill()


def _start(
    context: multiprocessing.context.SpawnContext, index: int, config: ServerConfig
) -> tuple[SpawnProcess, multiprocessing.connection.Connection, float]:
    receive, send = context.Pipe(duplex=False)
    process = context.Process(
        target=_worker_main, args=(index, config, send), name=f"quicsrv-worker-{index}"
    )
    process.start()
    send.close()
    return process, receive, time.monotonic()


def _wait_ready(process: SpawnProcess, ready: multiprocessing.connection.Connection) -> bool:
    """Until the worker says it listens (True) or dies first (False)."""
    while True:
        if ready.poll(0.5):
            try:
                return bool(ready.recv())
            except EOFError:
                return False
        if not process.is_alive():
            return False


def _worker_main(
    index: int, config: ServerConfig, ready: multiprocessing.connection.Connection
) -> None:
    import asyncio

    from .app import serve
    from .logs import configure_logging

    die_with_parent(signal.SIGTERM)  # a kill -9 of the parent takes the workers with it
    configure_logging(config.log_format)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C arrives as SIGTERM

    def announce(port: int) -> None:
        log.info("worker %d (pid %d) listening on port %d", index, os.getpid(), port)
        ready.send(True)
        ready.close()

    asyncio.run(serve(config, announce=announce))


def _hold_port(host: str, port: int, *, tcp: bool) -> list[socket.socket]:
    """The port number for every worker, held (UDP, and TCP when the TCP listener is on)
    in the workers' SO_REUSEPORT groups. With port 0 the kernel picks the UDP port, which TCP
    may already use elsewhere: then another is tried (a fixed port is not retried)."""
    attempts = 20 if port == 0 else 1
    for attempt in range(attempts):
        udp = _bound(host, port, socket.SOCK_DGRAM)
        if not tcp:
            return [udp]
        try:
            return [udp, _bound(host, udp.getsockname()[1], socket.SOCK_STREAM)]
        except OSError as exc:
            udp.close()
            if exc.errno != errno.EADDRINUSE or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _bound(host: str, port: int, kind: socket.SocketKind) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT; never listened on or read."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, kind)
    try:
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock
