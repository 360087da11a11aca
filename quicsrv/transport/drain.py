"""The last step of a shutdown: which connections it still waits for, once every stream was
told END(shutdown). Pure: time is passed in.

By then every pause has landed (or its grace period ran out), and every record and KV blob is
where the next process reads them: what a stream's peer acknowledges changes nothing for its
session, whose record already covers every token the peer may hold. Waiting for the END frames'
acknowledgements only spares a live client the detour of a lost connection (END(shutdown) makes
it resume at once; a closed connection makes it reconnect first, then resume the same). So the
wait is for peers that answer: a peer that has left a packet unacknowledged, and sent nothing,
for :data:`QUIET_PROBE_TIMEOUTS` probe timeouts (a killed client, a network gone) is not waited
for at all, and one that went quiet before the shutdown is known at once; its streams are
ended, and its connection closed, with the others'.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "QUIET_PROBE_TIMEOUTS",
    "Drained",
    "PeerDrain",
    "QuietPeer",
    "silent_s",
    "still_waiting",
]

#: A peer that answered nothing for this many probe timeouts (RFC 9002 §6.2.1: its RTT, four
#: deviations and its ACK delay) after the END frames were sent has gone quiet. Three is the span
#: RFC 9000 §10.1 sets as the shortest idle timeout: a peer silent that long could have been
#: dropped by an idle timeout anyway. On loopback it is about 0.1 s; a live peer acknowledges
#: within one probe timeout (that is what a probe timeout bounds).
QUIET_PROBE_TIMEOUTS = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerDrain:
    """One connection at one moment, as the drain sees it."""

    unacked_streams: tuple[int, ...]
    """Request streams with response data (the END frame among it) not acknowledged yet."""
    heard_at: float
    """When the last datagram from the peer arrived (the loop's clock)."""
    unacked_since: float | None
    """When the oldest packet the peer has not acknowledged was sent (None: none in flight,
    the unacknowledged data still waits to be sent)."""
    probe_timeout_s: float
    """The connection's probe timeout, without backoff (RFC 9002 §6.2.1)."""


def silent_s(peer: PeerDrain, *, told_at: float, now: float) -> float:
    """How long ``peer`` has owed an answer and given none, at ``now``: since its last datagram,
    or since the oldest packet it has not acknowledged was sent if that is later (a reader that
    had nothing to acknowledge for a while owes nothing); data not even sent yet (its window is
    closed) is owed from ``told_at``, when the END frames were handed to the streams."""
    owed_since = told_at if peer.unacked_since is None else peer.unacked_since
    return now - max(peer.heard_at, owed_since)


def still_waiting(peer: PeerDrain, *, told_at: float, now: float) -> bool:
    """Whether the shutdown still waits for ``peer``'s acknowledgements at ``now``, the END
    frames having been handed to the streams at ``told_at``: it has some unacknowledged, and
    has not been :func:`silent <silent_s>` for :data:`QUIET_PROBE_TIMEOUTS` probe timeouts."""
    if not peer.unacked_streams:
        return False
    return silent_s(peer, told_at=told_at, now=now) < QUIET_PROBE_TIMEOUTS * peer.probe_timeout_s


@dataclass(frozen=True, slots=True, kw_only=True)
class QuietPeer:
    """A peer the shutdown did not wait for: its streams' END frames unacknowledged."""

    peer: str
    """Its address, for the log."""
    streams: tuple[int, ...]
    silent_s: float
    """How long it had owed an answer and given none (:func:`silent_s`) when the shutdown
    closed its connection."""
    probe_timeout_s: float

    def describe(self) -> str:
        streams = ", ".join(str(s) for s in self.streams)
        quiet_after_s = QUIET_PROBE_TIMEOUTS * self.probe_timeout_s
        return (
            f"{self.peer} (stream {streams}): the peer has been silent for {self.silent_s:.2f} s "
            f"({QUIET_PROBE_TIMEOUTS} probe timeouts: {quiet_after_s:.2f} s); its END frames "
            "are left unacknowledged, the records cover what it holds"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Drained:
    """How the wait for the END frames' acknowledgements ended (logged, kept for tests)."""

    waited_s: float
    acknowledged: int
    """Connections whose every request stream was acknowledged to its end."""
    quiet: tuple[QuietPeer, ...]
    """Connections not waited for: the peer went quiet."""
    cut_short: int
    """Connections still answering, yet with data unacknowledged when the deadline (the one
    grace period of the whole shutdown) passed."""
    deadline_passed: bool
    """The wait ended at the deadline (else: nobody it waited for was left)."""

    def describe(self) -> str:
        return (
            f"waited {self.waited_s:.2f} s for END frames: {self.acknowledged} connections "
            f"acknowledged them, {len(self.quiet)} peers gone quiet not waited for, "
            f"{self.cut_short} cut short by the grace period"
        )
