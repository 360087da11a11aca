"""The llama.cpp engine: one context, many sequences, a few ``llama_decode`` calls per step.

A single worker thread owns the llama.cpp context. Each step it feeds a piece of the prompt of
as many pending sequences as fit in ``n_batch`` tokens, oldest first, until the step holds half
the waiting prompt tokens, in as few calls as :mod:`.pieces` allows without changing any
sequence's numbers, then the next token of each decoding sequence (some wait: ``_decode_step``),
and samples each whose logits came out, after its call: a first token is sent then, not at the
step's end. New sequences join at the next step; finished or cancelled ones release their KV
cells at once. The event loop never touches llama.cpp.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import functools
import itertools
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
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
    EngineHealth,
    EngineUnavailable,
    FinishReason,
    Grammar,
    PausedState,
    ResumePath,
    SequenceRequest,
    StepListener,
    TokenSink,
)
from .facts import ModelInfo
from .observer import EngineObserver
from .pieces import ROWS_CELLS, RULES_VERSION, Shape, share_calls
from .placement import KvCells, SlotPlacement
from .prefix_cache import EndLogits
from .request_checks import check_admission, check_request
from .sampling import GrammarState, GrammarViolation, SequenceSampler, token_logprobs
from .sequence import BatchEntry, LlamaSequence
from .vocab import Vocabulary, file_digest

__all__ = ["EngineObserver", "EngineSettings", "LlamaEngine", "ModelFacts", "open_context"]

log = logging.getLogger(__name__)

SNAPSHOT_AFTER_S = 0.05
"""How long the engine waits for work before it saves kept entries' cells: a client's next
request (a retry, the next turn, an agent's next step) usually comes sooner, and finds the
engine free (measured: the same prompt again took 18 ms where saves began at once, 9 without)."""

LAST_ENTRY_AFTER_S = 1.0
"""How much longer the kept entry used last waits for its save: the one a client goes on from
in its slot (a chat's next turn, an agent's next step), whom a save costs 28 ms at 1594 cells."""

HANDOVER_S = 0.025
"""How long the engine waits, when an end or a pause freed an id and no prompt is pending, for
the request the server hands it from its queue within milliseconds: else that one missed the
next step and waited behind the prompt after it (~1 s at c=32), its slot idle."""


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
    chat_template_file: Path | None
    """A Jinja chat template used instead of the GGUF's (checked at start: ``app.preflight``)."""
    cpu_extra_buffers: bool = True
    """llama.cpp's extra CPU weight buffers (AMX, repacked layouts); off = the safe mode."""

    @property
    def chat_template(self) -> str | None:
        """The text of :attr:`chat_template_file` (None: the GGUF's template)."""
        if self.chat_template_file is None:
            return None
        return self.chat_template_file.read_text(encoding="utf-8")

    def numerics(self, model_digest: bytes) -> bytes:
        """What a token's computed numbers depend on besides the tokens: cells computed under
        another digest are never reused."""
        return blake3.blake3(
            b"%s|fa=%d|bi=%d|cpu=%d|uni=%d|ctx=%d|pieces=%d"
            % (
                model_digest,
                self.flash_attn,
                self.batch_invariant,
                self.cpu_extra_buffers,
                self.kv_unified,
                self.context_per_sequence,
                RULES_VERSION,
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

    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        return self.vocabulary.tokenize(text, add_special=add_special, parse_special=parse_special)

    def render_chat(
        self, messages: list[dict[str, str]], tools: list[dict[str, object]] | None = None
    ) -> str:
        return self.vocabulary.render_chat(messages, tools)

    def grammar_for(self, schema: str) -> Grammar:
        return self.vocabulary.grammar_for(schema)

    def piece(self, token_id: int) -> bytes:
        return self.vocabulary.piece(token_id)

    def token_text(self, token_id: int) -> bytes:
        return self.vocabulary.token_text(token_id)

    @functools.cached_property
    def model_info(self) -> ModelInfo:
        return self.vocabulary.describe(self.settings.model_path)


class LlamaEngine(ModelFacts):
    """Continuous-batching engine over llama-cpp-python's low-level API."""

    def __init__(self, settings: EngineSettings, observer: EngineObserver | None = None) -> None:
        self.settings = settings
        self._observer = observer or EngineObserver()
        self._model, self._context = open_context(settings)
        self._cells = KvCells(self._context)
        self._batch = llama_cpp.llama_batch_init(settings.n_batch, 0, 1)
        self._n_vocab = self._model.n_vocab()
        self.vocabulary = Vocabulary(
            self._model, file_digest(settings.model_path), settings.chat_template
        )
        self._logit_views: dict[int, npt.NDArray[np.float32]] = {}
        self._inbox: queue.SimpleQueue[LlamaSequence | None] = queue.SimpleQueue()
        self._waiting: deque[LlamaSequence] = deque()
        self._active: list[LlamaSequence] = []
        self._free_ids = list(range(settings.n_seq_max - 1, -1, -1))
        self._freed = False  # an id was freed in the last step (HANDOVER_S)
        self._deferred: frozenset[int] = frozenset()  # orders the half rule put off (_decode_step)
        self._placement = SlotPlacement.open(
            self._cells,
            enabled=settings.prefix_cache,
            numerics=settings.numerics(self.vocabulary.model_digest),
            window=llama_cpp.llama_model_n_swa(self._model.model),
            max_blob_bytes=settings.prefix_cache_max_bytes,
            shelf_dir=settings.prefix_cache_dir,
            shelf_bytes=settings.prefix_cache_disk_bytes,
            cuts_inside_pieces=settings.flash_attn,  # the ways of .pieces are its kernel's
        )
        self.prefix_stats = self._placement.stats
        self._admitted = 0
        self._submissions = itertools.count()
        self._admission_lock = threading.Lock()
        self._closing = False
        self._failed = False
        self.tokens_generated_total = 0  # every sampled token, for tests and stats
        self.on_step: StepListener | None = None  # not called: the observer reports steps
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

    def submit(self, request: SequenceRequest, sink: TokenSink) -> LlamaSequence:
        """Queue a sequence; raises PromptTooLong or Overloaded instead of waiting unboundedly."""
        chunk = check_request(self.settings, request)
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
        sequence = LlamaSequence.for_request(
            request,
            sink,
            sampler,
            chunk=chunk,
            order=next(self._submissions),
            release_admission=self._release_admission,
        )
        self._inbox.put(sequence)
        return sequence

    def deliver_on(self, loop: asyncio.AbstractEventLoop) -> None:
        pass  # sinks are called on the decode thread, as they happen

    def health(self) -> EngineHealth:
        failure = "the engine thread failed; see the server log" if self._failed else None
        return EngineHealth(
            failure=failure,
            prefix_cache=dataclasses.replace(self.prefix_stats),
            threads=self.settings.n_threads,
        )

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
        handover = (
            self._freed and not self._waiting and not any(s.pending_prompt for s in self._active)
        )
        self._freed = False
        while idle or handover or not self._inbox.empty():
            if idle:
                self._placement.idle(True)
                item = self._next_while_idle()
                self._placement.idle(False)
            elif handover and self._inbox.empty():
                try:
                    item = self._inbox.get(timeout=HANDOVER_S)
                except queue.Empty:
                    break
            else:
                item = self._inbox.get_nowait()
            handover = False
            if item is None:
                for sequence in [*self._active, *self._waiting]:
                    self._finish(sequence, FinishReason.SHUTDOWN)
                self._placement.shelve()
                return False
            self._waiting.append(item)
            idle = False
        for sequence in [*self._active, *self._waiting]:
            if sequence.cancelled:
                self._finish(sequence, FinishReason.CANCELLED)
            elif sequence.pause_requested or sequence.out_of_allowance:
                self._pause(sequence)
        from_kept = False
        while self._waiting and self._free_ids:
            sequence = self._waiting.popleft()
            # A scored prompt computes every position (reused cells have no logits).
            scored = sequence.prompt_scores is not None
            hit = None
            if not scored:
                hit = self._placement.find(
                    sequence.request, sequence.plan if sequence.fixed else None
                )
            new = not (sequence.fixed or scored)
            tiled = sequence.tiled_reuse(self._widest) if new and self._merges else 0
            sequence.seq_id, in_place = self._placement.slot_for(
                hit, self._free_ids, sequence.request if new else None, tiled=tiled
            )
            self._free_ids.remove(sequence.seq_id)
            # Batches in id order: with llama.cpp's per-sequence KV streams a batch whose ids
            # are not ascending costs 40-80% more per step (python -m loadtest.bench.seqids).
            self._active.append(sequence)
            self._active.sort(key=lambda s: s.seq_id)
            if not self._admit_resumed(sequence):
                if hit is not None:
                    reused = self._placement.take(sequence.seq_id, hit)
                else:
                    hit, reused = in_place, in_place.length if in_place is not None else 0
                sequence.start_prompt(reused, hit, widest=self._widest)
                if hit is not None and hit.end is not None and not sequence.pending_prompt:
                    self._start_from_end_logits(sequence, hit.end)
                    from_kept = True
        # A first token sampled from kept logits ends the step: it leaves now, not after the
        # next decode (the next step comes at once).
        if self._active and not from_kept:
            self._decode_step()
        return True

    def _next_while_idle(self) -> LlamaSequence | None:
        """The next submission. If none comes within :data:`SNAPSHOT_AFTER_S`, the kept
        entries' cells are saved one at a time meanwhile (:meth:`.placement.SlotPlacement.
        snapshot_one`), the entry used last only after :data:`LAST_ENTRY_AFTER_S` more: a
        prompt arriving then waits for one save at most, where a burst that takes their slots
        would wait for all of them."""
        for wait_s, spare_last in ((SNAPSHOT_AFTER_S, True), (LAST_ENTRY_AFTER_S, False)):
            try:
                return self._inbox.get(timeout=wait_s)
            except queue.Empty:
                pass
            while self._inbox.empty() and self._placement.snapshot_one(spare_last=spare_last):
                pass
        return self._inbox.get()

    @property
    def _merges(self) -> bool:
        """Whether tiled pieces merge, and are cut anywhere: only where the ways are flash
        attention's (.pieces), and never under batch_invariant (a call a piece, as measured)."""
        return self.settings.flash_attn and not self.settings.batch_invariant

    @property
    def _widest(self) -> int:
        """The most prompt tokens one step takes beside a token of every slot."""
        return self.settings.n_batch - self.settings.n_seq_max

    def _decode_step(self) -> None:
        # What the half rule put off would have fitted the last step (llama-server's one batch):
        # the decoders whose readers see text wait for it, and for no prompt that came after it.
        owed = any(s.order in self._deferred for s in self._active)
        decoding: list[BatchEntry] = []
        for sequence in self._active:
            if not sequence.pending_prompt and not (owed and sequence.first_text.shown):
                decoding.append((sequence, sequence.last_token, sequence.n_past, True))
                sequence.n_past += 1
        pieces = self._prompt_pieces(decoding=len(decoding), owed=owed)
        if self.settings.batch_invariant:
            # Each sequence in its own micro-batch: its logits cannot depend on its neighbours.
            calls = [[entry] for entry in decoding] + pieces
        else:
            # Prompt pieces share calls (in id order, loadtest.bench.seqids); a decoded token
            # within ROWS_CELLS cells is a row-by-row piece too (.pieces), else the decoded
            # tokens' call comes after the prompts' (as in llama-server's batch): an answer due
            # to end ends after the new prompt, and a client's next request (an agent's loop)
            # finds it done, not ahead of it (loadtest/README.md, "a closed loop's TTFT").
            # First while a reader awaits its first text, though: its next token may be it.
            awaiting_text = not all(e[0].first_text.shown for e in decoding)
            rows = (
                self.settings.flash_attn
                and not awaiting_text
                and all(e[2] < ROWS_CELLS for e in decoding)
            )
            fed = [[entry] for entry in decoding] if rows else []
            shared = share_calls(
                [(Shape(p[0][0].seq_id, len(p), p[-1][2] + 1, p[-1][3]), p) for p in fed + pieces],
                pack=self.settings.flash_attn,
                n_ubatch=self.settings.n_batch,
            )
            calls = [
                sorted((e for piece in call for e in piece), key=lambda e: e[0].seq_id)
                for call in shared
            ]
            if decoding and not rows:
                calls.insert(0 if awaiting_text else len(calls), decoding)
        for i, call in enumerate(calls):
            if self._decode(call) and i + 1 < len(calls):
                # A first token leaves now, not after the step's other calls: in a burst of
                # long prompts each completes early in a step that then runs a second on.
                self._observer.tokens_sampled()

    def _prompt_pieces(self, *, decoding: int, owed: bool) -> list[list[BatchEntry]]:
        """This step's prompt pieces, oldest sequence first: the oldest's up to ``n_batch``
        tokens (a prompt of ``n_batch`` completes in one step, as in llama-server), then the
        others' that fit beside the ``decoding`` sequences' tokens, until they hold half the
        waiting prompt tokens (a burst's first half gets its first tokens after a step half as
        long: 8 short prompts' TTFT p50 went from 1.19x llama-server's to 0.95x). A sequence's
        tiled pieces merge while the budget lasts, the step filled to the token
        (:func:`.pieces.tiled_take`); a cold prompt's tail may go past the budget
        (``LlamaSequence.feed_prompt``). A prompt completed here reports its plan now."""
        waiting = sorted((s for s in self._active if s.pending_prompt), key=lambda s: s.order)
        room = self.settings.n_batch
        crowded = decoding > 0 or len(waiting) > 1
        widest = self._widest
        pieces: list[list[BatchEntry]] = []
        half = sum(len(s.pending_prompt) for s in waiting) / 2
        taken = 0
        deferred: frozenset[int] = frozenset()
        for i, sequence in enumerate(waiting):
            if taken >= half:  # what would have fitted is put off: the next step owes it
                if sum(len(s.pending_prompt) for s in waiting[i:]) <= room - decoding:
                    deferred = frozenset(s.order for s in waiting[i:])
                break
            # The oldest may fill a call (the decoded tokens have theirs, or the short pieces'):
            # a prompt of n_batch tokens then completes in one step, as in llama-server, where
            # it waited a step for want of a few tokens of room.
            budget = room if i == 0 else room - decoding
            fed = sequence.feed_prompt(
                crowded=crowded,
                widest=widest,
                budget=budget,
                merge=self._merges,
                spare=i + 1 < len(waiting),
            )
            if fed is None:
                continue  # the next step; those after it may still fit this one
            mine, complete = fed
            pieces += mine
            fed_now = sum(len(piece) for piece in mine)
            room -= fed_now
            taken += fed_now
            if complete:
                plan = sequence.planned()
                n_prompt = len(sequence.request.prompt_tokens)
                self.prefix_stats.count(reused=plan.reused, n_prompt=n_prompt)
                sequence.sink.sequence_planned(plan)
        self._deferred = deferred & self._deferred if owed else deferred
        return pieces

    def _start_from_end_logits(self, sequence: LlamaSequence, end: EndLogits) -> None:
        """A prompt found whole with its last position's logits: its plan (the entry's, to the
        prompt's end) is reported and its first token sampled from them; nothing is computed,
        and its next step decodes that token."""
        sequence.end_logits = end
        plan = sequence.planned()
        self.prefix_stats.count(reused=plan.reused, n_prompt=plan.length)
        sequence.sink.sequence_planned(plan)
        self._sample(sequence, end.logits.copy())  # a grammar's sampler may mask in place

    def _decode(self, entries: list[BatchEntry]) -> bool:
        """One ``llama_decode`` call, and the sampling after it; whether it sampled a token."""
        sampled = False
        batch = self._batch
        for i, (sequence, token, position, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.logits[i] = token, position, logits
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, sequence.seq_id
        batch.n_tokens = len(entries)
        self._observer.decode_started()
        status = llama_cpp.llama_decode(self._context.ctx, batch)
        self._observer.decode_finished()
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        for i, (sequence, _token, position, logits) in enumerate(entries):
            if not logits:
                continue
            prompt = sequence.request.prompt_tokens
            scores = sequence.prompt_scores
            if scores is not None and position + 1 < len(prompt):  # a scored prompt's, not last
                top = sequence.request.logprobs or 0
                scores.append(token_logprobs(self._logits(i), prompt[position + 1], top))
                continue
            row = self._logits(i)
            if position + 1 == len(prompt) and self._placement.keeps_end_logits:
                sequence.end_logits = EndLogits(len(prompt), row.copy())
            self._sample(sequence, row)
            sampled = True
        return sampled

    def _admit_resumed(self, sequence: LlamaSequence) -> bool:
        """Give a resumed sequence its cells back from its blob; False: it computes them."""
        resume = sequence.request.resume
        if resume is None:
            return False
        if resume.kv_state is not None and resume.generated:
            return self._restore(sequence, resume.generated, resume.kv_state)
        if not resume.generated:
            sequence.sink.sequence_resumed(ResumePath.REPLAY)  # nothing to rebuild
        return False

    # --- pause and resume -------------------------------------------------------------------

    def _restore(self, sequence: LlamaSequence, generated: tuple[int, ...], kv: bytes) -> bool:
        if not self._cells.load(sequence.seq_id, kv):
            # The blob does not fit this context (or is damaged): fall back to exact replay.
            log.warning("KV blob rejected by llama_state_seq_set_data; replaying instead")
            self._cells.clear(sequence.seq_id)
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

    def _pause(self, sequence: LlamaSequence) -> None:
        kv: bytes | None = None
        capturable = sequence.history and not sequence.forced and not sequence.pending_prompt
        if sequence.capture_kv and capturable and sequence.seq_id >= 0 and sequence in self._active:
            kv = self._cells.save(sequence.seq_id)
        generated = (*sequence.history, *sequence.forced)
        resume = sequence.request.resume
        if sequence.seq_id < 0 and resume is not None:
            # Never admitted: hand the resume point back as it came (a KV-restore resume has
            # no history or forced tokens yet, and its blob belongs to all of them).
            kv, generated = resume.kv_state, resume.generated
        self._release(sequence)
        sequence.sink.sequence_paused(PausedState(generated=generated, kv_state=kv))

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

    def _sample(self, sequence: LlamaSequence, logits: npt.NDArray[np.float32]) -> None:
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
        ends = is_eog and (not sequence.request.ignore_eos or sequence.sampler.constrained)
        top = sequence.request.logprobs
        logprobs = None if top is None else token_logprobs(logits, token, top)
        if sequence.prompt_scores is not None:  # its first token: the prompt's scores first
            scores, sequence.prompt_scores = tuple(sequence.prompt_scores), None
            ended = None
            if ends:
                ended = (token, logprobs or token_logprobs(logits, token, 0))
            sequence.sink.prompt_scored(scores, ended)
        if ends:
            self._finish(sequence, FinishReason.EOS)
            return
        piece = b"" if is_eog else self.vocabulary.piece(token)
        sequence.first_text.feed(piece)
        sequence.sink.token_generated(index, token, piece, logprobs)
        if sequence.generated >= sequence.request.max_tokens:
            self._finish(sequence, FinishReason.LENGTH)

    def _release_admission(self, sequence: LlamaSequence) -> None:
        with self._admission_lock:
            if sequence.release_admission is not None:
                sequence.release_admission = None
                self._admitted -= 1

    def _release(self, sequence: LlamaSequence, *, keep: bool = True) -> bool:
        """Take a sequence out of the engine; its cells stay for the prefix cache (``keep``,
        where there is one) or are freed. False if it was not in."""
        if sequence in self._active:
            self._active.remove(sequence)
            kept = keep and self._placement.keep(
                sequence.seq_id,
                sequence.request,
                sequence.history,
                sequence.n_past,
                sequence.plan,
                sequence.end_logits,
            )
            if not kept:
                self._cells.clear(sequence.seq_id)
            self._free_ids.append(sequence.seq_id)
            self._freed = True
        elif sequence in self._waiting:
            self._waiting.remove(sequence)
        else:
            return False
        sequence.sampler.close()
        self._release_admission(sequence)
        return True

    def _finish(self, sequence: LlamaSequence, reason: FinishReason) -> None:
        kept = reason in (FinishReason.EOS, FinishReason.LENGTH, FinishReason.CANCELLED)
        if not self._release(sequence, keep=kept):
            return
        generated = sequence.generated - (1 if reason is FinishReason.EOS else 0)
        sequence.sink.sequence_finished(reason, generated)
