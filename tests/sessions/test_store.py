"""The session store and the KV store: persistence, budgets, expiry (no model, no sockets)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from quicsrv.engine import SamplingParams
from quicsrv.sessions.file_store import FileSessionStore
from quicsrv.sessions.kvstore import KVStore
from quicsrv.sessions.record import SessionEnd, SessionRecord
from quicsrv.sessions.spec import GenerationSpec
from quicsrv_proto import EndReason


def _record(session: bytes, *, expires: float = 100.0) -> SessionRecord:
    return SessionRecord(
        session_id=session,
        model_digest=b"m" * 32,
        spec=GenerationSpec(
            prompt_tokens=(1, 2, 3),
            sampling=SamplingParams(temperature=0.5, top_k=4, seed=9),
            max_tokens=16,
            stop=("\n\n",),
            ignore_eos=True,
            prefill_chunk=64,
        ),
        created_at_s=0.0,
        expires_at_s=expires,
    )


def _store(tmp_path, **limits) -> FileSessionStore:
    options = dict(ttl_s=60.0, max_sessions=100, max_disk_bytes=1 << 20, clock=lambda: 0.0)
    options.update(limits)
    return FileSessionStore(tmp_path, **options)


def test_records_and_their_tokens_survive_a_restart(tmp_path):
    store = _store(tmp_path)
    record = _record(b"a" * 16)
    store.add(record)
    for token in (7, 8, 9):
        store.append_token(record, token)
    record.end = SessionEnd(EndReason.LENGTH, 3)
    store.save(record)
    store.flush().result(timeout=10)
    # No close(): as after a kill -9, only what reached the kernel counts.
    again = _store(tmp_path).get(b"a" * 16)
    assert again is not None
    assert list(again.generated) == [7, 8, 9]
    assert again.end == SessionEnd(EndReason.LENGTH, 3)
    assert again.snapshot() == record.snapshot()
    for path in tmp_path.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_when_a_record_ended_survives_a_restart(tmp_path):
    """The Responses API answers it as completed_at: the same from every process."""
    store = _store(tmp_path)
    record = _record(b"e" * 16)
    store.add(record)
    record.end = SessionEnd(EndReason.STOP, 0, 1_700_000_123.5)
    store.save(record)
    store.flush().result(timeout=10)
    again = _store(tmp_path).get(b"e" * 16)
    assert again is not None and again.end is not None
    assert again.end.ended_at_s == 1_700_000_123.5
    # A record written before the time was kept reads back without it.
    meta = record.meta()
    meta["end"] = [EndReason.STOP.value, 0]
    old = SessionRecord.from_meta(meta, record.generated)
    assert old.end is not None and old.end.ended_at_s is None


def test_a_torn_last_token_write_is_ignored(tmp_path):
    store = _store(tmp_path)
    record = _record(b"b" * 16)
    store.add(record)
    store.append_token(record, 5)
    store.close()
    with open(tmp_path / f"{(b'b' * 16).hex()}.tokens", "ab") as f:
        f.write(b"\x01\x02")  # half a token
    again = _store(tmp_path).get(b"b" * 16)
    assert again is not None and list(again.generated) == [5]


def test_expired_sessions_are_removed_from_disk_and_remembered(tmp_path):
    store = _store(tmp_path)
    old, fresh = _record(b"o" * 16, expires=10.0), _record(b"f" * 16, expires=1000.0)
    store.add(old)
    store.add(fresh)
    assert store.expired(50.0) == [old]
    store.remove(old.session_id, expired=True)
    store.flush().result(timeout=10)
    assert store.get(old.session_id) is None and store.was_expired(old.session_id)
    assert not list(tmp_path.glob(f"{old.session_id.hex()}*"))
    assert _store(tmp_path).get(fresh.session_id) is not None


def test_the_count_limit_evicts_the_stalest_evictable_session(tmp_path):
    store = _store(tmp_path, max_sessions=2)
    a, b = _record(b"a" * 16), _record(b"b" * 16)
    store.add(a)
    store.add(b)
    store.touch(a)  # b is now the stalest
    assert store.has_room(lambda r: True)
    assert store.get(b.session_id) is None and store.get(a.session_id) is not None
    store.add(_record(b"c" * 16))
    assert not store.has_room(lambda r: False)  # nothing may go: no room


def test_saves_and_removals_run_on_the_writer_thread_in_order(tmp_path, monkeypatch):
    store = _store(tmp_path)
    done: list[tuple[str, str]] = []
    real_replace, real_unlink = os.replace, Path.unlink

    def replace(src, dst):
        if Path(dst).parent == tmp_path:
            done.append(("write", threading.current_thread().name))
        real_replace(src, dst)

    def unlink(path, missing_ok=False):
        if path.parent == tmp_path:
            done.append(("unlink", threading.current_thread().name))
        real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(Path, "unlink", unlink)
    record = _record(b"w" * 16)
    store.add(record)
    store.flush().result(timeout=10)
    store.touch(record)
    store.remove(record.session_id)
    store.flush().result(timeout=10)
    assert [what for what, _ in done] == ["write", "write", "unlink", "unlink"]
    assert all(thread != threading.current_thread().name for _, thread in done)
    assert not list(tmp_path.glob(f"{record.session_id.hex()}*"))
    assert store.usage().disk_bytes == 0
    store.save(record)  # a late save of a removed session must not bring its file back
    store.close()
    assert not list(tmp_path.glob(f"{record.session_id.hex()}*"))


def test_saves_waiting_for_the_writer_collapse_into_one_write_of_the_newest(tmp_path, monkeypatch):
    store = _store(tmp_path)
    writes: list[str] = []
    real_replace = os.replace

    def replace(src, dst):
        writes.append(Path(dst).name)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    gate = threading.Event()
    store._writes.submit(gate.wait)  # the writer is busy: every save below has to wait
    record = _record(b"s" * 16)
    store.add(record)
    store.touch(record)
    first = store.save(record)
    record.end = SessionEnd(EndReason.LENGTH, 0)
    last = store.save(record)
    other_record = _record(b"t" * 16)
    store.add(other_record)
    other = store.save(other_record)
    gate.set()
    for future in (first, last, other):
        future.result(timeout=10)
    assert sorted(writes) == sorted([f"{(b's' * 16).hex()}.meta", f"{(b't' * 16).hex()}.meta"])
    again = _store(tmp_path).get(record.session_id)
    assert again is not None and again.end == SessionEnd(EndReason.LENGTH, 0)


def test_kv_blobs_spill_lru_to_disk_with_checksums(tmp_path):
    kv = KVStore(tmp_path, memory_budget_bytes=250, disk_budget_bytes=10_000)
    kv.put(b"1" * 16, 3, b"x" * 100)
    kv.put(b"2" * 16, 4, b"y" * 100)
    kv.put(b"3" * 16, 5, b"z" * 100)  # over the memory budget: the oldest spills
    kv.flush().result(timeout=10)
    usage = kv.usage()
    assert (usage.memory_blobs, usage.disk_blobs) == (2, 1)
    assert kv.get(b"1" * 16, 3) == b"x" * 100  # read back from disk, checksum verified
    assert kv.get(b"1" * 16, 4) is None  # a blob for another token count is stale
    path = tmp_path / f"{(b'1' * 16).hex()}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert kv.get(b"1" * 16, 3) is None  # damaged: the resume will replay instead
    # A new store finds the spilled blobs again.
    assert KVStore(tmp_path, memory_budget_bytes=0, disk_budget_bytes=10_000).usage().disk_blobs


def test_the_kv_disk_budget_drops_the_oldest_blobs(tmp_path):
    kv = KVStore(tmp_path, memory_budget_bytes=0, disk_budget_bytes=400)
    for i in range(5):
        kv.put(bytes([i]) * 16, 1, b"k" * 100)
    kv.flush().result(timeout=10)
    usage = kv.usage()
    assert usage.disk_bytes <= 400 and usage.disk_blobs < 5
    assert kv.get(bytes([4]) * 16, 1) == b"k" * 100
    assert kv.get(bytes([0]) * 16, 1) is None


def test_a_kv_spill_runs_on_its_own_thread_and_the_blob_stays_readable_meanwhile(
    tmp_path, monkeypatch
):
    kv = KVStore(tmp_path, memory_budget_bytes=0, disk_budget_bytes=10_000)
    writing, release = threading.Event(), threading.Event()
    writers: list[str] = []
    real_replace = os.replace

    def slow_replace(src, dst):
        writers.append(threading.current_thread().name)
        writing.set()
        assert release.wait(10)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", slow_replace)
    kv.put(b"s" * 16, 7, b"v" * 100)  # returns while the spill waits on its thread
    assert writing.wait(10)
    assert kv.has(b"s" * 16, 7) and kv.get(b"s" * 16, 7) == b"v" * 100
    kv.discard(b"s" * 16)  # discarded while being written: the file must not stay
    release.set()
    kv.close()
    assert writers and writers[0] != threading.current_thread().name
    assert kv.get(b"s" * 16, 7) is None
    assert not list(tmp_path.glob("*.kv")) and kv.usage().disk_blobs == 0
