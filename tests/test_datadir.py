"""One server process per data dir: the lock, waited for up to a bound, then a clear refusal."""

from __future__ import annotations

import asyncio
import os

import pytest

from quicsrv.datadir import DataDirBusy, DataDirLock

pytestmark = pytest.mark.asyncio


async def test_a_held_data_dir_is_refused_after_the_wait_naming_its_holder(tmp_path):
    held = await DataDirLock.acquire(tmp_path / "data", wait_s=0)
    assert (tmp_path / "data").stat().st_mode & 0o777 == 0o700
    with pytest.raises(DataDirBusy) as busy:
        await DataDirLock.acquire(tmp_path / "data", wait_s=0.2)
    assert f"pid {os.getpid()}" in str(busy.value)
    held.release()
    again = await DataDirLock.acquire(tmp_path / "data", wait_s=0)
    again.release()


async def test_a_waiting_server_takes_the_dir_once_the_holder_lets_go(tmp_path):
    held = await DataDirLock.acquire(tmp_path, wait_s=0)
    waiting = asyncio.ensure_future(DataDirLock.acquire(tmp_path, wait_s=60))
    # Until the holder lets go, the waiter keeps trying (a busy wait would fail it at once).
    done, _ = await asyncio.wait({waiting}, timeout=0.3)
    assert not done
    held.release()
    taken = await waiting
    taken.release()
