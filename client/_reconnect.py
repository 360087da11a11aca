"""When and how often a generation reconnects by itself after its connection is lost."""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["ReconnectPolicy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconnectPolicy:
    """How a :class:`~client.Generation` reconnects and resumes after a connection loss."""

    max_attempts: int = 12
    """Consecutive reconnect attempts without a new token before giving up. The defaults ride
    out at least 26 s of pauses (53 s without jitter), plus each attempt's connect timeout:
    a server restart is the old process's hand-over (up to ``shutdown_grace_s``, 5 s by
    default) and the new one's start (about 3 s here: Python, model load, canary)."""
    initial_delay_s: float = 0.05
    max_delay_s: float = 10.0
    """Backoff doubles from ``initial_delay_s`` up to this, each delay jittered down to half."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not 0 < self.initial_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < initial_delay_s <= max_delay_s")

    def delay_s(self, attempt: int) -> float:
        """The pause before reconnect attempt ``attempt`` (1-based): backoff with jitter."""
        ceiling = min(self.max_delay_s, self.initial_delay_s * 2 ** (attempt - 1))
        return float(ceiling * random.uniform(0.5, 1.0))
