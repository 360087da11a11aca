"""Engine events reach the loop in order, with one wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

import pytest

from quicsrv.sessions.inbox import LoopInbox

pytestmark = pytest.mark.asyncio


async def test_a_burst_from_another_thread_runs_in_order_after_one_wakeup():
    loop = asyncio.get_running_loop()
    inbox = LoopInbox(loop)
    seen: list[int] = []
    done = asyncio.Event()

    def burst() -> None:  # a decode step's tokens, from the engine's thread
        for i in range(8):
            inbox.post(seen.append, i)
        inbox.post(done.set)

    thread = threading.Thread(target=burst)
    thread.start()
    thread.join()  # the loop has not run meanwhile: all nine wait in the inbox
    await asyncio.wait_for(done.wait(), 5)
    assert seen == list(range(8))
    assert inbox.posted == 9 and inbox.wakeups == 1


async def test_a_failing_callback_is_reported_and_the_rest_still_run():
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        inbox = LoopInbox(loop)
        seen: list[str] = []
        done = asyncio.Event()

        def fail() -> None:
            raise RuntimeError("boom")

        inbox.post(fail)
        inbox.post(seen.append, "after")
        inbox.post(done.set)
        await asyncio.wait_for(done.wait(), 5)
    finally:
        loop.set_exception_handler(None)
    assert seen == ["after"]
    assert isinstance(reported[0]["exception"], RuntimeError)
