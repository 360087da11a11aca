"""One sequence as the in-process engine's decode thread holds it, and how its prompt is fed.

A :class:`LlamaSequence` is the handle :meth:`~.llama.LlamaEngine.submit` returns (its
``cancel``, ``pause`` and ``allow`` set plain fields the decode thread reads each step) and the
state that thread keeps of it. It answers the questions of its own prompt, with no llama.cpp
call: where a resume starts (the recorded plan, a replay's forced tokens, a re-prefill), how the
prompt goes on from the cells it could reuse, which of its tokens the next step feeds (its
*piece*, if it fits the step's budget: one step of its plan, or several tiled ones) and in which
step, and the plan it
reports once its prompt is in. The engine (:mod:`.llama`) finds the cells (:mod:`.placement`),
decides which pieces share a ``llama_decode`` (:mod:`.pieces`), decodes and samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ._api import PrefillPlan, ResumePath, Segment, SequenceRequest, TokenLogprobs, TokenSink
from .first_text import FirstText
from .pieces import TILE_TOKENS, cold_plan, merges, tail, tiled_head, tiled_take
from .prefix_cache import EndLogits, Hit, cut, extend, rest
from .sampling import SequenceSampler

__all__ = ["BatchEntry", "LlamaSequence"]

BatchEntry = tuple["LlamaSequence", int, int, bool]
"""What a step feeds the model: the sequence, a token, its position, whether logits are wanted."""


@dataclass(eq=False)
class LlamaSequence:
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
    run_end: int = 0  # where the run of tiled plan pieces being fed ends (.pieces.tiled_take)
    reused: int = 0  # leading positions whose cells came from the prefix cache
    pending_prompt: deque[int] = field(default_factory=deque)
    forced: deque[int] = field(default_factory=deque)  # replay: tokens to decode, not sample
    history: list[int] = field(default_factory=list)  # every generated token, in order
    # Whether its reader has seen text yet (a resume's reader has had its tokens).
    first_text: FirstText = field(default_factory=FirstText)
    # A prompt scored (request.prompt_logprobs): its tokens' log-probabilities so far, until
    # they are reported with its first token.
    prompt_scores: list[TokenLogprobs] | None = None
    # Its prompt's last logits, kept with its cells when it leaves (.prefix_cache.EndLogits).
    end_logits: EndLogits | None = None
    release_admission: Callable[[LlamaSequence], None] | None = None

    @classmethod
    def for_request(
        cls,
        request: SequenceRequest,
        sink: TokenSink,
        sampler: SequenceSampler,
        *,
        chunk: int,
        order: int,
        release_admission: Callable[[LlamaSequence], None],
    ) -> LlamaSequence:
        """A new sequence, set to rebuild a resume's cells the way it asks (unless it brings
        them as a blob: the engine restores those when it gets a slot)."""
        resume = request.resume
        plan = request.prefill_plan
        if plan is None and resume is not None and resume.generated:
            # Tokens were sent from a run without a recorded plan: one that fed the prompt in
            # chunks from position 0 (what every run did before plans were recorded).
            plan = PrefillPlan.plain(len(request.prompt_tokens), chunk)
        sequence = cls(
            request=request,
            sink=sink,
            sampler=sampler,
            pending_prompt=deque(request.prompt_tokens),
            plan=plan.segments if plan is not None else (),
            fixed=plan is not None,
            release_admission=release_admission,
            chunk=chunk,
            order=order,
            prompt_scores=[] if request.prompt_logprobs else None,
            first_text=FirstText(shown=resume is not None and bool(resume.generated)),
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
        return sequence

    # --- the handle (any thread) --------------------------------------------------------

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

    # --- its prompt (the decode thread) -------------------------------------------------

    @property
    def out_of_allowance(self) -> bool:
        busy_rebuilding = self.pending_prompt or self.forced
        return not busy_rebuilding and self.generated >= self.allowed

    def tiled_reuse(self, widest: int) -> int:
        """How many first positions of its prompt may come from cells another prompt computed
        tiled (:meth:`.prefix_cache.PrefixCache.reusable`): all but the last 64 of the run of
        tiled pieces its cold plan starts with, which are then fed tiled from there."""
        cold = cold_plan(len(self.request.prompt_tokens), self.chunk, widest)
        return max(0, tiled_head(cold.segments) - TILE_TOKENS)

    def start_prompt(self, reused: int, hit: Hit | None, *, widest: int) -> None:
        """Its slot holds the first ``reused`` positions' cells, taken from ``hit``: set out
        how the rest is fed, a fixed plan's segments or steps chosen as it goes (``widest``:
        the most prompt tokens a step takes beside a token of every slot)."""
        cold = hit is not None and hit.cold
        if not self.fixed and (not reused or cold):
            # A cold prompt is cut the same way whatever runs beside it, so that the same
            # request gives the same output under any load: in chunks of ``prefill_chunk``.
            n_prompt = len(self.request.prompt_tokens)
            self.plan = cold_plan(n_prompt, self.chunk, widest).segments
            self.fixed = True
        if cold:
            # The cold plan's tiled run goes on from the reused cells as one piece, which
            # feed_prompt cuts where it likes into parts of 64 or more: each of its tokens
            # gets the cells its own piece of the plan gives it.
            head = tiled_head(self.plan)
            self.segments = deque((Segment(head, head - reused), *rest(self.plan, head)))
        elif self.fixed:
            self.segments = deque(rest(self.plan, reused))
        else:
            assert hit is not None
            self.plan = cut(hit.entry.segments, reused)  # the hit's way, up to the cut
        for _ in range(reused):
            self.pending_prompt.popleft()
        self.n_past = self.reused = reused

    def feed_prompt(
        self, *, crowded: bool, widest: int, budget: int, merge: bool, spare: bool
    ) -> tuple[list[list[BatchEntry]], bool] | None:
        """This step's pieces of its prompt, if the first fits in ``budget`` tokens (None: it
        waits for the next step), and whether they complete the prompt (report :meth:`planned`
        now). ``crowded``: other sequences decode or prefill in this step; ``widest``: the
        most prompt tokens a step takes beside a token of every slot. ``merge``: while the
        budget lasts, the next steps' pieces too, as one piece, where each is tiled
        (:func:`.pieces.merges`): a burst's oldest prompt is then in first, as alone; a fixed
        plan's run of tiled pieces is fed as far as the budget goes, cut anywhere that leaves
        tiled parts (:func:`.pieces.tiled_take`; ``spare``: other prompts wait for this
        step's room); and when what is left is the prompt's last piece (a cold prompt's
        tail), that too, as a second piece, for a call of its own after the first's."""
        fed_from = self.n_past
        run = self._tiled_run() if merge and self.fixed else 0
        if run:
            take = tiled_take(run, budget, spare=spare)
            if take is None:
                return None
            piece = self._take(take, take)
            tiled = True
        else:
            step, room = self._prefill_step(crowded=crowded, widest=widest)
            if room > budget and not self._is_tail(room):
                return None
            piece = self._take(step, room)
            tiled = merge and merges(room)
            while tiled and self.pending_prompt:
                step, room = self._prefill_step(crowded=crowded, widest=widest)
                if len(piece) + room > budget or not merges(room):
                    break
                piece += self._take(step, room)
        pieces = [piece]
        if tiled and self.pending_prompt and self.n_past >= self.run_end:
            step, room = self._prefill_step(crowded=crowded, widest=widest)
            last = room == len(self.pending_prompt) and not merges(room)
            if last and (len(piece) + room <= budget or self._is_tail(room)):
                pieces.append(self._take(step, room))
        return pieces, fed_from < len(self.request.prompt_tokens) <= self.n_past

    def _is_tail(self, room: int) -> bool:
        """Whether the next ``room`` prompt tokens are its last one or two (a cold prompt's
        :func:`.pieces.tail`): they go past the step's budget, in a call of their own, so that
        the prompt completes in this step, not a step later, for a call's ~15 ms."""
        return room == len(self.pending_prompt) <= tail(len(self.request.prompt_tokens))

    def _tiled_run(self) -> int:
        """How many prompt tokens are left of the run of tiled pieces (:func:`.pieces.merges`)
        that a fixed plan feeds next (0: its next piece is not tiled): from the pieces as
        :meth:`_prefill_step` gives them, or where a run cut by the budget goes on."""
        if self.n_past >= self.run_end:
            self.run_end = self.n_past
            for segment in self.segments:
                while self.run_end < segment.end:
                    length = min(segment.step, segment.end - self.run_end)
                    if not merges(length):
                        return self.run_end - self.n_past
                    self.run_end += length
        return self.run_end - self.n_past

    def _take(self, step: int, room: int) -> list[BatchEntry]:
        """The next ``room`` prompt tokens, fed in a step of ``step`` (as the plan says)."""
        piece: list[BatchEntry] = []
        for _ in range(room):
            token = self.pending_prompt.popleft()
            last = not self.pending_prompt
            # A re-prefill ends on a generated token whose successor is already known; a
            # scored prompt needs every position's logits.
            logits = (last and not self.reprefill) or self.prompt_scores is not None
            piece.append((self, token, self.n_past, logits))
            self.n_past += 1
            if last and self.reprefill:
                self.reprefill = False
                self.sink.sequence_resumed(ResumePath.REPREFILL)
        if self.fixed:
            while self.segments and self.n_past >= self.segments[0].end:
                self.segments.popleft()
        else:
            self.plan = extend(self.plan, self.n_past, step)
        return piece

    def planned(self) -> PrefillPlan:
        """How its prompt's cells were computed (what a replay must do again)."""
        return PrefillPlan(cut(self.plan, len(self.request.prompt_tokens)), self.reused)

    def _prefill_step(self, *, crowded: bool, widest: int) -> tuple[int, int]:
        """The step the prompt is fed in now, and how many of its tokens go in.

        A fixed plan's steps (a recorded one, or a cold prompt's chunks) are taken from each
        segment's start, so a replay cuts the prompt exactly as the run it replays did. What
        follows reused cells is fed in steps chosen now (and added to the plan): beside other
        sequences a chunk of ``prefill_chunk`` tokens, so that their next token is not stalled
        behind a long prompt and other prompts share the step; alone, the widest piece a batch
        takes, which stalls nobody and over a long kept prefix costs half of what chunks do
        (measured: loadtest.bench.conversation).
        """
        if self.fixed:
            segment = self.segments[0]
            return segment.step, min(segment.step, segment.end - self.n_past)
        step = self.chunk if crowded else widest
        return step, min(step, len(self.pending_prompt))
