"""When the engine worker sends its finished decode steps to the server.

Every message the worker sends wakes the server's event loop, which then frames, encrypts and
sends a datagram that wakes the client: on two cores those wake-ups are taken from llama.cpp's
own threads, and at one stream they were most of what the server and the client cost per token
(measured: ``python -m loadtest.bench.cpu``, README "Token coalescing"). So tokens may wait up
to ``window_s`` in the worker to share one message, one datagram and one client wake-up with the
next ones. What someone waits on never waits: a sequence's first tokens up to the first that
shows text (time to first token, and a resume's first token), a finish, a pause, a resume. The
window bounds the wait: steps are sent once the oldest held token would be older than the window
by the end of the next step. What must not wait does not wait for the rest of its step either: a
call's events go out before the step's next calls (a new prompt's, up to a second here) where
they hold any (:meth:`StepCoalescer.call_finished`).

"Shows text" as :mod:`.first_text` says: a first token with no text of its own is no first token
to its reader, who sees the next one. Held, that next one waited the window (measured: 2 of the
8 prompts of ``loadtest.bench.burst_ttft``'s burst start with ``<|im_end|>``, no text under
``ignore_eos``, then ``\n``; their first text reached the client ~100 ms after their first
token had reached the server).

Pure: the worker's engine thread feeds it steps and sends what it returns.
"""

from __future__ import annotations

from .first_text import FirstText
from .ipc import Event, SequenceFinished, SequencePaused, Step, TokenGenerated

__all__ = ["HEARTBEAT_S", "StepCoalescer"]

#: A step with no events is still proof of progress: one goes out at least this often while the
#: worker decodes (replays produce no events), far below any stall timeout.
HEARTBEAT_S = 0.1


class StepCoalescer:
    """Holds finished steps until they are due; ``window_s`` 0 sends every step at once."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._held: list[Step] = []
        self._oldest_at: float | None = None  # when the oldest held event was produced
        self._last_step_at: float | None = None
        self._last_sent_at = float("-inf")
        self._streaming: set[int] = set()  # sequences whose first text has left
        # Sequences whose tokens so far show no text (n_seq_max at most).
        self._textless: dict[int, FirstText] = {}

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def step_finished(self, step: Step) -> list[Step] | None:
        """Take the step that just ended; the steps to send now, or None to hold them."""
        now = step.finished_at
        step_s = 0.0 if self._last_step_at is None else now - self._last_step_at
        self._last_step_at = now
        self._hold(step)
        urgent = self._urgent(step.events)
        if self._window_s <= 0 or urgent:
            return self.flush(now) or [step]
        if self._oldest_at is not None:
            # The next step would take about as long as this one: send now if the oldest held
            # token would otherwise be older than the window by the time it ends.
            if now + step_s - self._oldest_at >= self._window_s:
                return self.flush(now)
            return None
        if now - self._last_sent_at >= HEARTBEAT_S:
            self._last_sent_at = now
            return [step]
        return None

    def call_finished(self, step: Step) -> list[Step] | None:
        """Take what one call of a step reported, more calls of the step to come: everything
        held and ``step``, if anything in it must not wait; else held for the step's end (which
        alone times the window, as a whole step)."""
        self._hold(step)
        if self._urgent(step.events) or (self._window_s <= 0 and step.events):
            return self.flush(step.finished_at)
        return None

    def send_now(self, step: Step) -> list[Step]:
        """Everything held and ``step`` (events from another thread that must not wait)."""
        self._urgent(step.events)
        return [*self.flush(step.finished_at), step]

    def flush(self, now: float) -> list[Step]:
        """Everything held, in order (also when something else must leave at once)."""
        held, self._held = self._held, []
        self._oldest_at = None
        self._last_sent_at = now
        return held

    def _hold(self, step: Step) -> None:
        if step.events:
            self._held.append(step)
            if self._oldest_at is None:
                self._oldest_at = step.finished_at

    def _urgent(self, events: tuple[Event, ...]) -> bool:
        urgent = False
        for event in events:
            if isinstance(event, TokenGenerated):
                if event.key not in self._streaming:
                    urgent = True
                    if self._shows_text(event.key, event.piece):
                        self._streaming.add(event.key)
            else:
                urgent = True
                if isinstance(event, SequenceFinished | SequencePaused):
                    self._streaming.discard(event.key)
                    self._textless.pop(event.key, None)
        return urgent

    def _shows_text(self, key: int, piece: bytes) -> bool:
        """Whether ``piece`` completes the first text of sequence ``key``'s tokens so far."""
        first = self._textless.pop(key, None) or FirstText()
        if first.feed(piece):
            return True
        self._textless[key] = first
        return False
