"""What :meth:`client.Client.generate` yields, in stream order."""

from __future__ import annotations

from dataclasses import dataclass

import quicsrv_proto

__all__ = [
    "CheckpointReceived",
    "Event",
    "GenerationEnded",
    "GenerationResult",
    "Reconnected",
    "ResumePosition",
    "SessionStarted",
    "TokenReceived",
]


@dataclass(frozen=True, slots=True)
class SessionStarted:
    """The server named the generation's session (``quicsrv-session`` response header)."""

    session_id: str
    resume_path: str | None = None
    """On a resume: how the server rebuilds the decoder state (kv-restore, replay, none)."""
    early_data: bool = False
    """The request was answered from 0-RTT early data (a resume on a resumed TLS session)."""


@dataclass(frozen=True, slots=True)
class TokenReceived:
    """One generated token."""

    index: int
    token_id: int
    text: str
    logprob: float | None = None
    """Its log-probability in the model's distribution (``logprobs=`` asked for them)."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The most likely tokens there, ``(token id, log-probability)``, most likely first."""


@dataclass(frozen=True, slots=True)
class CheckpointReceived:
    """The server saved the state after token ``index`` under ``snapshot_hash``."""

    index: int
    snapshot_hash: bytes


@dataclass(frozen=True, slots=True)
class GenerationEnded:
    """The generation finished normally; always the last event."""

    reason: quicsrv_proto.EndReason
    prompt_tokens: int
    completion_tokens: int
    text: str = ""
    """Trailing text the server held back while it could have begun a stop sequence."""
    cached_tokens: int = 0
    """Prompt tokens the server did not compute again: their KV cells were kept from an
    earlier generation (the previous turn of a chat)."""


@dataclass(frozen=True, slots=True)
class Reconnected:
    """The connection was lost; the client reconnected and resumed after ``last_index``."""

    attempt: int
    """Which consecutive reconnect attempt succeeded (1: the first)."""
    last_index: int
    early_data: bool
    """The RESUME_STREAM went out as 0-RTT data (a session ticket was held)."""
    delay_s: float
    """The backoff pause before this attempt."""
    error: str
    """What broke the previous connection."""


Event = SessionStarted | TokenReceived | CheckpointReceived | Reconnected | GenerationEnded


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """A whole generation, collected by :meth:`client.Client.generate_text`."""

    text: str
    token_ids: tuple[int, ...]
    end: GenerationEnded


@dataclass(frozen=True, slots=True)
class ResumePosition:
    """Everything needed to resume a generation: give it to :meth:`client.Client.resume_from`."""

    session_id: str
    last_index: int
    """The last token index the client received (-1: none)."""
    checkpoint_index: int
    """The index the snapshot hash names (<= last_index)."""
    snapshot_hash: bytes
