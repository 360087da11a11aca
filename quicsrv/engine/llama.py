"""The llama.cpp engine: one context, many sequences, one ``llama_decode`` per step.

A single worker thread owns the llama.cpp context. Each step it gathers the next token of every
decoding sequence plus a chunk of at most one pending prompt, decodes them together, and samples
each sequence. New sequences join at the next step; finished or cancelled ones release their KV
cells at once. The event loop never touches llama.cpp.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp import _logger as llama_cpp_logger
from llama_cpp._internals import LlamaContext, LlamaModel
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from ._api import (
    EngineError,
    FinishReason,
    PromptTooLong,
    SequenceRequest,
    TokenSink,
)
from .sampling import SequenceSampler

__all__ = ["EngineSettings", "LlamaEngine", "Overloaded"]

log = logging.getLogger(__name__)


class Overloaded(EngineError):
    """Every sequence slot is busy and the admission queue is full."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    model_path: Path
    n_seq_max: int = 8
    context_per_sequence: int = 2048
    n_batch: int = 512
    prefill_chunk: int = 256
    n_threads: int = 2
    max_queued: int = 64
    batch_invariant: bool = False
    """Decode each sequence in its own micro-batch so its output never depends on its batch."""


@dataclass(eq=False)
class _Sequence:
    request: SequenceRequest
    sink: TokenSink
    sampler: SequenceSampler
    seq_id: int = -1
    n_past: int = 0
    generated: int = 0
    last_token: int = -1
    cancelled: bool = False
    pending_prompt: deque[int] = field(default_factory=deque)
    release_admission: Callable[[_Sequence], None] | None = None

    def cancel(self) -> None:
        # A plain flag read by the worker each step: cancellation takes effect within one token.
        self.cancelled = True
        # Its admission place is given back at once, so a request arriving right after a cancel
        # is queued (and served when the cells are freed) rather than refused as overloaded.
        if self.release_admission is not None:
            self.release_admission(self)


class LlamaEngine:
    """Continuous-batching engine over llama-cpp-python's low-level API."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        llama_cpp_logger.set_verbose(False)
        llama_cpp.llama_backend_init()
        self._model = LlamaModel(
            path_model=str(settings.model_path),
            params=llama_cpp.llama_model_default_params(),
            verbose=False,
        )
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = settings.context_per_sequence * settings.n_seq_max
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_batch
        params.n_seq_max = settings.n_seq_max
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        self._context = LlamaContext(model=self._model, params=params, verbose=False)
        self._memory = llama_cpp.llama_get_memory(self._context.ctx)
        self._batch = llama_cpp.llama_batch_init(settings.n_batch, 0, 1)
        self._n_vocab = self._model.n_vocab()
        self._chat = self._make_chat_formatter()
        self._inbox: queue.SimpleQueue[_Sequence | None] = queue.SimpleQueue()
        self._waiting: deque[_Sequence] = deque()
        self._active: list[_Sequence] = []
        self._free_ids = list(range(settings.n_seq_max - 1, -1, -1))
        self._admitted = 0
        self._admission_lock = threading.Lock()
        self._closing = False
        self.tokens_generated_total = 0  # every sampled token, for tests and stats
        self.decode_calls_total = 0
        self._thread = threading.Thread(target=self._run, name="llama-engine", daemon=True)
        self._thread.start()

    @property
    def context_per_sequence(self) -> int:
        return self.settings.context_per_sequence

    @property
    def model_path(self) -> Path:
        return self.settings.model_path

    def _make_chat_formatter(self) -> Jinja2ChatFormatter | None:
        metadata = self._model.metadata()
        template = metadata.get("tokenizer.chat_template")
        if not template:
            return None
        eos = self._model.token_to_piece(self._model.token_eos(), special=True)
        bos = self._model.token_to_piece(self._model.token_bos(), special=True)
        return Jinja2ChatFormatter(
            template=template,
            eos_token=eos.decode("utf-8", "replace"),
            bos_token=bos.decode("utf-8", "replace"),
        )

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return list(self._model.tokenize(text.encode("utf-8"), add_special, True))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        if self._chat is None:
            # No template in the GGUF: a plain transcript is the least surprising fallback.
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + "\nassistant:"
        return str(self._chat(messages=messages).prompt)  # type: ignore[arg-type]

    def submit(self, request: SequenceRequest, sink: TokenSink) -> _Sequence:
        """Queue a sequence; raises PromptTooLong or Overloaded instead of waiting unboundedly."""
        if not request.prompt_tokens:
            raise PromptTooLong("the prompt is empty after tokenization")
        budget = len(request.prompt_tokens) + request.max_tokens
        if budget > self.settings.context_per_sequence:
            raise PromptTooLong(
                f"prompt ({len(request.prompt_tokens)} tokens) + max_tokens "
                f"({request.max_tokens}) exceeds the per-sequence context of "
                f"{self.settings.context_per_sequence} tokens"
            )
        with self._admission_lock:
            if self._closing:
                raise EngineError("the engine is shutting down")
            limit = self.settings.n_seq_max + self.settings.max_queued
            if self._admitted >= limit:
                raise Overloaded(
                    f"{self._admitted} generations active or queued (limit {limit})",
                    retry_after_s=1.0,
                )
            self._admitted += 1
        sequence = _Sequence(
            request=request,
            sink=sink,
            sampler=SequenceSampler(request.sampling, self._n_vocab),
            pending_prompt=deque(request.prompt_tokens),
            release_admission=self._release_admission,
        )
        self._inbox.put(sequence)
        return sequence

    def close(self) -> None:
        """Finish every sequence with SHUTDOWN and stop the worker."""
        with self._admission_lock:
            self._closing = True
        self._inbox.put(None)
        self._thread.join(timeout=30)
        llama_cpp.llama_batch_free(self._batch)
        self._context.close()  # type: ignore[no-untyped-call]
        self._model.close()  # type: ignore[no-untyped-call]

    # --- the worker thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except Exception:  # the engine thread must never die silently
            log.exception("engine worker crashed")
            for sequence in [*self._active, *self._waiting]:
                self._finish(sequence, FinishReason.SHUTDOWN)

    def _step(self) -> bool:
        idle = not self._active and not self._waiting
        while True:
            try:
                item = self._inbox.get(block=idle)
            except queue.Empty:
                break
            if item is None:
                for sequence in [*self._active, *self._waiting]:
                    self._finish(sequence, FinishReason.SHUTDOWN)
                return False
            self._waiting.append(item)
            idle = False
        for sequence in [s for s in [*self._active, *self._waiting] if s.cancelled]:
            self._finish(sequence, FinishReason.CANCELLED)
        while self._waiting and self._free_ids:
            sequence = self._waiting.popleft()
            sequence.seq_id = self._free_ids.pop()
            self._active.append(sequence)
        if self._active:
            self._decode_step()
        return True

    def _decode_step(self) -> None:
        # (sequence, token, position, wants logits) for everything this step feeds the model.
        entries: list[tuple[_Sequence, int, int, bool]] = []
        for sequence in self._active:
            if not sequence.pending_prompt:
                entries.append((sequence, sequence.last_token, sequence.n_past, True))
                sequence.n_past += 1
        # One prompt chunk per step (first come, first served), so a long prompt is fed in
        # pieces between the other sequences' tokens instead of stalling them.
        prefilling = next((s for s in self._active if s.pending_prompt), None)
        if prefilling is not None:
            room = min(self.settings.prefill_chunk, self.settings.n_batch - len(entries))
            for _ in range(min(room, len(prefilling.pending_prompt))):
                token = prefilling.pending_prompt.popleft()
                entries.append(
                    (prefilling, token, prefilling.n_past, not prefilling.pending_prompt)
                )
                prefilling.n_past += 1
        if not self.settings.batch_invariant:
            self._decode(entries)
            return
        # Each sequence in its own micro-batch: its logits cannot depend on its neighbours.
        groups: dict[int, list[tuple[_Sequence, int, int, bool]]] = {}
        for entry in entries:
            groups.setdefault(entry[0].seq_id, []).append(entry)
        for group in groups.values():
            self._decode(group)

    def _decode(self, entries: list[tuple[_Sequence, int, int, bool]]) -> None:
        for i, (sequence, token, position, logits) in enumerate(entries):
            self._add(i, token, position, sequence.seq_id, logits)
        self._batch.n_tokens = len(entries)
        status = llama_cpp.llama_decode(self._context.ctx, self._batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        self.decode_calls_total += 1
        for i, (sequence, _token, _position, logits) in enumerate(entries):
            if logits:
                self._sample(sequence, i)

    def _add(self, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        batch = self._batch
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq_id
        batch.logits[i] = logits

    def _sample(self, sequence: _Sequence, position: int) -> None:
        pointer = llama_cpp.llama_get_logits_ith(self._context.ctx, position)
        logits = np.ctypeslib.as_array(
            ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self._n_vocab,)
        )
        index = sequence.generated
        token = sequence.sampler.sample(logits, index)
        sequence.sampler.accept(token)
        sequence.generated += 1
        self.tokens_generated_total += 1
        sequence.last_token = token
        is_eog = llama_cpp.llama_vocab_is_eog(self._model.vocab, token)
        if is_eog and not sequence.request.ignore_eos:
            self._finish(sequence, FinishReason.EOS)
            return
        piece = b"" if is_eog else self._piece(token)
        sequence.sink.token_generated(index, token, piece)
        if sequence.generated >= sequence.request.max_tokens:
            self._finish(sequence, FinishReason.LENGTH)

    def _release_admission(self, sequence: _Sequence) -> None:
        with self._admission_lock:
            if sequence.release_admission is not None:
                sequence.release_admission = None
                self._admitted -= 1

    def _piece(self, token: int) -> bytes:
        """The token's bytes (possibly part of a UTF-8 character)."""
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self._model.vocab, token, buffer, size, 0, False)
            if n >= 0:
                return buffer.raw[:n]
            size = -n

    def _finish(self, sequence: _Sequence, reason: FinishReason) -> None:
        if sequence in self._active:
            self._active.remove(sequence)
            llama_cpp.llama_memory_seq_rm(self._memory, sequence.seq_id, -1, -1)
            self._free_ids.append(sequence.seq_id)
        elif sequence in self._waiting:
            self._waiting.remove(sequence)
        else:
            return
        sequence.sampler.close()
        self._release_admission(sequence)
        generated = sequence.generated - (1 if reason is FinishReason.EOS else 0)
        sequence.sink.sequence_finished(reason, generated)
