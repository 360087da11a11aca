"""KV blobs of paused sessions: in memory under a byte budget, spilled LRU to disk.

A blob is what ``llama_state_seq_get_data`` returned for one sequence (about 23 KB per token of
context for the default model). Blobs past the memory budget are written to
``<dir>/<session>.kv`` (atomic rename, BLAKE3 checksum); past the disk budget the oldest are
dropped, and a resume without its blob falls back to the exact replay. Thread-safe: the engine
side puts, the event loop's worker threads get, a writer thread spills.
"""

from __future__ import annotations

import logging
import struct
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import blake3

from ..files import write_atomically

if TYPE_CHECKING:
    from .shared_kv import SharedKV

__all__ = ["KVStore", "KVUsage"]

log = logging.getLogger(__name__)

_MAGIC = b"QKV1"
_HEADER = struct.Struct(">4sIQ32s")  # magic, tokens covered, blob length, BLAKE3 of the blob


@dataclass(frozen=True, slots=True)
class KVUsage:
    memory_blobs: int
    memory_bytes: int
    disk_blobs: int
    disk_bytes: int

    def describe(self) -> str:
        return (
            f"kv memory {self.memory_blobs} blobs {self.memory_bytes / 2**20:.1f} MiB, "
            f"disk {self.disk_blobs} blobs {self.disk_bytes / 2**20:.1f} MiB"
        )


class KVStore:
    def __init__(
        self,
        directory: Path,
        *,
        memory_budget_bytes: int,
        disk_budget_bytes: int,
        shared: SharedKV | None = None,
    ) -> None:
        self._dir = directory
        self._shared = shared
        self._memory_budget = memory_budget_bytes
        self._disk_budget = disk_budget_bytes
        self._lock = threading.Lock()
        # Least recently used first.
        self._memory: OrderedDict[bytes, _Blob] = OrderedDict()
        self._memory_bytes = 0
        self._spilling: dict[bytes, _Blob] = {}  # past the memory budget, not yet on disk
        self._disk: OrderedDict[bytes, int] = OrderedDict()  # session -> file size
        self._disk_bytes = 0
        # Multi-MB writes and unlinks happen here, in order, never on the putting thread
        # (the engine's, whose every stream would wait) nor on the event loop.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-spill")
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for path in sorted(directory.glob("*.kv"), key=lambda p: p.stat().st_mtime):
            try:
                session = bytes.fromhex(path.stem)
            except ValueError:
                continue
            size = path.stat().st_size
            self._disk[session] = size
            self._disk_bytes += size
        for leftover in directory.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)  # a write interrupted by a crash

    def put(self, session: bytes, n_generated: int, blob: bytes) -> None:
        """Keep the blob covering a session's first ``n_generated`` tokens."""
        with self._lock:
            self._discard_locked(session)
            self._memory[session] = _Blob(n_generated, blob)
            self._memory_bytes += len(blob)
            while self._memory_bytes > self._memory_budget and self._memory:
                victim, held = self._memory.popitem(last=False)
                self._memory_bytes -= len(held.data)
                self._spilling[victim] = held
                self._writer.submit(self._spill, victim, held)
        if self._shared is not None:
            self._writer.submit(self._shared.publish, session, _pack(n_generated, blob))

    def get(self, session: bytes, n_generated: int) -> bytes | None:
        """The blob if it covers exactly ``n_generated`` tokens and its checksum holds."""
        with self._lock:
            held = self._memory.get(session)
            if held is not None:
                self._memory.move_to_end(session)
            else:
                held = self._spilling.get(session)
            if held is not None:
                return held.data if held.n_generated == n_generated else None
            if session not in self._disk:
                return self._get_shared(session, n_generated)
            path = self._path(session)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        blob = _unpack(data, n_generated)
        if blob is None:
            log.warning("KV blob %s is stale or damaged; the resume will replay", path.name)
        return blob

    def pull(self, session: bytes, n_generated: int) -> bool:
        """Bring another process's blob for exactly ``n_generated`` tokens here (blocking: off
        the loop), so :meth:`has` knows of it; whether there is one now."""
        if self.has(session, n_generated):
            return True
        blob = self._get_shared(session, n_generated)
        if blob is None:
            return False
        with self._lock:
            self._discard_locked(session)
            self._memory[session] = _Blob(n_generated, blob)
            self._memory_bytes += len(blob)
        return True

    def has(self, session: bytes, n_generated: int) -> bool:
        """Whether a blob for exactly ``n_generated`` tokens is probably there (not verified)."""
        with self._lock:
            held = self._memory.get(session) or self._spilling.get(session)
            return held.n_generated == n_generated if held is not None else session in self._disk

    def discard(self, session: bytes, *, shared: bool = True) -> None:
        """Forget the session's blob (``shared``: the copy for other processes too)."""
        with self._lock:
            self._discard_locked(session)
        if shared and self._shared is not None:
            self._writer.submit(self._shared.delete, session)

    def sweep_shared(self) -> int:
        """Old shared files left by killed processes (blocking)."""
        return self._shared.sweep() if self._shared is not None else 0

    def usage(self) -> KVUsage:
        with self._lock:
            return KVUsage(
                memory_blobs=len(self._memory),
                memory_bytes=self._memory_bytes,
                disk_blobs=len(self._disk),
                disk_bytes=self._disk_bytes,
            )

    def persist(self) -> None:
        """Write every blob held in memory to disk, where a process started on this data dir
        finds them (within the disk budget); blocking, so off the event loop. Blobs for other
        processes were published as they were put."""
        with self._lock:
            held, self._memory = self._memory, OrderedDict()
            self._memory_bytes = 0
            for session, blob in held.items():
                self._spilling[session] = blob
                self._writer.submit(self._spill, session, blob)
        self.flush().result()

    def flush(self) -> Future[None]:
        """Done when every spill and removal asked for so far is done."""
        return self._writer.submit(lambda: None)

    def close(self) -> None:
        """Finish the pending spills (a restarted server finds them on disk)."""
        self._writer.shutdown(wait=True)

    def _path(self, session: bytes) -> Path:
        return self._dir / f"{session.hex()}.kv"

    def _get_shared(self, session: bytes, n_generated: int) -> bytes | None:
        if self._shared is None:
            return None
        data = self._shared.fetch(session)
        return None if data is None else _unpack(data, n_generated)

    def _discard_locked(self, session: bytes) -> None:
        held = self._memory.pop(session, None)
        if held is not None:
            self._memory_bytes -= len(held.data)
        self._spilling.pop(session, None)  # the spill sees that and removes its file
        size = self._disk.pop(session, None)
        if size is not None:
            self._disk_bytes -= size
            self._writer.submit(self._path(session).unlink, missing_ok=True)

    # --- the writer thread --------------------------------------------------------------

    def _spill(self, session: bytes, held: _Blob) -> None:
        blob = held.data
        data = _header(held.n_generated, blob)
        size = len(data) + len(blob)
        with self._lock:
            if self._spilling.get(session) is not held:
                return  # discarded or replaced while queued
            if size > self._disk_budget:
                del self._spilling[session]  # bigger than the whole budget: a resume replays
                return
            while self._disk and self._disk_bytes + size > self._disk_budget:
                oldest, dropped = self._disk.popitem(last=False)
                self._disk_bytes -= dropped
                self._path(oldest).unlink(missing_ok=True)
        path = self._path(session)
        try:
            write_atomically(path, data, blob)
        except OSError as exc:
            log.warning("cannot spill KV blob to %s: %s", path, exc)
            with self._lock:
                if self._spilling.get(session) is held:
                    del self._spilling[session]
            return
        with self._lock:
            if self._spilling.get(session) is held:
                del self._spilling[session]
                self._disk[session] = size
                self._disk_bytes += size
                return
        path.unlink(missing_ok=True)  # discarded while being written


@dataclass(frozen=True, slots=True, eq=False)
class _Blob:
    n_generated: int
    data: bytes


def _header(n_generated: int, blob: bytes) -> bytes:
    return _HEADER.pack(_MAGIC, n_generated, len(blob), blake3.blake3(blob).digest())


def _pack(n_generated: int, blob: bytes) -> bytes:
    return _header(n_generated, blob) + blob


def _unpack(data: bytes, n_generated: int) -> bytes | None:
    if len(data) < _HEADER.size:
        return None
    magic, covered, length, checksum = _HEADER.unpack_from(data)
    blob = data[_HEADER.size :]
    if magic != _MAGIC or covered != n_generated or length != len(blob):
        return None
    if blake3.blake3(blob).digest() != checksum:
        return None
    return blob
