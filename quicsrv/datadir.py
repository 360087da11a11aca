"""One server process per data directory: an exclusive lock, held for the process's life.

Two processes writing the same session records, KV blobs, MAC keys and tickets would undo each
other's work. ``quicsrv serve`` takes ``<data_dir>/lock`` (``flock``: the kernel releases it
however the process ends, ``kill -9`` included) before it reads anything there. A second one
waits for it, up to a bound, so that a restart can start the new server right after signalling
the old one: the new one loads its model meanwhile and takes over the directory the moment the
old one has saved everything and let go. Past the bound it stops with one line naming the
holder.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from pathlib import Path

__all__ = ["DataDirBusy", "DataDirLock"]

LOCK_FILE = "lock"
_POLL_S = 0.1


class DataDirBusy(Exception):
    """Another process holds the data directory's lock, and did not let go in time."""


class DataDirLock:
    """The held lock of one data directory (see the module docstring)."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    async def acquire(cls, data_dir: Path, *, wait_s: float) -> DataDirLock:
        """The lock of ``data_dir`` (made if missing, 0700), waiting up to ``wait_s`` for a
        holder to let go; raises :class:`DataDirBusy` after that."""
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = data_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + wait_s
            while not _try_lock(fd):
                if loop.time() >= deadline:
                    raise DataDirBusy(
                        f"{data_dir} is in use by another quicsrv ({_holder(path)}); "
                        f"waited {wait_s:g}s for it to stop (data_dir_wait_s)"
                    )
                # The holder is another process: there is nothing to await but time.
                await asyncio.sleep(_POLL_S)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        return cls(fd, path)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the descriptor drops the flock


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid else "a process that has not written its pid yet"
