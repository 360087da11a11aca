"""The frame codec: header + CBOR payload, and an incremental decoder.

Wire layout of one frame (all integers big-endian)::

    +--------+---------+----------------+------+----------------------+
    | "LLM\\0" | version | payload length | type | CBOR payload          |
    | 4 bytes | 1 byte  | 4 bytes (u32)  | 1 B  | `payload length` bytes |
    +--------+---------+----------------+------+----------------------+

This is the only module that touches cbor2. Payloads are encoded canonically (RFC 8949 §4.2.1),
so equal frames always encode to equal bytes — the snapshot MAC relies on that.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import cbor2

from .errors import (
    BadMagic,
    FrameTooLarge,
    MalformedPayload,
    ProtocolError,
    TruncatedFrame,
    UnknownFrameType,
    UnsupportedVersion,
)
from .frames import FRAME_CLASSES, Frame, FrameType

__all__ = [
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "HEADER_SIZE",
    "MAGIC",
    "VERSION",
    "FrameDecoder",
    "canonical_cbor",
    "decode_frames",
    "encode_frame",
]

MAGIC = b"LLM\x00"
VERSION = 1
_HEADER = struct.Struct(">4sBIB")
HEADER_SIZE = _HEADER.size
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 20


def canonical_cbor(value: Any) -> bytes:
    """Canonical CBOR of a plain value (maps, arrays, text, bytes, ints, floats, bools)."""
    return cbor2.dumps(value, canonical=True)


def encode_frame(frame: Frame) -> bytes:
    """The complete wire bytes of one frame."""
    payload = canonical_cbor(frame.to_payload())
    return _HEADER.pack(MAGIC, VERSION, len(payload), frame.frame_type) + payload


def _refuse_tags(*_: object) -> object:
    # No frame field is tagged; accepting tags would let a peer make cbor2 build arbitrary
    # objects (datetimes, decimals, big numbers) that no validator expects.
    raise MalformedPayload("CBOR tags are not allowed in frames")


class _EveryTag(Mapping[int, Callable[..., object]]):
    """A semantic-decoder table that claims every tag number for :func:`_refuse_tags`.

    cbor2 calls ``tag_hook`` only for tags it has no decoder of its own for; its built-in ones
    (bignums, datetimes, sets, shared references, ...) run unless this table overrides them, and
    a fixed list of tag numbers would silently miss those a newer cbor2 learns.
    """

    def __getitem__(self, tag: int) -> Callable[..., object]:
        return _refuse_tags

    def __iter__(self) -> Iterator[int]:
        return iter(())

    def __len__(self) -> int:
        return 0


_EVERY_TAG = _EveryTag()


def _decode_payload(frame_type: FrameType, payload: bytes) -> Frame:
    stream = io.BytesIO(payload)
    try:
        decoder = cbor2.CBORDecoder(stream, tag_hook=_refuse_tags, semantic_decoders=_EVERY_TAG)
        value = decoder.decode()
    except ProtocolError:
        raise
    except Exception as exc:  # cbor2 raises several types for bad input, none of them ours
        if isinstance(exc.__cause__, ProtocolError):  # cbor2 wraps what a tag decoder raises
            raise exc.__cause__ from None
        raise MalformedPayload(f"payload is not valid CBOR: {exc}") from None
    if stream.tell() != len(payload):
        raise MalformedPayload("payload has trailing bytes after the CBOR item")
    return FRAME_CLASSES[frame_type].from_payload(value)


class FrameDecoder:
    """Turns a byte stream, fed in chunks of any size, into frames.

    The declared payload length is checked against ``max_payload_bytes`` as soon as the header is
    complete, before any payload byte is kept. After a :class:`ProtocolError` the stream cannot be
    re-synchronised, so the decoder refuses further input with the same error.
    """

    def __init__(self, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        self._max_payload_bytes = max_payload_bytes
        self._buffer = bytearray()
        self._failed: ProtocolError | None = None

    @property
    def buffered_bytes(self) -> int:
        """Bytes held that do not yet form a whole frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[Frame]:
        """Add bytes; return every frame they complete, in order."""
        if self._failed is not None:
            raise self._failed
        self._buffer += data
        try:
            return list(self._drain())
        except ProtocolError as exc:
            self._failed = exc
            self._buffer.clear()
            raise

    def end_of_stream(self) -> None:
        """The peer finished sending; raise if a frame was left incomplete."""
        if self._failed is not None:
            raise self._failed
        if self._buffer:
            raise TruncatedFrame(f"stream ended inside a frame ({len(self._buffer)} bytes left)")

    def _drain(self) -> Iterator[Frame]:
        while True:
            self._check_prefix()
            if len(self._buffer) < HEADER_SIZE:
                return
            _, _, length, type_byte = _HEADER.unpack_from(self._buffer)
            if len(self._buffer) < HEADER_SIZE + length:
                return
            payload = bytes(self._buffer[HEADER_SIZE : HEADER_SIZE + length])
            del self._buffer[: HEADER_SIZE + length]
            yield _decode_payload(FrameType(type_byte), payload)

    def _check_prefix(self) -> None:
        """Validate as much of the header as has arrived, so garbage fails at its first byte."""
        head = bytes(self._buffer[:HEADER_SIZE])
        magic = head[:4]
        if magic != MAGIC[: len(magic)]:
            raise BadMagic(f"bad magic {magic!r}, expected {MAGIC!r}")
        if len(head) > 4 and head[4] != VERSION:
            raise UnsupportedVersion(
                f"protocol version {head[4]} is not supported (want {VERSION})"
            )
        if len(head) >= 9:
            (length,) = struct.unpack_from(">I", head, 5)
            if length > self._max_payload_bytes:
                raise FrameTooLarge(
                    f"declared payload of {length} bytes exceeds the limit of "
                    f"{self._max_payload_bytes}"
                )
        if len(head) >= HEADER_SIZE:
            type_byte = head[9]
            if type_byte not in FRAME_CLASSES:
                raise UnknownFrameType(f"unknown frame type {type_byte}")


def decode_frames(
    data: bytes, *, max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
) -> list[Frame]:
    """Decode a complete byte string holding whole frames only."""
    decoder = FrameDecoder(max_payload_bytes=max_payload_bytes)
    frames = decoder.feed(data)
    decoder.end_of_stream()
    return frames
