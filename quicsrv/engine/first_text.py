"""Whether a sequence's tokens so far show its reader any text.

As the server's text stream decodes them (UTF-8, ``errors="replace"``): a first token with no
text of its own (an end-of-generation token under ``ignore_eos``, a special token, the first
bytes of a character) is no first token to its reader, who sees the next one. What waits for
a reader's first text must wait for that one (:mod:`.coalescing`, and the engine's step:
:mod:`.llama`).
"""

from __future__ import annotations

import codecs

__all__ = ["FirstText"]


class FirstText:
    """Fed a sequence's pieces in order until its text shows (``shown``)."""

    __slots__ = ("_decoder", "shown")

    def __init__(self, *, shown: bool = False) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.shown = shown

    def feed(self, piece: bytes) -> bool:
        """Whether ``piece`` is the one with which the text shows (only once)."""
        if self.shown or not self._decoder.decode(piece):
            return False
        self.shown = True
        return True
