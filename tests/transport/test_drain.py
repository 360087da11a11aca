"""The shutdown's last wait (quicsrv.transport.drain): which peers it waits for, without a loop
or a socket."""

from __future__ import annotations

import pytest

from quicsrv.transport.drain import QUIET_PROBE_TIMEOUTS, PeerDrain, silent_s, still_waiting

PTO = 0.03
QUIET_S = QUIET_PROBE_TIMEOUTS * PTO
TOLD_AT = 100.0  # the END frames were handed to the streams


def peer(*, unacked: bool = True, heard_at: float, unacked_since: float | None) -> PeerDrain:
    return PeerDrain(
        unacked_streams=(0,) if unacked else (),
        heard_at=heard_at,
        unacked_since=unacked_since,
        probe_timeout_s=PTO,
    )


def test_a_peer_that_acknowledged_everything_is_not_waited_for():
    done = peer(unacked=False, heard_at=TOLD_AT, unacked_since=None)
    assert not still_waiting(done, told_at=TOLD_AT, now=TOLD_AT)


def test_a_peer_that_vanished_before_the_shutdown_is_not_waited_for_at_all():
    # Its oldest packet went unanswered a second before the END frames were sent.
    gone = peer(heard_at=TOLD_AT - 1.2, unacked_since=TOLD_AT - 1.0)
    assert not still_waiting(gone, told_at=TOLD_AT, now=TOLD_AT)
    assert silent_s(gone, told_at=TOLD_AT, now=TOLD_AT) == pytest.approx(1.0)


def test_a_reader_that_had_nothing_to_acknowledge_gets_its_probe_timeouts_from_the_end_frames():
    # Queued for a slot: nothing was sent to it for a minute, then the END frame.
    waiting = peer(heard_at=TOLD_AT - 60.0, unacked_since=TOLD_AT)
    assert still_waiting(waiting, told_at=TOLD_AT, now=TOLD_AT + QUIET_S / 2)
    assert not still_waiting(waiting, told_at=TOLD_AT, now=TOLD_AT + QUIET_S)


def test_a_peer_that_keeps_answering_is_waited_for():
    # A long backlog in flight since before the shutdown, acknowledged as it goes.
    busy = peer(heard_at=TOLD_AT + 2.0, unacked_since=TOLD_AT - 5.0)
    assert still_waiting(busy, told_at=TOLD_AT, now=TOLD_AT + 2.0 + QUIET_S / 2)
    assert not still_waiting(busy, told_at=TOLD_AT, now=TOLD_AT + 2.0 + QUIET_S)


def test_data_its_window_holds_back_is_owed_from_when_the_end_frames_were_handed_over():
    blocked = peer(heard_at=TOLD_AT - 10.0, unacked_since=None)
    assert still_waiting(blocked, told_at=TOLD_AT, now=TOLD_AT + QUIET_S / 2)
    assert not still_waiting(blocked, told_at=TOLD_AT, now=TOLD_AT + QUIET_S)
