"""The session store and the KV store: persistence, budgets, expiry (no model, no sockets)."""

from __future__ import annotations

import stat

from proto import EndReason
from quicsrv.engine import SamplingParams
from quicsrv.sessions.kvstore import KVStore
from quicsrv.sessions.store import SessionEnd, SessionRecord, SessionStore


def _record(session: bytes, *, expires: float = 100.0) -> SessionRecord:
    return SessionRecord(
        session_id=session,
        model_digest=b"m" * 32,
        prompt_tokens=(1, 2, 3),
        sampling=SamplingParams(temperature=0.5, top_k=4, seed=9),
        max_tokens=16,
        stop=("\n\n",),
        ignore_eos=True,
        prefill_chunk=64,
        created_at_s=0.0,
        expires_at_s=expires,
    )


def _store(tmp_path, **limits) -> SessionStore:
    options = dict(ttl_s=60.0, max_sessions=100, max_disk_bytes=1 << 20, clock=lambda: 0.0)
    options.update(limits)
    return SessionStore(tmp_path, **options)


def test_records_and_their_tokens_survive_a_restart(tmp_path):
    store = _store(tmp_path)
    record = _record(b"a" * 16)
    store.add(record)
    for token in (7, 8, 9):
        store.append_token(record, token)
    record.end = SessionEnd(EndReason.LENGTH, 3)
    store.save(record)
    # No close(): as after a kill -9, only what reached the kernel counts.
    again = _store(tmp_path).get(b"a" * 16)
    assert again is not None
    assert list(again.generated) == [7, 8, 9]
    assert again.end == SessionEnd(EndReason.LENGTH, 3)
    assert again.snapshot() == record.snapshot()
    for path in tmp_path.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


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


def test_kv_blobs_spill_lru_to_disk_with_checksums(tmp_path):
    kv = KVStore(tmp_path, memory_budget_bytes=250, disk_budget_bytes=10_000)
    kv.put(b"1" * 16, 3, b"x" * 100)
    kv.put(b"2" * 16, 4, b"y" * 100)
    kv.put(b"3" * 16, 5, b"z" * 100)  # over the memory budget: the oldest spills
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
    usage = kv.usage()
    assert usage.disk_bytes <= 400 and usage.disk_blobs < 5
    assert kv.get(bytes([4]) * 16, 1) == b"k" * 100
    assert kv.get(bytes([0]) * 16, 1) is None
