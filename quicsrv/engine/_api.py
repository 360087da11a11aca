"""The engine's small interface: the server submits sequences and receives tokens through a sink.

The engine knows nothing of QUIC or frames. Callbacks on the sink are made from the engine's own
worker thread; the sink is responsible for handing them to its event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

__all__ = [
    "Engine",
    "EngineError",
    "FinishReason",
    "PromptTooLong",
    "SamplingParams",
    "SequenceHandle",
    "SequenceRequest",
    "TokenSink",
]


class FinishReason(StrEnum):
    LENGTH = "length"
    EOS = "eos"
    CANCELLED = "cancelled"
    SHUTDOWN = "shutdown"


class EngineError(Exception):
    """The engine refused a request."""


class PromptTooLong(EngineError):
    """The prompt plus max_tokens does not fit in one sequence's context."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceRequest:
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    ignore_eos: bool = False


class TokenSink(Protocol):
    """Receives one sequence's output, on the engine thread."""

    def token_generated(self, index: int, token_id: int, piece: bytes) -> None: ...

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None: ...


class SequenceHandle(Protocol):
    def cancel(self) -> None:
        """Stop generating at the next step; the sink gets ``sequence_finished(CANCELLED)``."""


class Engine(Protocol):
    """What the server needs from an engine."""

    @property
    def context_per_sequence(self) -> int: ...

    def tokenize(self, text: str, *, add_special: bool) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str: ...

    def submit(self, request: SequenceRequest, sink: TokenSink) -> SequenceHandle: ...

    def close(self) -> None: ...
