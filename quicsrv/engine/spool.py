"""The directory that the server and its engine workers pass files through.

KV blobs are megabytes: they go as files (in ``/dev/shm`` where it is writable, so memory to
memory), and only their names go over the worker's socket. Every name is made here:

* ``in-<incarnation>-<key>.kv``: a resumed sequence's KV cells, written by the server for the
  worker (read and removed by it);
* ``out-<incarnation>-<key>-<tokens>.kv``: a paused sequence's KV cells, written by the worker
  for the server (read and removed by :func:`take`);
* ``phase-<incarnation>``: one byte, what the worker is doing (:class:`~.ipc.WorkerPhase`), so
  that its death can be told apart (in the canary, inside ``llama_decode``...).

A dead worker's files are removed with :meth:`Spool.discard`, the directory with the engine.
The directory's name carries the server's pid, so that a server killed before it could remove
its own (``kill -9``, an OOM kill) has it removed by the next one that starts beside it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

__all__ = ["Spool", "in_path", "out_path", "phase_path", "take"]

log = logging.getLogger("quicsrv.engine")

_PREFIX = "quicsrv-kv-"
_OWNED = re.compile(rf"{_PREFIX}(\d+)-")


class Spool:
    """A fresh directory under ``parent`` (None: ``/dev/shm`` where writable, else the
    system's temporary directory), removed by :meth:`remove`."""

    def __init__(self, parent: Path | None) -> None:
        directory = _parent(parent)
        _remove_orphans(Path(directory) if directory is not None else Path(tempfile.gettempdir()))
        self.path = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=directory))

    def write_in(self, incarnation: int, key: int, blob: bytes) -> str | None:
        """Hand a resumed sequence's KV blob to worker ``incarnation``: the file's name, or
        None when it cannot be written (the worker then rebuilds the cells by exact replay)."""
        path = in_path(self.path, incarnation, key)
        try:
            path.write_bytes(blob)
        except OSError as exc:
            log.warning("could not spool a KV blob (%s); the sequence will replay", exc)
            path.unlink(missing_ok=True)
            return None
        return str(path)

    def discard(self, incarnation: int) -> None:
        """The files of a dead worker that nobody will read any more."""
        for pattern in (f"in-{incarnation}-*.kv", f"out-{incarnation}-*.kv"):
            for orphan in self.path.glob(pattern):
                orphan.unlink(missing_ok=True)
        phase_path(self.path, incarnation).unlink(missing_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def in_path(spool_dir: Path, incarnation: int, key: int) -> Path:
    return spool_dir / f"in-{incarnation}-{key}.kv"


def out_path(spool_dir: Path, incarnation: int, key: int, n_tokens: int) -> Path:
    """Where worker ``incarnation`` writes a paused sequence's KV blob (the worker's side)."""
    return spool_dir / f"out-{incarnation}-{key}-{n_tokens}.kv"


def phase_path(spool_dir: Path, incarnation: int) -> Path:
    return spool_dir / f"phase-{incarnation}"


def take(kv_file: str | None) -> bytes | None:
    """Read and remove a KV blob a worker passed on (None: none, or it cannot be read, and
    the session then resumes by exact replay)."""
    if kv_file is None:
        return None
    path = Path(kv_file)
    try:
        return path.read_bytes()
    except OSError as exc:
        log.warning("KV blob %s unreadable: %s", kv_file, exc)
        return None
    finally:
        path.unlink(missing_ok=True)


def _remove_orphans(parent: Path) -> None:
    """Remove the spool directories under ``parent`` whose server is gone."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return
    for entry in entries:
        owner = _OWNED.match(entry.name)
        if owner is None or _alive(int(owner.group(1))):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        log.info("removed %s: its server (pid %s) is gone", entry, owner.group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True


def _parent(parent: Path | None) -> str | None:
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
        return str(parent)
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and _writable(shm) else None


def _writable(directory: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False
