"""Each package's settings, derived from the one :class:`~quicsrv.config.ServerConfig`.

The configuration holds every default once and knows no package; the packages take their own
small settings objects and know no configuration. This module maps one onto the others, for the
composition root (:mod:`quicsrv.app`) and for tools and tests that drive a part without a server
(the ``*_for`` functions: the defaults, with changes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import fields
from pathlib import Path
from typing import Any

from .config import ServerConfig
from .cpus import CpuBudget, usable_cpus
from .engine.llama import EngineSettings
from .engine.supervisor import SupervisorSettings
from .engine.supervisor import probe_cpu_extra_buffers as _probe
from .sessions.settings import FlowSettings, SessionSettings
from .transport.sockets import SocketOptions

__all__ = [
    "engine_settings",
    "engine_threads",
    "engine_settings_for",
    "flow_settings",
    "probe_cpu_extra_buffers",
    "session_settings",
    "session_settings_for",
    "socket_options",
    "socket_options_for",
    "supervisor_settings",
    "supervisor_settings_for",
]


def engine_settings(config: ServerConfig, model_path: Path) -> EngineSettings:
    return EngineSettings(
        model_path=model_path,
        n_seq_max=config.n_seq_max,
        context_per_sequence=config.context_per_sequence,
        n_batch=config.n_batch,
        prefill_chunk=config.prefill_chunk_tokens,
        n_threads=engine_threads(config),
        max_queued=config.max_queued_requests,
        batch_invariant=config.batch_invariant,
        flash_attn=config.flash_attn,
        kv_unified=config.kv_unified,
        prefix_cache=config.prefix_cache,
        prefix_cache_max_bytes=config.prefix_cache_max_bytes,
        prefix_cache_dir=(config.kv_shared_dir or config.data_dir) / "prefix-cache",
        prefix_cache_disk_bytes=config.prefix_cache_disk_bytes,
        chat_template_file=config.chat_template_file,
    )


def engine_threads(config: ServerConfig, cpus: CpuBudget | None = None) -> int:
    """llama.cpp's thread count: ``n_threads`` when set, else every CPU this process may use
    (``cpus``, default :func:`~quicsrv.cpus.usable_cpus`) split across the ``workers``."""
    if config.n_threads > 0:
        return config.n_threads
    budget = cpus if cpus is not None else usable_cpus()
    return max(1, budget.count // max(1, config.workers))


def supervisor_settings(config: ServerConfig) -> SupervisorSettings:
    config.check()
    return SupervisorSettings(
        cpu_extra_buffers=config.cpu_extra_buffers,
        start_timeout_s=config.worker_start_timeout_s,
        stall_timeout_s=config.worker_stall_timeout_s,
        max_restarts=config.worker_max_restarts,
        restart_window_s=config.worker_restart_window_s,
        breaker_cooldown_s=config.worker_breaker_cooldown_s,
        breaker_max_cooldown_s=config.worker_breaker_max_cooldown_s,
        breaker_probation_steps=config.worker_breaker_probation_steps,
        poison_strikes=config.worker_poison_strikes,
        token_coalesce_s=config.token_coalesce_ms / 1000,
    )


def session_settings(config: ServerConfig) -> SessionSettings:
    return SessionSettings(
        data_dir=config.data_dir,
        ttl_s=config.session_ttl_s,
        max_sessions=config.max_sessions,
        max_disk_bytes=config.max_session_disk_bytes,
        kv_memory_budget_bytes=config.kv_memory_budget_bytes,
        kv_disk_budget_bytes=config.kv_disk_budget_bytes,
        max_tokens_limit=config.max_tokens_limit,
        on_conflict=config.resume_conflict,
        mac_key=bytes.fromhex(config.mac_key_hex) if config.mac_key_hex else None,
        max_active_per_client=config.max_active_per_client,
        max_queued_per_client=config.max_queued_per_client,
        max_queue_wait_s=config.max_queue_wait_s,
        store_url=config.store,
        lease_s=config.store_lease_s,
        kv_redis_max_bytes=config.kv_redis_max_bytes,
        kv_shared_dir=config.kv_shared_dir,
        flow=flow_settings(config),
    )


def flow_settings(config: ServerConfig) -> FlowSettings:
    config.check()
    return FlowSettings(
        max_tokens_ahead=config.max_tokens_ahead,
        high_watermark_bytes=config.send_high_watermark_bytes,
        low_watermark_bytes=config.send_low_watermark_bytes,
        checkpoint_every_tokens=config.checkpoint_every_tokens,
        inexact_reprefill=config.inexact_reprefill,
        coalesce_s=config.token_coalesce_ms / 1000,
        prefix_cache_shared=config.prefix_cache_shared,
    )


def socket_options(config: ServerConfig) -> SocketOptions:
    return SocketOptions(
        recv_buffer_bytes=config.udp_recv_buffer_bytes,
        send_buffer_bytes=config.udp_send_buffer_bytes,
        pmtu_probe=config.udp_pmtu_probe,
        reuse_port=config.udp_reuse_port,
    )


def engine_settings_for(model_path: Path, **changes: Any) -> EngineSettings:
    """The default configuration's engine settings for ``model_path``, with ``changes`` (for
    tools and tests that drive an engine without a server)."""
    # Without a server there is no data directory: no shelf unless one is named.
    changes.setdefault("prefix_cache_dir", None)
    return dataclasses.replace(engine_settings(ServerConfig(), model_path), **changes)


def supervisor_settings_for(**changes: Any) -> SupervisorSettings:
    """The default configuration's supervisor settings, with ``changes``."""
    return dataclasses.replace(supervisor_settings(ServerConfig()), **changes)


def session_settings_for(data_dir: Path, **changes: Any) -> SessionSettings:
    """The default configuration's session settings under ``data_dir``, with ``changes``;
    :class:`~quicsrv.sessions.settings.FlowSettings` fields may be given among them."""
    base = session_settings(ServerConfig(data_dir=data_dir))
    flow_fields = {f.name for f in fields(base.flow)}
    flow = {k: changes.pop(k) for k in list(changes) if k in flow_fields}
    return dataclasses.replace(base, flow=dataclasses.replace(base.flow, **flow), **changes)


def socket_options_for(**changes: Any) -> SocketOptions:
    """The default configuration's UDP socket options, with ``changes``."""
    return dataclasses.replace(socket_options(ServerConfig()), **changes)


def probe_cpu_extra_buffers(model_path: Path, config: ServerConfig | None = None) -> bool:
    """Whether llama.cpp's extra CPU buffers survive the start-up canary on this machine (a
    worker process takes the risk: :func:`quicsrv.engine.supervisor.probe_cpu_extra_buffers`)."""
    config = config or ServerConfig()
    return _probe(engine_settings(config, model_path), supervisor_settings(config))
