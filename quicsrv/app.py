"""The composition root: one server process built from a :class:`~quicsrv.config.ServerConfig`.

``quicsrv serve`` runs :func:`run` in its own process; ``quicsrv serve --workers N`` runs
:func:`serve` in each worker process (:mod:`quicsrv.workers`). Nothing else wires the engine,
the sessions and the transport together. This module needs the ``server`` extra (llama.cpp,
Redis, Prometheus, hypercorn): the command line imports it only to serve.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import redis

from .config import ServerConfig, redact_store_url
from .datadir import DataDirBusy, DataDirLock
from .engine import EngineUnavailable, default_model_path
from .engine.supervisor import WorkerEngine
from .logs import quiet_exception_handler
from .sessions.redis_store import connect
from .transport import start_server

__all__ = ["preflight", "run", "serve"]

log = logging.getLogger("quicsrv")


def preflight(config: ServerConfig) -> str | None:
    """Why ``config`` cannot be served (None: nothing found), checked before anything starts
    so that the answer is one line instead of a failure minutes later."""
    try:
        model_path = config.model_path or default_model_path()
    except FileNotFoundError as exc:
        return str(exc)
    if not model_path.is_file():
        return f"model_path: {model_path} is not a file"
    if config.store in ("", "file"):
        return None
    try:
        connect(config.store, timeout_s=5.0, retries=0).ping()
    except (redis.RedisError, ValueError) as exc:
        return f"the session store {redact_store_url(config.store)} cannot be reached: {exc}"
    return None


def run(config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM in this process; the exit status."""
    try:
        asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 130
    except EngineUnavailable as exc:
        log.error("cannot serve: %s", exc)
        return 1
    except DataDirBusy as exc:
        log.error("cannot serve: %s", exc)
        return 2
    return 0


async def serve(config: ServerConfig, announce: Callable[[int], None] | None = None) -> None:
    """Run one server until SIGINT/SIGTERM; ``announce(port)`` once it listens (default: print
    the "listening" line that scripts and tests wait for)."""
    log.info("config: %s", config.describe())
    asyncio.get_running_loop().set_exception_handler(quiet_exception_handler)
    model_path = config.model_path or default_model_path()
    # The data dir's lock is waited for while the model loads: a restarted server takes over
    # the moment the old one has handed its sessions over, with its engine ready.
    locking = asyncio.ensure_future(
        DataDirLock.acquire(config.data_dir, wait_s=config.data_dir_wait_s)
    )
    try:
        # Blocks until the worker loaded the model and passed its canary (safe mode decided).
        engine = await asyncio.to_thread(
            WorkerEngine, config.engine_settings(model_path), config.supervisor_settings()
        )
    except BaseException:
        if locking.done() and not locking.cancelled() and locking.exception() is None:
            locking.result().release()
        else:
            locking.cancel()
        raise
    try:
        lock = await locking
    except BaseException:
        await asyncio.to_thread(engine.close)
        raise
    try:
        await _serve_with(engine, config, model_path, announce)
    finally:
        lock.release()


async def _serve_with(
    engine: WorkerEngine,
    config: ServerConfig,
    model_path: Path,
    announce: Callable[[int], None] | None,
) -> None:
    running = await start_server(engine, config)
    if announce is not None:
        announce(running.port)
    else:
        transports = "udp, h3" + (" + tcp, h2, http/1.1" if running.tcp is not None else "")
        print(
            f"quicsrv listening on {config.address(running.port)} ({transports}) "
            f"model={model_path.name}",
            flush=True,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("shutting down: handing the sessions over")
    await running.shutdown(config.shutdown_grace_s)
    log.info("store usage at exit: %s", running.sessions.usage())
    await asyncio.to_thread(engine.close)
    log.info("stopped")
