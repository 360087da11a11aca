"""Session records and their persistence: they survive a ``kill -9`` of the server.

Each session is two files under ``<dir>``: ``<id>.meta`` (canonical CBOR of everything but the
generated tokens, replaced atomically when it changes) and ``<id>.tokens`` (4 bytes per generated
token, appended before the token is sent). So whatever a client has received is on disk, and
the snapshot hash it holds verifies against what a restarted server reads back.

Metadata saves and deletions (open, write, rename, unlink: each can wait on the disk) run in
order on one writer thread, never on the caller's (the event loop's) thread; :meth:`flush`
tells when everything asked so far is done. Token appends stay where they are called: one
``write(2)`` of a step's token to a page-cache file, and it must precede the token's frame.
"""

from __future__ import annotations

import functools
import logging
import os
import struct
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cbor2

from quicsrv_proto import EndReason, canonical_cbor

from ..engine import Grammar, PrefillPlan, SamplingParams, Segment
from ..files import write_atomically
from .snapshot import Snapshot

__all__ = ["SessionEnd", "SessionRecord", "SessionStore", "StoreUsage"]

log = logging.getLogger(__name__)

_TOKEN = struct.Struct("<I")
_TOMBSTONES = 65536


@dataclass(frozen=True, slots=True)
class SessionEnd:
    reason: EndReason
    completion_tokens: int


@dataclass(eq=False, kw_only=True)
class SessionRecord:
    """What is known of one session; ``generated`` grows as tokens are produced."""

    session_id: bytes
    model_digest: bytes
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool
    prefill_chunk: int
    created_at_s: float
    expires_at_s: float
    # 4 bytes a token (a list of ints costs ~36): thousands of idle sessions stay in memory.
    generated: array[int] = field(default_factory=lambda: array("I"))
    end: SessionEnd | None = None
    owner: str = ""
    """The id of the API key that started the session ("" on an open server): a resume
    must present the same key."""
    prefill_plan: PrefillPlan | None = None
    """How the engine computed the prompt's cells when it started from reused ones (None: as
    a cold start): a replay follows it, or it would not be exact."""
    grammar: Grammar | None = None
    """What constrains its tokens (structured output); a resume replays them into it."""
    unattended: bool = False
    """It runs to its end whether or not anyone reads it (a background response): a restarted
    server starts it again on its own."""
    api: dict[str, Any] | None = None
    """What a front end keeps with the session to answer about it later (the Responses API:
    its request fields and the conversation the prompt was rendered from); CBOR values."""

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose cells its first run took from the prefix cache."""
        return 0 if self.prefill_plan is None else self.prefill_plan.reused

    def snapshot(self, upto: int | None = None) -> Snapshot:
        """The snapshot of the first ``upto`` generated tokens (all by default)."""
        tokens = self.generated if upto is None else self.generated[:upto]
        return Snapshot(
            session_id=self.session_id,
            model_digest=self.model_digest,
            prompt_tokens=self.prompt_tokens,
            sampling=self.sampling,
            max_tokens=self.max_tokens,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            prefill_chunk=self.prefill_chunk,
            generated=tuple(tokens),
            created_at_s=self.created_at_s,
            expires_at_s=self.expires_at_s,
            grammar_digest=None if self.grammar is None else self.grammar.digest,
        )

    def _meta(self) -> dict[str, object]:
        s = self.sampling
        meta: dict[str, object] = {
            "v": 1,
            "session": self.session_id,
            "model": self.model_digest,
            "prompt": list(self.prompt_tokens),
            "sampling": [s.temperature, s.top_p, s.top_k, s.min_p, s.repeat_penalty, s.seed],
            "max_tokens": self.max_tokens,
            "stop": list(self.stop),
            "ignore_eos": self.ignore_eos,
            "chunk": self.prefill_chunk,
            "created": self.created_at_s,
            "expires": self.expires_at_s,
        }
        if self.end is not None:
            meta["end"] = [self.end.reason.value, self.end.completion_tokens]
        if self.owner:
            meta["owner"] = self.owner
        if self.unattended:
            meta["unattended"] = True
        if self.grammar is not None:
            meta["grammar"] = [self.grammar.digest, self.grammar.gbnf]
        if self.api is not None:
            meta["api"] = self.api
        if self.prefill_plan is not None:
            meta["plan"] = [self.prefill_plan.reused, [list(s) for s in self.prefill_plan.segments]]
        return meta

    @classmethod
    def _from_meta(cls, meta: Any, tokens: array[int]) -> SessionRecord:
        t, p, k, m, r, seed = meta["sampling"]
        end = meta.get("end")
        plan = meta.get("plan")
        grammar = meta.get("grammar")
        return cls(
            session_id=bytes(meta["session"]),
            model_digest=bytes(meta["model"]),
            prompt_tokens=tuple(meta["prompt"]),
            sampling=SamplingParams(
                temperature=t, top_p=p, top_k=k, min_p=m, repeat_penalty=r, seed=seed
            ),
            max_tokens=int(meta["max_tokens"]),
            stop=tuple(meta["stop"]),
            ignore_eos=bool(meta["ignore_eos"]),
            prefill_chunk=int(meta["chunk"]),
            created_at_s=float(meta["created"]),
            expires_at_s=float(meta["expires"]),
            generated=tokens,
            owner=str(meta.get("owner", "")),
            prefill_plan=None
            if plan is None
            else PrefillPlan(tuple(Segment(int(e), int(s)) for e, s in plan[1]), int(plan[0])),
            end=None if end is None else SessionEnd(EndReason(end[0]), int(end[1])),
            unattended=bool(meta.get("unattended", False)),
            grammar=None
            if grammar is None
            else Grammar(gbnf=str(grammar[1]), digest=bytes(grammar[0])),
            api=meta.get("api"),
        )


@dataclass(frozen=True, slots=True)
class StoreUsage:
    sessions: int
    disk_bytes: int

    def describe(self) -> str:
        return f"sessions {self.sessions} ({self.disk_bytes / 2**20:.2f} MiB on disk)"


class SessionStore:
    """Every known session, persisted, bounded in count and bytes, expired by TTL."""

    def __init__(
        self,
        directory: Path | None,
        *,
        ttl_s: float,
        max_sessions: int,
        max_disk_bytes: int,
        clock: Callable[[], float],
    ) -> None:
        self._dir = directory
        self.ttl_s = ttl_s
        self._max_sessions = max_sessions
        self._max_disk_bytes = max_disk_bytes
        self._clock = clock
        # Least recently touched first, so eviction takes the stalest.
        self._records: OrderedDict[bytes, SessionRecord] = OrderedDict()
        self._logs: dict[bytes, int] = {}  # open token-log descriptors of live sessions
        self._meta_bytes: dict[bytes, int] = {}  # what each .meta file holds (or soon will)
        self._expired: OrderedDict[bytes, None] = OrderedDict()
        self._disk_bytes = 0
        # One thread, so the files change in the order they were asked to.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-writer")
        self._queue_lock = threading.Lock()
        self._queued_saves: dict[bytes, tuple[Callable[[], None], Future[None]]] = {}
        if directory is not None:  # None: a subclass keeps the records elsewhere
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._load()

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[SessionRecord]:
        return iter(list(self._records.values()))

    def get(self, session: bytes) -> SessionRecord | None:
        return self._records.get(session)

    def was_expired(self, session: bytes) -> bool:
        return session in self._expired

    def usage(self) -> StoreUsage:
        return StoreUsage(sessions=len(self._records), disk_bytes=self._disk_bytes)

    def has_room(self, evictable: Callable[[SessionRecord], bool]) -> bool:
        """Make room for one more session by evicting the stalest evictable ones."""
        if self._has_room():
            return True  # the usual case, without a walk over every session
        for record in list(self._records.values()):
            if self._has_room():
                break
            if evictable(record):
                log.info("session store full: evicting session %s", record.session_id.hex())
                self.remove(record.session_id)
        return self._has_room()

    def _has_room(self) -> bool:
        return len(self._records) < self._max_sessions and self._disk_bytes < self._max_disk_bytes

    def add(self, record: SessionRecord) -> None:
        self._records[record.session_id] = record
        self.save(record)

    def touch(self, record: SessionRecord) -> None:
        """The session was used: it expires ``ttl_s`` from now."""
        record.expires_at_s = self._clock() + self.ttl_s
        self._records.move_to_end(record.session_id)
        self.save(record)

    def durable_tokens(self, record: SessionRecord) -> int:
        """How many of the record's tokens a crash would not lose: only those may be sent."""
        return len(record.generated)  # each append is a write(2) before it returns

    def append_token(self, record: SessionRecord, token: int) -> None:
        """Record a generated token; call before the token is sent to anyone."""
        record.generated.append(token)
        fd = self._logs.get(record.session_id)
        if fd is None:
            fd = os.open(
                self._tokens_path(record.session_id),
                os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                0o600,
            )
            self._logs[record.session_id] = fd
        # One write(2) of 4 bytes: a kill -9 loses nothing the kernel already has.
        os.write(fd, _TOKEN.pack(token))
        self._disk_bytes += _TOKEN.size

    def close_log(self, record: SessionRecord) -> None:
        fd = self._logs.pop(record.session_id, None)
        if fd is not None:
            os.close(fd)

    def save(self, record: SessionRecord) -> Future[None]:
        """Have the record's metadata written atomically, on the writer thread."""
        if record.session_id not in self._records:  # removed: writing would bring it back
            return self.flush()
        data = canonical_cbor(record._meta())
        old = self._meta_bytes.get(record.session_id, 0)
        self._meta_bytes[record.session_id] = len(data)
        self._disk_bytes += len(data) - old
        return self._save_latest(
            record.session_id,
            functools.partial(_write_or_log, self._meta_path(record.session_id), data),
        )

    def _save_latest(self, session: bytes, write: Callable[[], None]) -> Future[None]:
        """Have the writer thread run ``write``, the newest metadata of ``session``. A write of
        the same session still waiting takes its place: a request saves its record up to four
        times, twice within one loop turn, and only the last of each pair needs the disk. The
        future is done once data as new as this is written."""
        with self._queue_lock:  # held across submit: the writer cannot pop before we store
            queued = self._queued_saves.get(session)
            if queued is not None:
                self._queued_saves[session] = (write, queued[1])
                return queued[1]
            future = self._writer.submit(self._run_save, session)
            self._queued_saves[session] = (write, future)
            return future

    def _run_save(self, session: bytes) -> None:
        with self._queue_lock:
            write, _ = self._queued_saves.pop(session)
        write()

    def flush(self) -> Future[None]:
        """Done when every save and removal asked for so far is on disk."""
        return self._writer.submit(lambda: None)

    def remove(self, session: bytes, *, expired: bool = False) -> None:
        record = self._records.pop(session, None)
        if record is None:
            return
        self.close_log(record)
        self._disk_bytes -= self._meta_bytes.pop(session, 0) + _TOKEN.size * len(record.generated)
        paths = (self._meta_path(session), self._tokens_path(session))
        self._writer.submit(_unlink_all, paths)
        if expired:
            self._expired[session] = None
            while len(self._expired) > _TOMBSTONES:
                self._expired.popitem(last=False)

    def delete(self, session: bytes) -> None:
        """Forget a session for good, at its owner's request (not an expiry): a later lookup
        finds nothing."""
        self.remove(session)

    def expired(self, now_s: float) -> list[SessionRecord]:
        return [r for r in self._records.values() if r.expires_at_s <= now_s]

    def close(self) -> None:
        """Finish the pending writes; close the token logs."""
        self._writer.shutdown(wait=True)
        for fd in self._logs.values():
            os.close(fd)
        self._logs.clear()

    def _meta_path(self, session: bytes) -> Path:
        assert self._dir is not None
        return self._dir / f"{session.hex()}.meta"

    def _tokens_path(self, session: bytes) -> Path:
        assert self._dir is not None
        return self._dir / f"{session.hex()}.tokens"

    def _load(self) -> None:
        assert self._dir is not None
        for leftover in self._dir.glob(".*.tmp"):
            leftover.unlink(missing_ok=True)
        loaded = []
        for path in self._dir.glob("*.meta"):
            try:
                meta = cbor2.loads(path.read_bytes())
                tokens_path = path.with_suffix(".tokens")
                raw = tokens_path.read_bytes() if tokens_path.exists() else b""
                raw = raw[: len(raw) - len(raw) % _TOKEN.size]  # a torn last write
                tokens = array("I", (t for (t,) in _TOKEN.iter_unpack(raw)))
                record = SessionRecord._from_meta(meta, tokens)
            except Exception as exc:  # one bad file must not stop the server
                log.warning("ignoring unreadable session file %s: %s", path.name, exc)
                continue
            meta_bytes = path.stat().st_size
            self._meta_bytes[record.session_id] = meta_bytes
            self._disk_bytes += meta_bytes + len(raw)
            loaded.append(record)
        for record in sorted(loaded, key=lambda r: r.expires_at_s):
            self._records[record.session_id] = record


def _write_or_log(path: Path, data: bytes) -> None:
    try:
        write_atomically(path, data)
    except OSError as exc:  # a full disk must not take the server down: the session lives on
        log.error("cannot write session file %s: %s", path.name, exc)


def _unlink_all(paths: tuple[Path, ...]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove session file %s: %s", path.name, exc)
