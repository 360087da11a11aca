"""The engine's small interface: the server submits sequences and receives tokens through a sink.

The engine knows nothing of QUIC or frames. Callbacks on the sink are made from the engine's own
worker thread; the sink is responsible for handing them to its event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .facts import ModelInfo
from .restarts import Breaker

if TYPE_CHECKING:
    from .prefix_cache import PrefixStats  # which builds on Segment, defined here

__all__ = [
    "CannotReplay",
    "Engine",
    "EngineError",
    "EngineHealth",
    "EngineUnavailable",
    "FinishReason",
    "Overloaded",
    "PausedState",
    "PrefillPlan",
    "PromptTooLong",
    "ResumePath",
    "ResumePoint",
    "SamplingParams",
    "Segment",
    "SequenceHandle",
    "SequenceRequest",
    "StepListener",
    "TokenLogprobs",
    "TokenSink",
]


class FinishReason(StrEnum):
    LENGTH = "length"
    EOS = "eos"
    CANCELLED = "cancelled"
    SHUTDOWN = "shutdown"
    FAILED = "failed"
    """The engine failed and could not be brought back: the session stays resumable."""
    POISONED = "poisoned"
    """This sequence kept killing the engine worker: it was stopped alone so that the others
    go on (the session stays resumable, but will most likely do the same again)."""


class EngineError(Exception):
    """The engine refused a request (this class itself: it is shutting down, or the request
    can never run on it). ``retry_after_s``: when trying again may succeed (None: no hint)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(EngineError):
    """Every sequence slot is busy and the admission queue is full (a retry hint always)."""

    retry_after_s: float

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s)


class EngineUnavailable(EngineError):
    """The engine failed (its worker crashes in a loop, or its thread died): no new work."""


class PromptTooLong(EngineError):
    """The prompt plus max_tokens does not fit in one sequence's context."""


class InvalidSchema(EngineError):
    """A JSON schema that cannot constrain sampling here (a keyword refused, a bound passed, a
    grammar that does not parse); ``path`` names the part, e.g. ``properties.name.maxLength``."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


MAX_TOP_LOGPROBS = 20
"""Alternatives a token's log-probability comes with at most (OpenAI's bound)."""

CONSTRAINED_SAMPLING = "sample-then-check/1"
"""How a grammar constrains the pick (see :mod:`.sampling`): part of what makes a constrained
generation reproducible, so it is named in every constrained session's MAC."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Grammar:
    """What constrains a generation's tokens: llama.cpp GBNF (root rule ``root``)."""

    gbnf: str
    digest: bytes
    """Names the GBNF and the converter that made it: a record keeps it, snapshots MAC it."""


class CannotReplay(EngineError):
    """This engine can never continue the sequence as it was computed (its prefill settings
    changed since the recorded plan): a replay would not be exact, so there is none."""


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


class ResumePath(StrEnum):
    """How a resumed sequence got its KV cells back."""

    KV_RESTORE = "kv-restore"  # llama_state_seq_set_data of the blob saved at pause
    REPLAY = "replay"  # the prompt with its original chunking, then each token decoded alone
    REPREFILL = "re-prefill"  # prompt + generated tokens in chunks: fast, not bit-exact (opt-in)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumePoint:
    """Where a resumed sequence picks up: the tokens it already generated, and maybe its KV."""

    generated: tuple[int, ...]
    kv_state: bytes | None = None
    """``llama_state_seq_get_data`` of the paused sequence; None: rebuild its cells."""
    inexact_reprefill: bool = False
    """Without a blob, prefill prompt + generated in chunks instead of the exact replay."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PausedState:
    """What the engine hands back when a sequence is paused."""

    generated: tuple[int, ...]
    """Every token the sequence generated, in order (including any replayed ones)."""
    kv_state: bytes | None
    """Its KV cells (prompt + generated[:-1]); None when they were not captured."""


class Segment(NamedTuple):
    """Prompt positions up to ``end`` (from the previous segment's end), fed ``step`` at a time."""

    end: int
    step: int


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """How a sequence's prompt cells are computed: ``segments`` in order, the first ``reused``
    positions taken from the cache (computed by an earlier sequence, the same way)."""

    segments: tuple[Segment, ...]
    reused: int = 0

    def __reduce__(self) -> tuple[type[PrefillPlan], tuple[tuple[Segment, ...], int]]:
        # Its constructor call: unpickling a frozen slots dataclass otherwise takes a walk
        # over its fields (it travels in the worker's step messages; see .ipc).
        return PrefillPlan, (self.segments, self.reused)

    @classmethod
    def plain(cls, n_tokens: int, step: int) -> PrefillPlan:
        """A prompt prefilled from position 0 in chunks of ``step``: a cold start."""
        return cls((Segment(n_tokens, min(step, n_tokens)),))

    def is_cold(self, step: int) -> bool:
        """Whether it computes the cells as :meth:`plain` with ``step`` does (whatever was
        reused): a replay without a recorded plan is then exact."""
        return self.segments == PrefillPlan.plain(self.length, step).segments

    @property
    def length(self) -> int:
        return self.segments[-1].end if self.segments else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SequenceRequest:
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    ignore_eos: bool = False
    prefill_chunk: int | None = None
    """Prompt tokens fed per step; None: the engine's setting. A resume must reuse the original."""
    resume: ResumePoint | None = None
    prefill_plan: PrefillPlan | None = None
    """A resume's recorded plan (what ``sequence_planned`` said when it first ran): its prompt
    is recomputed the same way. None: a cold plan, or whatever the prefix cache offers."""
    cache_scope: str = ""
    """Whose prefix-cache entries this sequence may reuse, and leaves its own cells to."""
    grammar: str | None = None
    """GBNF (root rule ``root``) that every generated token must fit (structured output); a
    resume's tokens are checked against it and replayed into it. None: unconstrained."""
    logprobs: int | None = None
    """Report each generated token's log-probability with this many most likely alternatives
    (0 to :data:`MAX_TOP_LOGPROBS`); None: none."""
    prompt_logprobs: bool = False
    """Score the prompt too (``TokenSink.prompt_scored``, with ``logprobs`` alternatives): its
    cells are all computed, none taken from the prefix cache, with the logits of every
    position. A resume never asks: the first run's scores are kept."""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log-probability in the model's own distribution (the log-softmax of
    its logits, before repetition penalty, temperature, top-k/top-p/min-p and any grammar), and
    the ``top`` most likely tokens there, most likely first (ties: lower id first). Every value
    is a float32 (widened): what a token log keeps, bit for bit."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def __reduce__(self) -> tuple[type[TokenLogprobs], tuple[float, tuple[tuple[int, float], ...]]]:
        return TokenLogprobs, (self.logprob, self.top)  # one per token through the worker pipe


class TokenSink(Protocol):
    """Receives one sequence's output, on the engine thread."""

    def token_generated(
        self, index: int, token_id: int, piece: bytes, logprobs: TokenLogprobs | None
    ) -> None:
        """``logprobs``: when the request asked for them (:attr:`SequenceRequest.logprobs`)."""

    def sequence_finished(self, reason: FinishReason, completion_tokens: int) -> None: ...

    def prompt_scored(
        self, logprobs: tuple[TokenLogprobs, ...], ended: tuple[int, TokenLogprobs] | None
    ) -> None:
        """A request with ``prompt_logprobs``: its prompt tokens' log-probabilities (all but
        the first, which nothing predicts), once, before its first token; ``ended``: the first
        token sampled (id and log-probabilities) when it ended the generation (an
        end-of-generation token, which is never reported as a token)."""

    def sequence_paused(self, state: PausedState) -> None:
        """The sequence left the batch (``pause()`` or its token allowance ran out)."""

    def sequence_resumed(self, path: ResumePath) -> None:
        """A resumed sequence has its KV cells back and is about to generate."""

    def sequence_planned(self, plan: PrefillPlan) -> None:
        """The sequence got a slot and will compute its prompt cells as ``plan`` says (before
        any token of it is reported): a replay must follow the same plan to be exact."""


class SequenceHandle(Protocol):
    def cancel(self) -> None:
        """Stop generating at the next step; the sink gets ``sequence_finished(CANCELLED)``."""

    def pause(self, *, capture_kv: bool = True) -> None:
        """Leave the batch at the next step; the sink gets ``sequence_paused``."""

    def allow(self, n_tokens: int) -> None:
        """Generate at most ``n_tokens`` tokens in all; reaching the allowance pauses."""


StepListener = Callable[[list[int], float], None]
"""Told of one decode step that sampled tokens: whose sequences got one (their keys) and when
the step ended (``time.monotonic()``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineHealth:
    """How an engine is, at one moment (metrics and readiness read it); the defaults are an
    engine that takes work and has nothing else to report."""

    failure: str | None = None
    """Why no work is taken now (the engine failed, or its worker crash-loops: the breaker is
    open); None while work is taken."""
    restarting: bool = False
    """No worker process runs now: one died and the next is starting (work waits for it)."""
    restarts: int = 0
    """Worker processes replaced after a death."""
    breaker: Breaker | None = None
    """The worker restart breaker (:mod:`.restarts`); None: an engine without one."""
    worker_deaths: int = 0
    breaker_opens: int = 0
    poisoned_generations: int = 0
    """Generations convicted of killing the worker, failed alone (:mod:`.suspects`)."""
    prefix_cache: PrefixStats | None = None
    """A copy of the prefix cache's counts; None: an engine without one."""
    cpu_extra_buffers: bool | None = None
    """Whether the running worker uses llama.cpp's extra CPU buffers (False: the safe mode);
    None: not reported (no worker process)."""
    threads: int = 0
    """llama.cpp threads it decodes with (0: not reported)."""
    worker_pid: int | None = None
    """The engine worker process now running (its memory and open files are exported);
    None: none runs now, or the engine runs in the server's process."""

    @property
    def up(self) -> bool:
        """Whether work is taken now."""
        return self.failure is None


class Engine(Protocol):
    """What the server needs from an engine."""

    on_step: StepListener | None
    """Told of each decode step that sampled tokens (set by whoever meters steps: the server's
    metrics). An engine that does not report its steps never calls it: the in-process engine,
    whose worker process reports them through its observer instead."""

    @property
    def context_per_sequence(self) -> int: ...

    @property
    def prefill_chunk(self) -> int: ...

    @property
    def n_seq_max(self) -> int:
        """Sequences decoded at once: the slots the server hands out."""

    @property
    def max_queued(self) -> int:
        """Requests that may wait for a slot, all clients together."""

    def tokenize(
        self, text: str, *, add_special: bool, parse_special: bool = True
    ) -> list[int]: ...

    def render_chat(
        self, messages: list[dict[str, str]], tools: list[dict[str, object]] | None = None
    ) -> str:
        """The chat's prompt; ``tools`` (OpenAI's shape) go to a template that renders them
        (``model_info.tool_call_format``)."""
        ...

    def piece(self, token_id: int) -> bytes: ...

    def token_text(self, token_id: int) -> bytes:
        """The token's bytes, a control token as its text (``/detokenize``); raises IndexError
        for an id outside the vocabulary."""
        ...

    @property
    def model_info(self) -> ModelInfo:
        """The model file's own facts (``/props``, ``/v1/models``)."""
        ...

    def grammar_for(self, schema: str) -> Grammar:
        """The grammar of a JSON schema (JSON text), checked to compile with this model's
        vocabulary (cached); raises InvalidSchema."""
        ...

    @property
    def model_digest(self) -> bytes: ...

    def submit(self, request: SequenceRequest, sink: TokenSink) -> SequenceHandle: ...

    def deliver_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Call sinks on ``loop``'s thread where that saves a thread hop (a worker engine reads
        its worker's messages there); an engine with a decode thread of its own ignores it.
        Sinks must accept calls on any thread either way."""

    def health(self) -> EngineHealth:
        """How the engine is now; cheap (asked at every scrape and readiness probe)."""
        ...

    def close(self) -> None: ...
