"""The sessions' settings: derived from :class:`quicsrv.config.ServerConfig` by the composition
root (:mod:`quicsrv.app`), which holds the defaults."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import ResumeConflict
from ..engine import Engine
from .admission import AdmissionLimits

__all__ = ["FlowSettings", "SessionSettings"]


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowSettings:
    """Derived from :class:`quicsrv.config.ServerConfig` (``flow_settings()``)."""

    max_tokens_ahead: int
    """Tokens generated beyond what the reader acknowledged before the sequence pauses; more
    where the reader's delay needs it (:mod:`.flow`)."""
    high_watermark_bytes: int
    """Unacknowledged stream bytes at which the reader counts as blocked."""
    low_watermark_bytes: int
    """...and below which it counts as drained again."""
    checkpoint_every_tokens: int
    coalesce_s: float
    """How long the engine may hold a token before sending it (the worker's coalescing)."""
    inexact_reprefill: bool
    """Rebuild missing KV by one chunked prefill (fast, not bit-exact) instead of the replay."""
    prefix_cache_shared: bool
    """Every API key's generations reuse every key's kept cells (by default only their own:
    the time to first token would tell one key what another key's prompts were)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionSettings:
    """Derived from :class:`quicsrv.config.ServerConfig` (``session_settings()``), which holds
    the defaults."""

    data_dir: Path
    ttl_s: float
    max_sessions: int
    max_disk_bytes: int
    kv_memory_budget_bytes: int
    kv_disk_budget_bytes: int
    max_tokens_limit: int
    on_conflict: ResumeConflict
    mac_key: bytes | None
    flow: FlowSettings
    max_active_per_client: int
    """0: three quarters of the engine's slots (at least 1), so one client never takes all."""
    max_queued_per_client: int
    """0: a quarter of the engine's queue (at least 1)."""
    max_queue_wait_s: float
    """A new request that cannot start within this long ends with ``deadline_exceeded``."""
    store_url: str
    """Where records, token logs and MAC keys live: "" (or "file"): under ``data_dir``;
    ``redis://host:port/db``: in Redis, shared by every process that names it."""
    lease_s: float
    """With Redis: how long a process owns a session after its last write to it."""
    kv_redis_max_bytes: int
    """With Redis: paused KV blobs up to this size are shared through Redis."""
    kv_shared_dir: Path | None
    """With Redis: larger blobs are shared here (None: not shared; a resume elsewhere replays)."""
    previous_key_ttl_s: float = 86400.0
    """How long a rotated-out MAC key still verifies (``quicsrv keys rotate`` sets its own)."""

    def queue_wait_s(self, deadline_ms: int | None, waited_s: float) -> float:
        """How much longer a new request that waited ``waited_s`` already may wait for a slot:
        the server's ``max_queue_wait_s`` and the request's ``deadline_ms``, both from its
        arrival."""
        bound_s = self.max_queue_wait_s
        if deadline_ms is not None:
            bound_s = min(bound_s, deadline_ms / 1000)
        return max(0.0, bound_s - waited_s)

    def admission_limits(self, engine: Engine) -> AdmissionLimits:
        slots, queue = engine.n_seq_max, engine.max_queued
        return AdmissionLimits(
            slots=slots,
            max_queued=queue,
            max_active_per_client=self.max_active_per_client or max(1, slots * 3 // 4),
            max_queued_per_client=self.max_queued_per_client or max(1, queue // 4),
        )
