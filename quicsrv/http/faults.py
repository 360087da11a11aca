"""Test faults of the front door: a stream whose connection drops mid-answer, on demand.

A browser test cannot cut an established HTTP/3 stream from the outside (DevTools' offline
emulation does not), so the server can: :meth:`StreamFaults.cut_next` arms the next streamed
answers to drop their connection after a number of body writes, as a network that goes away
would (HTTP/3: the QUIC connection is closed; TCP: the connection is aborted). Nothing arms it
unless a test asks; it costs one attribute read per streamed answer.
"""

from __future__ import annotations

from collections import deque

__all__ = ["StreamFaults"]


class StreamFaults:
    def __init__(self) -> None:
        self._cuts: deque[int] = deque()
        self.cuts_made = 0
        """Streams armed with a cut so far."""

    def cut_next(self, after_writes: int, *, streams: int = 1) -> None:
        """Drop the connection of each of the next ``streams`` streamed answers after
        ``after_writes`` body writes (an SSE event or a burst of them is one write)."""
        if after_writes < 1:
            raise ValueError("after_writes must be at least 1")
        self._cuts.extend([after_writes] * streams)

    def take(self) -> int | None:
        """The cut for the streamed answer now starting, if one is armed."""
        if not self._cuts:
            return None
        self.cuts_made += 1
        return self._cuts.popleft()
