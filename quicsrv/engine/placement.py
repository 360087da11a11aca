"""Where a sequence's KV cells come from and where they go: its slot, the kept prefix it starts
from, and the blobs that leave a slot.

:class:`KvCells` is llama.cpp's per-sequence cell operations (a sequence's cells as a blob and
back, cut, cleared). :class:`SlotPlacement` answers the decode thread's questions about kept
cells and makes the llama.cpp calls its answers need: which kept cells a new prompt can start
from, which slot it gets (the entry used longest ago leaving its slot as a blob), how many kept
positions it could take, whether a released sequence's cells stay, and, when the engine closes,
which entries go to the shelf. :mod:`.prefix_cache` keeps the books (pure); the engine
(:mod:`.llama`) acts on the answers. Called on the engine's thread only.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from pathlib import Path

import llama_cpp
from llama_cpp._internals import LlamaContext

from ._api import Segment, SequenceRequest
from .pieces import TILE_TOKENS
from .prefix_cache import (
    EndLogits,
    Entry,
    Hit,
    PrefixCache,
    PrefixShelf,
    PrefixStats,
    cut,
    extend,
)

__all__ = ["KvCells", "SlotPlacement"]

log = logging.getLogger(__name__)

# A bytes object of a given size, not yet filled in (the C API's way to build bytes in place;
# filled here before anything else can see the object).
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def _contents(blob: bytes) -> ctypes._Pointer[ctypes.c_uint8]:
    """The bytes object's own buffer, as llama.cpp's state calls take it: no copy."""
    return ctypes.cast(ctypes.c_char_p(blob), ctypes.POINTER(ctypes.c_uint8))


class KvCells:
    """The KV cells of each sequence id of one llama.cpp context."""

    def __init__(self, context: LlamaContext) -> None:
        self._ctx = context.ctx
        self._memory = llama_cpp.llama_get_memory(context.ctx)

    def size(self, seq_id: int) -> int:
        """The bytes of :meth:`save`'s blob (``llama_state_seq_get_size``)."""
        return int(llama_cpp.llama_state_seq_get_size(self._ctx, seq_id))

    def save(self, seq_id: int) -> bytes | None:
        """The sequence's cells as a blob (``llama_state_seq_get_data``); None: it has none.

        llama.cpp writes straight into the new bytes object: a buffer and a copy of it cost
        twice the time at 1594 cells (35 MiB: 57 ms, not 28), the first touch of their pages."""
        size = self.size(seq_id)
        if size <= 1:
            return None  # no cells' header; and CPython shares the empty bytes object
        blob: bytes = _new_bytes(None, size)
        written = llama_cpp.llama_state_seq_get_data(self._ctx, _contents(blob), size, seq_id)
        if not written:
            return None
        return blob if written == size else blob[:written]

    def load(self, seq_id: int, blob: bytes) -> bool:
        """Set the sequence's cells from ``blob``; False: llama.cpp rejected it. llama.cpp only
        reads it, from the bytes object's own buffer (with a copy: 36 ms at 35 MiB, not 5)."""
        return bool(
            llama_cpp.llama_state_seq_set_data(self._ctx, _contents(blob), len(blob), seq_id)
        )

    def cut(self, seq_id: int, length: int) -> bool:
        """Keep the cells of positions ``0..length-1`` only; False: they cannot be cut there."""
        return bool(llama_cpp.llama_memory_seq_rm(self._memory, seq_id, length, -1))

    def clear(self, seq_id: int) -> None:
        llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)


class SlotPlacement:
    """See the module docstring. ``cache`` None: nothing is kept (every prompt starts cold, a
    new sequence gets the lowest free slot)."""

    def __init__(self, cells: KvCells, cache: PrefixCache | None) -> None:
        self._cells = cells
        self._cache = cache
        self.stats = cache.stats if cache is not None else PrefixStats(enabled=False)
        """What the cache did and holds (its ``enabled`` False when there is none)."""

    @classmethod
    def open(
        cls,
        cells: KvCells,
        *,
        enabled: bool,
        numerics: bytes,
        window: int,
        max_blob_bytes: int,
        shelf_dir: Path | None,
        shelf_bytes: int,
        cuts_inside_pieces: bool,
    ) -> SlotPlacement:
        """Placement over a prefix cache for cells computed under ``numerics`` (see
        ``EngineSettings.numerics``), unless the cache is off (``enabled``) or cannot work
        for this model (``window``: its sliding-window size, ``llama_model_n_swa``).
        ``cuts_inside_pieces``: see :attr:`.prefix_cache.PrefixCache.cuts_inside_pieces`."""
        if not enabled:
            return cls(cells, None)
        if window > 0:
            # Sliding-window layers drop the cells behind their window, so a kept sequence's
            # prefix cannot be continued from them; a full-size SWA cache for every slot would
            # cost this model's whole context in every layer.
            log.info("prefix cache off: the model uses sliding-window attention (%d)", window)
            return cls(cells, None)
        cache = PrefixCache(
            numerics, max_blob_bytes=max_blob_bytes, cuts_inside_pieces=cuts_inside_pieces
        )
        if shelf_dir is not None and shelf_bytes > 0:
            cache.shelf = PrefixShelf(shelf_dir, shelf_bytes, cache.stats)
        return cls(cells, cache)

    def find(self, request: SequenceRequest, recorded: Sequence[Segment] | None) -> Hit | None:
        """The kept cells ``request``'s prompt can start from (none for a KV restore, which
        brings its own). ``recorded``: a fixed plan, which takes only cells computed its own
        way; None: a new prompt, which takes any."""
        cache = self._cache
        resume = request.resume
        if cache is None or (resume is not None and resume.kv_state is not None):
            return None
        return cache.find(request.cache_scope, request.prompt_tokens, recorded)

    def slot_for(
        self,
        hit: Hit | None,
        free: Sequence[int],
        request: SequenceRequest | None = None,
        *,
        tiled: int = 0,
    ) -> tuple[int, Hit | None]:
        """Of the ``free`` slots: the hit's; else, for a new ``request`` without a hit, one whose
        cells hold its whole prompt with its last logits (:meth:`.prefix_cache.PrefixCache.
        kept_whole`); else the lowest that keeps nothing; else the slot of the entry used
        longest ago (a scrap first), which becomes a blob (or is forgotten). With the slot, for
        such a request: what its prompt reuses of the cells that were in it (the whole, or
        :meth:`.prefix_cache.PrefixCache.reusable`, which takes ``tiled``: how many first
        positions its cold plan may take from cells computed tiled), already cut to that
        length; None: it reuses nothing there (the slot holds no cells)."""
        cache = self._cache
        if cache is None:
            return min(free), None
        if hit is not None and hit.entry.slot is not None:
            return hit.entry.slot, None
        if hit is None and request is not None and request.resume is None:
            # A prompt shorter than a block, found whole in the slot it left (no lookup finds
            # a scrap), with its last logits: it computes nothing there.
            whole = cache.kept_whole(free, request.cache_scope, request.prompt_tokens)
            if whole is not None:
                assert whole.entry.slot is not None
                slot = whole.entry.slot
                cache.take(whole.entry)
                if self._cells.cut(slot, whole.length):
                    return slot, whole
                self._cells.clear(slot)
                return slot, None
        empty = [slot for slot in free if cache.entry_in(slot) is None]
        if empty:
            return min(empty), None
        victim = cache.least_used(free)
        assert victim is not None and victim.slot is not None
        slot = victim.slot
        blob = self._blob(victim) if cache.max_blob_bytes > 0 and victim.blocks else None
        cache.spill(victim, blob)
        reused, cold = 0, False
        if hit is None and request is not None and request.resume is None:
            prompt = request.prompt_tokens
            reused = cache.reusable(victim, request.cache_scope, prompt, tiled)
            cold = len(prompt) >= TILE_TOKENS
        if reused and self._cells.cut(slot, reused):
            return slot, Hit(victim, reused, cold=cold)
        self._cells.clear(slot)
        return slot, None

    def take(self, slot: int, hit: Hit) -> int:
        """Move the hit's cells into ``slot`` and cut them to its length: the positions
        reused; 0 when they could not be had (a rejected blob: the prompt is computed cold)."""
        assert self._cache is not None
        entry = hit.entry
        self._cache.take(entry)
        if entry.blob is not None and not self._cells.load(slot, entry.blob):
            self._cells.clear(slot)
            return 0
        if not self._cells.cut(slot, hit.length):
            self._cells.clear(slot)
            return 0
        return hit.length

    def keep(
        self,
        slot: int,
        request: SequenceRequest,
        history: Sequence[int],
        n_past: int,
        plan: Sequence[Segment],
        end: EndLogits | None = None,
    ) -> bool:
        """Leave a released sequence's cells (its first ``n_past`` positions: the prompt, then
        the generated ``history``, computed as ``plan`` says) in its slot for later prompts,
        with its prompt's last logits (``end``); False: not kept (the caller frees them)."""
        cache = self._cache
        if cache is None or n_past <= 0:
            return False
        tokens = (*request.prompt_tokens, *history)[:n_past]
        computed = plan[-1].end if plan else 0
        # Generated tokens were decoded one at a time, after what the plan computed.
        kept = extend(plan, n_past, 1) if n_past > computed else cut(plan, n_past)
        return cache.keep(slot, request.cache_scope, tokens, kept, end)

    def _blob(self, entry: Entry) -> bytes | None:
        """A resident entry's cells as a blob: the one saved ahead of need, else saved now."""
        assert entry.slot is not None
        return entry.snapshot if entry.snapshot is not None else self._cells.save(entry.slot)

    @property
    def keeps_end_logits(self) -> bool:
        """Whether entries keep their prompt's last logits (:class:`.prefix_cache.EndLogits`):
        where there is a cache."""
        return self._cache is not None

    def snapshot_one(self, *, spare_last: bool = False) -> bool:
        """While the engine waits for work: save the cells of the kept entry next to leave its
        slot (:meth:`.prefix_cache.PrefixCache.unsaved`, with ``spare_last``) within the blob
        budget, so that a new prompt given that slot copies nothing first. Measured before: a
        burst after long generations saved one 12 MB entry per prompt ahead of its first step.
        False: none saved (none left, or no room)."""
        cache = self._cache
        if cache is None or cache.max_blob_bytes <= 0:
            return False
        entry = cache.unsaved(spare_last=spare_last)
        if entry is None or entry.slot is None:
            return False
        if not cache.has_room(self._cells.size(entry.slot)):
            return False
        blob = self._cells.save(entry.slot)
        if blob is None:
            return False
        cache.add_snapshot(entry, blob)
        return True

    def idle(self, idle: bool) -> None:
        """The engine waits for work (True) or computes (False): the shelf is written only
        while it waits (:class:`.prefix_cache.PrefixShelf`)."""
        shelf = self._cache.shelf if self._cache is not None else None
        if shelf is not None:
            if idle:
                shelf.engine_idle.set()
            else:
                shelf.engine_idle.clear()

    def shelve(self) -> None:
        """Closing: the cells kept in slots go to the shelf, if there is one, the most recently
        used first, so that the next engine (a restarted server) finds them."""
        cache = self._cache
        if cache is None or cache.shelf is None:
            return
        self.idle(True)
        for entry in sorted(cache.resident(), key=lambda e: -e.used):
            assert entry.slot is not None
            blob = self._blob(entry)
            cache.drop(entry)
            if blob is not None:
                cache.shelf.put(entry, blob, wait=True)
        cache.shelf.flush()
