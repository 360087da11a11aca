"""The llama.cpp engine: one context, many sequences, one ``llama_decode`` per step.

A single worker thread owns the llama.cpp context. Each step it gathers the next token of every
decoding sequence plus a chunk of at most one pending prompt, decodes them together, and samples
each sequence. New sequences join at the next step; finished or cancelled ones release their KV
cells at once. The event loop never touches llama.cpp.
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import llama_cpp
import numpy as np
import numpy.typing as npt
from llama_cpp import _logger as llama_cpp_logger
from llama_cpp._internals import LlamaContext, LlamaModel

from ._api import (
    CannotReplay,
    EngineError,
    EngineUnavailable,
    FinishReason,
    Grammar,
    Overloaded,
    PausedState,
    PrefillPlan,
    PromptTooLong,
    ResumePath,
    Segment,
    SequenceRequest,
    TokenSink,
)
from .prefix_cache import Hit, PrefixCache, PrefixShelf, PrefixStats, cut, extend, rest
from .sampling import GrammarState, GrammarViolation, SequenceSampler
from .vocab import Vocabulary, file_digest

__all__ = [
    "EngineObserver",
    "EngineSettings",
    "LlamaEngine",
    "ModelFacts",
    "check_admission",
    "check_request",
    "open_context",
]

log = logging.getLogger(__name__)


def check_request(settings: EngineSettings, request: SequenceRequest) -> int:
    """Refuse what an engine with ``settings`` could never run; returns the prefill chunk."""
    if not request.prompt_tokens:
        raise PromptTooLong("the prompt is empty after tokenization")
    chunk = request.prefill_chunk or settings.prefill_chunk
    if not 0 < chunk <= settings.n_batch - settings.n_seq_max:
        # A chunk must always fit beside every decoding sequence's token, so prompts are cut
        # the same way whatever else is running: an exact replay depends on it.
        raise EngineError(
            f"prefill chunk {chunk} must be in 1..n_batch - n_seq_max "
            f"({settings.n_batch - settings.n_seq_max})"
        )
    plan = request.prefill_plan
    if plan is not None and not _plan_fits(plan, len(request.prompt_tokens), settings):
        raise CannotReplay(
            "this generation's prompt was computed in steps this server's prefill settings no "
            "longer allow (n_batch - n_seq_max), so it cannot be continued exactly"
        )
    budget = len(request.prompt_tokens) + request.max_tokens
    if budget > settings.context_per_sequence:
        raise PromptTooLong(
            f"prompt ({len(request.prompt_tokens)} tokens) + max_tokens "
            f"({request.max_tokens}) exceeds the per-sequence context of "
            f"{settings.context_per_sequence} tokens"
        )
    return chunk


def _plan_fits(plan: PrefillPlan, n_prompt: int, settings: EngineSettings) -> bool:
    start = 0
    for segment in plan.segments:
        if segment.end <= start or not 0 < segment.step <= settings.n_batch - settings.n_seq_max:
            return False
        start = segment.end
    return start == n_prompt


def check_admission(settings: EngineSettings, admitted: int) -> None:
    """Refuse one more sequence past the slots and the queue, with a retry hint."""
    limit = settings.n_seq_max + settings.max_queued
    if admitted >= limit:
        raise Overloaded(
            f"{admitted} generations active or queued (limit {limit})", retry_after_s=1.0
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """Derived from :class:`quicsrv.config.ServerConfig` (``engine_settings()``), which holds
    the defaults and says why; only what the supervisor decides at run time has one here."""

    model_path: Path
    n_seq_max: int
    context_per_sequence: int
    n_batch: int
    prefill_chunk: int
    n_threads: int
    max_queued: int
    batch_invariant: bool
    """Decode each sequence in its own micro-batch so its output never depends on its batch."""
    flash_attn: bool
    kv_unified: bool
    """One KV buffer for all sequences: faster at 8, but output then depends on the batch."""
    prefix_cache: bool
    """Keep finished sequences' cells for the prompts that start the same (.prefix_cache)."""
    prefix_cache_max_bytes: int
    """Evicted entries kept as blobs in memory, up to this many bytes in all."""
    prefix_cache_dir: Path | None
    """Where entries go from memory (a directory other engines on this node may share)."""
    prefix_cache_disk_bytes: int
    cpu_extra_buffers: bool = True
    """llama.cpp's extra CPU weight buffers (AMX, repacked layouts); off = the safe mode."""

    def numerics(self, model_digest: bytes) -> bytes:
        """What a token's computed numbers depend on besides the tokens: cells computed under
        another digest are never reused."""
        return blake3.blake3(
            b"%s|fa=%d|bi=%d|cpu=%d|uni=%d|ctx=%d"
            % (
                model_digest,
                self.flash_attn,
                self.batch_invariant,
                self.cpu_extra_buffers,
                self.kv_unified,
                self.context_per_sequence,
            )
        ).digest()


def open_context(settings: EngineSettings) -> tuple[LlamaModel, LlamaContext]:
    """The model and one context for ``settings``: how the engine (and the benchmark's raw
    loop, to compare like with like) sets llama.cpp up."""
    llama_cpp_logger.set_verbose(False)
    llama_cpp.llama_backend_init()
    model_params = llama_cpp.llama_model_default_params()
    # Off avoids llama.cpp's AMX buffer, whose batched matmul faults on some Xeons.
    model_params.use_extra_bufts = settings.cpu_extra_buffers
    model = LlamaModel(path_model=str(settings.model_path), params=model_params, verbose=False)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = settings.context_per_sequence * settings.n_seq_max
    params.n_batch = settings.n_batch
    params.n_ubatch = settings.n_batch
    params.n_seq_max = settings.n_seq_max
    params.n_threads = settings.n_threads
    params.n_threads_batch = settings.n_threads
    # Explicit, not "auto": the attention kernel changes the float results, and "auto"
    # resolves differently across CPUs and builds (llama-cpp-python's Llama defaults to off).
    params.flash_attn_type = (
        llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if settings.flash_attn
        else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    params.kv_unified = settings.kv_unified
    return model, LlamaContext(model=model, params=params, verbose=False)


class EngineObserver:
    """Hooks around the worker thread's steps (the engine worker process meters and reports
    through them); every method is called on the engine thread and does nothing here."""

    def decode_started(self) -> None:
        """``llama_decode`` is about to run."""

    def decode_finished(self) -> None:
        """``llama_decode`` returned."""

    def step_finished(self) -> None:
        """A step ended: every sink callback of that step has been made."""

    def engine_failed(self, error: BaseException) -> None:
        """The worker thread stopped on an exception; every sequence got ``FAILED``."""


@dataclass(eq=False)
class _Sequence:
    request: SequenceRequest
    sink: TokenSink
    sampler: SequenceSampler
    seq_id: int = -1
    n_past: int = 0
    generated: int = 0
    last_token: int = -1
    order: int = 0  # submission order: prompts are prefilled first come, first served
    chunk: int = 256  # prompt tokens per step: part of what makes a replay exact
    allowed: int = 1 << 62  # tokens it may generate before it pauses itself (flow control)
    cancelled: bool = False
    pause_requested: bool = False
    capture_kv: bool = True
    reprefill: bool = False  # pending_prompt holds generated tokens too: sample nothing from it
    # How its cells are computed, pending_prompt's included: a recorded plan, whole from the
    # start (``fixed``); else its steps are chosen as it goes and added here as they are fed.
    plan: tuple[Segment, ...] = ()
    fixed: bool = False
    segments: deque[Segment] = field(default_factory=deque)  # a fixed plan's part still to feed
    reused: int = 0  # leading positions whose cells came from the prefix cache
    pending_prompt: deque[int] = field(default_factory=deque)
    forced: deque[int] = field(default_factory=deque)  # replay: tokens to decode, not sample
    history: list[int] = field(default_factory=list)  # every generated token, in order
    release_admission: Callable[[_Sequence], None] | None = None

    def pause(self, *, capture_kv: bool = True) -> None:
        self.capture_kv = capture_kv
        self.pause_requested = True
        # Like a cancel, it leaves at the next step: its admission place is free already.
        if self.release_admission is not None:
            self.release_admission(self)

    def allow(self, n_tokens: int) -> None:
        # A plain int read by the worker each step, like the cancel flag.
        self.allowed = n_tokens

    def cancel(self) -> None:
        # A plain flag read by the worker each step: cancellation takes effect within one token.
        self.cancelled = True
        # Its admission place is given back at once, so a request arriving right after a cancel
        # is queued (and served when the cells are freed) rather than refused as overloaded.
        if self.release_admission is not None:
            self.release_admission(self)


class ModelFacts:
    """The part of the Engine protocol answered from the settings and the vocabulary alone,
    shared by the in-process engine and the worker-process one."""

    settings: EngineSettings
    vocabulary: Vocabulary

    @property
    def context_per_sequence(self) -> int:
        return self.settings.context_per_sequence

    @property
    def prefill_chunk(self) -> int:
        return self.settings.prefill_chunk

    @property
    def n_seq_max(self) -> int:
        return self.settings.n_seq_max

    @property
    def max_queued(self) -> int:
        return self.settings.max_queued

    @property
    def model_digest(self) -> bytes:
        return self.vocabulary.model_digest

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return self.vocabulary.tokenize(text, add_special=add_special)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self.vocabulary.render_chat(messages)

    def grammar_for(self, schema: str) -> Grammar:
        return self.vocabulary.grammar_for(schema)

    def piece(self, token_id: int) -> bytes:
        return self.vocabulary.piece(token_id)


class LlamaEngine(ModelFacts):
    """Continuous-batching engine over llama-cpp-python's low-level API."""

    def __init__(self, settings: EngineSettings, observer: EngineObserver | None = None) -> None:
        self.settings = settings
        self._observer = observer or EngineObserver()
        self._model, self._context = open_context(settings)
        self._memory = llama_cpp.llama_get_memory(self._context.ctx)
        self._batch = llama_cpp.llama_batch_init(settings.n_batch, 0, 1)
        self._n_vocab = self._model.n_vocab()
        self.vocabulary = Vocabulary(self._model, file_digest(settings.model_path))
        self._logit_views: dict[int, npt.NDArray[np.float32]] = {}
        self._inbox: queue.SimpleQueue[_Sequence | None] = queue.SimpleQueue()
        self._waiting: deque[_Sequence] = deque()
        self._active: list[_Sequence] = []
        self._free_ids = list(range(settings.n_seq_max - 1, -1, -1))
        self._cache = self._open_cache()
        self.prefix_stats = self._cache.stats if self._cache else PrefixStats(enabled=False)
        self._admitted = 0
        self._submissions = itertools.count()
        self._admission_lock = threading.Lock()
        self._closing = False
        self._failed = False
        self.tokens_generated_total = 0  # every sampled token, for tests and stats
        self._thread = threading.Thread(target=self._run, name="llama-engine", daemon=True)
        self._thread.start()

    @property
    def model_path(self) -> Path:
        return self.settings.model_path

    def _sampler_for(self, request: SequenceRequest) -> SequenceSampler:
        """A new sequence's sampler, its grammar (if any) advanced over a resume's tokens."""
        grammar = None
        if request.grammar is not None:
            grammar = GrammarState(self.vocabulary.handle, request.grammar)
        sampler = SequenceSampler(request.sampling, self._n_vocab, grammar)
        if request.resume is not None and request.resume.generated:
            try:
                sampler.catch_up(request.resume.generated)  # the server checked them already
            except GrammarViolation as exc:
                sampler.close()
                raise CannotReplay(f"the recorded tokens do not fit the grammar: {exc}") from None
        return sampler

    def submit(self, request: SequenceRequest, sink: TokenSink) -> _Sequence:
        """Queue a sequence; raises PromptTooLong or Overloaded instead of waiting unboundedly."""
        chunk = check_request(self.settings, request)
        resume = request.resume
        sampler = self._sampler_for(request)
        try:
            with self._admission_lock:
                if self._failed:
                    raise EngineUnavailable("the engine failed; see the server log")
                if self._closing:
                    raise EngineError("the engine is shutting down")
                check_admission(self.settings, self._admitted)
                self._admitted += 1
        except BaseException:
            sampler.close()
            raise
        plan = request.prefill_plan
        if plan is None and resume is not None and resume.generated:
            # Tokens were sent from a run without a recorded plan: one that fed the prompt in
            # chunks from position 0 (what every run did before plans were recorded).
            plan = PrefillPlan.plain(len(request.prompt_tokens), chunk)
        sequence = _Sequence(
            request=request,
            sink=sink,
            sampler=sampler,
            pending_prompt=deque(request.prompt_tokens),
            plan=plan.segments if plan is not None else (),
            fixed=plan is not None,
            release_admission=self._release_admission,
            chunk=chunk,
            order=next(self._submissions),
        )
        if resume is not None and resume.kv_state is None and resume.generated:
            if resume.inexact_reprefill:
                # Fast, but prompt-processing logits are not bit-identical to token-by-token
                # decoding, so the continuation may differ: only on explicit request.
                generated = resume.generated
                sequence.pending_prompt.extend(generated[:-1])
                sequence.plan = extend(sequence.plan, len(sequence.pending_prompt), chunk)
                sequence.reprefill = True
                sequence.history = list(generated)
                sequence.generated = len(generated)
                sequence.last_token = generated[-1]
            else:
                # Exact replay: the prompt with the same chunking, then the generated tokens
                # decoded one at a time, as the computation originally happened.
                sequence.forced = deque(resume.generated)
        self._inbox.put(sequence)
        return sequence

    def deliver_on(self, loop: asyncio.AbstractEventLoop) -> None:
        pass  # sinks are called on the decode thread, as they happen

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
                self._observer.step_finished()
        except Exception as exc:  # the engine thread must never die silently
            log.exception("engine worker thread failed")
            with self._admission_lock:
                self._failed = True  # nobody would ever serve what is admitted now
            for sequence in [*self._active, *self._waiting]:
                self._finish(sequence, FinishReason.FAILED)
            while True:  # and whatever was submitted meanwhile
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    self._waiting.append(item)
                    self._finish(item, FinishReason.FAILED)
            self._observer.engine_failed(exc)

    def _step(self) -> bool:
        idle = not self._active and not self._waiting
        while idle or not self._inbox.empty():
            item = self._inbox.get(block=idle)
            if item is None:
                for sequence in [*self._active, *self._waiting]:
                    self._finish(sequence, FinishReason.SHUTDOWN)
                self._shelve_resident()
                return False
            self._waiting.append(item)
            idle = False
        for sequence in [*self._active, *self._waiting]:
            if sequence.cancelled:
                self._finish(sequence, FinishReason.CANCELLED)
            elif sequence.pause_requested or self._out_of_allowance(sequence):
                self._pause(sequence)
        while self._waiting and self._free_ids:
            sequence = self._waiting.popleft()
            hit = self._lookup(sequence)
            sequence.seq_id = self._slot_for(hit)
            self._free_ids.remove(sequence.seq_id)
            # Batches in id order: with llama.cpp's per-sequence KV streams a batch whose ids
            # are not ascending costs 40-80% more per step (python -m loadtest.bench.seqids).
            self._active.append(sequence)
            self._active.sort(key=lambda s: s.seq_id)
            if not self._admit_resumed(sequence):
                self._plan_prompt(sequence, hit)
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
        # One prompt piece per step (first come, first served).
        prefilling = min(
            (s for s in self._active if s.pending_prompt), key=lambda s: s.order, default=None
        )
        if prefilling is not None:
            step, room = self._prefill_step(prefilling, decoding=bool(entries))
            fed_from = prefilling.n_past
            for _ in range(room):
                token = prefilling.pending_prompt.popleft()
                last = not prefilling.pending_prompt
                # A re-prefill ends on a generated token whose successor is already known.
                entries.append(
                    (prefilling, token, prefilling.n_past, last and not prefilling.reprefill)
                )
                prefilling.n_past += 1
                if last and prefilling.reprefill:
                    prefilling.reprefill = False
                    prefilling.sink.sequence_resumed(ResumePath.REPREFILL)
            if prefilling.fixed:
                if prefilling.n_past >= prefilling.segments[0].end:
                    prefilling.segments.popleft()
            else:
                prefilling.plan = extend(prefilling.plan, prefilling.n_past, step)
            if fed_from < len(prefilling.request.prompt_tokens) <= prefilling.n_past:
                self._report_plan(prefilling)
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
        self._observer.decode_started()
        status = llama_cpp.llama_decode(self._context.ctx, self._batch)
        self._observer.decode_finished()
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        for i, (sequence, _token, _position, logits) in enumerate(entries):
            if logits:
                self._sample(sequence, i)

    def _prefill_step(self, sequence: _Sequence, *, decoding: bool) -> tuple[int, int]:
        """The step a prompt is fed in now, and how many of its tokens go in.

        A fixed plan's steps (a recorded one, or a cold prompt's chunks) are taken from each
        segment's start, so a replay cuts the prompt exactly as the run it replays did. What
        follows reused cells is fed in steps chosen now (and added to the plan): beside
        decoding sequences a chunk of ``prefill_chunk`` tokens, so that their next token is not
        stalled behind a long prompt; alone, the widest piece a batch takes, which stalls
        nobody (prompts in line wait for this one's prefill anyway) and over a long kept
        prefix costs half of what chunks do (measured: loadtest.bench.conversation).
        """
        if sequence.fixed:
            segment = sequence.segments[0]
            return segment.step, min(segment.step, segment.end - sequence.n_past)
        widest = self.settings.n_batch - self.settings.n_seq_max
        step = sequence.chunk if decoding else widest
        return step, min(step, len(sequence.pending_prompt))

    def _out_of_allowance(self, sequence: _Sequence) -> bool:
        busy_rebuilding = sequence.pending_prompt or sequence.forced
        return not busy_rebuilding and sequence.generated >= sequence.allowed

    def _admit_resumed(self, sequence: _Sequence) -> bool:
        """Give a resumed sequence its cells back from its blob; False: it computes them."""
        resume = sequence.request.resume
        if resume is None:
            return False
        if resume.kv_state is not None and resume.generated:
            return self._restore(sequence, resume.generated, resume.kv_state)
        if not resume.generated:
            sequence.sink.sequence_resumed(ResumePath.REPLAY)  # nothing to rebuild
        return False

    # --- the prefix cache -------------------------------------------------------------------

    def _open_cache(self) -> PrefixCache | None:
        settings = self.settings
        if not settings.prefix_cache:
            return None
        window = llama_cpp.llama_model_n_swa(self._model.model)
        if window > 0:
            # Sliding-window layers drop the cells behind their window, so a kept sequence's
            # prefix cannot be continued from them; a full-size SWA cache for every slot would
            # cost this model's whole context in every layer.
            log.info("prefix cache off: the model uses sliding-window attention (%d)", window)
            return None
        cache = PrefixCache(
            settings.numerics(self.vocabulary.model_digest),
            max_blob_bytes=settings.prefix_cache_max_bytes,
        )
        if settings.prefix_cache_dir is not None and settings.prefix_cache_disk_bytes > 0:
            cache.shelf = PrefixShelf(
                settings.prefix_cache_dir, settings.prefix_cache_disk_bytes, cache.stats
            )
        return cache

    def _lookup(self, sequence: _Sequence) -> Hit | None:
        """The kept cells this sequence's prompt can start from (none for a KV restore)."""
        cache = self._cache
        resume = sequence.request.resume
        if cache is None or (resume is not None and resume.kv_state is not None):
            return None
        request = sequence.request
        # A fixed plan takes only cells computed its own way; a new prompt, any.
        recorded = sequence.plan if sequence.fixed else None
        return cache.find(request.cache_scope, request.prompt_tokens, recorded)

    def _slot_for(self, hit: Hit | None) -> int:
        """The hit's slot; else the lowest free slot that keeps nothing; else the slot of the
        entry used longest ago, which becomes a blob (or is forgotten)."""
        cache = self._cache
        if cache is None:
            return min(self._free_ids)
        if hit is not None and hit.entry.slot is not None:
            return hit.entry.slot
        empty = [slot for slot in self._free_ids if cache.entry_in(slot) is None]
        if empty:
            return min(empty)
        victim = cache.least_used(self._free_ids)
        assert victim is not None and victim.slot is not None
        slot = victim.slot
        blob = self._state_of(slot) if cache.max_blob_bytes > 0 else None
        cache.spill(victim, blob)
        llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)
        return slot

    def _plan_prompt(self, sequence: _Sequence, hit: Hit | None) -> None:
        """Start the prompt from the hit's cells (if they can be had) and set out how the rest
        is fed: a fixed plan's segments, or steps chosen as it goes (:meth:`_prefill_step`)."""
        reused = self._take(sequence.seq_id, hit) if hit is not None else 0
        if not sequence.fixed and not reused:
            # A cold prompt is cut the same way whatever runs beside it, so that the same
            # request gives the same output under any load: in chunks of ``prefill_chunk``.
            n_prompt = len(sequence.request.prompt_tokens)
            sequence.plan = PrefillPlan.plain(n_prompt, sequence.chunk).segments
            sequence.fixed = True
        if sequence.fixed:
            sequence.segments = deque(rest(sequence.plan, reused))
        else:
            assert hit is not None
            sequence.plan = cut(hit.entry.segments, reused)  # the hit's way, up to the cut
        for _ in range(reused):
            sequence.pending_prompt.popleft()
        sequence.n_past = sequence.reused = reused

    def _report_plan(self, sequence: _Sequence) -> None:
        """The prompt is fed: tell the sink how (before its first token), and count it."""
        n_prompt = len(sequence.request.prompt_tokens)
        if self._cache is not None:
            stats = self._cache.stats
            stats.hits += bool(sequence.reused)
            stats.misses += not sequence.reused
            stats.reused_tokens += sequence.reused
            stats.prefilled_tokens += n_prompt - sequence.reused
        plan = PrefillPlan(cut(sequence.plan, n_prompt), sequence.reused)
        sequence.sink.sequence_planned(plan)

    def _shelve_resident(self) -> None:
        """Closing: the cells kept in slots go to the shelf, if there is one, the most recently
        used first, so that the next engine (a restarted server) finds them."""
        cache = self._cache
        if cache is None or cache.shelf is None:
            return
        for entry in sorted(cache.resident(), key=lambda e: -e.used):
            assert entry.slot is not None
            blob = self._state_of(entry.slot)
            cache.drop(entry)
            if blob is not None:
                cache.shelf.put(entry, blob)

    def _take(self, slot: int, hit: Hit) -> int:
        """Move the hit's cells into ``slot`` and cut them to its length; 0 when they could
        not be had (a rejected blob: the prompt is computed cold)."""
        assert self._cache is not None
        entry = hit.entry
        self._cache.take(entry)
        if entry.blob is not None and not self._set_state(slot, entry.blob):
            llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)
            return 0
        if not llama_cpp.llama_memory_seq_rm(self._memory, slot, hit.length, -1):
            llama_cpp.llama_memory_seq_rm(self._memory, slot, -1, -1)
            return 0
        return hit.length

    def _keep(self, sequence: _Sequence) -> bool:
        """Leave a released sequence's cells in its slot for later prompts; False: not kept."""
        cache = self._cache
        if cache is None or sequence.n_past <= 0:
            return False
        n_past = sequence.n_past
        tokens = (*sequence.request.prompt_tokens, *sequence.history)[:n_past]
        computed = sequence.plan[-1].end if sequence.plan else 0
        plan = extend(sequence.plan, n_past, 1) if n_past > computed else cut(sequence.plan, n_past)
        return cache.keep(sequence.seq_id, sequence.request.cache_scope, tokens, plan)

    def _state_of(self, seq_id: int) -> bytes | None:
        size = llama_cpp.llama_state_seq_get_size(self._context.ctx, seq_id)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._context.ctx, buffer, size, seq_id)
        return ctypes.string_at(buffer, written) if written else None

    def _set_state(self, seq_id: int, blob: bytes) -> bool:
        buffer = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        written = llama_cpp.llama_state_seq_set_data(self._context.ctx, buffer, len(blob), seq_id)
        return bool(written)

    # --- pause and resume -------------------------------------------------------------------

    def _restore(self, sequence: _Sequence, generated: tuple[int, ...], kv: bytes) -> bool:
        if not self._set_state(sequence.seq_id, kv):
            # The blob does not fit this context (or is damaged): fall back to exact replay.
            log.warning("KV blob rejected by llama_state_seq_set_data; replaying instead")
            llama_cpp.llama_memory_seq_rm(self._memory, sequence.seq_id, -1, -1)
            sequence.forced = deque(generated)
            return False
        sequence.pending_prompt.clear()
        for token in generated:
            sequence.sampler.accept(token)
        sequence.history = list(generated)
        sequence.generated = len(generated)
        sequence.last_token = generated[-1]
        # The last generated token was sampled but never decoded: it goes in at the next step.
        sequence.n_past = len(sequence.request.prompt_tokens) + len(generated) - 1
        sequence.sink.sequence_resumed(ResumePath.KV_RESTORE)
        return True

    def _pause(self, sequence: _Sequence) -> None:
        kv: bytes | None = None
        capturable = sequence.history and not sequence.forced and not sequence.pending_prompt
        if sequence.capture_kv and capturable and sequence.seq_id >= 0 and sequence in self._active:
            kv = self._state_of(sequence.seq_id)
        generated = (*sequence.history, *sequence.forced)
        resume = sequence.request.resume
        if sequence.seq_id < 0 and resume is not None:
            # Never admitted: hand the resume point back as it came (a KV-restore resume has
            # no history or forced tokens yet, and its blob belongs to all of them).
            kv, generated = resume.kv_state, resume.generated
        self._release(sequence)
        sequence.sink.sequence_paused(PausedState(generated=generated, kv_state=kv))

    def _add(self, i: int, token: int, pos: int, seq_id: int, logits: bool) -> None:
        batch = self._batch
        batch.token[i] = token
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq_id
        batch.logits[i] = logits

    def _logits(self, position: int) -> npt.NDArray[np.float32]:
        """The logits row of batch entry ``position``, as a view (no copy) of llama.cpp's."""
        address = ctypes.cast(
            llama_cpp.llama_get_logits_ith(self._context.ctx, position), ctypes.c_void_p
        ).value
        if address is None:
            raise RuntimeError(f"llama.cpp has no logits for batch entry {position}")
        view = self._logit_views.get(address)
        if view is None:
            # Rows sit at the same addresses step after step, so their views are kept: making
            # one costs more than the argmax over it. A new output buffer brings new addresses.
            if len(self._logit_views) >= 4 * self.settings.n_batch:
                self._logit_views.clear()
            view = np.ctypeslib.as_array(
                ctypes.cast(address, ctypes.POINTER(ctypes.c_float)), shape=(self._n_vocab,)
            )
            self._logit_views[address] = view
        return view

    def _sample(self, sequence: _Sequence, position: int) -> None:
        logits = self._logits(position)
        index = sequence.generated
        replayed = bool(sequence.forced)
        try:
            if replayed:
                token = sequence.forced.popleft()
            else:
                token = sequence.sampler.sample(logits, index)
            sequence.sampler.accept(token)
        except GrammarViolation as exc:  # a dead end of the grammar: this sequence only
            log.error("sequence %d stopped: %s", sequence.order, exc)
            self._finish(sequence, FinishReason.FAILED)
            return
        sequence.generated += 1
        sequence.history.append(token)
        sequence.last_token = token
        if replayed:
            if not sequence.forced:
                sequence.sink.sequence_resumed(ResumePath.REPLAY)
            return  # the client already has it; replay only rebuilds the KV cells
        self.tokens_generated_total += 1
        is_eog = self.vocabulary.is_end_of_generation(token)
        # A grammar allows an end token only once its text is complete: nothing may follow.
        if is_eog and (not sequence.request.ignore_eos or sequence.sampler.constrained):
            self._finish(sequence, FinishReason.EOS)
            return
        piece = b"" if is_eog else self.vocabulary.piece(token)
        sequence.sink.token_generated(index, token, piece)
        if sequence.generated >= sequence.request.max_tokens:
            self._finish(sequence, FinishReason.LENGTH)

    def _release_admission(self, sequence: _Sequence) -> None:
        with self._admission_lock:
            if sequence.release_admission is not None:
                sequence.release_admission = None
                self._admitted -= 1

    def _release(self, sequence: _Sequence, *, keep: bool = True) -> bool:
        """Take a sequence out of the engine; its cells stay for the prefix cache (``keep``,
        where there is one) or are freed. False if it was not in."""
        if sequence in self._active:
            self._active.remove(sequence)
            if not (keep and self._keep(sequence)):
                llama_cpp.llama_memory_seq_rm(self._memory, sequence.seq_id, -1, -1)
            self._free_ids.append(sequence.seq_id)
        elif sequence in self._waiting:
            self._waiting.remove(sequence)
        else:
            return False
        sequence.sampler.close()
        self._release_admission(sequence)
        return True

    def _finish(self, sequence: _Sequence, reason: FinishReason) -> None:
        kept = reason in (FinishReason.EOS, FinishReason.LENGTH, FinishReason.CANCELLED)
        if not self._release(sequence, keep=kept):
            return
        generated = sequence.generated - (1 if reason is FinishReason.EOS else 0)
        sequence.sink.sequence_finished(reason, generated)
