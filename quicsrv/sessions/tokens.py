"""Token sequences as bytes: the log codec both stores write, and the digests that name them.

A generated token is 4 little-endian bytes everywhere it is kept: a file store's ``.tokens`` log,
a shared store's ``APPEND``-ed value, and what :class:`TokenChain` hashes for the checkpoint MACs.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable

import blake3

from quicsrv_proto import canonical_cbor

__all__ = ["TOKEN_BYTES", "TokenChain", "digest_tokens", "pack_token", "unpack_tokens"]

_TOKEN = struct.Struct("<I")
TOKEN_BYTES = _TOKEN.size
"""Bytes a token takes in a log."""


def pack_token(token: int) -> bytes:
    """One token as a log holds it."""
    return _TOKEN.pack(token)


def unpack_tokens(raw: bytes) -> array[int]:
    """A log read back; a torn last write (fewer than 4 bytes) is dropped."""
    raw = raw[: len(raw) - len(raw) % TOKEN_BYTES]
    return array("I", (t for (t,) in _TOKEN.iter_unpack(raw)))


def digest_tokens(tokens: tuple[int, ...] | list[int]) -> bytes:
    """A content digest of a token sequence (not keyed: it names, it does not authenticate)."""
    return blake3.blake3(canonical_cbor(list(tokens))).digest()


class TokenChain:
    """A running digest of a token sequence: BLAKE3 over each token as 4 little-endian bytes.

    Unlike :func:`digest_tokens` it grows with the sequence: ``append`` costs one token, and the
    digest of what is there so far is a copy away.
    """

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self._hasher = blake3.blake3()
        self._length = 0
        self.extend(tokens)

    def __len__(self) -> int:
        return self._length

    def append(self, token: int) -> None:
        self._hasher.update(token.to_bytes(4, "little"))
        self._length += 1

    def extend(self, tokens: Iterable[int]) -> None:
        packed = array("I", tokens)
        if sys.byteorder != "little":
            packed.byteswap()
        self._hasher.update(packed.tobytes())
        self._length += len(packed)

    def digest(self) -> bytes:
        return self._hasher.copy().digest()
