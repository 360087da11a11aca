"""The values a caller chooses: how the client connects, and how a generation samples.

Both are frozen dataclasses, so one value can be built once, shared, and varied with
:meth:`~ClientConfig.replace`; the keyword forms (``Client(api_key=...)``,
``client.stream(prompt, max_tokens=...)``) are typed by the matching ``TypedDict`` and land in
the same dataclass, so each default is written exactly once.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

import quicsrv_proto

from ._protocol import DEFAULT_ACK_DELAY_S
from ._reconnect import ReconnectPolicy

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_CA",
    "DEFAULT_READ_WINDOW_BYTES",
    "DEFAULT_STALL_TIMEOUT_S",
    "ClientConfig",
    "ClientSettings",
    "SamplingOptions",
    "SamplingSettings",
]

_GENERATE: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(quicsrv_proto.Generate)}

DEFAULT_CA = "certs/ca.pem"
#: Stream receive window: how far the server may run ahead of what the application has read.
DEFAULT_READ_WINDOW_BYTES = 16 * 1024
#: Silence after a token (while the caller waits) that counts as a stalled stream: far above
#: the gaps a busy server makes (a long prompt's prefill chunks, a replayed resume).
DEFAULT_STALL_TIMEOUT_S = 30.0
API_KEY_ENV = "QUICSRV_API_KEY"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientConfig:
    """How a :class:`~client.Client` connects, whatever server it talks to."""

    ca: Path = Path(DEFAULT_CA)
    """The CA certificate (PEM) the server's certificate must chain to."""
    insecure_skip_verify: bool = False
    """Accept any server certificate (development only)."""
    connect_timeout_s: float = 10.0
    """How long the QUIC/TLS handshake may take."""
    read_window_bytes: int = DEFAULT_READ_WINDOW_BYTES
    """How far the server may run ahead of what the application has read, per stream."""
    ack_delay_s: float = DEFAULT_ACK_DELAY_S
    """Longest wait before acknowledging received packets (at most 25 ms)."""
    idle_timeout_s: float = 30.0
    """A connection with nothing received for this long is dead (keepalives while busy)."""
    reconnect: ReconnectPolicy | None = None
    """Reconnect and resume inside ``async for`` after a connection loss; None: raise."""
    api_key: str | None = field(default_factory=lambda: os.environ.get(API_KEY_ENV) or None)
    """Sent as ``authorization: Bearer``; default: the QUICSRV_API_KEY variable."""
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S
    """A stream silent this long after a token, on a live connection, is treated as lost
    (auto-resume, else StallTimeout); None: wait forever."""

    def __post_init__(self) -> None:
        # Paths arrive as strings from CLIs and settings files.
        object.__setattr__(self, "ca", Path(self.ca))
        if self.connect_timeout_s <= 0 or self.idle_timeout_s <= 0:
            raise ValueError("connect_timeout_s and idle_timeout_s must be positive")
        if self.read_window_bytes < 1024:
            raise ValueError("read_window_bytes must be at least 1024")
        if self.ack_delay_s < 0:
            raise ValueError("ack_delay_s cannot be negative")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 0:
            raise ValueError("stall_timeout_s must be positive (None: no stall detection)")

    def replace(self, **changes: object) -> ClientConfig:
        """A copy with ``changes`` applied (checked like a new one)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


class ClientSettings(TypedDict, total=False):
    """:class:`ClientConfig`'s fields as keywords of :class:`~client.Client`."""

    ca: str | Path | None
    insecure_skip_verify: bool
    connect_timeout_s: float
    read_window_bytes: int
    ack_delay_s: float
    idle_timeout_s: float
    reconnect: ReconnectPolicy | None
    api_key: str | None
    stall_timeout_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingOptions:
    """How one generation picks its tokens and when it stops.

    ``temperature=0`` is greedy. A ``seed`` makes a sampled generation reproducible, and a
    resumed one identical to the uninterrupted run.
    """

    # The wire frame's defaults, so a default here is what the server does when it is left out.
    max_tokens: int = _GENERATE["max_tokens"]
    temperature: float = _GENERATE["temperature"]
    top_p: float = _GENERATE["top_p"]
    top_k: int = _GENERATE["top_k"]
    min_p: float = _GENERATE["min_p"]
    repeat_penalty: float = _GENERATE["repeat_penalty"]
    seed: int | None = _GENERATE["seed"]
    stop: tuple[str, ...] = _GENERATE["stop"]
    """Strings that end the generation (not included in the text)."""
    ignore_eos: bool = _GENERATE["ignore_eos"]
    """Go on past the model's end-of-generation token (benchmarks)."""

    def __post_init__(self) -> None:
        # A list or a generator of stop strings is convenient; the value stays hashable.
        object.__setattr__(self, "stop", tuple(self.stop))

    def replace(self, **changes: object) -> SamplingOptions:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def to_frame(
        self,
        *,
        prompt: str | None,
        messages: tuple[quicsrv_proto.ChatMessage, ...] | None,
        deadline_ms: int | None,
        truncation: quicsrv_proto.Truncation = quicsrv_proto.Truncation.DISABLED,
    ) -> quicsrv_proto.Generate:
        """The GENERATE frame asking for these options (the frame checks every range)."""
        return quicsrv_proto.Generate(
            prompt=prompt,
            messages=messages,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            deadline_ms=deadline_ms,
            truncation=truncation,
        )


class SamplingSettings(TypedDict, total=False):
    """:class:`SamplingOptions`' fields as keywords of :meth:`~client.Client.stream`."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repeat_penalty: float
    seed: int | None
    stop: Iterable[str]
    ignore_eos: bool
