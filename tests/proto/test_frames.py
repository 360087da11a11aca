"""Frame types: exact round trips, canonical encoding, and field validation with wire codes."""

from __future__ import annotations

import ast
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quicsrv_proto
from quicsrv_proto import (
    HEADER_SIZE,
    MAGIC,
    MAX_MAX_TOKENS,
    VERSION,
    ChatMessage,
    End,
    EndReason,
    Error,
    ErrorCode,
    Frame,
    FrameType,
    Generate,
    InvalidField,
    MalformedPayload,
    MissingField,
    ProtocolError,
    UnknownField,
    decode_frames,
    encode_frame,
    http_status_for,
)
from quicsrv_proto.frames import (
    FRAME_CLASSES,
    MAX_ERROR_MESSAGE_CHARS,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_TOKEN_TEXT_CHARS,
)

from .strategies import FRAME_STRATEGIES, HEADER, frames, raw_map_frame

SESSION = b"\x11" * 16
HASH = b"\x22" * 32

#: A minimal valid payload of every frame type; the rejection tests break one thing at a time.
VALID_PAYLOADS: dict[FrameType, dict[str, Any]] = {
    FrameType.GENERATE: {"prompt": "hi", "max_tokens": 4},
    FrameType.TOKEN: {"index": 0, "id": 1, "text": "a"},
    FrameType.END: {"reason": "eos"},
    FrameType.ERROR: {"code": 30, "message": "busy"},
    FrameType.RESUME_STREAM: {"session": SESSION, "last_index": -1, "hash": HASH},
    FrameType.CHECKPOINT: {"session": SESSION, "index": 0, "hash": HASH},
}


def decode_payload(frame_type: FrameType, payload: Any) -> Frame:
    (frame,) = decode_frames(raw_map_frame(payload, frame_type=frame_type))
    return frame


def with_fields(frame_type: FrameType, **changes: Any) -> dict[str, Any]:
    """The valid payload of ``frame_type`` with fields changed (a value of ... removes it)."""
    payload = dict(VALID_PAYLOADS[frame_type])
    for key, value in changes.items():
        if value is ...:
            del payload[key]
        else:
            payload[key] = value
    return payload


def assert_rejected(
    frame_type: FrameType, payload: Any, error: type[ProtocolError], code: ErrorCode
) -> ProtocolError:
    with pytest.raises(error) as caught:
        decode_payload(frame_type, payload)
    assert caught.value.error_code is code
    return caught.value


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("frame_class", list(FRAME_STRATEGIES), ids=lambda c: c.__name__)
def test_every_frame_class_has_a_strategy_and_a_type(frame_class: type[Frame]) -> None:
    assert FRAME_CLASSES[frame_class.frame_type] is frame_class
    assert set(FRAME_STRATEGIES) == set(FRAME_CLASSES.values())


@pytest.mark.parametrize("frame_class", list(FRAME_STRATEGIES), ids=lambda c: c.__name__)
@settings(max_examples=60)
@given(data=st.data())
def test_decode_is_the_exact_inverse_of_encode(
    frame_class: type[Frame], data: st.DataObject
) -> None:
    frame = data.draw(FRAME_STRATEGIES[frame_class])
    decoded = decode_frames(encode_frame(frame))
    assert decoded == [frame]
    assert type(decoded[0]) is frame_class


@settings(max_examples=200)
@given(frame=frames)
def test_encoding_is_deterministic_and_canonical(frame: Frame) -> None:
    wire = encode_frame(frame)
    assert encode_frame(frame) == wire
    assert encode_frame(dataclasses.replace(frame)) == wire
    # Decoding and re-encoding reproduces the bytes: the encoding is a function of the value.
    (decoded,) = decode_frames(wire)
    assert encode_frame(decoded) == wire


@settings(max_examples=100)
@given(frame=frames)
def test_header_describes_the_payload(frame: Frame) -> None:
    wire = encode_frame(frame)
    magic, version, length, frame_type = HEADER.unpack_from(wire)
    assert (magic, version, frame_type) == (MAGIC, VERSION, frame.frame_type)
    assert length == len(wire) - HEADER_SIZE


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (Generate(prompt="x", temperature=1), Generate(prompt="x", temperature=1.0)),
        (Generate(prompt="x", top_p=1), Generate(prompt="x", top_p=1.0)),
        (Generate(prompt="x", repeat_penalty=2), Generate(prompt="x", repeat_penalty=2.0)),
        (Generate(prompt="x", min_p=-0.0), Generate(prompt="x", min_p=0.0)),
        (
            Error(code=30, message="", retry_after_s=3),
            Error(code=30, message="", retry_after_s=3.0),
        ),
        (
            Error(code=30, message="", retry_after_s=-0.0),
            Error(code=30, message="", retry_after_s=0.0),
        ),
    ],
)
def test_equal_frames_encode_to_equal_bytes(left: Frame, right: Frame) -> None:
    # The snapshot MAC is computed over encodings, so == must imply equal bytes.
    assert left == right
    assert encode_frame(left) == encode_frame(right)


def test_defaults_are_left_out_of_the_payload() -> None:
    wire = encode_frame(Generate(prompt="x"))
    assert wire == encode_frame(Generate(prompt="x", temperature=0.0, top_p=1.0, stop=()))
    assert b"temperature" not in wire
    assert b"seed" not in wire
    assert b"temperature" in encode_frame(Generate(prompt="x", temperature=0.5))


def test_error_without_retry_after_decodes_to_none() -> None:
    frame = decode_payload(FrameType.ERROR, {"code": 999, "message": "?"})
    assert frame == Error(code=999, message="?", retry_after_s=None)


def test_end_counts_default_to_zero() -> None:
    assert decode_payload(FrameType.END, {"reason": "stop"}) == End(reason=EndReason.STOP)


# --- boundaries that must be accepted ------------------------------------------------------


@pytest.mark.parametrize(
    ("frame_type", "payload"),
    [
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, max_tokens=1)),
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, max_tokens=MAX_MAX_TOKENS)),
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, prompt="x" * MAX_PROMPT_CHARS)),
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, prompt="")),
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, seed=MAX_SEED)),
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, seed=None)),
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, temperature=0)),
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, temperature=100.0)),
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, top_p=5e-324)),
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, stop=["s"] * MAX_STOP_SEQUENCES)),
        (FrameType.GENERATE, with_fields(FrameType.GENERATE, stop=["s" * MAX_STOP_CHARS])),
        (
            FrameType.GENERATE,
            with_fields(
                FrameType.GENERATE,
                prompt=...,
                messages=[{"role": "user", "content": "c"}] * MAX_MESSAGES,
            ),
        ),
        (FrameType.TOKEN, with_fields(FrameType.TOKEN, text="t" * MAX_TOKEN_TEXT_CHARS)),
        (FrameType.ERROR, with_fields(FrameType.ERROR, message="m" * MAX_ERROR_MESSAGE_CHARS)),
        (FrameType.ERROR, with_fields(FrameType.ERROR, retry_after_s=0)),
        (FrameType.RESUME_STREAM, with_fields(FrameType.RESUME_STREAM, last_index=-1)),
    ],
)
def test_boundary_values_are_accepted(frame_type: FrameType, payload: dict[str, Any]) -> None:
    frame = decode_payload(frame_type, payload)
    assert type(frame) is FRAME_CLASSES[frame_type]


def test_messages_decode_to_a_tuple_of_chat_messages() -> None:
    payload = {
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        "max_tokens": 2,
    }
    frame = decode_payload(FrameType.GENERATE, payload)
    assert isinstance(frame, Generate)
    assert frame.prompt is None
    assert frame.messages == (
        ChatMessage(role="system", content="s"),
        ChatMessage(role="user", content="u"),
    )


# --- rejections ----------------------------------------------------------------------------

G = FrameType.GENERATE
MISSING = (MissingField, ErrorCode.MISSING_FIELD)
UNKNOWN = (UnknownField, ErrorCode.UNKNOWN_FIELD)
INVALID = (InvalidField, ErrorCode.INVALID_FIELD)
MALFORMED = (MalformedPayload, ErrorCode.MALFORMED_PAYLOAD)
USER = {"role": "user", "content": "c"}

REJECTIONS: list[tuple[str, FrameType, Any, tuple[type[ProtocolError], ErrorCode]]] = [
    # missing fields
    ("generate without max_tokens", G, with_fields(G, max_tokens=...), MISSING),
    ("generate without prompt or messages", G, with_fields(G, prompt=...), MISSING),
    ("token without text", FrameType.TOKEN, with_fields(FrameType.TOKEN, text=...), MISSING),
    ("token without id", FrameType.TOKEN, with_fields(FrameType.TOKEN, id=...), MISSING),
    ("end without reason", FrameType.END, {}, MISSING),
    ("error without code", FrameType.ERROR, with_fields(FrameType.ERROR, code=...), MISSING),
    (
        "resume without hash",
        FrameType.RESUME_STREAM,
        with_fields(FrameType.RESUME_STREAM, hash=...),
        MISSING,
    ),
    (
        "checkpoint without session",
        FrameType.CHECKPOINT,
        with_fields(FrameType.CHECKPOINT, session=...),
        MISSING,
    ),
    ("message without content", G, {"messages": [{"role": "user"}], "max_tokens": 1}, MISSING),
    # unknown fields
    ("generate with unknown key", G, with_fields(G, best_of=2), UNKNOWN),
    (
        "token with unknown key",
        FrameType.TOKEN,
        with_fields(FrameType.TOKEN, confidence=0.1),
        UNKNOWN,
    ),
    ("end with unknown key", FrameType.END, with_fields(FrameType.END, why="x"), UNKNOWN),
    (
        "message with unknown key",
        G,
        {"messages": [{**USER, "name": "bob"}], "max_tokens": 1},
        UNKNOWN,
    ),
    # wrong types
    ("bool as max_tokens", G, with_fields(G, max_tokens=True), INVALID),
    ("str as max_tokens", G, with_fields(G, max_tokens="4"), INVALID),
    ("float as max_tokens", G, with_fields(G, max_tokens=4.0), INVALID),
    ("null as max_tokens", G, with_fields(G, max_tokens=None), INVALID),
    ("bool as temperature", G, with_fields(G, temperature=False), INVALID),
    ("str as temperature", G, with_fields(G, temperature="0.5"), INVALID),
    ("int as prompt", G, with_fields(G, prompt=5), INVALID),
    ("bytes as prompt", G, with_fields(G, prompt=b"hi"), INVALID),
    ("int as ignore_eos", G, with_fields(G, ignore_eos=1), INVALID),
    ("bool as seed", G, with_fields(G, seed=True), INVALID),
    ("map as messages", G, {"messages": {"role": "user"}, "max_tokens": 1}, INVALID),
    ("str as stop", G, with_fields(G, stop="\n"), INVALID),
    ("int in stop", G, with_fields(G, stop=[1]), INVALID),
    ("list as message", G, {"messages": [["user", "c"]], "max_tokens": 1}, MALFORMED),
    ("bool as token index", FrameType.TOKEN, with_fields(FrameType.TOKEN, index=False), INVALID),
    ("bytes as token text", FrameType.TOKEN, with_fields(FrameType.TOKEN, text=b"a"), INVALID),
    ("int as end reason", FrameType.END, {"reason": 1}, INVALID),
    ("str as error code", FrameType.ERROR, with_fields(FrameType.ERROR, code="30"), INVALID),
    (
        "str as session id",
        FrameType.RESUME_STREAM,
        with_fields(FrameType.RESUME_STREAM, session="x" * 16),
        INVALID,
    ),
    # out of range
    ("max_tokens 0", G, with_fields(G, max_tokens=0), INVALID),
    ("max_tokens too big", G, with_fields(G, max_tokens=MAX_MAX_TOKENS + 1), INVALID),
    ("negative max_tokens", G, with_fields(G, max_tokens=-1), INVALID),
    ("negative temperature", G, with_fields(G, temperature=-0.1), INVALID),
    ("huge temperature", G, with_fields(G, temperature=100.5), INVALID),
    ("NaN temperature", G, with_fields(G, temperature=math.nan), INVALID),
    ("infinite temperature", G, with_fields(G, temperature=math.inf), INVALID),
    ("-inf min_p", G, with_fields(G, min_p=-math.inf), INVALID),
    ("NaN top_p", G, with_fields(G, top_p=math.nan), INVALID),
    ("top_p 0", G, with_fields(G, top_p=0.0), INVALID),
    ("top_p above 1", G, with_fields(G, top_p=1.01), INVALID),
    ("min_p above 1", G, with_fields(G, min_p=1.5), INVALID),
    ("repeat_penalty 0", G, with_fields(G, repeat_penalty=0), INVALID),
    ("negative top_k", G, with_fields(G, top_k=-1), INVALID),
    ("negative seed", G, with_fields(G, seed=-1), INVALID),
    ("prompt too long", G, with_fields(G, prompt="x" * (MAX_PROMPT_CHARS + 1)), INVALID),
    (
        "role not allowed",
        G,
        {"messages": [{"role": "robot", "content": "c"}], "max_tokens": 1},
        INVALID,
    ),
    (
        "role too long",
        G,
        {"messages": [{"role": "u" * 17, "content": "c"}], "max_tokens": 1},
        INVALID,
    ),
    ("both prompt and messages", G, with_fields(G, messages=[USER]), INVALID),
    ("empty messages", G, {"messages": [], "max_tokens": 1}, INVALID),
    ("too many messages", G, {"messages": [USER] * (MAX_MESSAGES + 1), "max_tokens": 1}, INVALID),
    ("too many stops", G, with_fields(G, stop=["s"] * (MAX_STOP_SEQUENCES + 1)), INVALID),
    ("empty stop string", G, with_fields(G, stop=[""]), INVALID),
    ("stop string too long", G, with_fields(G, stop=["s" * (MAX_STOP_CHARS + 1)]), INVALID),
    ("negative token index", FrameType.TOKEN, with_fields(FrameType.TOKEN, index=-1), INVALID),
    ("token id too big", FrameType.TOKEN, with_fields(FrameType.TOKEN, id=1 << 31), INVALID),
    (
        "token text too long",
        FrameType.TOKEN,
        with_fields(FrameType.TOKEN, text="t" * (MAX_TOKEN_TEXT_CHARS + 1)),
        INVALID,
    ),
    ("unknown end reason", FrameType.END, {"reason": "bored"}, INVALID),
    ("negative end count", FrameType.END, {"reason": "eos", "prompt_tokens": -1}, INVALID),
    ("error code too big", FrameType.ERROR, with_fields(FrameType.ERROR, code=0x10000), INVALID),
    (
        "negative retry_after_s",
        FrameType.ERROR,
        with_fields(FrameType.ERROR, retry_after_s=-1.0),
        INVALID,
    ),
    (
        "retry_after_s beyond a day",
        FrameType.ERROR,
        with_fields(FrameType.ERROR, retry_after_s=86401),
        INVALID,
    ),
    (
        "short session id",
        FrameType.RESUME_STREAM,
        with_fields(FrameType.RESUME_STREAM, session=b"\x00" * 15),
        INVALID,
    ),
    (
        "long snapshot hash",
        FrameType.CHECKPOINT,
        with_fields(FrameType.CHECKPOINT, hash=b"\x00" * 33),
        INVALID,
    ),
    (
        "last_index below -1",
        FrameType.RESUME_STREAM,
        with_fields(FrameType.RESUME_STREAM, last_index=-2),
        INVALID,
    ),
    # not a map
    ("array payload", G, ["hi", 4], MALFORMED),
    ("text payload", FrameType.TOKEN, "a", MALFORMED),
    ("null payload", FrameType.END, None, MALFORMED),
    ("non-text keys", FrameType.TOKEN, {0: 0, 1: 1, 2: "a"}, MALFORMED),
]


@pytest.mark.parametrize(
    ("frame_type", "payload", "expected"),
    [case[1:] for case in REJECTIONS],
    ids=[case[0] for case in REJECTIONS],
)
def test_invalid_payloads_are_rejected_with_their_code(
    frame_type: FrameType,
    payload: Any,
    expected: tuple[type[ProtocolError], ErrorCode],
) -> None:
    error, code = expected
    exc = assert_rejected(frame_type, payload, error, code)
    assert exc.message  # every rejection says what was wrong


@pytest.mark.parametrize(
    ("frame", "error"),
    [
        (Generate(), MissingField),
        (Generate(prompt="p", messages=(ChatMessage(role="user", content="c"),)), InvalidField),
        (Generate(messages=()), InvalidField),
        (Generate(prompt="p", max_tokens=0), InvalidField),
        (Generate(prompt="p", temperature=math.nan), InvalidField),
        (Generate(prompt="p", stop=("a",) * (MAX_STOP_SEQUENCES + 1)), InvalidField),
    ],
)
def test_the_decoder_refuses_invalid_frames_the_encoder_can_build(
    frame: Frame, error: type[ProtocolError]
) -> None:
    # Frames are not validated on construction; the receiving side is where it counts.
    with pytest.raises(error):
        decode_frames(encode_frame(frame))


# --- error codes ---------------------------------------------------------------------------


def test_error_codes_are_unique() -> None:
    assert len(ErrorCode.__members__) == len(list(ErrorCode))


def test_each_protocol_error_class_has_its_own_code() -> None:
    classes = [
        c
        for name in quicsrv_proto.__all__
        if isinstance(c := getattr(quicsrv_proto, name), type) and issubclass(c, ProtocolError)
    ]
    subclasses = [c for c in classes if c is not ProtocolError]
    assert len(subclasses) == 10
    assert len({c.error_code for c in subclasses}) == len(subclasses)
    for cls in subclasses:
        assert cls.error_code.slug == cls.error_code.name.lower()
        assert cls.error_code.slug in repr(cls("why"))


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (ErrorCode.BAD_MAGIC, 400),
        (ErrorCode.INVALID_FIELD, 400),
        (ErrorCode.UNEXPECTED_FRAME, 400),
        (ErrorCode.FRAME_TOO_LARGE, 413),
        (ErrorCode.PROMPT_TOO_LONG, 413),
        (ErrorCode.NOT_FOUND, 404),
        (ErrorCode.METHOD_NOT_ALLOWED, 405),
        (ErrorCode.OVERLOADED, 503),
        (ErrorCode.SHUTTING_DOWN, 503),
        (ErrorCode.TOO_EARLY, 425),
        (ErrorCode.UNKNOWN_SESSION, 404),
        (ErrorCode.SESSION_EXPIRED, 410),
        (ErrorCode.HASH_MISMATCH, 403),
        (ErrorCode.INDEX_BEYOND_SNAPSHOT, 416),
        (ErrorCode.MODEL_CHANGED, 409),
        (ErrorCode.SESSION_BUSY, 409),
        (ErrorCode.INTERNAL_ERROR, 500),
        (ErrorCode.ENGINE_UNAVAILABLE, 503),
        (ErrorCode.CLIENT_LIMIT, 429),
        (ErrorCode.DEADLINE_EXCEEDED, 504),
        (ErrorCode.SESSION_KEY_MISMATCH, 403),
        (ErrorCode.UNAUTHORIZED, 401),
    ],
)
def test_http_status_for_each_code(code: ErrorCode, status: int) -> None:
    assert http_status_for(code) == status
    assert http_status_for(int(code)) == status


@pytest.mark.parametrize("code", [0, 11, 999, 0xFFFF, -1])
def test_http_status_for_unknown_codes_is_400(code: int) -> None:
    assert http_status_for(code) == 400


def test_http_status_is_an_error_status_for_every_code() -> None:
    for code in ErrorCode:
        status = http_status_for(code)
        assert 400 <= status <= 599
        # Our own faults are the only 5xx besides capacity (a full queue, or one too slow for
        # the request's deadline) and shutdown.
        if status >= 500:
            assert code in {
                ErrorCode.INTERNAL_ERROR,
                ErrorCode.ENGINE_UNAVAILABLE,
                ErrorCode.STORE_UNAVAILABLE,
                ErrorCode.OVERLOADED,
                ErrorCode.DEADLINE_EXCEEDED,
                ErrorCode.SHUTTING_DOWN,
            }


# --- sans-I/O ------------------------------------------------------------------------------

PROTO_DIR = Path(quicsrv_proto.__file__).parent
FORBIDDEN = {"asyncio", "socket", "time", "datetime"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return {name.partition(".")[0] for name in names}


def test_proto_has_modules_to_check() -> None:
    assert {"codec.py", "frames.py", "errors.py"} <= {p.name for p in PROTO_DIR.glob("*.py")}


@pytest.mark.parametrize("path", sorted(PROTO_DIR.glob("*.py")), ids=lambda p: p.name)
def test_proto_imports_no_event_loop_socket_or_clock(path: Path) -> None:
    assert imported_modules(path) & FORBIDDEN == set()


@pytest.mark.parametrize("path", sorted(PROTO_DIR.glob("*.py")), ids=lambda p: p.name)
def test_only_the_codec_touches_cbor2(path: Path) -> None:
    assert ("cbor2" in imported_modules(path)) == (path.name == "codec.py")


def test_the_import_checker_sees_imports() -> None:
    # Guard against a checker that would pass on anything.
    sample = PROTO_DIR / "codec.py"
    assert {"struct", "io", "cbor2"} <= imported_modules(sample)
