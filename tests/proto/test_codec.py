"""The frame decoder: chunking at every split point, and framing/CBOR-level rejections."""

from __future__ import annotations

import struct

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quicsrv_proto import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    BadMagic,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameTooLarge,
    FrameType,
    MalformedPayload,
    ProtocolError,
    Token,
    TruncatedFrame,
    UnknownFrameType,
    UnsupportedVersion,
    decode_frames,
    encode_frame,
)

from .strategies import frames, one_of_each, raw_frame

SAMPLE = one_of_each()
SAMPLE_WIRE = b"".join(encode_frame(f) for f in SAMPLE)
VALID_GENERATE = cbor2.dumps({"prompt": "hi", "max_tokens": 4})


def feed_all(chunks: list[bytes], **options: int) -> list[Frame]:
    decoder = FrameDecoder(**options)
    out: list[Frame] = []
    for chunk in chunks:
        out += decoder.feed(chunk)
    decoder.end_of_stream()
    return out


def test_header_is_ten_bytes() -> None:
    assert HEADER_SIZE == struct.calcsize(">4sBIB") == 10
    assert MAGIC == b"LLM\x00"
    assert VERSION == 1


def test_the_sample_holds_every_frame_type() -> None:
    assert {f.frame_type for f in SAMPLE} == set(FrameType)
    assert decode_frames(SAMPLE_WIRE) == SAMPLE


# --- chunking ------------------------------------------------------------------------------


def test_every_split_point_gives_the_same_frames() -> None:
    for i in range(len(SAMPLE_WIRE) + 1):
        assert feed_all([SAMPLE_WIRE[:i], SAMPLE_WIRE[i:]]) == SAMPLE, f"split at {i}"


def test_every_pair_of_split_points_in_one_frame_gives_the_same_frame() -> None:
    wire = encode_frame(SAMPLE[0])
    for i in range(len(wire) + 1):
        for j in range(i, len(wire) + 1):
            assert feed_all([wire[:i], wire[i:j], wire[j:]]) == [SAMPLE[0]], f"split {i}, {j}"


def test_one_byte_at_a_time_yields_each_frame_at_its_last_byte() -> None:
    ends: list[int] = []
    offset = 0
    for frame in SAMPLE:
        offset += len(encode_frame(frame))
        ends.append(offset - 1)

    decoder = FrameDecoder()
    got: list[Frame] = []
    for i in range(len(SAMPLE_WIRE)):
        new = decoder.feed(SAMPLE_WIRE[i : i + 1])
        if i in ends:
            assert len(new) == 1, f"byte {i} completes a frame"
            assert decoder.buffered_bytes == 0
        else:
            assert new == [], f"byte {i} completes nothing"
            assert decoder.buffered_bytes > 0
        got += new
    decoder.end_of_stream()
    assert got == SAMPLE


def test_many_frames_in_one_chunk() -> None:
    tokens = [Token(index=i, token_id=i * 7, text=f"t{i}") for i in range(2000)]
    wire = b"".join(encode_frame(t) for t in tokens)
    decoder = FrameDecoder()
    assert decoder.feed(wire) == tokens
    assert decoder.buffered_bytes == 0


def test_empty_feeds_are_harmless() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(b"") == []
    decoder.end_of_stream()
    assert feed_all([b"", SAMPLE_WIRE[:5], b"", SAMPLE_WIRE[5:], b""]) == SAMPLE


def test_a_partial_frame_is_held_until_complete() -> None:
    wire = encode_frame(SAMPLE[2])
    decoder = FrameDecoder()
    assert decoder.feed(wire[:-1]) == []
    assert decoder.buffered_bytes == len(wire) - 1
    assert decoder.feed(wire[-1:]) == [SAMPLE[2]]
    assert decoder.buffered_bytes == 0


@settings(max_examples=100)
@given(
    frame_list=st.lists(frames, min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0), max_size=8),
)
def test_any_chunking_of_any_frames_decodes_the_same(
    frame_list: list[Frame], cuts: list[int]
) -> None:
    wire = b"".join(encode_frame(f) for f in frame_list)
    points = sorted({c % (len(wire) + 1) for c in cuts})
    chunks = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    assert b"".join(chunks) == wire
    assert feed_all(chunks) == frame_list


@settings(max_examples=25)
@given(frame_list=st.lists(frames, min_size=2, max_size=3))
def test_every_split_point_of_random_frames(frame_list: list[Frame]) -> None:
    wire = b"".join(encode_frame(f) for f in frame_list)
    for i in range(len(wire) + 1):
        assert feed_all([wire[:i], wire[i:]]) == frame_list


# --- framing errors ------------------------------------------------------------------------


def assert_feed_fails(
    decoder: FrameDecoder, data: bytes, error: type[ProtocolError], code: ErrorCode
) -> ProtocolError:
    with pytest.raises(error) as caught:
        decoder.feed(data)
    assert caught.value.error_code is code
    assert decoder.buffered_bytes == 0
    return caught.value


@pytest.mark.parametrize("position", range(4))
def test_bad_magic_fails_at_the_first_bad_byte(position: int) -> None:
    decoder = FrameDecoder()
    assert decoder.feed(MAGIC[:position]) == []
    bad = bytes([MAGIC[position] ^ 0xFF])
    assert_feed_fails(decoder, bad, BadMagic, ErrorCode.BAD_MAGIC)


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n", b"\x00", b"llm\x00", b"\x16\x03\x01"])
def test_non_frame_bytes_are_bad_magic(garbage: bytes) -> None:
    assert_feed_fails(FrameDecoder(), garbage, BadMagic, ErrorCode.BAD_MAGIC)


def test_bad_magic_in_a_later_frame() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(encode_frame(SAMPLE[2])) == [SAMPLE[2]]
    assert decoder.feed(b"LL") == []
    assert_feed_fails(decoder, b"X", BadMagic, ErrorCode.BAD_MAGIC)


@pytest.mark.parametrize("version", [0, 2, 255])
def test_wrong_version_fails_at_the_version_byte(version: int) -> None:
    decoder = FrameDecoder()
    assert decoder.feed(MAGIC) == []
    assert_feed_fails(decoder, bytes([version]), UnsupportedVersion, ErrorCode.UNSUPPORTED_VERSION)


@pytest.mark.parametrize("frame_type", [0, 7, 8, 128, 255])
def test_unknown_frame_type_fails_before_its_payload(frame_type: int) -> None:
    header = raw_frame(VALID_GENERATE, frame_type=frame_type)[:HEADER_SIZE]
    decoder = FrameDecoder()
    assert decoder.feed(header[:-1]) == []
    assert_feed_fails(decoder, header[-1:], UnknownFrameType, ErrorCode.UNKNOWN_FRAME_TYPE)


def test_oversized_length_fails_on_the_header_alone() -> None:
    header = raw_frame(b"", length=DEFAULT_MAX_PAYLOAD_BYTES + 1)
    assert len(header) == HEADER_SIZE
    assert_feed_fails(FrameDecoder(), header, FrameTooLarge, ErrorCode.FRAME_TOO_LARGE)


def test_oversized_length_fails_before_the_type_byte() -> None:
    header = raw_frame(b"", length=0xFFFFFFFF)
    decoder = FrameDecoder()
    assert decoder.feed(header[:8]) == []
    assert_feed_fails(decoder, header[8:9], FrameTooLarge, ErrorCode.FRAME_TOO_LARGE)


def test_the_payload_limit_is_inclusive_and_configurable() -> None:
    payload = cbor2.dumps({"index": 0, "id": 1, "text": "x" * 40})
    limit = len(payload)
    frame = raw_frame(payload, frame_type=FrameType.TOKEN)
    assert feed_all([frame], max_payload_bytes=limit) == [Token(index=0, token_id=1, text="x" * 40)]
    assert_feed_fails(
        FrameDecoder(max_payload_bytes=limit - 1), frame, FrameTooLarge, ErrorCode.FRAME_TOO_LARGE
    )
    with pytest.raises(FrameTooLarge):
        decode_frames(frame, max_payload_bytes=limit - 1)


def test_a_frame_at_the_default_limit_is_held_not_refused() -> None:
    decoder = FrameDecoder()
    header = raw_frame(b"", length=DEFAULT_MAX_PAYLOAD_BYTES)
    assert decoder.feed(header) == []
    assert decoder.buffered_bytes == HEADER_SIZE


@pytest.mark.parametrize("cut", range(1, len(SAMPLE_WIRE)))
def test_a_stream_ending_inside_a_frame_is_truncated(cut: int) -> None:
    decoder = FrameDecoder()
    decoder.feed(SAMPLE_WIRE[:cut])
    boundaries = {0}
    for frame in SAMPLE:
        boundaries.add(max(boundaries) + len(encode_frame(frame)))
    if cut in boundaries:
        decoder.end_of_stream()  # a stream may end between frames
        return
    with pytest.raises(TruncatedFrame) as caught:
        decoder.end_of_stream()
    assert caught.value.error_code is ErrorCode.TRUNCATED_FRAME


def test_decode_frames_refuses_a_trailing_partial_frame() -> None:
    with pytest.raises(TruncatedFrame):
        decode_frames(SAMPLE_WIRE + MAGIC)


# --- CBOR-level errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # no item at all
        b"\xff",  # a lone break
        b"\xa1",  # a map that never gets its entry
        b"\xa2\x61a\x01",  # a map one entry short
        b"\x7f\x61a",  # an unterminated indefinite text string
        b"\x62\xc3\x28",  # text that is not UTF-8
        b"\x1c",  # reserved additional information
        b"\xa1\x61a\x1b\x00",  # an 8-byte integer cut short
    ],
    ids=lambda p: p.hex() or "empty",
)
def test_malformed_cbor_is_malformed_payload(payload: bytes) -> None:
    assert_feed_fails(
        FrameDecoder(), raw_frame(payload), MalformedPayload, ErrorCode.MALFORMED_PAYLOAD
    )


@pytest.mark.parametrize("extra", [b"\x00", b"\xa0", b"\xff", VALID_GENERATE])
def test_trailing_bytes_after_the_payload_item(extra: bytes) -> None:
    assert decode_frames(raw_frame(VALID_GENERATE))  # the item alone is fine
    assert_feed_fails(
        FrameDecoder(),
        raw_frame(VALID_GENERATE + extra),
        MalformedPayload,
        ErrorCode.MALFORMED_PAYLOAD,
    )


@pytest.mark.parametrize("payload", [[1, 2], "hi", 5, None, True, b"\xa0", 1.5])
def test_a_payload_that_is_not_a_map(payload: object) -> None:
    assert_feed_fails(
        FrameDecoder(),
        raw_frame(cbor2.dumps(payload)),
        MalformedPayload,
        ErrorCode.MALFORMED_PAYLOAD,
    )


# Tags cbor2 decodes itself (datetimes, bignums, decimals, sets, shared references, ...) as well
# as tags it does not know: all of them must be refused the same way.
TAG_NUMBERS = [0, 1, 2, 3, 4, 5, 25, 28, 29, 30, 35, 36, 37, 52, 54, 100, 256, 258, 260, 261]
TAG_NUMBERS += [1004, 43000, 55799, 6, 27, 999, 2**32, 2**64 - 1]


def tagged(tag: int, value: bytes) -> bytes:
    """CBOR head of major type 6 for ``tag``, followed by the encoded ``value``."""
    return cbor2.dumps(cbor2.CBORTag(tag, None))[:-1] + value


def test_tagged_helper_builds_a_tag_head() -> None:
    assert tagged(2, b"\x41\x05") == b"\xc2\x41\x05"
    assert tagged(55799, b"\xa0") == b"\xd9\xd9\xf7\xa0"


@pytest.mark.parametrize("tag", TAG_NUMBERS)
@pytest.mark.parametrize(
    "value",
    [b"\x41\x05", b"\x05", b"\x64\x31\x32\x33\x34", b"\x82\x01\x02"],
    ids=["bytes", "int", "text", "array"],
)
def test_a_tagged_field_value_is_refused(tag: int, value: bytes) -> None:
    # {"prompt": "hi", "max_tokens": tag(value)} — with tag 2 and b"\x05" a bignum 5.
    payload = b"\xa2" + cbor2.dumps("prompt") + cbor2.dumps("hi")
    payload += cbor2.dumps("max_tokens") + tagged(tag, value)
    assert_feed_fails(
        FrameDecoder(), raw_frame(payload), MalformedPayload, ErrorCode.MALFORMED_PAYLOAD
    )


@pytest.mark.parametrize("tag", TAG_NUMBERS)
def test_a_tagged_payload_map_is_refused(tag: int) -> None:
    exc = assert_feed_fails(
        FrameDecoder(),
        raw_frame(tagged(tag, VALID_GENERATE)),
        MalformedPayload,
        ErrorCode.MALFORMED_PAYLOAD,
    )
    assert "tags are not allowed" in exc.message


@settings(max_examples=100)
@given(tag=st.integers(0, 2**64 - 1))
def test_any_tag_number_is_refused(tag: int) -> None:
    # {"index": 0, "id": 1, "text": tag("a")}
    payload = b"\xa3" + cbor2.dumps("index") + b"\x00" + cbor2.dumps("id") + b"\x01"
    payload += cbor2.dumps("text") + tagged(tag, cbor2.dumps("a"))
    with pytest.raises(MalformedPayload):
        decode_frames(raw_frame(payload, frame_type=FrameType.TOKEN))


def test_a_bignum_too_large_for_a_float_is_refused_as_a_tag() -> None:
    # 10**400 as a bignum: converting it to float would raise OverflowError, not ProtocolError.
    payload = cbor2.dumps({"prompt": "x", "max_tokens": 1, "temperature": 10**400})
    assert b"\xc2" in payload
    with pytest.raises(MalformedPayload):
        decode_frames(raw_frame(payload))


# --- after an error ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (b"X", BadMagic),
        (raw_frame(b"", length=DEFAULT_MAX_PAYLOAD_BYTES + 1), FrameTooLarge),
        (raw_frame(b"\xff"), MalformedPayload),
        (raw_frame(VALID_GENERATE, frame_type=99), UnknownFrameType),
    ],
)
def test_after_an_error_the_decoder_keeps_refusing(bad: bytes, error: type[ProtocolError]) -> None:
    decoder = FrameDecoder()
    with pytest.raises(error) as first:
        decoder.feed(bad)
    code = first.value.error_code
    for data in (encode_frame(SAMPLE[2]), b"", SAMPLE_WIRE):
        with pytest.raises(error) as again:
            decoder.feed(data)
        assert again.value.error_code is code
        assert decoder.buffered_bytes == 0
    with pytest.raises(error):
        decoder.end_of_stream()


def test_frames_before_an_error_in_an_earlier_chunk_are_delivered() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(encode_frame(SAMPLE[2])) == [SAMPLE[2]]
    with pytest.raises(MalformedPayload):
        decoder.feed(raw_frame(b"\xff"))
