"""What is known of one session: :class:`SessionRecord`, and its persisted form.

A record is kept as two parts by every store: its metadata (canonical CBOR of everything but the
generated tokens, rewritten whole when it changes) and its token log (4 bytes a token, with its
log-probabilities where the session asked for them, appended before the token is sent:
:mod:`.tokens`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

from quicsrv_proto import EndReason

from ..engine import PrefillPlan, Segment, TokenLogprobs
from .snapshot import Snapshot
from .spec import GenerationSpec
from .tokens import LogprobLog, entry_bytes, pack_entry, unpack_log

__all__ = ["SessionEnd", "SessionRecord"]


@dataclass(frozen=True, slots=True)
class SessionEnd:
    reason: EndReason
    completion_tokens: int
    ended_at_s: float | None = field(default=None, compare=False)
    """When it ended (wall clock; None in a record written before this was kept): what the
    Responses API answers as ``completed_at``, the same on every replay."""


@dataclass(eq=False, kw_only=True)
class SessionRecord:
    """What is known of one session; ``generated`` grows as tokens are produced."""

    session_id: bytes
    model_digest: bytes
    spec: GenerationSpec
    """What the generation is, held whole (the snapshots and every engine request share it)."""
    created_at_s: float
    expires_at_s: float
    # 4 bytes a token (a list of ints costs ~36): thousands of idle sessions stay in memory.
    generated: array[int] = field(default_factory=lambda: array("I"))
    end: SessionEnd | None = None
    owner: str = ""
    """The id of the API key that started the session ("" on an open server): a resume
    must present the same key."""
    prefill_plan: PrefillPlan | None = None
    """How the engine computed the prompt's cells when it started from reused ones (None: as
    a cold start): a replay follows it, or it would not be exact."""
    unattended: bool = False
    """It runs to its end whether or not anyone reads it (a background response): a restarted
    server starts it again on its own."""
    api: dict[str, Any] | None = None
    """What a front end keeps with the session to answer about it later (the Responses API:
    its request fields and the conversation the prompt was rendered from); CBOR values."""
    logprobs: LogprobLog | None = None
    """The generated tokens' log-probabilities, where the spec asks for them (made empty for a
    new record); None: not kept."""
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    """A scored prompt's (``spec.score_prompt``) tokens' log-probabilities, but the first's;
    None: not scored (yet)."""
    ended_by: tuple[int, TokenLogprobs] | None = None
    """A scored prompt's first token when it ended the generation (an end-of-generation
    token, never recorded as a token), with its log-probabilities."""

    def __post_init__(self) -> None:
        if self.logprobs is None and self.spec.logprobs is not None:
            self.logprobs = LogprobLog(self.spec.logprobs)

    @property
    def entry_bytes(self) -> int:
        """Bytes a generated token takes in its token log."""
        return entry_bytes(self.spec.logprobs)

    def add_token(self, token: int, logprobs: TokenLogprobs | None) -> bytes:
        """Record a generated token (and its log-probabilities, where they are kept); its entry
        as the token log holds it."""
        self.generated.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
        return pack_entry(token, self.spec.logprobs, logprobs)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose cells its first run took from the prefix cache."""
        return 0 if self.prefill_plan is None else self.prefill_plan.reused

    def snapshot(self, upto: int | None = None) -> Snapshot:
        """The snapshot of the first ``upto`` generated tokens (all by default)."""
        tokens = self.generated if upto is None else self.generated[:upto]
        return Snapshot(
            session_id=self.session_id,
            model_digest=self.model_digest,
            spec=self.spec,
            generated=tuple(tokens),
            created_at_s=self.created_at_s,
            expires_at_s=self.expires_at_s,
        )

    def meta(self) -> dict[str, object]:
        """The persisted metadata: everything but the generated tokens (CBOR values)."""
        meta: dict[str, object] = {
            "v": 1,
            "session": self.session_id,
            "model": self.model_digest,
            **self.spec.meta(),
            "created": self.created_at_s,
            "expires": self.expires_at_s,
        }
        if self.end is not None:
            end: list[object] = [self.end.reason.value, self.end.completion_tokens]
            if self.end.ended_at_s is not None:
                end.append(self.end.ended_at_s)
            meta["end"] = end
        if self.owner:
            meta["owner"] = self.owner
        if self.unattended:
            meta["unattended"] = True
        if self.api is not None:
            meta["api"] = self.api
        if self.prefill_plan is not None:
            meta["plan"] = [self.prefill_plan.reused, [list(s) for s in self.prefill_plan.segments]]
        if self.prompt_logprobs is not None:
            meta["prompt_logprobs"] = [_logprobs_wire(lp) for lp in self.prompt_logprobs]
        if self.ended_by is not None:
            meta["ended_by"] = [self.ended_by[0], _logprobs_wire(self.ended_by[1])]
        return meta

    @classmethod
    def from_log(cls, meta: Any, log: bytes) -> SessionRecord:
        """Read back what :meth:`meta` wrote and the token log (entries :meth:`add_token` made)."""
        spec_logprobs = meta.get("logprobs")
        tokens, logprobs = unpack_log(log, None if spec_logprobs is None else int(spec_logprobs))
        return cls.from_meta(meta, tokens, logprobs)

    @classmethod
    def from_meta(
        cls, meta: Any, tokens: array[int], logprobs: LogprobLog | None = None
    ) -> SessionRecord:
        """Read back what :meth:`meta` wrote, with the token log's ``tokens``."""
        end = meta.get("end")
        plan = meta.get("plan")
        return cls(
            session_id=bytes(meta["session"]),
            model_digest=bytes(meta["model"]),
            spec=GenerationSpec.from_meta(meta),
            created_at_s=float(meta["created"]),
            expires_at_s=float(meta["expires"]),
            generated=tokens,
            owner=str(meta.get("owner", "")),
            prefill_plan=None
            if plan is None
            else PrefillPlan(tuple(Segment(int(e), int(s)) for e, s in plan[1]), int(plan[0])),
            end=None
            if end is None
            else SessionEnd(
                EndReason(end[0]), int(end[1]), float(end[2]) if len(end) > 2 else None
            ),
            unattended=bool(meta.get("unattended", False)),
            api=meta.get("api"),
            logprobs=logprobs,
            prompt_logprobs=None
            if meta.get("prompt_logprobs") is None
            else tuple(_logprobs_read(v) for v in meta["prompt_logprobs"]),
            ended_by=None
            if meta.get("ended_by") is None
            else (int(meta["ended_by"][0]), _logprobs_read(meta["ended_by"][1])),
        )


def _logprobs_wire(logprobs: TokenLogprobs) -> list[object]:
    return [logprobs.logprob, [[token, lp] for token, lp in logprobs.top]]


def _logprobs_read(value: Any) -> TokenLogprobs:
    return TokenLogprobs(float(value[0]), tuple((int(t), float(lp)) for t, lp in value[1]))
