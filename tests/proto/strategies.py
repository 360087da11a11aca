"""Hypothesis strategies for every frame type, and hand-built wire bytes for malformed input."""

from __future__ import annotations

import struct
from typing import Any

import cbor2
from hypothesis import strategies as st

from quicsrv_proto import (
    MAGIC,
    VERSION,
    ChatMessage,
    Checkpoint,
    End,
    EndReason,
    Error,
    Frame,
    Generate,
    ResumeStream,
    Token,
    Truncation,
)
from quicsrv_proto.frames import (
    CHAT_ROLES,
    MAX_DEADLINE_MS,
    MAX_MAX_TOKENS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TOKEN_ID,
    MAX_TOKEN_INDEX,
    MAX_TOP_LOGPROBS,
    SESSION_ID_BYTES,
    SNAPSHOT_HASH_BYTES,
)

# The wire header, spelled out independently of quicsrv_proto.codec so a codec bug cannot hide here.
HEADER = struct.Struct(">4sBIB")

# Short texts keep the examples fast; the length limits get their own boundary tests.
short_text = st.text(max_size=24)


def raw_frame(
    payload: bytes,
    *,
    frame_type: int = 1,
    magic: bytes = MAGIC,
    version: int = VERSION,
    length: int | None = None,
) -> bytes:
    """A frame built by hand: header (with any field overridden) + the given payload bytes."""
    declared = len(payload) if length is None else length
    return HEADER.pack(magic, version, declared, frame_type) + payload


def raw_map_frame(payload: Any, *, frame_type: int = 1) -> bytes:
    """A frame whose payload is ``payload`` in plain (non-canonical) CBOR."""
    return raw_frame(cbor2.dumps(payload), frame_type=frame_type)


chat_messages = st.builds(ChatMessage, role=st.sampled_from(sorted(CHAT_ROLES)), content=short_text)


@st.composite
def generates(draw: st.DrawFn) -> Generate:
    if draw(st.booleans()):
        source: dict[str, Any] = {"prompt": draw(short_text)}
    else:
        source = {
            "messages": tuple(draw(st.lists(chat_messages, min_size=1, max_size=4))),
            "truncation": draw(st.sampled_from(Truncation)),
        }
    return Generate(
        **source,
        max_tokens=draw(st.integers(1, MAX_MAX_TOKENS)),
        temperature=draw(st.floats(0.0, 100.0)),
        top_p=draw(st.floats(0.0, 1.0, exclude_min=True)),
        top_k=draw(st.integers(0, MAX_TOKEN_ID)),
        min_p=draw(st.floats(0.0, 1.0)),
        repeat_penalty=draw(st.floats(0.0, 10.0, exclude_min=True)),
        seed=draw(st.none() | st.integers(0, MAX_SEED)),
        stop=tuple(
            draw(
                st.lists(st.text(min_size=1, max_size=MAX_STOP_CHARS), max_size=MAX_STOP_SEQUENCES)
            )
        ),
        ignore_eos=draw(st.booleans()),
        deadline_ms=draw(st.none() | st.integers(1, MAX_DEADLINE_MS)),
        logprobs=draw(st.none() | st.integers(0, MAX_TOP_LOGPROBS)),
        score_prompt=draw(st.booleans()),
    )


logprobs = st.floats(-(2.0**100), 0.0, width=32)


@st.composite
def tokens(draw: st.DrawFn) -> Token:
    logprob = draw(st.none() | logprobs)
    top = ()
    if logprob is not None:
        pair = st.tuples(st.integers(0, MAX_TOKEN_ID), logprobs)
        top = tuple(draw(st.lists(pair, max_size=MAX_TOP_LOGPROBS)))
    return Token(
        index=draw(st.integers(0, MAX_TOKEN_INDEX)),
        token_id=draw(st.integers(0, MAX_TOKEN_ID)),
        text=draw(short_text),
        logprob=logprob,
        top_logprobs=top,
    )


ends = st.builds(
    End,
    reason=st.sampled_from(EndReason),
    prompt_tokens=st.integers(0, MAX_TOKEN_INDEX),
    completion_tokens=st.integers(0, MAX_TOKEN_INDEX),
)

errors = st.builds(
    Error,
    code=st.integers(0, 0xFFFF),
    message=short_text,
    retry_after_s=st.none() | st.floats(0.0, 86400.0),
)

session_ids = st.binary(min_size=SESSION_ID_BYTES, max_size=SESSION_ID_BYTES)
snapshot_hashes = st.binary(min_size=SNAPSHOT_HASH_BYTES, max_size=SNAPSHOT_HASH_BYTES)


@st.composite
def resume_streams(draw: st.DrawFn) -> ResumeStream:
    last_index = draw(st.integers(-1, MAX_TOKEN_INDEX))
    return ResumeStream(
        session_id=draw(session_ids),
        last_index=last_index,
        snapshot_hash=draw(snapshot_hashes),
        hash_index=draw(st.none() | st.integers(-1, last_index)),
    )


checkpoints = st.builds(
    Checkpoint,
    session_id=session_ids,
    index=st.integers(-1, MAX_TOKEN_INDEX),
    snapshot_hash=snapshot_hashes,
)

FRAME_STRATEGIES: dict[type[Frame], st.SearchStrategy[Any]] = {
    Generate: generates(),
    Token: tokens(),
    End: ends,
    Error: errors,
    ResumeStream: resume_streams(),
    Checkpoint: checkpoints,
}

frames: st.SearchStrategy[Frame] = st.one_of(*FRAME_STRATEGIES.values())


def one_of_each() -> list[Frame]:
    """A fixed, valid frame of every type (for exhaustive split-point tests)."""
    return [
        Generate(
            messages=(
                ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content="héllo ✓"),
            ),
            max_tokens=7,
            temperature=0.7,
            seed=42,
            stop=("\n\n",),
        ),
        Generate(prompt="Once upon a time", max_tokens=3),
        Token(index=0, token_id=9906, text="Hello"),
        Token(index=1, token_id=0, text=""),
        Token(index=2, token_id=5, text="x", logprob=-0.5, top_logprobs=((5, -0.5), (6, -1.25))),
        Checkpoint(session_id=b"\x01" * 16, index=1, snapshot_hash=b"\x02" * 32),
        ResumeStream(session_id=b"\x01" * 16, last_index=-1, snapshot_hash=b"\x03" * 32),
        End(reason=EndReason.LENGTH, prompt_tokens=4, completion_tokens=2),
        Error(code=30, message="overloaded", retry_after_s=1.5),
    ]
