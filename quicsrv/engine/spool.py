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
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

__all__ = ["Spool", "in_path", "out_path", "phase_path", "take"]

log = logging.getLogger("quicsrv.engine")


class Spool:
    """A fresh directory under ``parent`` (None: ``/dev/shm`` where writable, else the
    system's temporary directory), removed by :meth:`remove`."""

    def __init__(self, parent: Path | None) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="quicsrv-kv-", dir=_parent(parent)))

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
