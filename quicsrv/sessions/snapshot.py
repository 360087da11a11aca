"""Snapshots of decoder state and the keyed MAC that names them.

A snapshot holds everything needed to continue a generation exactly: the prompt tokens, the
sampling parameters and seed (with the counter-based draw, that plus the token history *is* the
sampler state), the tokens generated so far, the KV offset and the model's digest.

The hash given to clients for token index ``i`` is a keyed BLAKE3 MAC over the canonical CBOR of
the snapshot *prefix* ending at ``i``. So an older checkpoint hash of a session stays valid: it
verifies the prefix it names, which is all a client resuming from ``i`` needs.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import blake3

from proto import canonical_cbor

from ..engine import SamplingParams

__all__ = ["MAC_BYTES", "Snapshot", "digest_tokens"]

MAC_BYTES = 32


def digest_tokens(tokens: tuple[int, ...] | list[int]) -> bytes:
    """A content digest of a token sequence (not keyed: it names, it does not authenticate)."""
    return blake3.blake3(canonical_cbor(list(tokens))).digest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Snapshot:
    session_id: bytes
    model_digest: bytes
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool
    prefill_chunk: int
    generated: tuple[int, ...]
    created_at_s: float
    expires_at_s: float

    @property
    def last_index(self) -> int:
        """Index of the last generated token held; -1 before the first."""
        return len(self.generated) - 1

    @property
    def n_past(self) -> int:
        """KV cells the sequence occupies: every token fed to the model so far."""
        # The last generated token is sampled but not yet decoded.
        return len(self.prompt_tokens) + max(len(self.generated) - 1, 0)

    def prefix_payload(self, index: int) -> dict[str, object]:
        """The canonical map a MAC for token ``index`` covers."""
        if not -1 <= index <= self.last_index:
            raise ValueError(f"index {index} outside the snapshot (last {self.last_index})")
        s = self.sampling
        return {
            "v": 1,
            "session": self.session_id,
            "model": self.model_digest,
            "prompt": digest_tokens(self.prompt_tokens),
            "sampling": [s.temperature, s.top_p, s.top_k, s.min_p, s.repeat_penalty, s.seed],
            "max_tokens": self.max_tokens,
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
            "chunk": self.prefill_chunk,
            "index": index,
            "tokens": digest_tokens(self.generated[: index + 1]),
        }

    def mac(self, key: bytes, index: int) -> bytes:
        """The keyed BLAKE3 MAC naming this snapshot's prefix up to ``index``."""
        return blake3.blake3(canonical_cbor(self.prefix_payload(index)), key=key).digest(MAC_BYTES)

    def verify(self, keys: list[bytes], index: int, presented: bytes) -> bool:
        """Whether ``presented`` is the MAC of the prefix up to ``index`` under any live key."""
        if not -1 <= index <= self.last_index:
            return False
        ok = False
        for key in keys:
            # Check every key, and compare in constant time, so timing says nothing.
            ok |= hmac.compare_digest(self.mac(key, index), presented)
        return ok
