"""Snapshots of decoder state and the keyed MAC that names them.

A snapshot holds everything needed to continue a generation exactly: the prompt tokens, the
sampling parameters and seed (with the counter-based draw, that plus the token history *is* the
sampler state), the tokens generated so far, the KV offset and the model's digest.

The hash given to clients for token index ``i`` is a keyed BLAKE3 MAC over the canonical CBOR of
the snapshot *prefix* ending at ``i``. So an older checkpoint hash of a session stays valid: it
verifies the prefix it names, which is all a client resuming from ``i`` needs.

The prefix's tokens enter the MAC as a digest that can be extended one token at a time
(:class:`TokenChain`, format v2), so a running session signs a checkpoint in the time of the
tokens since the last one (:class:`PrefixSigner`), not of its whole history. Format v1 (a digest
of the tokens' CBOR array, which cannot be extended) is still verified, so checkpoints issued
before v2 stay valid.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass

import blake3

from quicsrv_proto import canonical_cbor

from .spec import GenerationSpec
from .tokens import TokenChain, digest_tokens

__all__ = ["MAC_BYTES", "PrefixSigner", "Snapshot"]

MAC_BYTES = 32


def _mac(key: bytes, header: dict[str, object], index: int, tokens_digest: bytes) -> bytes:
    payload = {**header, "index": index, "tokens": tokens_digest}
    return blake3.blake3(canonical_cbor(payload), key=key).digest(MAC_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    session_id: bytes
    model_digest: bytes
    spec: GenerationSpec
    """What the generation is: its prompt, sampling, limits and grammar."""
    generated: tuple[int, ...]
    created_at_s: float
    expires_at_s: float

    @property
    def last_index(self) -> int:
        """Index of the last generated token held; -1 before the first."""
        return len(self.generated) - 1

    def header(self, version: int = 2) -> dict[str, object]:
        """What every MAC of this session covers besides the index and the tokens."""
        return {
            "v": version,
            "session": self.session_id,
            "model": self.model_digest,
            **self.spec.mac_fields(),
        }

    def mac(self, key: bytes, index: int) -> bytes:
        """The keyed BLAKE3 MAC naming this snapshot's prefix up to ``index``."""
        self._check(index)
        return _mac(key, self.header(), index, TokenChain(self.generated[: index + 1]).digest())

    def verify(self, keys: list[bytes], index: int, presented: bytes) -> bool:
        """Whether ``presented`` is the MAC of the prefix up to ``index`` under any live key,
        in the current format or the one before."""
        if not -1 <= index <= self.last_index:
            return False
        prefix = self.generated[: index + 1]
        candidates = [
            (self.header(2), TokenChain(prefix).digest()),
            (self.header(1), digest_tokens(prefix)),
        ]
        ok = False
        for key in keys:
            for header, tokens_digest in candidates:
                # Check every key and format, each in constant time, so timing says nothing.
                ok |= hmac.compare_digest(_mac(key, header, index, tokens_digest), presented)
        return ok

    def _check(self, index: int) -> None:
        if not -1 <= index <= self.last_index:
            raise ValueError(f"index {index} outside the snapshot (last {self.last_index})")


class PrefixSigner:
    """Signs a growing session's checkpoints, each in the time of the tokens since the last.

    Keeps the MAC header (prompt digest included) computed once, a :class:`TokenChain` that
    follows the session's live token sequence, and the chain's digest at every ``every``-th
    token, so the checkpoints a resumed reader is replayed are signed without rehashing either.
    """

    def __init__(self, header: dict[str, object], tokens: Sequence[int], every: int) -> None:
        self._header = header
        self._tokens = tokens  # the session's own sequence, appended to by its owner
        self._every = every
        self._chain = TokenChain()
        self._marks: dict[int, bytes] = {-1: self._chain.digest()}
        self._catch_up()

    def mac(self, key: bytes, index: int) -> bytes:
        """The MAC of the prefix up to ``index`` (-1 .. the last token so far)."""
        self._catch_up()
        if not -1 <= index < len(self._chain):
            raise ValueError(f"index {index} outside the session (last {len(self._chain) - 1})")
        if index == len(self._chain) - 1:
            digest = self._chain.digest()
        else:
            digest = self._marks.get(index) or TokenChain(self._tokens[: index + 1]).digest()
        return _mac(key, self._header, index, digest)

    def _catch_up(self) -> None:
        for index in range(len(self._chain), len(self._tokens)):
            self._chain.append(self._tokens[index])
            if (index + 1) % self._every == 0:
                self._marks[index] = self._chain.digest()
