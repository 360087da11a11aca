"""The fair gate: round-robin across clients, resumes first, caps, deadlines, cancellation."""

from __future__ import annotations

import asyncio

import pytest

from quicsrv.sessions.admission import (
    MAX_REFUSAL_KEYS,
    OTHER_CLIENTS,
    AdmissionLimits,
    FairGate,
    Slot,
)
from quicsrv.sessions.errors import RequestRejected
from quicsrv_proto import ErrorCode

pytestmark = pytest.mark.asyncio


def _gate(slots: int = 1, max_queued: int = 64, active: int = 4, queued: int = 16) -> FairGate:
    return FairGate(
        AdmissionLimits(
            slots=slots,
            max_queued=max_queued,
            max_active_per_client=active,
            max_queued_per_client=queued,
        )
    )


async def _settle() -> None:
    # Granted futures wake their waiters on the next loop turns.
    for _ in range(3):
        await asyncio.sleep(0)


async def test_waiting_requests_are_served_round_robin_across_clients():
    gate = _gate(slots=1)
    running = await gate.acquire("hog")
    order: list[str] = []

    async def wait(client: str, n: int) -> None:
        slot = await gate.acquire(client)
        order.append(f"{client}{n}")
        slot.release()

    # The hog queues three before the others queue one each.
    tasks = [asyncio.create_task(wait("hog", n)) for n in range(3)]
    await _settle()
    tasks += [asyncio.create_task(wait(c, 0)) for c in ("alice", "bob")]
    await _settle()
    assert gate.queued == 5
    running.release()
    await asyncio.gather(*tasks)
    assert order == ["hog0", "alice0", "bob0", "hog1", "hog2"]


async def test_a_client_running_fewer_sequences_goes_first_whoever_queued_earlier():
    gate = _gate(slots=3)
    hog = [await gate.acquire("hog") for _ in range(2)]
    other = await gate.acquire("other")
    order: list[str] = []

    async def wait(client: str, n: int) -> None:
        await gate.acquire(client)  # held to the end of the test
        order.append(f"{client}{n}")

    # The hog queues first, then a newcomer with nothing running.
    tasks = [asyncio.create_task(wait("hog", n)) for n in range(2)]
    await _settle()
    tasks.append(asyncio.create_task(wait("new", 0)))
    await _settle()
    hog[0].release()  # the hog still runs one, the newcomer none: the newcomer goes first
    await _settle()
    assert order == ["new0"]
    other.release()  # now the hog (1 running) and the newcomer (1 running) tie: round-robin
    await _settle()
    assert order == ["new0", "hog0"]
    assert gate.queued == 1 and gate.active == 3
    tasks[1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_returning_session_goes_before_new_requests():
    gate = _gate(slots=1)
    running = await gate.acquire("a")
    order: list[str] = []

    async def wait(client: str, *, resume: bool) -> None:
        slot = await gate.acquire(client, resume=resume)
        order.append(("resume-" if resume else "new-") + client)
        slot.release()

    tasks = [asyncio.create_task(wait(c, resume=False)) for c in ("b", "c")]
    await _settle()
    tasks.append(asyncio.create_task(wait("d", resume=True)))
    await _settle()
    running.release()
    await asyncio.gather(*tasks)
    assert order == ["resume-d", "new-b", "new-c"]


async def test_a_client_at_its_active_cap_waits_while_others_run():
    gate = _gate(slots=4, active=2)
    mine = [await gate.acquire("hog") for _ in range(2)]
    hog_third = asyncio.create_task(gate.acquire("hog"))
    await _settle()
    assert not hog_third.done()  # a slot is free, but not for the hog
    other = await gate.acquire("other")  # served at once, ahead of the hog's queued one
    assert gate.active_for("other") == 1
    mine[0].release()
    third = await hog_third
    assert gate.active_for("hog") == 2
    for slot in (mine[1], third, other):
        slot.release()
    assert gate.active == 0


async def test_the_per_client_queue_cap_is_a_client_limit_with_a_retry_hint():
    gate = _gate(slots=1, queued=2)
    running = await gate.acquire("hog")
    waiters = [asyncio.create_task(gate.acquire("hog")) for _ in range(2)]
    await _settle()
    with pytest.raises(RequestRejected) as info:
        await gate.acquire("hog")
    assert info.value.code == ErrorCode.CLIENT_LIMIT
    assert info.value.retry_after_s is not None and info.value.retry_after_s > 0
    assert gate.refusals[ErrorCode.CLIENT_LIMIT, "hog"] == 1
    # Another client is not refused: its own queue is empty.
    other = asyncio.create_task(gate.acquire("other"))
    await _settle()
    assert gate.queued == 3
    for task in (*waiters, other):
        task.cancel()
    await asyncio.gather(*waiters, other, return_exceptions=True)
    running.release()
    assert gate.queued == 0 and gate.active == 0


async def test_the_server_wide_queue_cap_is_overloaded_and_grows_the_retry_hint():
    gate = _gate(slots=1, max_queued=2)
    running = await gate.acquire("a")
    waiters = [asyncio.create_task(gate.acquire(c)) for c in ("b", "c")]
    await _settle()
    with pytest.raises(RequestRejected) as info:
        await gate.acquire("d")
    assert info.value.code == ErrorCode.OVERLOADED
    assert gate.refusals[ErrorCode.OVERLOADED, "d"] == 1
    # The hint follows the queue: two ahead on one slot is three rounds of the mean hold.
    assert info.value.retry_after_s == pytest.approx(gate.retry_after_s(2, 1))
    assert gate.retry_after_s(2, 1) > gate.retry_after_s(0, 1)
    # Resumes are never refused for a full queue.
    resume = asyncio.create_task(gate.acquire("d", resume=True))
    await _settle()
    assert gate.queued == 3
    running.release()
    slot = await resume
    assert slot.client == "d"
    slot.release()
    for task in waiters:
        (await task).release()
    assert gate.active == 0


async def test_a_deadline_gives_the_place_up():
    gate = _gate(slots=1)
    running = await gate.acquire("a")
    with pytest.raises(RequestRejected) as info:
        await gate.acquire("b", timeout_s=0.01)
    assert info.value.code == ErrorCode.DEADLINE_EXCEEDED
    assert gate.queued == 0
    assert gate.refusals_by_code() == {ErrorCode.DEADLINE_EXCEEDED: 1}
    running.release()
    assert gate.active == 0


async def test_a_cancelled_waiter_gives_its_place_back_and_a_granted_one_its_slot():
    gate = _gate(slots=1)
    running = await gate.acquire("a")
    waiter = asyncio.create_task(gate.acquire("b"))
    await _settle()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.queued == 0
    running.release()
    assert gate.active == 0
    # Granted and cancelled in the same turn: the slot goes back, not lost.
    running = await gate.acquire("a")
    waiter = asyncio.create_task(gate.acquire("b"))
    await _settle()
    running.release()  # grants b's future...
    waiter.cancel()  # ...but b is cancelled before it wakes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.active == 0


async def test_release_is_idempotent():
    gate = _gate(slots=2)
    slot: Slot = await gate.acquire("a")
    slot.release()
    slot.release()
    assert gate.active == 0 and gate.active_for("a") == 0


async def test_limits_must_be_positive():
    with pytest.raises(ValueError):
        AdmissionLimits(slots=0, max_queued=1, max_active_per_client=1, max_queued_per_client=1)


async def test_refusal_counters_stay_bounded_however_many_clients_are_refused():
    gate = _gate(slots=1, max_queued=0)
    running = await gate.acquire("a")
    n = MAX_REFUSAL_KEYS + 10
    for i in range(n):
        with pytest.raises(RequestRejected):
            await gate.acquire(f"conn:{i}")
    assert len(gate.refusals) == MAX_REFUSAL_KEYS + 1
    assert gate.refusals[ErrorCode.OVERLOADED, OTHER_CLIENTS] == 10
    assert gate.refusals_by_code() == {ErrorCode.OVERLOADED: n}
    running.release()
