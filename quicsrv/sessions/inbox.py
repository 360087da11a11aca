"""Engine events to the event loop: one wake-up per burst, not one per token.

The engine delivers a decode step's events (a token for each of up to ``n_seq_max`` sequences)
back to back from its own thread. ``call_soon_threadsafe`` per event would wake the loop once
per token, each wake-up a write to its self-pipe and a trip through the selector, on a machine
whose cores llama.cpp is using. Posting through one inbox per loop schedules a single drain for
everything that arrives before the loop gets to it, so a step's tokens are handled, and their
frames written and transmitted, in one loop iteration.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["LoopInbox"]


class LoopInbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        """Make it on ``loop``'s thread."""
        self.loop = loop
        self._loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._items: deque[tuple[Callable[..., None], tuple[object, ...]]] = deque()
        self._scheduled = False
        self.wakeups = 0  # drains scheduled (stats, benchmarks)
        self.posted = 0

    def post(self, callback: Callable[..., None], *args: object) -> None:
        """Run ``callback(*args)`` on the loop, after everything posted before it (any thread)."""
        with self._lock:
            self._items.append((callback, args))
            self.posted += 1
            if self._scheduled:
                return
            self._scheduled = True
            self.wakeups += 1
        if threading.get_ident() == self._loop_thread:
            self.loop.call_soon(self._drain)  # already awake: no self-pipe write
            return
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the server is gone, nobody to tell
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for callback, args in items:
            try:
                callback(*args)
            except Exception as exc:  # as call_soon would: report it, and go on with the rest
                self.loop.call_exception_handler(
                    {"message": f"exception in {callback!r}", "exception": exc}
                )
