"""What a generation is, defined once and carried whole: :class:`GenerationSpec`.

The session record keeps it, every snapshot (and so every checkpoint MAC) covers it, and the
engine request of each (re)start is built from it by :meth:`GenerationSpec.request`, the one
builder of :class:`~quicsrv.engine.SequenceRequest`. Its two wire mappings live here too: the
record's metadata (:meth:`GenerationSpec.meta`) and the MAC header
(:meth:`GenerationSpec.mac_fields`). A new field is one field here and its two mappings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..engine import (
    CONSTRAINED_SAMPLING,
    Grammar,
    PrefillPlan,
    ResumePoint,
    SamplingParams,
    SequenceRequest,
)
from .tokens import digest_tokens

__all__ = ["GenerationSpec"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationSpec:
    """Everything that decides a generation's tokens, fixed when it starts."""

    prompt_tokens: tuple[int, ...]
    """The prompt as the engine reads it (a chat already rendered with its template)."""
    sampling: SamplingParams
    """Sampler settings and the seed: with the token history, the whole sampler state."""
    max_tokens: int
    """Tokens generated at most."""
    stop: tuple[str, ...]
    """Stop sequences: the text ends before the first match."""
    ignore_eos: bool
    """Generate past the model's end token (benchmarks)."""
    prefill_chunk: int
    """Prompt tokens fed per step when it first ran: a replay must feed them the same way."""
    grammar: Grammar | None = None
    """What constrains its tokens (structured output); None: nothing."""
    logprobs: int | None = None
    """Each token's log-probability is kept with this many alternatives; None: none. Not a
    part of the MAC: it decides what is kept of the tokens, not which they are."""
    score_prompt: bool = False
    """The prompt's tokens' log-probabilities are kept too (text completions' ``echo``): its
    first run computes every prompt position, none taken from the prefix cache."""

    def request(
        self,
        *,
        resume: ResumePoint | None = None,
        prefill_plan: PrefillPlan | None = None,
        cache_scope: str = "",
        scored: bool = False,
    ) -> SequenceRequest:
        """The engine request of a start (``resume`` None) or of a restart (``scored``: the
        prompt's scores are kept already)."""
        score = self.score_prompt and not scored and not (resume is not None and resume.generated)
        return SequenceRequest(
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            sampling=self.sampling,
            ignore_eos=self.ignore_eos,
            prefill_chunk=self.prefill_chunk,
            resume=resume,
            prefill_plan=prefill_plan,
            cache_scope=cache_scope,
            grammar=None if self.grammar is None else self.grammar.gbnf,
            logprobs=self.logprobs,
            prompt_logprobs=score,
        )

    def mac_fields(self) -> dict[str, object]:
        """What every checkpoint MAC covers of it (the prompt as a digest)."""
        fields: dict[str, object] = {
            "prompt": digest_tokens(self.prompt_tokens),
            "sampling": _sampling_wire(self.sampling),
            "max_tokens": self.max_tokens,
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
            "chunk": self.prefill_chunk,
        }
        if self.grammar is not None:
            # Only then: the MACs of unconstrained sessions stay what they were.
            fields["grammar"] = [self.grammar.digest, CONSTRAINED_SAMPLING]
        return fields

    def meta(self) -> dict[str, object]:
        """Its part of a record's persisted metadata (CBOR values)."""
        meta: dict[str, object] = {
            "prompt": list(self.prompt_tokens),
            "sampling": _sampling_wire(self.sampling),
            "max_tokens": self.max_tokens,
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
            "chunk": self.prefill_chunk,
        }
        if self.grammar is not None:
            meta["grammar"] = [self.grammar.digest, self.grammar.gbnf]
        if self.logprobs is not None:
            meta["logprobs"] = self.logprobs
        if self.score_prompt:
            meta["score_prompt"] = True
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> GenerationSpec:
        """Read back what :meth:`meta` wrote."""
        t, p, k, m, r, seed = meta["sampling"]
        grammar = meta.get("grammar")
        return cls(
            prompt_tokens=tuple(meta["prompt"]),
            sampling=SamplingParams(
                temperature=t, top_p=p, top_k=k, min_p=m, repeat_penalty=r, seed=seed
            ),
            max_tokens=int(meta["max_tokens"]),
            stop=tuple(meta["stop"]),
            ignore_eos=bool(meta["ignore_eos"]),
            prefill_chunk=int(meta["chunk"]),
            grammar=None
            if grammar is None
            else Grammar(gbnf=str(grammar[1]), digest=bytes(grammar[0])),
            logprobs=None if meta.get("logprobs") is None else int(meta["logprobs"]),
            score_prompt=bool(meta.get("score_prompt", False)),
        )


def _sampling_wire(s: SamplingParams) -> list[object]:
    """The sampling parameters as both wire forms hold them (a list: its order is the format)."""
    return [s.temperature, s.top_p, s.top_k, s.min_p, s.repeat_penalty, s.seed]
