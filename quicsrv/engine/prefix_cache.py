"""Kept KV cells, found again by the prompts that start like them.

A finished sequence leaves its cells where they are, in its released slot: they become an
:class:`Entry` of the :class:`PrefixCache`, with the tokens they were computed from and how. A
new sequence whose prompt starts with an entry's tokens takes the cells over and prefills only
the rest. An entry whose slot another sequence needs becomes a blob
(``llama_state_seq_get_data``) within a byte budget in memory, the least recently used going
first to a :class:`PrefixShelf` on disk: a directory other engines (the worker that replaces a
dead one, the other processes of ``--workers N``) find it in.

How cells were computed is part of what they are: llama.cpp's numbers for a token depend on
the way it was computed (in a piece of 64 prompt tokens or more, in a shorter one, or alone as a
decoded token: :mod:`.pieces`), so a generation that started from reused cells is rebuilt
exactly only by recomputing its prefix the same way. A :class:`PrefillPlan` says how: the
prompt's segments, each fed from its start in steps of a fixed number of tokens. Cells are cut
at a step boundary of their plan, or inside a piece where its first tokens, fed as a piece of
their own, take the same way (``cuts_inside_pieces``), so a cut plan still says exactly how the
cells that are left were made. A prompt found whole computes only its last position again (two
past 256 positions: :func:`.pieces.tail`), for its logits; or nothing, where the entry kept
them (:class:`EndLogits`).

Pure bookkeeping: the engine does the llama.cpp calls.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import cbor2
import numpy as np
import numpy.typing as npt

from ..files import write_atomically
from ._api import Segment
from .pieces import TILE_TOKENS, keeps_way, tail, tiled_head

__all__ = [
    "BLOCK_TOKENS",
    "EndLogits",
    "Entry",
    "Hit",
    "PrefixCache",
    "PrefixShelf",
    "PrefixStats",
    "boundaries",
    "cut",
    "extend",
    "piece_around",
    "rest",
]

log = logging.getLogger(__name__)

BLOCK_TOKENS = 64
"""Prefixes are looked up by the hash of each whole block of this many tokens: a shorter
common prefix is not worth a blob's restore, nor taking an entry out of its slot. Cells of fewer
positions stay in their slot as a *scrap* (an entry with no blocks, never looked up): a short
prompt given that slot starts from what it shares with them (:meth:`PrefixCache.reusable`)."""


def extend(segments: Sequence[Segment], end: int, step: int) -> tuple[Segment, ...]:
    """``segments`` then positions up to ``end`` in steps of ``step``, in the canonical form
    (a segment that continues its predecessor's steps exactly is merged into it), so that
    plans that compute the same cells the same way compare equal."""
    start = segments[-1].end if segments else 0
    if end <= start:
        return tuple(segments)
    if segments:
        last = segments[-1]
        last_start = segments[-2].end if len(segments) > 1 else 0
        # Fed in whole steps so far, it goes on with the same steps, or with one last piece.
        if (last.end - last_start) % last.step == 0 and (
            step == last.step or end - start <= min(step, last.step)
        ):
            return (*segments[:-1], Segment(end, last.step))
    return (*segments, Segment(end, min(step, end - start)))  # one piece: one way to say it


def boundaries(segments: Sequence[Segment]) -> Iterator[int]:
    """Every position where the plan's cells are complete (after a step), ascending."""
    start = 0
    for segment in segments:
        yield from range(start + segment.step, segment.end, segment.step)
        yield segment.end
        start = segment.end


def piece_around(segments: Sequence[Segment], at: int) -> tuple[int, int] | None:
    """The piece ``[start, end)`` the plan feeds in one step with ``start < at < end``; None
    where ``at`` is a boundary (or past the plan)."""
    start = 0
    for segment in segments:
        if at < segment.end:
            offset = (at - start) % segment.step
            if offset == 0:
                return None
            return at - offset, min(at - offset + segment.step, segment.end)
        start = segment.end
    return None


def cut(segments: Sequence[Segment], at: int) -> tuple[Segment, ...]:
    """The plan of the first ``at`` positions: one of its boundaries, or a position inside a
    piece whose first tokens, fed as a piece of their own, get the same cells
    (:func:`.pieces.keeps_way`)."""
    kept: tuple[Segment, ...] = ()
    start = 0
    for segment in segments:
        if at <= start:
            break
        kept = extend(kept, min(at, segment.end), segment.step)
        start = segment.end
    return kept


def rest(segments: Sequence[Segment], after: int) -> tuple[Segment, ...]:
    """The segments of the positions from ``after`` on (a boundary), fed as before."""
    return tuple(s for s in segments if s.end > after)


@dataclass(frozen=True, slots=True, eq=False)
class EndLogits:
    """The logits of a prompt's last position, kept with its cells: the same prompt again
    samples its first token from them and computes nothing.

    Exact, not close: they come from the computation the entry's plan describes, and the prompt
    found whole records that plan (the entry's, to the prompt's end) as its own, so a replay
    computes the same pieces and gets them once more."""

    n_prompt: int
    logits: npt.NDArray[np.float32]


@dataclass(eq=False, kw_only=True)
class Entry:
    """Cells kept for positions ``0..len(tokens)-1``: resident in ``slot``, or in ``blob``."""

    scope: str
    tokens: tuple[int, ...]
    segments: tuple[Segment, ...]
    blocks: tuple[bytes, ...]
    slot: int | None = None
    blob: bytes | None = None
    used: int = 0
    end: EndLogits | None = None
    """The logits of the last position of the prompt ``tokens[:end.n_prompt]`` (in memory
    only: a shelved entry goes without them)."""
    snapshot: bytes | None = None
    """A resident entry's cells saved as a blob while the engine waited for work
    (:meth:`.placement.SlotPlacement.snapshot_one`), so that leaving its slot copies nothing
    then; counted in the blob budget."""


@dataclass(frozen=True, slots=True)
class Hit:
    entry: Entry
    length: int
    """Positions whose cells are reused, below the prompt's end (at it with :attr:`end`): where
    the entry's cells may be cut (see :meth:`PrefixCache.find`), and a step boundary of a
    replay's recorded plan."""
    end: EndLogits | None = None
    """The whole prompt is found, with its last position's logits: nothing is computed."""
    cold: bool = False
    """The reused cells are the ones the prompt's cold plan computes, tiled, and the positions
    after them are fed tiled (:meth:`PrefixCache.reusable`): the prompt keeps its cold plan."""


@dataclass(slots=True)
class PrefixStats:
    """What the cache did so far (counters) and holds now (gauges)."""

    enabled: bool = True
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    resident_tokens: int = 0
    blob_bytes: int = 0
    disk_bytes: int = 0
    shelf_dropped: int = 0
    """Evicted entries not shelved: too many waited for the writer, which writes only while the
    engine waits for work (a busy engine, or a slow disk)."""

    def count(self, *, reused: int, n_prompt: int) -> None:
        """A prompt of ``n_prompt`` tokens is fed, its first ``reused`` from kept cells (not
        counted while the cache is off)."""
        if self.enabled:
            self.hits += bool(reused)
            self.misses += not reused
            self.reused_tokens += reused
            self.prefilled_tokens += n_prompt - reused


WRITE_CHUNK = 1 << 20
"""The shelf's writer waits for an idle engine between writes of this many bytes (~5-10 ms of a
core here): a prompt arriving while it writes shares the CPU that long at most."""


@dataclass(frozen=True, slots=True, eq=False)
class _Shelved:
    """An entry waiting to be written: what its file will hold."""

    tokens: tuple[int, ...]
    segments: tuple[Segment, ...]
    blob: bytes


class PrefixShelf:
    """Evicted entries on disk, one file each, named by the chained hash of the entry's last
    whole block: a prompt finds one by the hashes of its own blocks, deepest first, with a stat
    each, whichever process wrote it. Files are written whole and renamed into place; the
    oldest (by modification time) go first past ``max_bytes``.

    Written by a thread of its own while the engine is idle (:attr:`engine_idle`, set by the
    engine while it waits for work; set from the start for a shelf without one), a
    :data:`WRITE_CHUNK` at a time: :meth:`put` only queues the entry (found from memory until its
    file is there), so a burst that evicts entries waits neither for the disk nor beside it.
    Measured here: a 12 MB file takes 40-140 ms of a core to write; eight written on the engine
    thread held a burst's first step 570 ms, and written by a thread beside its steps (even at
    the lowest CPU priority) made them 3x as long: llama.cpp's threads wait for each other at
    every operation, so a core taken from one stalls both. At most ``max_pending_bytes`` wait to
    be written: past that a put is dropped (a cache entry lost, counted in ``shelf_dropped``),
    or with ``wait`` waits for the writer (an engine closing, idle, then calls :meth:`flush`)."""

    SUFFIX = ".prefix"

    def __init__(
        self, directory: Path, max_bytes: int, stats: PrefixStats, max_pending_bytes: int = 64 << 20
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_pending_bytes = max_pending_bytes
        self._stats = stats
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for leftover in directory.glob(f".*{self.SUFFIX}.*.tmp"):  # a writer killed mid-file
            leftover.unlink(missing_ok=True)
        self._stats.disk_bytes = sum(size for _, size, _ in self._files())
        self._changed = threading.Condition()
        self._pending: dict[Path, _Shelved] = {}
        self._pending_bytes = 0
        self._queue: deque[Path] = deque()
        self._writer: threading.Thread | None = None
        self.engine_idle = threading.Event()
        self.engine_idle.set()

    def put(self, entry: Entry, blob: bytes, *, wait: bool = False) -> None:
        if not entry.blocks or len(blob) > self.max_bytes:
            return
        path = self._path(entry.blocks[-1])
        with self._changed:
            while self._pending_bytes and self._pending_bytes + len(blob) > self.max_pending_bytes:
                if not wait:
                    self._stats.shelf_dropped += 1
                    return
                self._changed.wait()
            old = self._pending.get(path)
            if old is not None:
                self._pending_bytes -= len(old.blob)
            self._pending[path] = _Shelved(entry.tokens, entry.segments, blob)
            self._pending_bytes += len(blob)
            if path not in self._queue:
                self._queue.append(path)
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, name="prefix-shelf", daemon=True
                )
                self._writer.start()
            self._changed.notify_all()

    def flush(self) -> None:
        """Wait until every entry put so far is on disk (or could not be written)."""
        with self._changed:
            while self._pending:
                self._changed.wait()

    def _write_loop(self) -> None:
        while True:
            with self._changed:
                while not self._queue:
                    self._changed.wait()
                path = self._queue.popleft()
                shelved = self._pending[path]
            try:
                self._write(path, shelved)
            except Exception:  # a full disk, or worse: it costs the entry, never the writer
                log.warning("prefix cache: cannot write %s", path.name, exc_info=True)
            finally:
                with self._changed:
                    if self._pending.get(path) is shelved:  # else put again: queued again
                        del self._pending[path]
                        self._pending_bytes -= len(shelved.blob)
                    self._changed.notify_all()

    def _write(self, path: Path, shelved: _Shelved) -> None:
        self.engine_idle.wait()
        data = cbor2.dumps(
            {
                "v": 1,
                "tokens": list(shelved.tokens),
                "segments": shelved.segments,
                "blob": shelved.blob,
            }
        )
        view = memoryview(data)
        chunks = [view[i : i + WRITE_CHUNK] for i in range(0, len(data), WRITE_CHUNK)]
        try:
            write_atomically(path, *chunks, before_part=self.engine_idle.wait)
        finally:
            self._trim()

    def find(self, blocks: Sequence[bytes], scope: str, longer_than: int) -> Entry | None:
        """The shelved entry whose last whole block is the deepest of ``blocks`` (so that it
        shares more than ``longer_than`` tokens with their prompt), read in."""
        for depth in range(len(blocks), 0, -1):
            if depth * BLOCK_TOKENS <= longer_than:
                return None
            path = self._path(blocks[depth - 1])
            with self._changed:
                shelved = self._pending.get(path)
            if shelved is not None:
                tokens, segments, blob = shelved.tokens, shelved.segments, shelved.blob
                return Entry(scope=scope, tokens=tokens, segments=segments, blocks=(), blob=blob)
            try:
                data = cbor2.loads(path.read_bytes())
                tokens = tuple(int(t) for t in data["tokens"])
                segments = tuple(Segment(int(e), int(s)) for e, s in data["segments"])
                blob = bytes(data["blob"])
            except FileNotFoundError:
                continue
            except Exception as exc:  # damaged (or another version's): it goes
                log.warning("prefix cache: ignoring unreadable %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            os.utime(path)  # used: the last to go
            return Entry(scope=scope, tokens=tokens, segments=segments, blocks=(), blob=blob)
        return None

    def _trim(self) -> None:
        files = sorted(self._files(), key=lambda f: f[2])
        held = sum(size for _, size, _ in files)
        for path, size, _ in files:
            if held <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            held -= size
        self._stats.disk_bytes = held

    def _files(self) -> list[tuple[Path, int, float]]:
        found = []
        for path in self.directory.glob(f"*{self.SUFFIX}"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # another process trimmed it
            found.append((path, st.st_size, st.st_mtime))
        return found

    def _path(self, block: bytes) -> Path:
        return self.directory / f"{block.hex()}{self.SUFFIX}"


@dataclass(eq=False)
class PrefixCache:
    """Every entry, findable by the hashes of its whole token blocks."""

    namespace: bytes
    """Digest of what the numbers depend on (model, attention kernel, batching, CPU buffers):
    the root of every block hash, so that no other engine's cells ever match."""
    max_blob_bytes: int
    cuts_inside_pieces: bool = True
    """Cells may be cut inside a piece where :func:`.pieces.keeps_way` (flash attention on: the
    ways are its kernel's); False: at step boundaries only."""
    stats: PrefixStats = field(default_factory=PrefixStats)
    shelf: PrefixShelf | None = None
    _by_block: dict[bytes, list[Entry]] = field(default_factory=dict)
    _by_slot: dict[int, Entry] = field(default_factory=dict)
    _blobs: list[Entry] = field(default_factory=list)  # least recently used first
    _clock: Iterator[int] = field(default_factory=itertools.count)
    _snapshot_bytes: int = 0

    def keep(
        self,
        slot: int,
        scope: str,
        tokens: Sequence[int],
        plan: Sequence[Segment],
        end: EndLogits | None = None,
    ) -> bool:
        """A released slot's cells (computed as ``plan`` says) stay for later prompts, fewer
        than a block as a scrap (see :data:`BLOCK_TOKENS`), with ``end`` (its prompt's last
        logits); False: none (the caller frees them)."""
        if slot in self._by_slot:
            self.drop(self._by_slot[slot])
        if not tokens:
            return False
        entry = Entry(
            scope=scope,
            tokens=tuple(tokens),
            segments=tuple(plan),
            blocks=self._blocks(scope, tokens) if len(tokens) >= BLOCK_TOKENS else (),
            slot=slot,
            used=next(self._clock),
            end=end,
        )
        self._by_slot[slot] = entry
        for block in entry.blocks:
            self._by_block.setdefault(block, []).append(entry)
        self.stats.resident_tokens += len(entry.tokens)
        return True

    def find(
        self, scope: str, prompt: Sequence[int], plan: Sequence[Segment] | None = None
    ) -> Hit | None:
        """The entry whose cells serve most of ``prompt``, if any; ``plan``: a replay's recorded
        segments, which the reused cells must have been computed by too.

        The last prompt position is computed again, for its logits: a new prompt found whole
        computes only its :func:`.pieces.tail` (one position, or two past 256), or nothing
        where the entry kept those logits (:attr:`Hit.end`); a replay feeds its plan from one
        of the plan's boundaries."""
        limit = len(prompt) - 1
        if plan is None and self.cuts_inside_pieces:
            limit = len(prompt) - tail(len(prompt))
        best: Hit | None = None
        candidates: list[Entry] = []
        blocks = self._blocks(scope, prompt[:limit])
        for block in blocks:
            deeper = self._by_block.get(block)
            if not deeper:
                break
            candidates = deeper
        plan_boundaries = None if plan is None else set(boundaries(plan))
        if plan is None:
            whole = _whole_hit(candidates, prompt)  # no hit reuses more
            if whole is not None:
                return whole
        for entry in candidates:
            length = self._usable(entry, prompt, limit, plan, plan_boundaries)
            if length >= BLOCK_TOKENS and (
                best is None
                or (length, entry.slot is not None, entry.used)
                > (best.length, best.entry.slot is not None, best.entry.used)
            ):
                best = Hit(entry, length)
        if self.shelf is not None:
            shelved = self.shelf.find(blocks, scope, best.length if best else BLOCK_TOKENS - 1)
            if shelved is not None:
                length = self._usable(shelved, prompt, limit, plan, plan_boundaries)
                if length >= BLOCK_TOKENS and (best is None or length > best.length):
                    best = Hit(shelved, length)
        return best

    def resident(self) -> list[Entry]:
        return list(self._by_slot.values())

    def entry_in(self, slot: int) -> Entry | None:
        return self._by_slot.get(slot)

    def least_used(self, slots: Sequence[int]) -> Entry | None:
        """Among the entries resident in ``slots``, the one used longest ago, scraps first
        (they are worth the least)."""
        held = [self._by_slot[s] for s in slots if s in self._by_slot]
        return min(held, key=lambda e: (bool(e.blocks), e.used), default=None)

    def kept_whole(self, slots: Sequence[int], scope: str, prompt: Sequence[int]) -> Hit | None:
        """The entry resident in one of ``slots`` that holds all of ``prompt`` with its last
        logits (the most recently used), as a hit: a scrap too, which no lookup finds."""
        held = [self._by_slot[s] for s in slots if s in self._by_slot]
        return _whole_hit([e for e in held if e.scope == scope], prompt)

    def reusable(self, entry: Entry, scope: str, prompt: Sequence[int], tiled: int = 0) -> int:
        """How many first positions of a new ``prompt`` the cells of ``entry``, leaving its
        slot to ``prompt``'s sequence, serve: any number (a block is not needed, the cells are
        where they are used), so that the prompt gets the cells and the answer it gets cold, as
        llama-server's slots reuse their common prefix (a chat template's system prompt, say).

        A prompt shorter than a tiled piece is computed row by row from wherever it starts
        (:mod:`.pieces`). A longer one, whose cold plan computes its first ``tiled`` positions
        and the 64 or more after them tiled, takes up to ``tiled`` positions that ``entry``
        computed tiled too (:func:`.pieces.tiled_head`): a tiled token's numbers do not depend
        on where its piece starts, so the rest fed tiled from there gets its cold cells (the
        caller feeds it so, and records the cold plan)."""
        if entry.scope != scope:
            return 0
        if len(prompt) >= TILE_TOKENS:
            if not self.cuts_inside_pieces:
                return 0
            return _common_prefix(entry.tokens, prompt, min(tiled, tiled_head(entry.segments)))
        limit = len(prompt) - (tail(len(prompt)) if self.cuts_inside_pieces else 1)
        return self._usable(entry, prompt, limit, None, None)

    def take(self, entry: Entry) -> None:
        """The entry's cells (or blob) go to a new sequence: it is no longer the cache's."""
        self.drop(entry)

    def unsaved(self, *, spare_last: bool = False) -> Entry | None:
        """The resident entry with blocks and no snapshot that was used longest ago: the next
        to leave its slot (a scrap never becomes a blob). ``spare_last``: never the resident
        entry used last, the one a client most likely goes on from in its slot."""
        resident = self._by_slot.values()
        last = max(resident, key=lambda e: e.used, default=None) if spare_last else None
        held = [e for e in resident if e.blocks and e.snapshot is None and e is not last]
        return min(held, key=lambda e: e.used, default=None)

    def has_room(self, size: int) -> bool:
        """Whether a snapshot of ``size`` bytes fits the blob budget once the older blobs went
        to the shelf (or away); other snapshots are not pushed out."""
        return 0 < size and self._snapshot_bytes + size <= self.max_blob_bytes

    def add_snapshot(self, entry: Entry, blob: bytes) -> None:
        """``entry``'s cells as ``blob`` (:meth:`has_room` said yes): the older blobs go to the
        shelf to make room, as when an entry spills."""
        self._make_room(len(blob))
        entry.snapshot = blob
        self.stats.blob_bytes += len(blob)
        self._snapshot_bytes += len(blob)

    def spill(self, entry: Entry, blob: bytes | None) -> None:
        """A resident entry's slot is needed: keep its cells as ``blob`` in memory while the
        budget allows (its :class:`EndLogits` counted with it), the least recently used blobs
        going to the shelf (or away) first."""
        self.drop(entry)
        if blob is None or not entry.blocks:
            return  # a scrap is found in its slot only
        size = _held_bytes(blob, entry)
        if size > self.max_blob_bytes:
            self._shelve(entry, blob)
            return
        self._make_room(size)
        entry.slot, entry.blob = None, blob
        self._blobs.append(entry)
        for block in entry.blocks:
            self._by_block.setdefault(block, []).append(entry)
        self.stats.blob_bytes += size

    def _make_room(self, size: int) -> None:
        while self._blobs and self.stats.blob_bytes + size > self.max_blob_bytes:
            oldest = self._blobs[0]
            self.drop(oldest)
            assert oldest.blob is not None
            self._shelve(oldest, oldest.blob)

    def _shelve(self, entry: Entry, blob: bytes) -> None:
        if self.shelf is not None:
            self.shelf.put(entry, blob)

    def drop(self, entry: Entry) -> None:
        for block in entry.blocks:
            holders = self._by_block.get(block)
            if holders is not None and entry in holders:
                holders.remove(entry)
                if not holders:
                    del self._by_block[block]
        if entry.slot is not None and self._by_slot.get(entry.slot) is entry:
            del self._by_slot[entry.slot]
            self.stats.resident_tokens -= len(entry.tokens)
        if entry.snapshot is not None:
            self.stats.blob_bytes -= len(entry.snapshot)
            self._snapshot_bytes -= len(entry.snapshot)
            entry.snapshot = None
        if entry.blob is not None and entry in self._blobs:
            self._blobs.remove(entry)
            self.stats.blob_bytes -= _held_bytes(entry.blob, entry)

    def clear(self) -> None:
        for entry in [*self._by_slot.values(), *self._blobs]:
            self.drop(entry)

    def touch(self, entry: Entry) -> None:
        entry.used = next(self._clock)

    def _usable(
        self,
        entry: Entry,
        prompt: Sequence[int],
        limit: int,
        plan: Sequence[Segment] | None,
        plan_boundaries: set[int] | None,
    ) -> int:
        common = _common_prefix(entry.tokens, prompt, limit)
        if plan is None or plan_boundaries is None:
            return self._cut_below(entry.segments, common)
        for at in sorted(plan_boundaries, reverse=True):
            if at < BLOCK_TOKENS:
                break
            if at > common or self._cut_below(entry.segments, at) != at:
                continue
            if cut(entry.segments, at) == cut(plan, at):
                return at
        return 0

    def _cut_below(self, segments: Sequence[Segment], at: int) -> int:
        """The last position up to ``at`` where cells computed as ``segments`` may be cut."""
        piece = piece_around(segments, at)
        if piece is None:
            return at
        start, end = piece
        if self.cuts_inside_pieces and keeps_way(end - start, end, at - start):
            return at
        return start

    def _blocks(self, scope: str, tokens: Sequence[int]) -> tuple[bytes, ...]:
        """The chained hash of each whole block of ``tokens``: block k names tokens
        ``0..(k+1)*BLOCK_TOKENS-1`` under this namespace and ``scope``."""
        hasher = blake3.blake3(self.namespace)
        hasher.update(scope.encode())
        chain = []
        for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            packed = array("I", tokens[start : start + BLOCK_TOKENS])
            if sys.byteorder != "little":
                packed.byteswap()
            hasher.update(packed.tobytes())
            chain.append(hasher.copy().digest(16))
        return tuple(chain)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _held_bytes(blob: bytes, entry: Entry) -> int:
    """What an entry spilled as ``blob`` holds in memory."""
    return len(blob) + (entry.end.logits.nbytes if entry.end is not None else 0)


def _whole_hit(entries: Sequence[Entry], prompt: Sequence[int]) -> Hit | None:
    """Of ``entries``, the one that holds all of ``prompt``'s cells and its last logits (a
    resident one first, then the most recently used), as a hit."""
    n = len(prompt)
    found = [
        e
        for e in entries
        if e.end is not None and e.end.n_prompt == n and e.tokens[:n] == tuple(prompt)
    ]
    if not found:
        return None
    entry = max(found, key=lambda e: (e.slot is not None, e.used))
    return Hit(entry, n, entry.end)
