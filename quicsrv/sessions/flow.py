"""How far a session's engine sequence may run ahead of what its reader acknowledged.

A reader that keeps up still has tokens it has not acknowledged: those the engine worker holds
to send several at once (up to the coalescing window), and those on the wire or waiting for a
delayed ACK (about a round trip plus the peer's ACK delay). A fixed allowance of
``max_tokens_ahead`` tokens is smaller than that once tokens per second × delay is large (a fast
model, a mobile round trip): the sequence then ran into its allowance and paused (its KV cells
captured, later restored) every few dozen tokens although nobody fell behind. Measured on 2
cores through a relay adding 150 ms each way: 4 pauses in 512 tokens.

So the allowance covers twice the tokens generated during that delay, as measured for this
reader: the generation's rate, and how long the reader takes to acknowledge a write. It grows
in power-of-two multiples of ``max_tokens_ahead`` (a stable number: each change is a message to
the worker), to at most :data:`MAX_AHEAD_FACTOR` times it, which bounds what a reader who went
away, or one that delays its ACKs on purpose, can cost.
"""

from __future__ import annotations

__all__ = ["MAX_AHEAD_FACTOR", "DeliveryMeter", "tokens_ahead"]

#: The allowance grows to at most this many times ``max_tokens_ahead``.
MAX_AHEAD_FACTOR = 8
#: Tokens, and running time, timed before the rate counts: less is noise.
_MIN_RATE_TOKENS = 4
_MIN_RATE_S = 0.05
#: Running time after which earlier tokens weigh half as much.
_RATE_MEMORY_S = 2.0


def tokens_ahead(base: int, tokens_per_s: float, delay_s: float) -> int:
    """How many tokens past the acknowledged ones the engine may generate: ``base`` doubled
    until it covers twice the tokens made in ``delay_s``, at most ``MAX_AHEAD_FACTOR × base``."""
    wanted = 2.0 * tokens_per_s * delay_s
    ahead = max(1, base)
    while ahead < wanted and ahead < MAX_AHEAD_FACTOR * base:
        ahead *= 2
    return ahead


class DeliveryMeter:
    """One session's generation rate and its reader's acknowledgement delay (on the loop)."""

    __slots__ = ("_last", "_seconds", "_tokens", "ack_delay_s", "tokens_per_s")

    def __init__(self) -> None:
        self._last: tuple[float, int] | None = None  # the run's latest (time, tokens held)
        self._tokens = 0.0  # generated while the engine ran, recently (decaying)
        self._seconds = 0.0  # ...and the running time they took
        self.tokens_per_s = 0.0
        """Tokens per second while the engine runs (0 until a few tokens were timed)."""
        self.ack_delay_s = 0.0
        """From a write to its acknowledgement: smoothed, but up at once to a longer one."""

    def run_started(self) -> None:
        """The engine (re)starts the sequence: the time until its first token is no decoding
        time (prefill, or a restore), nor is the time it was paused."""
        self._last = None

    def recorded(self, tokens: int, now: float) -> None:
        """The session holds ``tokens`` tokens at ``now``."""
        last = self._last
        self._last = (now, tokens)
        if last is None or now <= last[0] or tokens <= last[1]:
            return
        if self._seconds > _RATE_MEMORY_S:  # older runs count less and less
            self._tokens /= 2
            self._seconds /= 2
        self._tokens += tokens - last[1]
        self._seconds += now - last[0]
        if self._tokens >= _MIN_RATE_TOKENS and self._seconds >= _MIN_RATE_S:
            self.tokens_per_s = self._tokens / self._seconds

    def acknowledged(self, written_at: float, now: float) -> None:
        """A write made at ``written_at`` was acknowledged at ``now``. An underestimate costs a
        pause and a restore, an overestimate a few tokens of allowance: rise at once, decay
        like a smoothed round-trip time (RFC 9002 §5.3)."""
        sample = now - written_at
        self.ack_delay_s = max(sample, 0.875 * self.ack_delay_s + 0.125 * sample)
