"""What one reader holds, and how far the engine may run ahead of it. Pure: time is passed in.

A reader is sent a session's frames in writes, each ending at some token index and some stream
offset; the transport says how many bytes the peer acknowledged without a gap. From those alone
:class:`ReaderFlow` answers what the reader holds (the tokens of every write acknowledged to its
last byte), whether it is blocked (its unacknowledged bytes reached the high watermark and have
not drained to the low one since), how many tokens the engine may have generated in all (the
allowance: :mod:`.flow`'s tokens ahead past what the reader holds), and whether a paused
sequence has room enough to restart.
"""

from __future__ import annotations

from collections import deque

from .flow import DeliveryMeter, tokens_ahead
from .settings import FlowSettings

__all__ = ["ALLOWANCE_STEPS", "ReaderFlow"]

#: The engine's allowance advances in steps of the tokens ahead / ALLOWANCE_STEPS.
ALLOWANCE_STEPS = 4


class ReaderFlow:
    """One reader's position in a session's frames and the engine's allowance it leads to."""

    __slots__ = ("_pending", "_settings", "acked_tokens", "blocked", "delivery", "next_index")

    def __init__(self, settings: FlowSettings, from_index: int) -> None:
        self._settings = settings
        self.next_index = from_index
        """The next token index to send."""
        self.acked_tokens = from_index
        """Tokens ``[0, acked_tokens)`` the reader holds or acknowledged."""
        self.blocked = False
        """Its unacknowledged bytes reached the high watermark, and not yet drained to the low."""
        self.delivery = DeliveryMeter()
        """The generation's rate and this reader's acknowledgement delay (:mod:`.flow`)."""
        # (tokens, stream offset, when written) of each write not yet acknowledged
        self._pending: deque[tuple[int, int, float]] = deque()

    def wrote(self, upto: int, offset: int, now: float) -> None:
        """The tokens before ``upto`` were written at ``now``, the write ending at stream byte
        ``offset``."""
        self.next_index = upto
        self._pending.append((upto, offset, now))

    def acknowledged(self, acked: int, sent: int, now: float) -> None:
        """At ``now`` the peer had acknowledged the stream's bytes up to ``acked`` of the
        ``sent`` written."""
        pending = self._pending
        written_at = None  # of the newest write this acknowledgement covers
        while pending and pending[0][1] <= acked:
            self.acked_tokens, _, written_at = pending.popleft()
        if written_at is not None:
            self.delivery.acknowledged(written_at, now)
        unacked = sent - acked
        if unacked >= self._settings.high_watermark_bytes:
            self.blocked = True
        elif unacked <= self._settings.low_watermark_bytes:
            self.blocked = False

    def tokens_ahead(self) -> int:
        """How many tokens past those the reader holds the engine may generate (:mod:`.flow`)."""
        delivery = self.delivery
        delay_s = self._settings.coalesce_s + delivery.ack_delay_s
        return tokens_ahead(self._settings.max_tokens_ahead, delivery.tokens_per_s, delay_s)

    def allowance(self, generated: int) -> int:
        """How many tokens the engine may have generated in all, ``generated`` having been."""
        if self.blocked:
            return generated  # pause at the next step
        # Moves in quarter-allowance steps, not per acknowledged token: with an engine worker
        # every change is a message that wakes it (and a thread here) mid-decode. A reader
        # keeping up still has 3/4 of the tokens ahead as headroom at the least.
        ahead = self.tokens_ahead()
        step = max(1, ahead // ALLOWANCE_STEPS)
        return (self.acked_tokens + ahead) // step * step

    def has_room(self, generated: int) -> bool:
        """Whether a paused sequence that generated ``generated`` tokens may restart now."""
        # Hysteresis: only once the reader has caught up by half the tokens ahead, so a slow
        # reader costs one restore per half allowance rather than one per token.
        room = self.allowance(generated) - generated
        return room >= max(1, self.tokens_ahead() // 2)
