"""A scripted engine for fast unit tests of stream logic (never the only proof: see e2e tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from quicsrv.engine import FinishReason, SequenceRequest, TokenSink


@dataclass
class FakeHandle:
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeEngine:
    """Tokenizes one character per token; the test drives output through ``sinks``."""

    context_per_sequence: int = 64
    sinks: list[TokenSink] = field(default_factory=list)
    handles: list[FakeHandle] = field(default_factory=list)

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return [ord(c) for c in text]

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    def submit(self, request: SequenceRequest, sink: TokenSink) -> FakeHandle:
        self.sinks.append(sink)
        handle = FakeHandle()
        self.handles.append(handle)
        return handle

    def close(self) -> None:
        pass

    def emit(self, pieces: list[bytes], finish: FinishReason | None = None) -> None:
        sink = self.sinks[-1]
        for index, piece in enumerate(pieces):
            sink.token_generated(index, 1000 + index, piece)
        if finish is not None:
            sink.sequence_finished(finish, len(pieces))
