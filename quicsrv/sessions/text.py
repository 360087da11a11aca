"""Token pieces in, text deltas out: UTF-8 safe, with stop sequences held back until decided.

A pure function of the token sequence: the same pieces always yield the same deltas, which is
what lets a resumed stream rebuild the state at any index and continue byte-identically.
"""

from __future__ import annotations

import codecs

__all__ = ["TextAssembler"]


class TextAssembler:
    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text not yet released: it may be the start of a stop sequence
        self.stopped = False
        self.matched: str | None = None
        """The stop sequence that ended the text (the first listed of those found earliest)."""

    def push(self, piece: bytes) -> str:
        """The text one token releases; sets ``stopped`` when a stop sequence matched."""
        if self.stopped:
            return ""
        self._held += self._utf8.decode(piece)
        held = self._held
        hits = [held.find(s) for s in self._stop if s in held]
        if hits:
            first = min(hits)
            self._held = ""
            self.stopped = True
            self.matched = next(s for s in self._stop if held.find(s) == first)
            return held[:first]
        keep = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(held)), 0, -1):
                if held.endswith(stop[:length]):
                    keep = max(keep, length)
                    break
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep]

    def finish(self) -> str:
        """Whatever is still held back, released at the end of the generation."""
        if self.stopped:
            return ""
        tail = self._held + self._utf8.decode(b"", final=True)
        self._held = ""
        return tail
