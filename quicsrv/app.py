"""The composition root: one server process built from a :class:`~quicsrv.config.ServerConfig`.

``quicsrv serve`` runs :func:`run` in its own process; ``quicsrv serve --workers N`` runs
:func:`serve` in each worker process (:mod:`quicsrv.workers`). Nothing else wires the parts
together: :func:`serve` makes the engine, :func:`start` the session store, key ring and KV store
(:func:`~quicsrv.sessions.persistence.open_persistence`), the metrics, the session manager, the
API keys, the router with the operator endpoints, the ticket store and the listeners (QUIC and
TCP, :func:`quicsrv.transport.start_server`), each from its settings (:mod:`quicsrv.settings`).
This module needs the ``server`` extra (llama.cpp, Redis, Prometheus, hypercorn): the command line
imports it only to serve.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

import redis

from .apikeys import ApiKeys
from .config import ServerConfig, redact_store_url
from .cpus import usable_cpus
from .datadir import DataDirBusy, DataDirLock
from .engine import Engine, EngineUnavailable, default_model_path
from .engine.supervisor import WorkerEngine
from .engine.vocab import check_chat_template
from .http.operator import PlainRoutes, authorize_metrics, readiness
from .http.router import Router
from .logs import quiet_exception_handler
from .metrics import ServerMetrics
from .rate_limits import RateLimits
from .sessions.manager import SessionManager
from .sessions.persistence import open_persistence
from .sessions.redis_store import connect
from .settings import (
    engine_settings,
    engine_threads,
    session_settings,
    socket_options,
    supervisor_settings,
)
from .transport import RunningServer, start_server
from .transport.redis_tickets import RedisTicketStore
from .transport.tickets import MemoryTicketStore, TicketStore

__all__ = ["preflight", "run", "serve", "start"]

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
    if config.chat_template_file is not None:
        try:
            check_chat_template(config.chat_template_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            return f"chat_template_file: cannot read {config.chat_template_file}: {exc}"
        except ValueError as exc:
            return f"chat_template_file: {config.chat_template_file} is not a Jinja template: {exc}"
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
    threads = engine_threads(config)
    chosen = "--threads" if config.n_threads > 0 else usable_cpus().describe()
    log.info("engine threads: %d (%s)", threads, chosen, extra={"event": "engine_threads"})
    try:
        # Blocks until the worker loaded the model and passed its canary (safe mode decided).
        engine = await asyncio.to_thread(
            WorkerEngine, engine_settings(config, model_path), supervisor_settings(config)
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
    running = await start(engine, config, model_id=config.model_name or model_path.stem)
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


async def start(
    engine: Engine,
    config: ServerConfig,
    sessions: SessionManager | None = None,
    tickets: TicketStore | None = None,
    *,
    model_id: str | None = None,
) -> RunningServer:
    """Build one server around ``engine`` and have it listen (``config.port`` 0: an ephemeral
    port). ``sessions`` (default: opened from ``config``) and ``tickets`` (default: shared in
    Redis when the sessions are, else kept in memory and left in the data dir for the next
    process) may be given, as tests and benchmarks do; ``model_id``: what ``/v1/models`` lists
    (default: ``config.model_name``, else the model file's stem, else "quicsrv")."""
    if sessions is None:
        settings = session_settings(config)
        sessions = SessionManager(
            engine, settings, persistence=open_persistence(settings), metrics=ServerMetrics()
        )
    metrics = sessions.metrics
    metrics.bind_sessions(sessions.facts)
    metrics.bind_engine(engine)
    api_keys = ApiKeys(
        [config.api_key] if config.api_key else [],
        keys_file=config.api_keys_file,
        rate_limits=RateLimits(
            requests_per_minute=config.rate_limit_requests_per_minute,
            tokens_per_minute=config.rate_limit_tokens_per_minute,
        ),
    )
    router = Router(
        sessions=sessions,
        api_keys=api_keys,
        plain=PlainRoutes(
            metrics=metrics,
            readiness=lambda: readiness(
                engine, accepting=sessions.accepting, store_outage=sessions.store.outage()
            ),
            authorize_metrics=lambda headers: authorize_metrics(
                headers, api_keys=api_keys, metrics_public=config.metrics_public
            ),
        ),
        metrics=metrics,
        model_id=model_id
        or config.model_name
        or (config.model_path.stem if config.model_path else "quicsrv"),
        max_body_bytes=config.max_request_bytes,
        sse_keepalive_s=config.sse_keepalive_s,
    )
    running = await start_server(
        router=router,
        sessions=sessions,
        metrics=metrics,
        config=config,
        udp_options=socket_options(config),
        tickets=tickets if tickets is not None else _tickets(config, sessions),
        on_closed=lambda: metrics.unbind_engine(engine),
    )
    if api_keys.enabled:
        log.info("API keys: %d accepted; requests without one get 401", len(api_keys))
    else:
        log.warning(
            "NO API KEY CONFIGURED: anyone who reaches %s can generate "
            "(set --api-key, QUICSRV_API_KEY or api_keys_file)",
            config.address(running.port),
        )
    log.info("session store: %s", sessions.usage())
    restarted = sessions.run_unattended_again()
    if restarted:
        log.info("background responses: %d unfinished ones started again", restarted)
    return running


def _tickets(config: ServerConfig, sessions: SessionManager) -> TicketStore:
    """0-RTT tickets: shared in Redis when the sessions are, else this process's own."""
    if sessions.settings.store_url not in ("", "file"):
        # A client of its own: aioquic asks for tickets on the event loop, so a Redis that
        # stalls must cost a handshake its 0-RTT within half a second, never retried.
        return RedisTicketStore(
            connect(sessions.settings.store_url, timeout_s=0.5, retries=0),
            ttl_s=config.ticket_ttl_s,
        )
    # Left in the data dir by the previous process, and for the next one when this one stops.
    kept_at = config.data_dir / "tickets.cbor"
    tickets = MemoryTicketStore(
        ttl_s=config.ticket_ttl_s, max_tickets=config.max_tickets, keep_at=kept_at
    )
    taken = tickets.load(kept_at)
    if taken:
        log.info("session tickets: %d taken over from the previous process", taken)
    return tickets
