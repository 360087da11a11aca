"""Token sequences as bytes: the log codec both stores write, and the digests that name them.

A generated token is 4 little-endian bytes everywhere it is kept: a file store's ``.tokens`` log,
a shared store's ``APPEND``-ed value, and what :class:`TokenChain` hashes for the checkpoint MACs.
A session that asked for log-probabilities keeps them in the same log, each token's entry
followed by its own (float32) and ``top`` (id, float32) pairs (:class:`LogprobLog`): one append
per token, durable before the token is sent, like the token itself.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Iterable, Iterator

import blake3

from quicsrv_proto import canonical_cbor

from ..engine import TokenLogprobs

__all__ = [
    "TOKEN_BYTES",
    "LogprobLog",
    "TokenChain",
    "digest_tokens",
    "entry_bytes",
    "pack_entry",
    "pack_token",
    "unpack_log",
    "unpack_tokens",
]

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


_LOGPROB = struct.Struct("<f")
_ALTERNATIVE = struct.Struct("<If")


def entry_bytes(top: int | None) -> int:
    """Bytes a token's entry takes in a log whose tokens keep ``top`` alternatives (None: no
    log-probabilities)."""
    return TOKEN_BYTES if top is None else TOKEN_BYTES + _LOGPROB.size + top * _ALTERNATIVE.size


class LogprobLog:
    """The log-probabilities of a session's generated tokens, ``top`` alternatives each, packed
    (a float32 and ``top`` pairs a token: a list of objects would cost ~20 times more)."""

    __slots__ = ("_ids", "_values", "top")

    def __init__(self, top: int) -> None:
        self.top = top
        self._values = array("f")  # a token's own log-probability, then its alternatives'
        self._ids = array("I")  # its alternatives' ids

    def __len__(self) -> int:
        return len(self._values) // (1 + self.top)

    def __iter__(self) -> Iterator[TokenLogprobs]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, index: int) -> TokenLogprobs:
        top = self.top
        values = self._values[index * (1 + top) : (index + 1) * (1 + top)]
        if not values:
            raise IndexError(index)
        ids = self._ids[index * top : (index + 1) * top]
        return TokenLogprobs(values[0], tuple(zip(ids, values[1:], strict=True)))

    def append(self, logprobs: TokenLogprobs | None) -> None:
        """Keep a token's (as :func:`pack_entry` takes them)."""
        logprobs = _complete(logprobs, self.top)
        self._values.append(logprobs.logprob)
        for token, logprob in logprobs.top:
            self._ids.append(token)
            self._values.append(logprob)


def pack_entry(token: int, top: int | None, logprobs: TokenLogprobs | None) -> bytes:
    """One token's entry in a log whose tokens keep ``top`` alternatives (None: the token
    alone)."""
    if top is None:
        return _TOKEN.pack(token)
    kept = _complete(logprobs, top)
    parts = [_TOKEN.pack(token), _LOGPROB.pack(kept.logprob)]
    parts.extend(_ALTERNATIVE.pack(i, lp) for i, lp in kept.top)
    return b"".join(parts)


def _complete(logprobs: TokenLogprobs | None, top: int) -> TokenLogprobs:
    """``logprobs`` as a log keeps them: where an engine did not compute them (None, or not
    ``top`` alternatives), NaNs, which the APIs answer as unknown."""
    if logprobs is None or len(logprobs.top) != top:
        return TokenLogprobs(math.nan, tuple((0, math.nan) for _ in range(top)))
    return logprobs


def unpack_log(raw: bytes, top: int | None) -> tuple[array[int], LogprobLog | None]:
    """A log of entries packed by :func:`pack_entry` read back; a torn last entry is dropped."""
    if top is None:
        return unpack_tokens(raw), None
    size = entry_bytes(top)
    tokens: array[int] = array("I")
    log = LogprobLog(top)
    for start in range(0, len(raw) - size + 1, size):
        tokens.append(_TOKEN.unpack_from(raw, start)[0])
        (own,) = _LOGPROB.unpack_from(raw, start + TOKEN_BYTES)
        at = start + TOKEN_BYTES + _LOGPROB.size
        pairs = tuple(_ALTERNATIVE.unpack_from(raw, at + k * _ALTERNATIVE.size) for k in range(top))
        log.append(TokenLogprobs(own, pairs))
    return tokens, log


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
