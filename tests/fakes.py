"""A scripted engine for fast unit tests of stream logic (never the only proof: see e2e tests)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import blake3

from quicsrv.engine import (
    EngineHealth,
    FinishReason,
    Grammar,
    InvalidSchema,
    ModelInfo,
    PausedState,
    SequenceRequest,
    StepListener,
    TokenLogprobs,
    TokenSink,
)

#: What the fake model file says of itself: Unicode's code points are its vocabulary.
FAKE_MODEL_INFO = ModelInfo(
    file_name="fake.gguf",
    name="fake",
    architecture="fake",
    n_vocab=0x110000,
    vocab_type=0,
    n_ctx_train=None,
    n_embd=None,
    n_params=0,
    size_bytes=0,
    chat_template=None,
    bos_token=None,
    eos_token=None,
)


@dataclass
class FakeHandle:
    request: SequenceRequest
    cancelled: bool = False
    pause_requested: bool = False
    capture_kv: bool = True
    allowed: int = 1 << 62

    def cancel(self) -> None:
        self.cancelled = True

    def pause(self, *, capture_kv: bool = True) -> None:
        self.pause_requested = True
        self.capture_kv = capture_kv

    def allow(self, n_tokens: int) -> None:
        self.allowed = n_tokens


@dataclass
class FakeEngine:
    """Tokenizes one character per token; the test drives output through ``sinks``."""

    context_per_sequence: int = 64
    prefill_chunk: int = 16
    n_seq_max: int = 8
    max_queued: int = 8
    model_digest: bytes = b"m" * 32
    sinks: list[TokenSink] = field(default_factory=list)
    handles: list[FakeHandle] = field(default_factory=list)
    pieces: dict[int, bytes] = field(default_factory=dict)
    submitted: asyncio.Event = field(default_factory=asyncio.Event)
    state: EngineHealth = field(default_factory=EngineHealth)
    """What :meth:`health` answers (a test sets it)."""
    on_step: StepListener | None = None

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)

    def piece(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def token_text(self, token_id: int) -> bytes:
        """Token ``n`` is the character ``n`` (as :meth:`tokenize` makes them), or a scripted
        piece."""
        if not 0 <= token_id < self.model_info.n_vocab:
            raise IndexError(token_id)
        return self.pieces.get(token_id) or chr(token_id).encode()

    @property
    def model_info(self) -> ModelInfo:
        return FAKE_MODEL_INFO

    def grammar_for(self, schema: str) -> Grammar:
        """Any schema that parses as JSON: its text stands for the grammar (no llama.cpp)."""
        try:
            json.loads(schema)
        except ValueError:
            raise InvalidSchema("the schema is not valid JSON") from None
        return Grammar(gbnf=f"fake <- {schema}", digest=blake3.blake3(schema.encode()).digest())

    def submit(self, request: SequenceRequest, sink: TokenSink) -> FakeHandle:
        self.sinks.append(sink)
        handle = FakeHandle(request)
        self.handles.append(handle)
        self.submitted.set()
        return handle

    def deliver_on(self, loop: asyncio.AbstractEventLoop) -> None:
        pass

    def health(self) -> EngineHealth:
        return self.state

    def close(self) -> None:
        pass

    def emit(self, pieces: list[bytes], finish: FinishReason | None = None, start: int = 0) -> None:
        sink = self.sinks[-1]
        top = self.handles[-1].request.logprobs
        for offset, piece in enumerate(pieces):
            index = start + offset
            self.pieces[1000 + index] = piece
            own = -0.5 - index / 8  # a binary fraction: a float32 as the engine makes them
            logprobs = (
                None
                if top is None
                else TokenLogprobs(own, tuple((1000 + index + k, own - k) for k in range(top)))
            )
            sink.token_generated(index, 1000 + index, piece, logprobs)
        if finish is not None:
            sink.sequence_finished(finish, start + len(pieces))

    def pause_latest(self, generated: tuple[int, ...], kv: bytes | None = b"kv") -> None:
        self.sinks[-1].sequence_paused(PausedState(generated=generated, kv_state=kv))
