"""Frame types: one frozen dataclass per frame, each able to read itself from a CBOR map.

A frame's payload is a CBOR map with text keys. ``from_payload`` is the untrusted path: it checks
every field's presence, type and range, and rejects unknown keys, raising a :class:`ProtocolError`
subclass that carries the wire code. ``to_payload`` omits fields left at their defaults, so the
encoding stays small and older peers never see keys they do not know.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any, ClassVar

from ._fields import FieldReader
from .errors import InvalidField, MissingField

__all__ = [
    "MAX_MAX_TOKENS",
    "MAX_TOP_LOGPROBS",
    "ChatMessage",
    "Checkpoint",
    "End",
    "EndReason",
    "Error",
    "Frame",
    "FrameType",
    "Generate",
    "ResumeStream",
    "Token",
]

#: Protocol-wide ceilings. A server narrows them further with its own configuration.
MAX_MAX_TOKENS = 1 << 16
MAX_PROMPT_CHARS = 1 << 18
MAX_MESSAGES = 256
MAX_SCHEMA_CHARS = 1 << 16
MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 128
MAX_TOKEN_TEXT_CHARS = 4096
MAX_ERROR_MESSAGE_CHARS = 1024
MAX_SEED = (1 << 64) - 1
MAX_DEADLINE_MS = 24 * 3600 * 1000
MAX_TOKEN_ID = (1 << 31) - 1
MAX_TOKEN_INDEX = (1 << 31) - 1
MAX_TOP_LOGPROBS = 20
SESSION_ID_BYTES = 16
SNAPSHOT_HASH_BYTES = 32
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class FrameType(IntEnum):
    """The frame type byte of the header."""

    GENERATE = 1
    TOKEN = 2
    END = 3
    ERROR = 4
    RESUME_STREAM = 5
    CHECKPOINT = 6


class Truncation(StrEnum):
    """What a chat over the context budget gets (OpenAI's Responses API names)."""

    DISABLED = "disabled"  # refused: prompt_too_long
    AUTO = "auto"  # its oldest turns are dropped (never system messages, never part of a turn)


class EndReason(StrEnum):
    """Why a stream stopped. The first four end the generation; ``shutdown`` and
    ``superseded`` end only this stream, and the generation stays resumable."""

    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # a stop sequence matched
    EOS = "eos"  # the model emitted end-of-generation
    CANCELLED = "cancelled"  # the client went away or reset the stream
    # Resumable: this server is going away (a restart). The generation was paused with its
    # KV cells saved where the next process reads them; reconnect (with backoff: the next
    # process may still be starting) and send RESUME_STREAM from the last token held.
    SHUTDOWN = "shutdown"
    SUPERSEDED = "superseded"  # a newer stream resumed the same session

    @property
    def ends_generation(self) -> bool:
        """Whether the generation is over (False: only this stream is, resume it)."""
        return self not in (EndReason.SHUTDOWN, EndReason.SUPERSEDED)


@dataclass(frozen=True, slots=True, kw_only=True)
class Frame(ABC):
    """Base of all frames."""

    frame_type: ClassVar[FrameType]

    @abstractmethod
    def to_payload(self) -> dict[str, Any]:
        """The CBOR map for this frame."""

    @classmethod
    @abstractmethod
    def from_payload(cls, payload: object) -> Frame:
        """Read and validate a frame of this type from a decoded CBOR value."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatMessage:
    """One chat turn; the server renders messages with the model's chat template."""

    role: str
    """``system``, ``user`` or ``assistant``."""
    content: str
    """The turn's text."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Generate(Frame):
    """Client → server: start a generation. Exactly one of ``prompt`` and ``messages``."""

    frame_type: ClassVar[FrameType] = FrameType.GENERATE

    prompt: str | None = None
    """Plain text, tokenized as it is."""
    messages: tuple[ChatMessage, ...] | None = None
    """Chat turns, rendered with the model's chat template."""
    max_tokens: int = 128
    """Upper bound on generated tokens, 1 ≤ n ≤ the server's limit."""
    temperature: float = 0.0
    """0 means greedy; otherwise logits are divided by it before sampling."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 disables it."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the best one; 0 disables it."""
    repeat_penalty: float = 1.0
    """Penalty on recently generated tokens; 1 disables it."""
    seed: int | None = None
    """Seed of the counter-based draw; None lets the server pick one."""
    stop: tuple[str, ...] = ()
    """Stop sequences; the match itself is not emitted."""
    ignore_eos: bool = False
    """Keep generating past end-of-generation tokens (benchmarks)."""
    deadline_ms: int | None = None
    """Give up (``deadline_exceeded``) unless generation starts within this many milliseconds
    of the request's arrival; None: the server's own queue-wait bound."""
    truncation: Truncation = Truncation.DISABLED
    """A chat (``messages``) over the context budget: refused, or its oldest turns dropped."""
    json_schema: str | None = None
    """A JSON schema (as JSON text) the output must follow: it constrains every token sampled,
    and a resume continues the same constrained generation. ``{"type": "object"}``: any JSON
    object."""
    logprobs: int | None = None
    """Send each TOKEN's log-probability with this many most likely alternatives (0 to
    :data:`MAX_TOP_LOGPROBS`); None: none. A resumed stream sends the same numbers."""
    score_prompt: bool = False
    """Keep the prompt's tokens' log-probabilities with the session too (``logprobs``
    alternatives each), for the HTTP API's ``echo``; its cells are then all computed, none
    reused. The native stream does not carry them."""
    tools: str | None = None
    """The tool list (JSON text: an array in OpenAI's chat shape) handed to a chat template
    that renders tools (the HTTP API's native tool calls); ``messages`` only."""

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"max_tokens": self.max_tokens}
        if self.prompt is not None:
            payload["prompt"] = self.prompt
        if self.messages is not None:
            payload["messages"] = [{"role": m.role, "content": m.content} for m in self.messages]
        defaults = _GENERATE_DEFAULTS
        for name in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty", "ignore_eos"):
            value = getattr(self, name)
            if value != defaults[name]:
                payload[name] = _wire_float(value) if isinstance(defaults[name], float) else value
        if self.seed is not None:
            payload["seed"] = self.seed
        if self.stop:
            payload["stop"] = list(self.stop)
        if self.deadline_ms is not None:
            payload["deadline_ms"] = self.deadline_ms
        if self.truncation is not Truncation.DISABLED:
            payload["truncation"] = self.truncation.value
        if self.json_schema is not None:
            payload["json_schema"] = self.json_schema
        if self.logprobs is not None:
            payload["logprobs"] = self.logprobs
        if self.score_prompt:
            payload["score_prompt"] = True
        if self.tools is not None:
            payload["tools"] = self.tools
        return payload

    @classmethod
    def from_payload(cls, payload: object) -> Generate:
        r = FieldReader("GENERATE", payload)
        prompt = r.optional_text("prompt", max_chars=MAX_PROMPT_CHARS)
        raw_messages = r.array("messages", max_items=MAX_MESSAGES)
        messages = None if raw_messages is None else tuple(_read_message(m) for m in raw_messages)
        if (prompt is None) == (messages is None):
            if prompt is None:
                raise MissingField("GENERATE needs one of prompt and messages")
            raise InvalidField("GENERATE takes prompt or messages, not both")
        if messages is not None and not messages:
            raise InvalidField("GENERATE.messages must not be empty")
        raw_stop = r.array("stop", max_items=MAX_STOP_SEQUENCES) or []
        stop = tuple(_read_stop(s) for s in raw_stop)
        raw_truncation = r.text("truncation", max_chars=16, default=Truncation.DISABLED.value)
        try:
            truncation = Truncation(raw_truncation)
        except ValueError:
            raise InvalidField(
                f"GENERATE.truncation {raw_truncation!r} is not one of "
                f"{sorted(t.value for t in Truncation)}"
            ) from None
        if truncation is Truncation.AUTO and messages is None:
            raise InvalidField("GENERATE.truncation applies to messages, not to a prompt")
        frame = cls(
            prompt=prompt,
            messages=messages,
            max_tokens=r.integer("max_tokens", lo=1, hi=MAX_MAX_TOKENS),
            temperature=r.number("temperature", lo=0.0, hi=100.0, default=0.0),
            top_p=r.number("top_p", lo=0.0, hi=1.0, default=1.0),
            top_k=r.integer("top_k", lo=0, hi=MAX_TOKEN_ID, default=0),
            min_p=r.number("min_p", lo=0.0, hi=1.0, default=0.0),
            repeat_penalty=r.number("repeat_penalty", lo=0.0, hi=10.0, default=1.0),
            seed=r.optional_integer("seed", lo=0, hi=MAX_SEED),
            stop=stop,
            ignore_eos=r.flag("ignore_eos", default=False),
            deadline_ms=r.optional_integer("deadline_ms", lo=1, hi=MAX_DEADLINE_MS),
            truncation=truncation,
            json_schema=r.optional_text("json_schema", max_chars=MAX_SCHEMA_CHARS),
            logprobs=r.optional_integer("logprobs", lo=0, hi=MAX_TOP_LOGPROBS),
            score_prompt=r.flag("score_prompt", default=False),
            tools=r.optional_text("tools", max_chars=MAX_SCHEMA_CHARS),
        )
        r.finish()
        if frame.tools is not None and messages is None:
            raise InvalidField("GENERATE.tools applies to messages, not to a prompt")
        if frame.top_p <= 0.0:
            raise InvalidField("GENERATE.top_p must be greater than 0")
        if frame.repeat_penalty <= 0.0:
            raise InvalidField("GENERATE.repeat_penalty must be greater than 0")
        return frame


_GENERATE_DEFAULTS: dict[str, object] = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repeat_penalty": 1.0,
    "ignore_eos": False,
}


def _wire_float(value: float) -> float:
    """``value`` as the float the wire carries, so that equal frames encode to equal bytes.

    An ``int`` is a valid ``float`` argument but CBOR encodes it as an integer, and ``-0.0 == 0.0``
    encodes differently from ``0.0``; adding ``0.0`` turns ``-0.0`` into ``0.0``.
    """
    return float(value) + 0.0


def _read_message(value: object) -> ChatMessage:
    r = FieldReader("GENERATE.messages[]", value)
    role = r.text("role", max_chars=16)
    content = r.text("content", max_chars=MAX_PROMPT_CHARS)
    r.finish()
    if role not in CHAT_ROLES:
        raise InvalidField(f"GENERATE.messages[].role must be one of {sorted(CHAT_ROLES)}")
    return ChatMessage(role=role, content=content)


def _read_stop(value: object) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_STOP_CHARS:
        raise InvalidField(f"GENERATE.stop[] must be non-empty text of <= {MAX_STOP_CHARS} chars")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Token(Frame):
    """Server → client: one generated token."""

    frame_type: ClassVar[FrameType] = FrameType.TOKEN

    index: int
    """Position in the generation, 0 for the first generated token."""
    token_id: int
    """The model's vocabulary id."""
    text: str
    """The text this token completes; may be empty while a UTF-8 character is incomplete."""
    logprob: float | None = None
    """Its log-probability in the model's distribution, when the GENERATE asked for them."""
    top_logprobs: tuple[tuple[int, float], ...] = ()
    """The most likely tokens there, ``(id, log-probability)``, most likely first."""

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"index": self.index, "id": self.token_id, "text": self.text}
        if self.logprob is not None:
            payload["logprob"] = _wire_float(self.logprob)
            payload["top"] = [[token, _wire_float(lp)] for token, lp in self.top_logprobs]
        return payload

    @classmethod
    def from_payload(cls, payload: object) -> Token:
        r = FieldReader("TOKEN", payload)
        index = r.integer("index", lo=0, hi=MAX_TOKEN_INDEX)
        token_id = r.integer("id", lo=0, hi=MAX_TOKEN_ID)
        text = r.text("text", max_chars=MAX_TOKEN_TEXT_CHARS)
        logprob = r.optional_number("logprob", lo=_MIN_LOGPROB, hi=0.0)
        top = r.array("top", max_items=MAX_TOP_LOGPROBS) or []
        r.finish()
        return cls(
            index=index,
            token_id=token_id,
            text=text,
            logprob=logprob,
            top_logprobs=tuple(_read_alternative(a) for a in top),
        )


_MIN_LOGPROB = -3.4e38  # a float32's range: the engine computes them as float32


def _read_alternative(value: object) -> tuple[int, float]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not isinstance(value[0], int)
        or isinstance(value[0], bool)
        or not 0 <= value[0] <= MAX_TOKEN_ID
        or not isinstance(value[1], float | int)
        or isinstance(value[1], bool)
        or not _MIN_LOGPROB <= value[1] <= 0.0
    ):
        raise InvalidField("TOKEN.top[] must be [token id, log-probability <= 0] pairs")
    return value[0], float(value[1])


@dataclass(frozen=True, slots=True, kw_only=True)
class End(Frame):
    """Server → client: the generation is over; nothing follows on this stream."""

    frame_type: ClassVar[FrameType] = FrameType.END

    reason: EndReason
    """Why it stopped."""
    prompt_tokens: int = 0
    """Tokens in the prompt as the model saw it."""
    completion_tokens: int = 0
    """Tokens generated."""
    text: str = ""
    """Text held back while it could have begun a stop sequence, released at the end."""
    cached_tokens: int = 0
    """Prompt tokens whose KV cells were reused from an earlier generation, not computed."""

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "reason": self.reason.value,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
        }
        if self.text:
            payload["text"] = self.text
        if self.cached_tokens:
            payload["cached_tokens"] = self.cached_tokens
        return payload

    @classmethod
    def from_payload(cls, payload: object) -> End:
        r = FieldReader("END", payload)
        reason = r.text("reason", max_chars=32)
        try:
            end_reason = EndReason(reason)
        except ValueError:
            raise InvalidField(f"END.reason {reason!r} is not a known reason") from None
        frame = cls(
            reason=end_reason,
            prompt_tokens=r.integer("prompt_tokens", lo=0, hi=MAX_TOKEN_INDEX, default=0),
            completion_tokens=r.integer("completion_tokens", lo=0, hi=MAX_TOKEN_INDEX, default=0),
            text=r.text("text", max_chars=MAX_STOP_CHARS * MAX_STOP_SEQUENCES, default=""),
            cached_tokens=r.integer("cached_tokens", lo=0, hi=MAX_TOKEN_INDEX, default=0),
        )
        r.finish()
        return frame


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(Frame):
    """Either direction: the request failed; nothing follows on this stream."""

    frame_type: ClassVar[FrameType] = FrameType.ERROR

    code: int
    """A stable :class:`~quicsrv_proto.errors.ErrorCode` value (unknown codes are kept as ints)."""
    message: str
    """Human-readable detail; never parse it."""
    retry_after_s: float | None = None
    """For ``overloaded`` and ``too_early``: when trying again makes sense."""

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.retry_after_s is not None:
            payload["retry_after_s"] = _wire_float(self.retry_after_s)
        return payload

    @classmethod
    def from_payload(cls, payload: object) -> Error:
        r = FieldReader("ERROR", payload)
        code = r.integer("code", lo=0, hi=0xFFFF)
        message = r.text("message", max_chars=MAX_ERROR_MESSAGE_CHARS)
        retry = r.number("retry_after_s", lo=0.0, hi=86400.0, default=-1.0)
        r.finish()
        return cls(code=code, message=message, retry_after_s=None if retry < 0 else retry)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeStream(Frame):
    """Client → server: continue a session after the last token index the client holds."""

    frame_type: ClassVar[FrameType] = FrameType.RESUME_STREAM

    session_id: bytes = field(repr=False)
    """The 128-bit session id."""
    last_index: int
    """Index of the last token the client holds; -1 if it holds none."""
    snapshot_hash: bytes = field(repr=False)
    """A CHECKPOINT hash of this session."""
    hash_index: int | None = None
    """The token index that hash names (a checkpoint's ``index``); None: ``last_index``.

    A client usually holds a few tokens past its latest checkpoint; naming the checkpoint lets
    the server verify it directly and still send only what follows ``last_index``.
    """

    @property
    def checkpoint_index(self) -> int:
        return self.last_index if self.hash_index is None else self.hash_index

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "session": self.session_id,
            "last_index": self.last_index,
            "hash": self.snapshot_hash,
        }
        if self.hash_index is not None:
            payload["hash_index"] = self.hash_index
        return payload

    @classmethod
    def from_payload(cls, payload: object) -> ResumeStream:
        r = FieldReader("RESUME_STREAM", payload)
        frame = cls(
            session_id=r.raw_bytes("session", length=SESSION_ID_BYTES),
            last_index=r.integer("last_index", lo=-1, hi=MAX_TOKEN_INDEX),
            snapshot_hash=r.raw_bytes("hash", length=SNAPSHOT_HASH_BYTES),
            hash_index=r.optional_integer("hash_index", lo=-1, hi=MAX_TOKEN_INDEX),
        )
        r.finish()
        if frame.checkpoint_index > frame.last_index:
            raise InvalidField("RESUME_STREAM.hash_index must not exceed last_index")
        return frame


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint(Frame):
    """Server → client: the state after token ``index`` is saved under ``snapshot_hash``."""

    frame_type: ClassVar[FrameType] = FrameType.CHECKPOINT

    session_id: bytes = field(repr=False)
    """The session this checkpoint belongs to."""
    index: int
    """Index of the last token covered; -1 before the first token."""
    snapshot_hash: bytes = field(repr=False)
    """Keyed MAC naming the snapshot; present it in RESUME_STREAM."""

    def to_payload(self) -> dict[str, Any]:
        return {"session": self.session_id, "index": self.index, "hash": self.snapshot_hash}

    @classmethod
    def from_payload(cls, payload: object) -> Checkpoint:
        r = FieldReader("CHECKPOINT", payload)
        frame = cls(
            session_id=r.raw_bytes("session", length=SESSION_ID_BYTES),
            index=r.integer("index", lo=-1, hi=MAX_TOKEN_INDEX),
            snapshot_hash=r.raw_bytes("hash", length=SNAPSHOT_HASH_BYTES),
        )
        r.finish()
        return frame


FRAME_CLASSES: dict[FrameType, type[Frame]] = {
    cls.frame_type: cls for cls in (Generate, Token, End, Error, ResumeStream, Checkpoint)
}
